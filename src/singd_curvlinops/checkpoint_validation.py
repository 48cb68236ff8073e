"""Validation of a whole state dict before `load_state_dict` changes anything.

`validate` checks, in this order, and raises before the optimizer changes:

1. **Top level**: a mapping with `"state"` (a mapping) and `"param_groups"` (a
   list of mappings, each with a list `"params"`); other top-level keys are
   ignored, as `torch.optim.Optimizer.load_state_dict` ignores them.
2. **Groups**: as many groups as the optimizer has, of the same sizes, with
   distinct parameter ids (ints, or the parameter names that
   `torch.distributed.checkpoint` uses); the saved parameters map onto the
   optimizer's in order, as in `torch.optim`.
3. **Options** of every group, by the check the constructor runs
   (`option_guard.check_options`: types, ranges, finiteness, with the group's
   place in the message). Options newer than the checkpoint take the loading
   optimizer's values (`checkpoint.from_plain`); options this package does not
   know are kept, as `torch.optim` keeps them.
4. **State**: no entry for an id that no saved group holds; an entry for every
   parameter, complete and valid for the parameter's role
   (`state_validation`). Exceptions: an empty `"state"` loads as the initial
   state (a fresh optimizer's), and a parameter that does not require gradients
   may lack its entry (`torch.distributed.checkpoint` leaves out frozen
   parameters): it keeps the state it has.

Wrong types raise `TypeError`, everything else `ValueError`, with the path of the
offending key (`state_dict['param_groups'][0]['T']`,
`state_dict['state'][3]['K.mat']`) and the layer or parameter it belongs to.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor
from torch.nn import Parameter

from singd_curvlinops import checkpoint, state_validation
from singd_curvlinops.distributed.fsdp import split_bias
from singd_curvlinops.layers.layer_set import LayerSet
from singd_curvlinops.option_guard import check_options
from singd_curvlinops.rules import FactorRule


@dataclass(frozen=True)
class LoadPlan:
    """A validated state dict and what `load_state_dict` does after loading it.

    Attributes:
        state_dict: For `torch.optim.Optimizer.load_state_dict`: the groups with
            their checked, normalised options.
        factors: Per layer weight, its factor tensors in the dtypes it computes
            them in (`torch.optim` would cast them to the parameter's).
        fresh: Whether the state is empty: every layer and fallback parameter
            then gets its initial state.
        kept: Parameters without a saved entry that keep their current one.
    """

    state_dict: dict[str, Any]
    factors: dict[Parameter, dict[str, Tensor]]
    fresh: bool
    kept: tuple[Parameter, ...]


def validate(
    state_dict: Any,
    *,
    groups: Sequence[dict[str, Any]],
    layers: LayerSet,
    fallback: Collection[Parameter],
    rule: FactorRule,
) -> LoadPlan:
    """Check a whole state dict against the loading optimizer (module docs).

    Args:
        state_dict: The state dict to load (not modified).
        groups: The optimizer's parameter groups.
        layers: Its layers.
        fallback: Its fallback parameters.
        rule: Its factor rule.

    Returns:
        What to load and restore.

    Raises:
        ValueError: If a saved id is unknown; the helpers raise it for other
            missing, unknown or invalid keys and values, and a `TypeError` for
            values of the wrong type.
    """
    _check_top_level(state_dict)
    ids = _check_group_params(state_dict["param_groups"], groups)
    restored = checkpoint.from_plain(state_dict, list(groups))
    checked = []
    for index, (saved, current) in enumerate(
        zip(restored["param_groups"], groups, strict=True)
    ):
        options = check_options(
            rule,
            saved,
            where=f"state_dict['param_groups'][{index}]",
            holds_fallback=any(p in fallback for p in current["params"]),
        )
        checked.append({**options, "params": list(saved["params"])})
    state = restored["state"]
    unknown = [key for key in state if key not in ids]
    if unknown:
        raise ValueError(
            f"state_dict['state'] has entries for {_few(unknown)}, which no group "
            f"of state_dict['param_groups'] holds (they hold {_few(list(ids))}); "
            "the state belongs to another model or optimizer configuration."
        )
    factors, kept = {}, []
    if state:
        for (saved_id, param), group in zip(
            ids.items(), _group_of(checked), strict=True
        ):
            entry = state.get(saved_id)
            if not entry and not param.requires_grad:  # None or empty
                kept.append(param)
                continue
            where = f"state_dict['state'][{saved_id!r}]"
            layer_factors = _check_entry(
                entry, where, param, group, layers=layers, fallback=fallback, rule=rule
            )
            if layer_factors is not None:
                factors[param] = layer_factors
    loadable = {"state": state, "param_groups": checked}
    return LoadPlan(loadable, factors, fresh=not state, kept=tuple(kept))


def _few(keys: list[Any]) -> str:
    """Return at most five keys for a message, with the count of the others.

    Args:
        keys: The keys.

    Returns:
        E.g. `"[0, 1, 2, 3, 4] and 7 more"`.
    """
    more = f" and {len(keys) - 5} more" if len(keys) > 5 else ""
    return f"{keys[:5]}{more}"


def _check_top_level(state_dict: Any) -> None:
    """Check the containers of a state dict.

    Args:
        state_dict: The candidate.

    Raises:
        TypeError: If a container has the wrong type.
        ValueError: If `"state"` or `"param_groups"` is missing.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"state_dict must be a mapping, got {type(state_dict).__name__}."
        )
    for key, kind in (("state", Mapping), ("param_groups", (list, tuple))):
        if key not in state_dict:
            raise ValueError(
                f"state_dict lacks {key!r}; an optimizer's state dict has 'state' "
                f"and 'param_groups', got {list(state_dict)}."
            )
        if not isinstance(state_dict[key], kind):
            raise TypeError(
                f"state_dict[{key!r}] must be a "
                f"{'mapping' if key == 'state' else 'list'}, got "
                f"{type(state_dict[key]).__name__}."
            )
    for index, group in enumerate(state_dict["param_groups"]):
        where = f"state_dict['param_groups'][{index}]"
        if not isinstance(group, Mapping):
            raise TypeError(f"{where} must be a mapping, got {type(group).__name__}.")
        if "params" not in group:
            raise ValueError(f"{where} lacks 'params' (the ids of its parameters).")
        if not isinstance(group["params"], (list, tuple)):
            raise TypeError(
                f"{where}['params'] must be a list of parameter ids, got "
                f"{type(group['params']).__name__}."
            )
    for key, entry in state_dict["state"].items():
        if not isinstance(entry, Mapping):
            raise TypeError(
                f"state_dict['state'][{key!r}] must be a mapping of state entries, "
                f"got {type(entry).__name__}."
            )


