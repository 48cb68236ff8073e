"""Checkpoints: `state_dict()` as plain tensors and containers, checked before loading.

`to_plain` makes an optimizer's state dict loadable with
`torch.load(..., weights_only=True)`: dtypes become strings, pairs lists, and a
callable `lr_cov` or `structures` a marker that `from_plain` replaces by the
callable of the optimizer that loads it. Options that a checkpoint lacks (it was
written before they existed) take the loading optimizer's values.
`checkpoint_validation` checks the whole state dict against the loading
optimizer before anything changes. Factors come back in the dtypes the layers
compute them in (`preconditioner_dtype`): `torch.optim.Optimizer.load_state_dict`
casts floating state to the parameter's dtype, which would turn float32 factors
of bfloat16 weights into bfloat16 (`restore_factors` undoes that).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.nn import Parameter

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

    Options that a saved group lacks (newer than the checkpoint) take the values
    of the loading optimizer's group at the same position.

    Args:
        state_dict: As written by `to_plain`, with as many groups as
            `current_groups` (checked by `checkpoint_validation`; not modified).
        current_groups: The loading optimizer's groups (for callable `lr_cov`).

    Returns:
        The state dict to hand to `torch.optim.Optimizer.load_state_dict`.

    Raises:
        ValueError: If the checkpoint has a callable `lr_cov` or `structures`
            where the loading optimizer has none, or `preconditioner_dtype` does
            not name floating dtypes.
    """
    restored = {
        "state": dict(state_dict["state"]),
        "param_groups": [dict(g) for g in state_dict["param_groups"]],
    }
    for index, (group, current) in enumerate(
        zip(restored["param_groups"], current_groups, strict=True)
    ):
        where = f"state_dict['param_groups'][{index}]"
        for key, value in current.items():  # options newer than the checkpoint
            group.setdefault(key, value)
        group["preconditioner_dtype"] = _dtypes(
            group["preconditioner_dtype"], f"{where}['preconditioner_dtype']"
        )
        for key in _PAIRS:
            if isinstance(group.get(key), list):
                group[key] = tuple(group[key])
        for key, marker in _CALLABLES.items():
            if not (isinstance(group.get(key), str) and group[key] == marker):
                continue
            if not callable(current.get(key)):
                raise ValueError(
                    f"The checkpoint was saved with a callable {key} ({where}); "
                    "construct the optimizer with the same callable before loading."
                )
            group[key] = current[key]
    return restored


def _dtypes(value: Any, where: str) -> Any:
    """Return saved dtype names as torch dtypes (other values as they are).

    Args:
        value: A saved `preconditioner_dtype`: names like `"float32"` or None.
        where: Its place, for the message.

    Returns:
        A tuple of dtypes and None, or `value` itself if it is no list or tuple
        (the option check rejects it then).

    Raises:
        ValueError: If a name is no floating torch dtype.
    """
    if not isinstance(value, (list, tuple)):
        return value
    dtypes = []
    for name in value:
        dtype = getattr(torch, name, None) if isinstance(name, str) else name
        if isinstance(name, str) and not isinstance(dtype, torch.dtype):
            dtype = name  # not a dtype's name
        if not (dtype is None or isinstance(dtype, torch.dtype)):
            raise ValueError(
                f"{where} must name a pair of floating torch dtypes or None "
                f"(e.g. ['float32', None]), got {value!r}."
            )
        dtypes.append(dtype)
    return tuple(dtypes)


def restore_factors(
    state: dict[Parameter, dict[str, Any]],
    factors: dict[Parameter, dict[str, Tensor]],
) -> None:
    """Put the validated factors into the loaded state, on their parameter's device.

    Args:
        state: The optimizer's `state` after `load_state_dict`.
        factors: The factor tensors of each layer, as validated.
    """
    for param, tensors in factors.items():
        state[param].update({k: t.to(param.device) for k, t in tensors.items()})
