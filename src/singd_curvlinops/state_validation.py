r"""Checks of one parameter's saved state entry (for `checkpoint_validation`).

What an entry must hold follows from the parameter's role, its group's options
and the optimizer's rule; every version of this package writes these entries
eagerly at construction, so each is required:

- **a layer's first parameter** (its weight): the rule's factor entries with the
  shapes `FactorRule.init_state` gives for the layer's dimensions and structures
  (SINGD `"K.*"`, `"C.*"`, `"m_K.*"`, `"m_C.*"`; KFAC `"A.*"`, `"G.*"` and the
  counter `"updates"`; EKFAC also `"Q_A.mat"`, `"Q_G.mat"`, `"eigenvalues"`),
  floating-point and finite in the dtype the layer computes them in (its group's
  `preconditioner_dtype`, or the weight's dtype where that is None: a factor
  saved in another floating dtype is cast to it, as loading casts momenta to the
  parameter's dtype); the step counter `"step"`; `"grad_scale"`;
  `"momentum_buffer"`.
- **a layer's other parameters** (its bias): `"momentum_buffer"`.
- **a fallback parameter**: the complete state of at least one fallback rule
  (AdamW `"step"`, `"exp_avg"`, `"exp_avg_sq"`; SGD `"momentum_buffer"`), each
  rule's entries all or none: a group whose `fallback` was changed keeps the
  old rule's state, and the new rule's is created at its first step.

Optional: AdamW grafting's `"graft_exp_avg"`, `"graft_exp_avg_sq"` (a pair,
created at the first grafted step; with `"graft_step"`, the count of grafted
steps, where grafting was switched on after construction), and the counters
`"skipped_steps"`, `"discarded_factor_updates"`. Momentum buffers, fallback
moments and grafting moments have the parameter's shape (the grafting moments
the layout of \(\Gamma\), `[d_C, d_K]`, but each parameter's own where FSDP2
splits a bias apart from the weight's blocks, `fsdp.split_bias`), any floating
dtype (loading casts them to the parameter's) and finite entries; counters are
ints in `[0, 2**63)` (or 0-d integer tensors); a gradient scale is a finite
positive number. Any other entry is refused.

Wrong types raise `TypeError`, everything else `ValueError`; messages give the
entry's path in the state dict (`state_dict['state'][0]['K.mat']`), the layer or
parameter, and what is allowed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torch.nn import Parameter

from singd_curvlinops._hyperparameters import check_positive
from singd_curvlinops.distributed.fsdp import split_bias
from singd_curvlinops.layers import Layer
from singd_curvlinops.rules import FactorRule
from singd_curvlinops.rules.fallback import FALLBACK_RULES
from singd_curvlinops.structure_policy import resolve_structures

#: Counters that other features may keep per parameter (allowed, not required).
OPTIONAL_COUNTERS = ("skipped_steps", "discarded_factor_updates")
GRAFT_KEYS = ("graft_exp_avg", "graft_exp_avg_sq")
MAX_COUNT = 2**63 - 1


def check_tensor(
    value: Any, where: str, shape: tuple[int, ...], dtype: torch.dtype | None = None
) -> Tensor:
    """Check a floating-point tensor of a given shape with finite entries.

    Args:
        value: The saved value.
        where: Its path and owner, for messages.
        shape: The expected shape.
        dtype: The dtype to cast it to before checking its entries (None: its
            own).

    Returns:
        The tensor (cast to `dtype`).

    Raises:
        TypeError: If it is no tensor or not floating-point.
        ValueError: If its shape differs or an entry is NaN or infinite.
    """
    if not isinstance(value, Tensor):
        raise TypeError(
            f"{where} must be a floating-point tensor of shape {shape}, got "
            f"{type(value).__name__}."
        )
    if not value.is_floating_point():
        raise TypeError(
            f"{where} must be a floating-point tensor, got dtype {value.dtype}."
        )
    if tuple(value.shape) != shape:
        raise ValueError(
            f"{where} must have shape {shape}, got {tuple(value.shape)}; the state "
            "belongs to another model or configuration."
        )
    if dtype is not None:
        value = value.to(dtype)
    local = value.to_local() if hasattr(value, "to_local") else value  # a DTensor
    if not bool(torch.isfinite(local).all()):
        raise ValueError(f"{where} has non-finite entries (NaN or infinity).")
    return value


def check_counter(value: Any, where: str) -> None:
    r"""Check a counter: an int in `[0, 2**63)` or a 0-d integer tensor.

    The bound is int64's: a larger step count overflows AdamW's \(\beta^t\).

    Args:
        value: The saved value.
        where: Its path and owner, for messages.

    Raises:
        TypeError: If it is neither.
        ValueError: If it is out of range.
    """
    integer_tensor = (
        isinstance(value, Tensor)
        and value.ndim == 0
        and not value.is_floating_point()
        and not value.is_complex()
        and value.dtype != torch.bool
    )
    if not integer_tensor and (isinstance(value, bool) or not isinstance(value, int)):
        raise TypeError(
            f"{where} must be a non-negative int (or a 0-d integer tensor), got "
            f"{value!r}."
        )
    if value < 0 or value > MAX_COUNT:
        raise ValueError(
            f"{where} must be a non-negative int below 2**63, got {value!r}."
        )


def check_layer_entry(
    entry: Mapping[str, Any],
    where: str,
    layer: Layer,
    group: Mapping[str, Any],
    rule: FactorRule,
) -> dict[str, Tensor]:
    """Check the state entry of a layer's first parameter (see the module docs).

    Args:
        entry: The saved entry.
        where: Its path, e.g. `"state_dict['state'][0]"`.
        layer: The layer.
        group: Its (checked, saved) group.
        rule: The optimizer's factor rule.

    Returns:
        The factor tensors, in the dtypes the layer computes them in.

    Raises:
        ValueError: For one of the grafting moments without the other; the
            helpers raise it for other missing, unknown or invalid entries, and
            a `TypeError` for entries of the wrong type.
    """
    owner = f"layer {layer.name!r}"
    _check_structures(where, owner, layer, group)
    options = layer.options(group)
    dtypes = layer.factor_dtypes(options)
    initial = rule.init_state(options, layer.dims, dtypes, "meta")
    factors = {k: v for k, v in initial.items() if isinstance(v, Tensor)}
    _check_factor_keys(entry, f"{where} ({owner})", factors, layer, rule)
    counters = [k for k, v in initial.items() if not isinstance(v, Tensor)]
    required = [*factors, *counters, "step", "grad_scale", "momentum_buffer"]
    optional = [*GRAFT_KEYS, "graft_step", *OPTIONAL_COUNTERS]
    _check_keys(entry, where, owner, required, optional)
    saved = {
        key: check_tensor(
            entry[key], _at(where, key, owner), tuple(value.shape), value.dtype
        )
        for key, value in factors.items()
    }
    for key in (*counters, "step"):
        check_counter(entry[key], _at(where, key, owner))
    check_positive(_at(where, "grad_scale", owner), entry["grad_scale"])
    _check_momentum(entry, where, owner, layer.weight)
    # the layout of Γ; per parameter where FSDP2's blocks are not shards of Γ
    shape = tuple(layer.weight.shape) if split_bias(layer) else layer.dims[::-1]
    _check_graft_moments(entry, where, owner, shape)
    if "graft_step" in entry:
        if "graft_exp_avg" not in entry:
            raise ValueError(
                f"{where} ({owner}) has 'graft_step' without the grafting moments."
            )
        check_counter(entry["graft_step"], _at(where, "graft_step", owner))
        # restored after torch's load, which casts it to the parameter's dtype
        saved["graft_step"] = torch.as_tensor(entry["graft_step"], dtype=torch.int64)
    _check_optional_counters(entry, where, owner)
    return saved


def check_param_entry(
    entry: Mapping[str, Any],
    where: str,
    owner: str,
    param: Parameter,
    *,
    grafted: bool = False,
) -> None:
    """Check the state entry of a layer's other parameter (its bias).

    Args:
        entry: The saved entry.
        where: Its path, for messages.
        owner: The parameter, for messages.
        param: The parameter.
        grafted: Whether it may keep AdamW grafting's moments (a bias that
            FSDP2 splits apart from the weight's blocks: `fsdp.split_bias`).

    The helpers raise a `ValueError` for a missing, unknown or invalid entry, a
    `TypeError` for one of the wrong type.
    """
    optional = [*GRAFT_KEYS, *OPTIONAL_COUNTERS] if grafted else OPTIONAL_COUNTERS
    _check_keys(entry, where, owner, ["momentum_buffer"], optional)
    _check_momentum(entry, where, owner, param)
    _check_graft_moments(entry, where, owner, tuple(param.shape))
    _check_optional_counters(entry, where, owner)


def _check_graft_moments(
    entry: Mapping[str, Any], where: str, owner: str, shape: tuple[int, ...]
) -> None:
    """Check AdamW grafting's moments, if the entry has them: both, of `shape`.

    Args:
        entry: The saved entry.
        where: Its path, for messages.
        owner: The layer or parameter, for messages.
        shape: Their shape.

    Raises:
        ValueError: For one moment without the other; `check_tensor` raises for
            invalid ones.
    """
    if not any(key in entry for key in GRAFT_KEYS):
        return
    for key in GRAFT_KEYS:
        if key not in entry:
            raise ValueError(
                f"{where} ({owner}) has one of {list(GRAFT_KEYS)} without the "
                "other; AdamW grafting keeps both."
            )
        check_tensor(entry[key], _at(where, key, owner), shape)


def check_fallback_entry(
    entry: Mapping[str, Any], where: str, owner: str, param: Parameter, fallback: str
) -> None:
    """Check the state entry of a fallback parameter (see the module docs).

    Args:
        entry: The saved entry.
        where: Its path, for messages.
        owner: The parameter, for messages.
        param: The parameter.
        fallback: Its group's fallback rule (`"adamw"`, `"sgd"` or a registered
            name).

    Raises:
        ValueError: For a missing or incomplete state of a rule; the helpers
            raise it for unknown or invalid entries, and a `TypeError` for
            entries of the wrong type.
    """
    allowed = [key for rule in FALLBACK_RULES.values() for key in rule.state_keys]
    _check_keys(entry, where, owner, [], [*allowed, *OPTIONAL_COUNTERS])
    present = [key for key in entry if key in allowed]
    own = FALLBACK_RULES.get(fallback)
    if own is not None and own.state_keys and not present:
        raise ValueError(
            f"{where} ({owner}) lacks the state of its fallback rule {fallback!r}: "
            f"{list(own.state_keys)}."
        )
    # the state holds whole states of rules (its own; earlier ones' after the
    # group's fallback changed): every key must belong to a rule present in full
    # (rules may share a key name, e.g. "exp_avg")
    whole = {
        name: rule
        for name, rule in FALLBACK_RULES.items()
        if rule.state_keys and all(key in entry for key in rule.state_keys)
    }
    covered = {key for rule in whole.values() for key in rule.state_keys}
    stray = [key for key in present if key not in covered]
    if stray:
        owners = [n for n, r in FALLBACK_RULES.items() if stray[0] in r.state_keys]
        name = fallback if fallback in owners else owners[0]
        keys = FALLBACK_RULES[name].state_keys
        missing = next(key for key in keys if key not in entry)
        raise ValueError(
            f"{where} ({owner}) lacks {missing!r}: the state of the fallback rule "
            f"{name!r} has all of {list(keys)}, got {[k for k in keys if k in entry]}."
        )
    meta = torch.empty(param.shape, dtype=param.dtype, device="meta")
    for rule in whole.values():
        for key, initial in rule.init_state(meta).items():
            if isinstance(initial, Tensor):
                check_tensor(entry[key], _at(where, key, owner), tuple(initial.shape))
            else:
                check_counter(entry[key], _at(where, key, owner))
    _check_optional_counters(entry, where, owner)


# ------------------------------------------------------------------- helpers
def _at(where: str, key: str, owner: str) -> str:
    """Return an entry's path with its owner, e.g. `... [0]['K.mat'] (layer '0')`.

    Args:
        where: The path of the parameter's entry.
        key: The key in it.
        owner: The layer or parameter.

    Returns:
        The text for messages.
    """
    return f"{where}[{key!r}] ({owner})"


def _check_keys(
    entry: Mapping[str, Any],
    where: str,
    owner: str,
    required: list[str],
    optional: Any,
) -> None:
    """Check that an entry has every required key and no unknown one.

    Args:
        entry: The saved entry.
        where: Its path, for messages.
        owner: The layer or parameter, for messages.
        required: The keys it must have.
        optional: The keys it may have.

    Raises:
        ValueError: If a key is missing or unknown.
    """
    missing = [key for key in required if key not in entry]
    if missing:
        raise ValueError(
            f"{where} ({owner}) lacks {', '.join(map(repr, missing))}; its entries "
            f"are {list(required)} (optional: {list(optional)})."
        )
    unknown = [key for key in entry if key not in required and key not in optional]
    if unknown:
        raise ValueError(
            f"{where} ({owner}) has the unknown entries {unknown}; allowed are "
            f"{list(required)} and optionally {list(optional)}."
        )


def _check_factor_keys(
    entry: Mapping[str, Any],
    label: str,
    factors: Mapping[str, Tensor],
    layer: Layer,
    rule: FactorRule,
) -> None:
    """Check that a layer's entry has exactly the factor entries of its structures.

    Args:
        entry: The saved entry.
        label: Its path and layer, for messages.
        factors: The expected factor entries (from `init_state`).
        layer: The layer.
        rule: The factor rule.

    Raises:
        ValueError: If factor entries are missing or foreign, or a shape differs.
    """
    prefixes = {prefix for prefix, _ in rule.factor_sides}
    saved = [
        k
        for k in entry
        if k in factors or (isinstance(k, str) and k.split(".")[0] in prefixes)
    ]
    missing = [k for k in factors if k not in entry]
    foreign = [k for k in saved if k not in factors]
    shapes = [
        f"{k!r} of shape {tuple(entry[k].shape)} (expected {tuple(factors[k].shape)})"
        for k in saved
        if k in factors
        and isinstance(entry[k], Tensor)
        and entry[k].shape != factors[k].shape
    ]
    details = [f"missing {missing}"] if missing else []
    details += [f"foreign {foreign}"] if foreign else []
    details += shapes
    if details:
        raise ValueError(
            f"{label}: the factors do not match this optimizer's (structures "
            f"{layer.structures}, dimensions {layer.dims}): {'; '.join(details)}. "
            "The state belongs to another model or structure configuration, or is "
            "incomplete."
        )


def _check_momentum(
    entry: Mapping[str, Any], where: str, owner: str, param: Parameter
) -> None:
    """Check a parameter's momentum buffer (the parameter's shape).

    Args:
        entry: The saved entry.
        where: Its path, for messages.
        owner: The layer or parameter, for messages.
        param: The parameter.
    """
    path = _at(where, "momentum_buffer", owner)
    check_tensor(entry["momentum_buffer"], path, tuple(param.shape))


def _check_optional_counters(entry: Mapping[str, Any], where: str, owner: str) -> None:
    """Check the optional counters an entry has.

    Args:
        entry: The saved entry.
        where: Its path, for messages.
        owner: The layer or parameter, for messages.
    """
    for key in OPTIONAL_COUNTERS:
        if key in entry:
            check_counter(entry[key], _at(where, key, owner))


def _check_structures(
    where: str, owner: str, layer: Layer, group: Mapping[str, Any]
) -> None:
    """Raise unless the saved group gives the layer the structures it was built with.

    Structures that store the same tensors (`triltoeplitz` and `triutoeplitz`,
    say) would otherwise load, read as other matrices.

    Args:
        where: The entry's path.
        owner: The layer, for messages.
        layer: The layer.
        group: Its saved group (checked).

    Raises:
        ValueError: Naming both structures.
    """
    saved = resolve_structures(layer.name, layer.dims, group, layer.diagonal_sides)
    if saved != tuple(layer.structures):
        raise ValueError(
            f"{where} ({owner}): the saved group gives the layer structures "
            f"{saved}, this optimizer built it with {tuple(layer.structures)}. A "
            "layer's structures are fixed when the optimizer is built: build it with "
            "the checkpoint's structures (and max_dense_dim) to load this state."
        )
