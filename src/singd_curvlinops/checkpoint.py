"""Checkpoints: `state_dict()` as plain tensors and containers, checked before loading.

`to_plain` makes an optimizer's state dict loadable with
`torch.load(..., weights_only=True)`: dtypes become strings, pairs lists, and a
callable `lr_cov` or `structures` a marker that `from_plain` replaces by the
callable of the optimizer that loads it. Options that a checkpoint lacks (it was
written before they existed) take the loading optimizer's values.
`validated_factors` compares the factors of a state dict with the layers of the
loading optimizer before anything changes, and keeps them
in their saved dtypes: `torch.optim.Optimizer.load_state_dict` casts floating
state to the parameter's dtype, which would turn float32 factors of bfloat16
weights into bfloat16 (`restore_factors` undoes that).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.nn import Parameter

from singd_curvlinops.layers import Layer
from singd_curvlinops.rules import FactorRule

CALLABLE_LR_COV = "<callable lr_cov: restored from the optimizer on load>"
CALLABLE_STRUCTURES = "<callable structures: restored from the optimizer on load>"
_CALLABLES = {"lr_cov": CALLABLE_LR_COV, "structures": CALLABLE_STRUCTURES}
_PAIRS = ("structures", "fallback_betas")


def to_plain(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Replace the group options that are not plain data, in place.

    Args:
        state_dict: From `torch.optim.Optimizer.state_dict`.

    Returns:
        The same dictionary.
    """
    for group in state_dict["param_groups"]:
        for key, marker in _CALLABLES.items():
            if callable(group.get(key)):
                group[key] = marker
        group["preconditioner_dtype"] = [
            None if d is None else str(d).removeprefix("torch.")
            for d in group["preconditioner_dtype"]
        ]
        for key in _PAIRS:
            if isinstance(group.get(key), tuple):
                group[key] = list(group[key])
    return state_dict


def from_plain(
    state_dict: dict[str, Any], current_groups: list[dict[str, Any]]
) -> dict[str, Any]:
    """Return a shallow copy with the group options restored to their types.

    Args:
        state_dict: As written by `to_plain` (not modified).
        current_groups: The loading optimizer's groups (for callable `lr_cov`).

    Returns:
        The state dict to hand to `torch.optim.Optimizer.load_state_dict`.

    Raises:
        ValueError: If the checkpoint has a callable `lr_cov` or `structures`
            where the loading optimizer has none.
    """
    restored = {
        "state": dict(state_dict["state"]),
        "param_groups": [dict(g) for g in state_dict["param_groups"]],
    }
    for group, current in zip(restored["param_groups"], current_groups, strict=False):
        for key, value in current.items():  # options newer than the checkpoint
            group.setdefault(key, value)
        group["preconditioner_dtype"] = tuple(
            None if d is None else getattr(torch, d)
            for d in group["preconditioner_dtype"]
        )
        for key in _PAIRS:
            if isinstance(group.get(key), list):
                group[key] = tuple(group[key])
        for key, marker in _CALLABLES.items():
            if group.get(key) != marker:
                continue
            if not callable(current.get(key)):
                raise ValueError(
                    f"The checkpoint was saved with a callable {key}; construct "
                    "the optimizer with the same callable before loading."
                )
            group[key] = current[key]
    return restored


def validated_factors(
    state_dict: dict[str, Any],
    current_groups: list[dict[str, Any]],
    layers: dict[Parameter, Layer],
    rule: FactorRule,
) -> dict[Parameter, dict[str, Tensor]]:
    """Check the factors of a state dict against the loading optimizer's layers.

    Args:
        state_dict: From `from_plain`.
        current_groups: The loading optimizer's parameter groups.
        layers: Its layers, by weight.
        rule: Its factor rule.

    Returns:
        Map from weight to its factor tensors, in their saved dtypes.

    Raises:
        ValueError: If groups, structures or factor shapes do not match.
    """
    params = [p for g in current_groups for p in g["params"]]
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(current_groups) or sum(
        len(g["params"]) for g in saved_groups
    ) != len(params):
        raise ValueError(
            "The state has different parameter groups than this optimizer: it "
            "belongs to another model or optimizer configuration."
        )
    group_of = {i: g for g in saved_groups for i in g["params"]}
    factors = {}
    for index, param in enumerate(params):
        saved = state_dict["state"].get(index, {})
        if param not in layers or "step" not in saved:
            continue
        layer = layers[param]
        group = layer.options(group_of[index])
        initial = rule.init_state(group, layer.dims, layer.factor_dtypes(group), "meta")
        expected = {
            k: tuple(v.shape)
            for k, v in initial.items()
            if isinstance(v, Tensor) and not k.startswith("graft_")
        }
        found = {  # the rule's entries: its factors and whatever else it keeps
            k: tuple(v.shape)
            for k, v in saved.items()
            if isinstance(v, Tensor)
            and (k in expected or k.split(".")[0] in _factor_prefixes(rule))
        }
        if found != expected:
            raise ValueError(
                f"The state's factors of layer {layer.name!r} do not match this "
                f"optimizer's: saved {found}, expected {expected} (structures "
                f"{layer.structures}); it belongs to another model or structure "
                "configuration."
            )
        factors[param] = {k: saved[k] for k in expected}
    return factors


def _factor_prefixes(rule: FactorRule) -> set[str]:
    """Return the state prefixes of a rule's factors (`"K"`, `"m_K"`, ...).

    Args:
        rule: The factor rule.

    Returns:
        The prefixes.
    """
    return {prefix for prefix, _ in rule.factor_sides}


def restore_factors(
    state: dict[Parameter, dict[str, Any]],
    factors: dict[Parameter, dict[str, Tensor]],
) -> None:
    """Put the validated factors into the loaded state, on their parameter's device.

    Args:
        state: The optimizer's `state` after `load_state_dict`.
        factors: From `validated_factors`.
    """
    for param, tensors in factors.items():
        state[param].update({k: t.to(param.device) for k, t in tensors.items()})
