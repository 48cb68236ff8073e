"""Who computes which side's decomposition (EKFAC's eigenbases) under `Shard`.

The decompositions of a step are a phase of their own (`decompositions`): they
end in the collective that shares them, before any rank preconditions, so they
are balanced among themselves, apart from the preconditioning that
`assignment` balances. A pure function of the layers' dimensions, structures
and `T` and of the world size: every rank computes the same placement.
"""

from __future__ import annotations

from collections.abc import Sequence

from singd_curvlinops.layers import Layer
from singd_curvlinops.rules import FactorRule


def decomposition_costs(
    layer: Layer, groups: Sequence[dict], rule: FactorRule
) -> tuple[float, float]:
    r"""Return a layer's decomposition work per side (`FactorRule.decompose`).

    An eigendecomposition of a \(d \times d\) factor costs a multiple of
    \(d^3\) multiply-adds; amortised over the `T` steps between updates.

    Args:
        layer: The layer.
        groups: The parameter groups.
        rule: The factor rule.

    Returns:
        \(d^3 / T\) for each decomposed side, else 0.
    """
    group = layer.options(groups[layer.group_index])
    sides = rule.decomposed_sides(group)
    return tuple(
        dim**3 / group["T"] if side in sides else 0.0
        for side, dim in enumerate(layer.dims)
    )


def assign_decompositions(
    costs: Sequence[tuple[float, float]], world_size: int
) -> list[tuple[int, int]]:
    """Place every side's decomposition largest first on the least loaded rank.

    The decompositions are a phase of their own: they end in the collective that
    shares them, before any rank preconditions. So they are balanced among
    themselves, from empty ranks (LPT; ties go to the lower rank).

    Args:
        costs: Per layer, the work of each side's decomposition (0: none).
        world_size: The number of ranks.

    Returns:
        Per layer, the rank of each side's decomposition (0 for a side without).
    """
    units = sorted(
        (-work, index, side)
        for index, pair in enumerate(costs)
        for side, work in enumerate(pair)
        if work > 0
    )
    loads = [0.0] * world_size
    ranks = [[0, 0] for _ in costs]
    for negative, index, side in units:
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        loads[rank] -= negative
        ranks[index][side] = rank
    return [(first, second) for first, second in ranks]
