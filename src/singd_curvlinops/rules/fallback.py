r"""The fallback rules: AdamW, SGD or yours, for the parameters that no layer owns.

A parameter group's `fallback` option (`"adamw"`, the default, `"sgd"`, a name
given to `register_fallback`, or None) names the rule that trains its parameters
outside any Kronecker layer: norm
scales and shifts, positional embeddings and class tokens, layer scales, biases
of unsupported modules. Its learning rate is the group's `lr` times
`fallback_lr_ratio` (default 1), so a scheduler that changes `lr` scales both
together. Per parameter \(\theta\) with gradient \(g\), at the parameter's own step
count \(t\):

- **AdamW** (Loshchilov & Hutter, 2019) with `fallback_betas` \((\beta_1,
  \beta_2)\) (default \((0.9, 0.999)\)), `fallback_eps` \(\epsilon\) (default
  \(10^{-8}\)) and the group's `weight_decay` \(\gamma\), decoupled:
  \(m \gets \beta_1 m + (1 - \beta_1) g\),
  \(v \gets \beta_2 v + (1 - \beta_2) g^2\),
  \(\theta \gets (1 - \eta\gamma)\theta - \eta\,\hat m / (\sqrt{\hat v} + \epsilon)\)
  with \(\hat m = m / (1 - \beta_1^t)\), \(\hat v = v / (1 - \beta_2^t)\); state
  `"step"`, `"exp_avg"`, `"exp_avg_sq"`.
- **SGD** with the group's `momentum` and `weight_decay` as SINGD applies them
  (`update.parameter_step` with \(\Delta = g\)); state `"momentum_buffer"`.

The same AdamW direction \(\hat m / (\sqrt{\hat v} + \epsilon)\) (or the gradient,
for SGD) is what learning-rate grafting (`graft`) measures a layer's step by; its
moments live under `"graft_exp_avg"`, `"graft_exp_avg_sq"`. Grafting takes these
two only.

Another rule is a `FallbackRule` subclass given a name with `register_fallback`
(the guide's *Fallback and grafting* page has an example, Lion).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from singd_curvlinops.update import parameter_step

GRAFTS = ("adamw", "sgd")
# the step guard's counters (`verdicts.COUNTERS`, not imported: it would import
# the distributed package, which imports this module)
RESERVED_KEYS = ("skipped_steps", "discarded_factor_updates")


def adam_directions(
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    *,
    steps: Sequence[int],
    betas: tuple[float, float],
    eps: float,
) -> list[Tensor]:
    r"""Update Adam's moments in place; return the directions of its step.

    Each direction is \(\hat m / (\sqrt{\hat v} + \epsilon)\) (module docs).
    One `torch._foreach_*` operation per term for all tensors (a multi-tensor
    kernel on a GPU); per tensor, the arithmetic of the one-tensor formulas.

    Args:
        grads: The gradients \(g\).
        exp_avgs: First moments \(m\) (updated in place).
        exp_avg_sqs: Second moments \(v\) (updated in place).
        steps: Each step count \(t \ge 1\) after this step.
        betas: \((\beta_1, \beta_2)\).
        eps: \(\epsilon\).

    Returns:
        New tensors, one per gradient.
    """
    beta1, beta2 = betas
    exp_avgs, exp_avg_sqs, grads = list(exp_avgs), list(exp_avg_sqs), list(grads)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
    denominators = torch._foreach_div(exp_avg_sqs, [1.0 - beta2**t for t in steps])
    torch._foreach_sqrt_(denominators)
    torch._foreach_add_(denominators, eps)
    directions = torch._foreach_div(exp_avgs, [1.0 - beta1**t for t in steps])
    torch._foreach_div_(directions, denominators)
    return directions


class FallbackRule(ABC):
    """How the fallback trains the parameters of a group outside any Kronecker layer.

    Attributes:
        state_keys: The entries of a parameter's state that the rule keeps.
    """

    state_keys: tuple[str, ...] = ()

    @abstractmethod
    def init_state(self, param: Tensor) -> dict[str, Any]:
        """Return the parameter's initial state (plain tensors and numbers).

        Args:
            param: The parameter.

        Returns:
            Its state entries.
        """

    @abstractmethod
    def step(
        self,
        params: Sequence[Tensor],
        grads: Sequence[Tensor],
        states: Sequence[dict[str, Any]],
        group: Mapping[str, Any],
    ) -> None:
        """Update parameters of one group in place, all together.

        The shell hands over the parameters of one group that are of one kind
        (all `DTensor`s, or none), so that `torch._foreach_*` operations can
        update them at once; each parameter's update must depend on its own
        gradient and state only (the guard checks them one by one).

        Args:
            params: The parameters.
            grads: Their (unscaled) gradients; may be overwritten.
            states: Their states (updated in place).
            group: Their parameter group.
        """


class AdamWFallback(FallbackRule):
    """AdamW with decoupled weight decay (module docs)."""

    state_keys = ("step", "exp_avg", "exp_avg_sq")

    def init_state(self, param: Tensor) -> dict[str, Any]:
        """Return step 0 and zero moments."""
        return {
            "step": 0,
            "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
        }

    def step(
        self,
        params: Sequence[Tensor],
        grads: Sequence[Tensor],
        states: Sequence[dict[str, Any]],
        group: Mapping[str, Any],
    ) -> None:
        """Apply one AdamW step to each parameter."""
        for state in states:
            state["step"] += 1
        lr = group["lr"] * group["fallback_lr_ratio"]
        directions = adam_directions(
            grads,
            [state["exp_avg"] for state in states],
            [state["exp_avg_sq"] for state in states],
            steps=[state["step"] for state in states],
            betas=group["fallback_betas"],
            eps=group["fallback_eps"],
        )
        params = list(params)
        if group["weight_decay"]:
            torch._foreach_mul_(params, 1.0 - lr * group["weight_decay"])
        torch._foreach_add_(params, directions, alpha=-lr)


class SGDFallback(FallbackRule):
    """SGD with the group's momentum and (L2) weight decay (module docs)."""

    state_keys = ("momentum_buffer",)

    def init_state(self, param: Tensor) -> dict[str, Any]:
        """Return a zero momentum buffer."""
        return {"momentum_buffer": torch.zeros_like(param)}

    def step(
        self,
        params: Sequence[Tensor],
        grads: Sequence[Tensor],
        states: Sequence[dict[str, Any]],
        group: Mapping[str, Any],
    ) -> None:
        """Apply one SGD step with momentum and weight decay to each parameter."""
        parameter_step(
            params,
            [grad.clone() for grad in grads],  # (weight decay is added to them)
            [state["momentum_buffer"] for state in states],
            lr=group["lr"] * group["fallback_lr_ratio"],
            momentum=group["momentum"],
            weight_decay=group["weight_decay"],
        )


