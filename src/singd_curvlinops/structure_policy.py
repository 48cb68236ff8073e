r"""Which structure each Kronecker factor gets, within a memory budget.

The option `structures` of a parameter group is a policy:

- a pair of structure names `(K, C)`, used for every layer of the group;
- `"auto"` (the default): `"dense"` for a factor of dimension
  \(d \le\) `max_dense_dim`, `"diagonal"` above;
- a callable `(layer_name, dims) -> (K, C)`, asked once per layer at registration
  with the layer's name and its dimensions `(d_K, d_C)`.

**Budget.** A group's `max_dense_dim` (default 4096, None: no limit) bounds every
factor of its layers: a factor may store at most `max_dense_dim**2` numbers (the
default: 16.8 million, 64 MiB in float32, so a dense factor up to dimension 4096).
A factor over the budget is never allocated: the optimizer raises a `ValueError`
at construction that names the layer, the factor's dimension and the options. A
user who wants such a factor (a dense \(50{,}257 \times 50{,}257\) factor holds 9.4
GiB in float32) names its layer explicitly: a parameter group of its own with a
larger `max_dense_dim`.

**Exactly diagonal factors.** The input side of an embedding (one-hot inputs) is a
diagonal matrix of token counts; it is always stored as `"diagonal"`, whatever the
policy says (under SINGD's update a dense factor would stay diagonal; other
structures would only blur the counts).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from singd_curvlinops.structures import get_structure

AUTO = "auto"
DEFAULT_MAX_DENSE_DIM = 4096
_SIDES = ("input-side (K)", "output-side (C)")

StructurePolicy = str | tuple[str, str] | Callable[[str, tuple[int, int]], Any]


def check_structures(structures: Any) -> StructurePolicy:
    """Check a structure policy (see the module docs).

    Args:
        structures: `"auto"`, a callable, or a pair of structure names.

    Returns:
        The policy; a pair as a tuple.

    Raises:
        ValueError: If it is none of these or names an unknown structure.
    """
    if structures == AUTO or callable(structures):
        return structures
    if (
        isinstance(structures, str)
        or not isinstance(structures, (tuple, list))
        or len(structures) != 2
    ):
        raise ValueError(
            "structures must be a pair (K structure, C structure), got "
            f"{structures!r} (or 'auto', or a callable (layer_name, dims) -> (K, C))."
        )
    for name in structures:
        get_structure(name)  # raises ValueError listing the valid names
    return tuple(structures)


def check_max_dense_dim(value: Any) -> int | None:
    """Check a budget `max_dense_dim`.

    Args:
        value: A positive int or None.

    Returns:
        The value.

    Raises:
        ValueError: If it is neither.
    """
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or value < 1
    ):
        raise ValueError(
            f"max_dense_dim must be a positive int or None, got {value!r}."
        )
    return value


def resolve_structures(
    name: str,
    dims: tuple[int, int],
    group: Mapping[str, Any],
    diagonal_sides: tuple[bool, bool] = (False, False),
) -> tuple[str, str]:
    """Return the structures of a layer's factors `(K, C)` under its group's policy.

    Args:
        name: The layer's name (for the callable policy and messages).
        dims: `(d_K, d_C)`.
        group: Its parameter group (`structures`, `max_dense_dim`).
        diagonal_sides: Which sides are exactly diagonal (stored as `"diagonal"`).

    Returns:
        The structure names.

    Raises:
        ValueError: If a callable policy returns no valid pair, or a factor
            exceeds the group's budget.
    """
    policy, budget = group["structures"], group["max_dense_dim"]
    if policy == AUTO:
        names = tuple(
            "dense" if budget is None or d <= budget else "diagonal" for d in dims
        )
    elif callable(policy):
        try:
            names = check_structures(policy(name, dims))
        except ValueError as error:
            raise ValueError(
                f"structures({name!r}, {dims}) returned no valid pair: {error}"
            ) from error
        if not isinstance(names, tuple):
            raise ValueError(
                f"structures({name!r}, {dims}) must return a pair of names, got "
                f"{names!r}."
            )
    else:
        names = tuple(policy)
    names = tuple(
        "diagonal" if diagonal else n
        for n, diagonal in zip(names, diagonal_sides, strict=True)
    )
    for side, (structure, dim) in enumerate(zip(names, dims, strict=True)):
        _check_budget(name, side, structure, dim, budget)
    return names


def stored_numbers(structure: str, dim: int) -> int:
    """Return how many numbers a factor of this structure and dimension stores.

    Args:
        structure: A structure name.
        dim: The dimension.

    Returns:
        The count (computed on the meta device: nothing is allocated).
    """
    return get_structure(structure).zeros(dim, device="meta").numel()


def _check_budget(
    name: str, side: int, structure: str, dim: int, budget: int | None
) -> None:
    """Raise if a factor would store more than `budget**2` numbers.

    Args:
        name: The layer's name.
        side: 0 (K) or 1 (C).
        structure: The factor's structure.
        dim: Its dimension.
        budget: The group's `max_dense_dim`, or None.

    Raises:
        ValueError: Naming the layer, the dimension and the options.
    """
    if budget is None:
        return
    numbers = stored_numbers(structure, dim)
    if numbers <= budget**2:
        return
    raise ValueError(
        f"Layer {name!r}: its {_SIDES[side]} factor has dimension {dim}; as "
        f"{structure!r} it stores {numbers:,} numbers ({numbers * 4 / 2**20:,.0f} MiB "
        f"in float32), over the budget max_dense_dim**2 = {budget}**2. Choose a "
        "smaller structure for it (structures='auto' picks 'diagonal' above "
        "max_dense_dim; a callable structures=(layer_name, dims) -> (K, C) chooses "
        "per layer), or name the layer explicitly: put it in a parameter group of its "
        "own with a larger max_dense_dim (None: no limit)."
    )
