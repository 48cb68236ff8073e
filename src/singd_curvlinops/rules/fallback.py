r"""The fallback rules: AdamW or SGD for the parameters that no layer owns.

A parameter group's `fallback` option (`"adamw"`, the default, `"sgd"`, or None)
names the rule that trains its parameters outside any Kronecker layer: norm
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
moments live under `"graft_exp_avg"`, `"graft_exp_avg_sq"`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from singd_curvlinops.update import parameter_step

FALLBACKS = ("adamw", "sgd")
GRAFTS = ("adamw", "sgd")


def adam_direction(
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    step: int,
    betas: tuple[float, float],
    eps: float,
) -> Tensor:
    r"""Update Adam's moments in place; return \(\hat m / (\sqrt{\hat v} + \epsilon)\).

    Args:
        grad: The gradient \(g\).
        exp_avg: First moment \(m\) (updated in place).
        exp_avg_sq: Second moment \(v\) (updated in place).
        step: The step count \(t \ge 1\) after this step.
        betas: \((\beta_1, \beta_2)\).
        eps: \(\epsilon\).

    Returns:
        A new tensor.
    """
    beta1, beta2 = betas
    exp_avg.lerp_(grad, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    denominator = (exp_avg_sq / (1.0 - beta2**step)).sqrt_().add_(eps)
    return (exp_avg / (1.0 - beta1**step)).div_(denominator)


class FallbackRule(ABC):
    """How the fallback trains one parameter outside any Kronecker layer.

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
        param: Tensor,
        grad: Tensor,
        state: dict[str, Any],
        group: Mapping[str, Any],
    ) -> None:
        """Update the parameter in place.

        Args:
            param: The parameter.
            grad: Its (unscaled) gradient; may be overwritten.
            state: Its state (updated in place).
            group: Its parameter group.
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
        param: Tensor,
        grad: Tensor,
        state: dict[str, Any],
        group: Mapping[str, Any],
    ) -> None:
        """Apply one AdamW step."""
        state["step"] += 1
        lr = group["lr"] * group["fallback_lr_ratio"]
        direction = adam_direction(
            grad,
            state["exp_avg"],
            state["exp_avg_sq"],
            step=state["step"],
            betas=group["fallback_betas"],
            eps=group["fallback_eps"],
        )
        if group["weight_decay"]:
            param.mul_(1.0 - lr * group["weight_decay"])
        param.add_(direction, alpha=-lr)


class SGDFallback(FallbackRule):
    """SGD with the group's momentum and (L2) weight decay (module docs)."""

    state_keys = ("momentum_buffer",)

    def init_state(self, param: Tensor) -> dict[str, Any]:
        """Return a zero momentum buffer."""
        return {"momentum_buffer": torch.zeros_like(param)}

    def step(
        self,
        param: Tensor,
        grad: Tensor,
        state: dict[str, Any],
        group: Mapping[str, Any],
    ) -> None:
        """Apply one SGD step with momentum and weight decay."""
        parameter_step(
            [param],
            [grad.clone()],  # (weight decay is added to the direction)
            [state["momentum_buffer"]],
            lr=group["lr"] * group["fallback_lr_ratio"],
            momentum=group["momentum"],
            weight_decay=group["weight_decay"],
        )


FALLBACK_RULES: dict[str, FallbackRule] = {
    "adamw": AdamWFallback(),
    "sgd": SGDFallback(),
}
