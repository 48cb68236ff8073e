r"""Factor decompositions computed by one rank each, shared in one `all_gather`.

EKFAC's update (`EKFACRule`) reads the examples of every rank: the corrected
eigenvalues \(E\) sum the squared projections of each rank's per-example
gradients in the new eigenbases, in a collective of their own. So under
`distribute="shard"` every rank runs every layer's update (`GatheredStep`'s
`replicated_updates`). The eigendecompositions of the averaged factors, the
update's costliest part (\(O(d^3)\) per dense side, several times a product of
two factors), need no examples, though, and are split:

1. every rank takes the all-reduced statistics; the rank assigned to a side
   (`Assignment.decomposers`, balanced by `decomposition_plan`) computes
   that side's decomposition from the factor as the update will average it
   (`FactorRule.decompose`, which changes nothing);
2. one `all_gather` shares them: per decomposed side its \(d^2\) entries and a
   status (1: sent, the new basis or, where the averaged factor is not finite,
   the one the side keeps; 2: the decomposition failed; 0: the layer has no
   statistics, nothing to decompose);
3. every rank runs every update as before, with the decompositions handed in
   (`FactorStatistics.decompositions`): the state is the same, bit for bit, as
   if it had computed them itself, and stays replicated.

Under `Shard(factors="owned")` a layer's owner computes its decompositions and
alone keeps its state and runs its update; the other ranks use the bases only
to add their examples' squared projections to the owner's (`FactorRule.contribute`)
and hold them only during the step (the gather's buffers are not kept).

A decomposition that fails is reported by every rank after the gather (its own
rank re-raises the error; the others name the layer's side and that rank), so
that no rank waits for a collective that another has left.

Per update step this sends every decomposed side's \(d^2\) numbers once, as
many as the all-reduce of its statistics; the decompositions of a model with
one dominant factor are as balanced as whole decompositions allow (the
benchmarks page has the figures).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from singd_curvlinops.distributed.buffers import Buffers
from singd_curvlinops.distributed.collectives import all_gather_parts, named_collective
from singd_curvlinops.distributed.fsdp import local
from singd_curvlinops.distributed.layout import buffer_dtype
from singd_curvlinops.layers import Layer
from singd_curvlinops.rules import FactorRule, FactorStatistics

# a decomposition's status in the gather: none (its layer has no statistics),
# sent, failed
NONE, SENT, FAILED = 0, 1, 2

Item = tuple[Layer, int]  # (layer, side)


def layout(
    layers: Sequence[Layer],
    plan: Mapping[Layer, Any],
    rule: FactorRule,
    groups: Sequence[dict],
    world: int,
) -> list[list[Item]]:
    """Return per rank the sides it decomposes, in the layers' order.

    Args:
        layers: The due layers (the same on every rank).
        plan: Per layer, its `Assignment`.
        rule: The factor rule.
        groups: The parameter groups.
        world: The number of ranks.

    Returns:
        Per rank, `(layer, side)` of each decomposition it sends.
    """
    items: list[list[Item]] = [[] for _ in range(world)]
    for layer in layers:
        assignment = plan[layer]
        if assignment is None or assignment.decomposers is None:
            continue
        group = layer.options(groups[layer.group_index])
        for side in rule.decomposed_sides(group):
            items[assignment.decomposers[side]].append((layer, side))
    return items


def numel(item: Item) -> int:
    r"""Return the numbers of one decomposition's message: its matrix and status.

    Args:
        item: `(layer, side)`.

    Returns:
        \(d^2 + 1\) for the side's dimension \(d\).
    """
    layer, side = item
    return layer.dims[side] ** 2 + 1


def gathered_bytes(
    layers: Sequence[Layer],
    plan: Mapping[Layer, Any],
    rule: FactorRule,
    groups: Sequence[dict],
    world: int,
) -> int:
    """Return the bytes every rank receives in the gather of an update step.

    Args:
        layers: The due layers.
        plan: Per layer, its `Assignment`.
        rule: The factor rule.
        groups: The parameter groups.
        world: The number of ranks.

    Returns:
        `world` times the largest rank's message (0: nothing decomposed).
    """
    items = layout(layers, plan, rule, groups, world)
    if not any(items):
        return 0
    longest = max(sum(map(numel, share)) for share in items)
    return world * longest * buffer_dtype(layers, groups).itemsize


def share(
    stepper: Any,
    plan: Mapping[Layer, Any],
    taken: dict[Layer, FactorStatistics | None],
    me: int,
    world: int,
    buffers: Buffers | None = None,
) -> dict[Layer, FactorStatistics | None]:
    """Decompose this rank's sides, share all in one `all_gather` (module docs).

    A collective: every rank, the same due layers. If a decomposition failed on
    any rank, every rank raises a `ValueError` after the gather.

    Args:
        stepper: The shell's `LayerStepper`.
        plan: Per layer, its `Assignment`.
        taken: Per due layer (in the same order on every rank), its statistics
            (all-reduced).
        me: This rank.
        world: The number of ranks.
        buffers: The strategy's message buffers (None: allocated here).

    Returns:
        `taken`, with the statistics of each layer that has decomposed sides
        carrying their decompositions.
    """
    layers = list(taken)
    items = layout(layers, plan, stepper.rule, stepper.groups, world)
    if not any(items):
        return taken
    mine, failure = _decompose(stepper, items[me], taken)
    dtype = buffer_dtype(layers, stepper.groups)
    device = local(layers[0].weight).device
    parts = []
    for (layer, side), (value, status) in zip(items[me], mine, strict=True):
        if value is None:  # (a placeholder of the message's size)
            dim = layer.dims[side]
            parts.append(torch.zeros(dim, dim, dtype=dtype, device=device))
        else:
            parts.append(value)
        parts += [torch.tensor([float(status)], dtype=dtype, device=device)]
    sizes = [sum(map(numel, share)) for share in items]
    with named_collective("The all_gather of EKFAC's eigendecompositions"):
        gathered = all_gather_parts(parts, sizes, dtype, device, buffers, slot="bases")
    received = _received(items, gathered)
    _raise_failures(items, received, failure)
    for item, (value, status) in zip(items[me], mine, strict=True):
        received[item] = (value, status)  # (its own numbers, in the factor's dtype)
    decomposed: dict[Layer, list[Tensor | None]] = {}
    for (layer, side), (value, status) in received.items():
        pair = decomposed.setdefault(layer, [None, None])
        if status == SENT:  # (exact: the buffer's dtype holds the factor's)
            group = layer.options(stepper.groups[layer.group_index])
            pair[side] = value.to(layer.factor_dtypes(group)[side])
    return {
        layer: statistics
        if statistics is None or layer not in decomposed
        else replace(statistics, decompositions=tuple(decomposed[layer]))
        for layer, statistics in taken.items()
    }


def _decompose(
    stepper: Any, items: Sequence[Item], taken: Mapping[Layer, Any]
) -> tuple[list[tuple[Tensor | None, int]], ValueError | None]:
    """Compute this rank's decompositions.

    Args:
        stepper: The shell's `LayerStepper`.
        items: This rank's `(layer, side)`.
        taken: Per due layer, its statistics.

    Returns:
        Per item `(decomposition or None, status)`, and the first error raised.
    """
    results, failure = [], None
    for layer, side in items:
        statistics = taken.get(layer)
        if statistics is None:  # (no update: nothing to decompose)
            results.append((None, NONE))
            continue
        state, group = stepper.state[layer.weight], stepper.group(layer)
        try:
            value = stepper.rule.decompose(state, group, statistics, side)
        except ValueError as error:
            failure = failure or error
            results.append((None, FAILED))
            continue
        results.append((value, SENT))
    return results, failure


def _received(
    items: Sequence[Sequence[Item]], gathered: Sequence[Tensor]
) -> dict[Item, tuple[Tensor, int]]:
    """Split the gathered buffers into each side's matrix and status.

    Args:
        items: Per rank, its `(layer, side)`.
        gathered: Per rank, its numbers.

    Returns:
        Per `(layer, side)`: its matrix (a view of the buffer) and status.
    """
    chunks, statuses = [], []
    for share, flat in zip(items, gathered, strict=True):
        for item, chunk in zip(
            share, flat.split([numel(i) for i in share]), strict=True
        ):
            dim = item[0].dims[item[1]]
            chunks.append((item, chunk[:-1].view(dim, dim)))
            statuses.append(chunk[-1:])
    codes = torch.cat(statuses).tolist() if statuses else []
    return {
        item: (matrix, round(code))
        for (item, matrix), code in zip(chunks, codes, strict=True)
    }


def _raise_failures(
    items: Sequence[Sequence[Item]],
    received: Mapping[Item, tuple[Tensor, int]],
    failure: ValueError | None,
) -> None:
    """Raise on every rank if any decomposition failed.

    Args:
        items: Per rank, its `(layer, side)`.
        received: Per item, its matrix and status.
        failure: The error this rank's own decomposition raised, if any.

    Raises:
        ValueError: This rank's own error, or one naming the failed side's
            layer and rank.
    """
    if failure is not None:
        raise failure
    for rank, share in enumerate(items):
        for layer, side in share:
            if received[layer, side][1] == FAILED:
                dim = layer.dims[side]
                raise ValueError(
                    f"The eigendecomposition of the ({dim}, {dim}) factor of "
                    f"side {side} of layer {layer.name!r} failed on rank {rank}, "
                    "which computes it for every rank; check the statistics for "
                    "infinities and NaNs."
                )