BUILTIN_FALLBACKS = ("adamw", "sgd")
FALLBACK_RULES: dict[str, FallbackRule] = {
    "adamw": AdamWFallback(),
    "sgd": SGDFallback(),
}  # the built-in rules, then those of `register_fallback`


def fallback_names() -> tuple[str, ...]:
    """Return the values that the `fallback` option takes besides None.

    Returns:
        The built-in names, then the registered ones, in registration order.
    """
    return tuple(FALLBACK_RULES)


def register_fallback(name: str, rule: FallbackRule) -> FallbackRule:
    """Make `rule` train the parameters of groups with `fallback=name`.

    Optimizers check the option when they are built and when a group changes, so
    register the rule before either. A checkpoint of a group with this fallback
    loads only where the rule is registered under the same name.

    Args:
        name: A new name (not `"adamw"`, `"sgd"` or one registered before).
        rule: An instance of a `FallbackRule` subclass; its `state_keys` must
            not be the step guard's counters (`RESERVED_KEYS`).

    Returns:
        `rule` (so that registration can wrap an instantiation).

    Raises:
        TypeError: If `name` is not a non-empty str, `rule` is not a
            `FallbackRule` instance, or its `state_keys` is not a tuple of str.
        ValueError: If `name` is taken, or a state key is reserved.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}.")
    if not isinstance(rule, FallbackRule):
        raise TypeError(
            f"rule must be a FallbackRule instance, got {type(rule).__name__}."
        )
    keys = rule.state_keys
    if not isinstance(keys, tuple) or not all(isinstance(k, str) for k in keys):
        raise TypeError(
            f"{type(rule).__name__}.state_keys must be a tuple of str, got {keys!r}."
        )
    if name in FALLBACK_RULES:
        taken_by = type(FALLBACK_RULES[name]).__name__
        raise ValueError(f"Fallback name {name!r} is already taken by {taken_by}.")
    reserved = [key for key in keys if key in RESERVED_KEYS]
    if reserved:
        raise ValueError(
            f"{type(rule).__name__}.state_keys uses {reserved[0]!r}, which the "
            "step guard keeps in the optimizer state; choose another name."
        )
    FALLBACK_RULES[name] = rule
    return rule


def unregister_fallback(name: str) -> None:
    """Remove a rule registered with `register_fallback`.

    Args:
        name: Its name.

    Raises:
        ValueError: If no rule was registered under `name` (the built-in ones
            cannot be removed).
    """
    if name in BUILTIN_FALLBACKS or name not in FALLBACK_RULES:
        registered = [n for n in FALLBACK_RULES if n not in BUILTIN_FALLBACKS]
        raise ValueError(
            f"{name!r} is not a registered fallback rule; registered: {registered}."
        )
    del FALLBACK_RULES[name]
