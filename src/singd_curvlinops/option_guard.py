"""Options of parameter groups, validated wherever they enter the optimizer.

`check_options` is the one check of a group's options: the rule's `check_group`
(which the constructor and `add_param_group` run), with the group's place in the
message (`param_groups[1]: T must be a positive int, got 0.`), a missing option
reported by name, and one consistency check with the optimizer's parameters (a
group that holds fallback parameters needs a `fallback` rule). `load_state_dict`
runs it on every saved group (`checkpoint_validation`); `OptionGuard` runs it on
the live groups when a step or a statistics hook reads them, so that an option
edited after construction (`optimizer.param_groups[0]["T"] = 0`) raises a clear
error before anything changes instead of failing inside the step. The options
that built the layers' factors (`FIXED_OPTIONS`: structures, their budget and
dtypes) may not change after their first check: an edit raises instead of being
ignored (structures) or failing inside a hook (dtypes).

The guard re-checks a group only when its options changed since its last check:
it keeps a snapshot (the group object, its keys and values) per group, and
comparing the snapshot costs about a microsecond. A scheduler that sets `lr` at
every step makes its group be checked at every step, a few microseconds.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn import Parameter

from singd_curvlinops.layers import Layer
from singd_curvlinops.rules import FactorRule
from singd_curvlinops.rules.fallback import fallback_names
from singd_curvlinops.stepping import is_due


def check_options(
    rule: FactorRule,
    group: Mapping[str, Any],
    *,
    where: str,
    holds_fallback: bool = False,
) -> dict[str, Any]:
    """Return a group's options checked and normalised, without changing `group`.

    Args:
        rule: The optimizer's factor rule (its `check_group` is the check).
        group: The options (a `"params"` entry is left out of the result).
        where: The group's place for messages, e.g. `"param_groups[1]"`.
        holds_fallback: Whether the group holds parameters that no layer owns,
            which its `fallback` rule trains.

    Returns:
        A new dictionary of the normalised options.

    Raises:
        ValueError: If an option is missing or out of range, or the group holds
            fallback parameters and has `fallback=None`; the message names the
            group and the option. An option of the wrong type raises the rule's
            `TypeError`, with the group's place added.
    """
    options = {key: value for key, value in group.items() if key != "params"}
    try:
        rule.check_group(options)
    except KeyError as error:
        raise ValueError(
            f"{where} lacks the option {error.args[0]!r} (options of a parameter "
            "group are never removed; set a valid value instead)."
        ) from None
    except (TypeError, ValueError) as error:
        kind = ValueError if isinstance(error, ValueError) else TypeError
        raise kind(f"{where}: {error}") from None
    check_scalars_fit(group, where=where, holds_fallback=holds_fallback)
    if holds_fallback and options.get("fallback") is None:
        raise ValueError(
            f"{where}: fallback=None, but the group holds parameters that no layer "
            "owns, which its fallback rule trains; fallback must be one of "
            f"{', '.join(map(repr, fallback_names()))}."
        )
    return options


# Options that a step passes as `alpha` to in-place tensor operations
# (`param.add_(direction, alpha=-lr)`), per option the tensors it scales: a
# value beyond their dtype's range cannot be converted and failed inside the step
# (`RuntimeError: value cannot be converted ... without overflow`, after the
# factor updates), e.g. lr = 1e39 on float32 parameters, or damping = 1e5 on
# float16 factors under `kfac_like` (`H + λ KᵀK`). Where the step multiplies by
# the value instead (plain SINGD's damping, lr_cov under normalize_lr_cov) it
# would only give an infinite update that the step guard discards: rejected too.
SCALARS = {
    "lr": "parameters",
    "weight_decay": "parameters",
    "lr_cov": "factors",
    "damping": "factors",
}


def check_scalars_fit(
    group: Mapping[str, Any], *, where: str, holds_fallback: bool = False
) -> None:
    """Raise unless the group's scalar options fit its tensors' dtypes.

    `lr` and `weight_decay` must be representable in the parameters' dtypes,
    `lr_cov` and `damping` in the factors' (`preconditioner_dtype`, None: the
    parameters'), and, for a group with fallback parameters,
    `lr · fallback_lr_ratio` (their learning rate) in the parameters' dtypes.
    Groups without tensors (a checkpoint's, whose `params` are indices) are not
    checked here. A value that does not fit raises `check_fits`'s `ValueError`.

    Args:
        group: A parameter group with its `"params"`.
        where: The group's place for messages.
        holds_fallback: Whether the group holds fallback parameters.
    """
    params = [p for p in group.get("params", ()) if isinstance(p, Tensor)]
    if not params:
        return
    dtypes = {"parameters": {p.dtype for p in params}}
    chosen = group.get("preconditioner_dtype") or (None, None)
    dtypes["factors"] = {dtype or p.dtype for dtype in chosen for p in params}
    for name, kind in SCALARS.items():
        if name in group:
            check_fits(name, group[name], dtypes[kind], kind, where=where)
    if holds_fallback and "fallback_lr_ratio" in group:
        product = float(group["lr"]) * float(group["fallback_lr_ratio"])
        name = "lr · fallback_lr_ratio"
        check_fits(name, product, dtypes["parameters"], "parameters", where=where)


def check_fits(
    name: str, value: Any, dtypes: Iterable[torch.dtype], kind: str, *, where: str
) -> None:
    """Raise unless a number fits the narrowest of the dtypes it scales.

    Args:
        name: The option.
        value: Its value (not a number, e.g. a callable `lr_cov`: not checked).
        dtypes: The dtypes of the tensors it scales.
        kind: What those tensors are (`SCALARS`' values), for the message.
        where: The group's place for messages.

    Raises:
        ValueError: Naming the option, its value and the dtype it does not fit.
    """
    if not isinstance(value, int | float):  # a callable lr_cov: `step_options`
        return
    narrowest = min(dtypes, key=lambda dtype: torch.finfo(dtype).max)
    largest = torch.finfo(narrowest).max
    if abs(float(value)) > largest:
        raise ValueError(
            f"{where}: {name} = {float(value):g} does not fit {narrowest} "
            f"(largest {largest:g}), the dtype of the {kind} it scales; "
            "choose a smaller value."
        )


# the options that decide a layer's factors when the optimizer is built
FIXED_OPTIONS = ("structures", "max_dense_dim", "preconditioner_dtype")


class OptionGuard:
    """Checks the live parameter groups' options when the optimizer reads them.

    Args:
        rule: The optimizer's factor rule.
        fallback: The optimizer's fallback parameters (a live collection).
    """

    def __init__(self, rule: FactorRule, fallback: Collection[Parameter]) -> None:
        self._rule = rule
        self._fallback = fallback
        self._checked: dict[int, tuple[dict[str, Any], tuple, tuple]] = {}

    def check(
        self, groups: Sequence[dict[str, Any]], indices: Sequence[int] | None = None
    ) -> None:
        """Check the groups whose options changed since their last check.

        A group that passes gets its normalised values (a pair as a tuple, ...),
        as the constructor gives them; one that fails raises `check_options`'s
        `ValueError` or `TypeError`, and nothing changes.

        Args:
            groups: The optimizer's parameter groups.
            indices: The groups to check (None: all).
        """
        for index in range(len(groups)) if indices is None else indices:
            group = groups[index]
            registered = group.get("fallback") in (None, *fallback_names())
            if self._unchanged(index, group) and registered:
                continue  # (a rule unregistered since its check is checked again)
            holds_fallback = any(p in self._fallback for p in group["params"])
            options = check_options(
                self._rule,
                group,
                where=f"param_groups[{index}]",
                holds_fallback=holds_fallback,
            )
            self._check_fixed(index, group, options)
            for key, value in options.items():
                if key in group and group[key] is not value:
                    group[key] = value
            self._checked[index] = (group, tuple(group), tuple(group.values()))

    def forget(self) -> None:
        """Forget every snapshot (after `load_state_dict` replaced the groups)."""
        self._checked.clear()

    def _check_fixed(
        self, index: int, group: dict[str, Any], options: Mapping[str, Any]
    ) -> None:
        """Raise if an option that built the group's layers changed since its check.

        Args:
            index: The group's position.
            group: The group.
            options: Its checked, normalised options.

        Raises:
            ValueError: Naming the option, its old and its new value.
        """
        seen = self._checked.get(index)
        if seen is None or seen[0] is not group:
            return
        before = dict(zip(seen[1], seen[2], strict=True))
        for key in FIXED_OPTIONS:
            if key in before and key in options and options[key] != before[key]:
                raise ValueError(
                    f"param_groups[{index}]: {key} is fixed when the optimizer is "
                    f"built (its layers' factors have their structures and dtypes); "
                    f"it was {before[key]!r}, now {options[key]!r}. Set it back, or "
                    "build a new optimizer (a checkpoint loads into one built with "
                    "other preconditioner_dtype; its factors are cast)."
                )

    def _unchanged(self, index: int, group: dict[str, Any]) -> bool:
        """Return whether a group has the keys and values of its last check.

        Args:
            index: Its position.
            group: The group.

        Returns:
            True if it is the same dictionary with the same keys and values.
        """
        seen = self._checked.get(index)
        if seen is None or seen[0] is not group:
            return False
        try:  # values compare by identity first; a tensor may refuse `==`
            return seen[1] == tuple(group) and seen[2] == tuple(group.values())
        except (RuntimeError, TypeError, ValueError):
            return False

    def step_options(
        self,
        layers: Sequence[Layer],
        state: Mapping[Parameter, dict[str, Any]],
        groups: Sequence[dict[str, Any]],
    ) -> dict[Layer, dict[str, Any]]:
        """Evaluate and check the step-dependent options of the due layers.

        Args:
            layers: The layers of this step.
            state: The optimizer's state.
            groups: Its parameter groups (checked).

        Returns:
            Per layer whose factors are due, the options that replace the group's
            in this step (`FactorRule.step_options`: a callable `lr_cov`'s value,
            which raises a `ValueError` if it is invalid or does not fit the
            factors' dtype; nothing has changed then).
        """
        values = {}
        for layer in layers:
            group = groups[layer.group_index]
            layer_state = state[layer.weight]
            if not is_due(layer_state, group):
                continue
            step = layer_state["step"]
            options = self._rule.step_options(layer.options(group), step)
            if options:  # (a callable lr_cov's value must fit the factors too)
                where = f"param_groups[{layer.group_index}] at step {step}"
                dtypes = {
                    "factors": layer.factor_dtypes(group),
                    "parameters": [p.dtype for p in layer.params],
                }
                for name, value in options.items():
                    if name in SCALARS:
                        kind = SCALARS[name]
                        check_fits(name, value, dtypes[kind], kind, where=where)
                values[layer] = options
        return values