def _check_group_params(
    saved_groups: Sequence[Mapping[str, Any]], groups: Sequence[dict[str, Any]]
) -> dict[Any, Parameter]:
    """Map the saved parameter ids onto the optimizer's parameters.

    Args:
        saved_groups: The saved groups.
        groups: The optimizer's groups.

    Returns:
        Saved id to parameter, in the optimizer's parameter order.

    Raises:
        ValueError: If the groups differ in number or size, or ids repeat.
    """
    saved_sizes = [len(group["params"]) for group in saved_groups]
    sizes = [len(group["params"]) for group in groups]
    if saved_sizes != sizes:
        raise ValueError(
            f"The state has parameter groups of sizes {saved_sizes}, this optimizer "
            f"of sizes {sizes}: it belongs to another model or optimizer "
            "configuration."
        )
    ids: dict[Any, Parameter] = {}
    for index, (saved, group) in enumerate(zip(saved_groups, groups, strict=True)):
        for saved_id, param in zip(saved["params"], group["params"], strict=True):
            try:
                repeated = saved_id in ids
            except TypeError:  # unhashable
                repeated = True
            if repeated:
                raise ValueError(
                    f"state_dict['param_groups'][{index}]['params'] repeats or has "
                    f"an invalid parameter id {saved_id!r}; every parameter has one "
                    "distinct id."
                )
            ids[saved_id] = param
    return ids


def _group_of(groups: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Return the group of each parameter, in parameter order.

    Args:
        groups: The groups.

    Returns:
        One group per parameter.
    """
    return [group for group in groups for _ in group["params"]]


def _check_entry(
    entry: Mapping[str, Any] | None,
    where: str,
    param: Parameter,
    group: dict[str, Any],
    *,
    layers: LayerSet,
    fallback: Collection[Parameter],
    rule: FactorRule,
) -> dict[str, Tensor] | None:
    """Check one parameter's entry by its role (`state_validation`).

    Args:
        entry: The saved entry, or None if there is none.
        where: Its path.
        param: The parameter.
        group: Its saved group (checked).
        layers: The optimizer's layers.
        fallback: Its fallback parameters.
        rule: Its factor rule.

    Returns:
        A layer's factor tensors for its first parameter, else None.

    Raises:
        ValueError: If the entry is missing or invalid.
    """
    layer = layers.owner(param)
    name = layers.name(param)
    if layer is None:
        owner = f"fallback parameter {name!r}"
    elif param is layer.weight:
        owner = f"layer {layer.name!r}"
    else:
        owner = f"parameter {name!r} of layer {layer.name!r}"
    if entry is None:
        raise ValueError(
            f"{where} is missing: the state has no entry for the {owner}, while "
            "others have one; the state belongs to another model or optimizer "
            "configuration, or is incomplete."
        )
    if layer is None:
        if param in fallback:
            state_validation.check_fallback_entry(
                entry, where, owner, param, group["fallback"]
            )
        return None
    if param is layer.weight:
        return state_validation.check_layer_entry(entry, where, layer, group, rule)
    grafted = split_bias(layer)  # (its own grafting moments)
    state_validation.check_param_entry(entry, where, owner, param, grafted=grafted)
    return None
