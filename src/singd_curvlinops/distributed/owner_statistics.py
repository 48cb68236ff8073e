r"""`Shard`'s statistics exchange: each side's statistics reduced to its owner only.

Under `Shard(factors="replicated")` only the rank that updates a side reads that
side's statistics (`engine`): the others keep their factors from the step's
`all_gather`. Instead of all-reducing every layer's \(H_K\), \(H_C\) to every
rank (`exchange.all_reduce_statistics`), each rank packs the stored entries of
its sides into one flat buffer, grouped by the rank that owns them, and one
`all_to_all_single` delivers every group to its owner, which adds up the \(P\)
parts it receives (its own included) in rank order: a reduce-scatter with parts
of different sizes, where every number crosses the wire once. (One `reduce`
per owner took 10.5-12.4 ms for the MLP benchmark on two gloo processes, this
8.7-9.4 ms: medians of three interleaved runs of 40 calls.) A side's owner then
holds exactly the combined statistics of the all-reduce,

\[
H_K = \frac{\sum_r N_r\, H_{K,r}}{\sum_r N_r}, \qquad
H_C = \frac{1}{P^2} \sum_r H_{C,r}
\]

(added in rank order, which may differ from the all-reduce's in the last bit
for \(P > 2\)).

**Rows.** A dense side of SINGD or KFAC whose hooks kept its rows
(`gram_rows.GramRows`: \(H = B^\top B\)) travels as those rows when all ranks
together have fewer rows than its dimension: rank \(r\) sends
\(\sqrt{N_r} B_r\) for \(H_K\) (\(B_r\) for \(H_C\)) and the owner forms
\(R^\top R\) of the rows \(R\) of all ranks stacked in rank order, the same sum
as above. Every other side travels as its stored entries (a rank that holds it
as rows forms it first). The MLP benchmark's statistics shrink from 6.36 to 0.69
MiB per update on two processes (64 rows per process against widths of 513 and
785).

One all-reduce comes first (`summary`): per layer the example counts, the
traces a split layer's other owner reads, a finiteness probe and every rank's
rows per side, so that every rank chooses each side's form alike and knows the
sizes of the all-to-all; `Shard`'s step check rides at its head.

A side formed from rows (by its owner, or by a rank before it travels densely)
can overflow where the rows did not (about \(10^{19}\) in float32): the ranks
agree on what the owners formed (`formed_statistics.agreed`), the step's input
verdict reads it (`PendingStatistics.agreed_finite`, the same on every rank), and
every rank skips the step as the all-reduce (and one process) would. A rank's
statistics of sides it neither owns nor needs the trace of stay its own, unused.
A transposed twin (tied weights) is reduced to its layer's owners with the sides
swapped: `pending.kronecker_sum` combines the two orientations from each side's
statistics and the other side's average trace, which is what an owner holds.
EKFAC's statistics reach their layer's owner in the same way under
`Shard(factors="owned")` (the owner forms \(R^\top R\) and decomposes it; its
eigenvalue sums are reduced to it too, `exchange.sum_on_owner`); under
`"shard"` every rank updates every EKFAC layer, and they are all-reduced.
Column blocks and replicated layers keep the all-reduce too (`owner_ranks`
gives None).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from singd_curvlinops.distributed.assignment import Assignment
from singd_curvlinops.distributed.collectives import (
    StepCheck,
    named_collective,
    rank,
    world_size,
)
from singd_curvlinops.distributed.gram_rows import GramRows, as_structured
from singd_curvlinops.distributed.summary import Layout, Statistics, agree_on_layout
from singd_curvlinops.layers import Layer
from singd_curvlinops.rules import FactorRule
from singd_curvlinops.structures import DenseMatrix, StructuredMatrix

Owners = tuple[int, int]


def owner_ranks(
    plan: Mapping[Layer, Assignment | None],
    layers: Sequence[Layer],
    rule: FactorRule,
    *,
    owned: bool,
) -> list[Owners] | None:
    r"""Return per layer the ranks that own its \(K\) and \(C\) statistics.

    Args:
        plan: The strategy's assignment per layer.
        layers: The due layers.
        rule: The factor rule.
        owned: Whether only owners keep factors (whole layers; a layer split by
            column blocks needs its statistics everywhere: then None). A rule
            with per-example gradients (EKFAC) updates every layer on every
            rank otherwise (then None).

    Returns:
        Per layer `(owner of K, owner of C)`, or None where the statistics must
        reach every rank (see the module docs).
    """
    if rule.per_example and not owned:  # (EKFAC: every rank updates every layer)
        return None
    tied = {layer.twin: layer for layer in plan if layer.twin is not None}
    owners = []
    for layer in layers:  # (a transposed twin: its layer's owners, sides swapped)
        assignment = plan.get(tied.get(layer, layer))
        if assignment is None or assignment.columns:
            return None
        K, C = assignment.owners
        pair = (K, C) if rule.splits_sides else (K, K)
        owners.append(pair[::-1] if layer.swapped else pair)
    return owners


def reduce_to_owners(
    statistics: Sequence[Statistics],
    owners: Sequence[Owners],
    *,
    keep_rows: bool = False,
    check: StepCheck | None = None,
) -> tuple[list[int], list[tuple[Any, Any]], list[bool]]:
    r"""Combine the ranks' statistics on their owners (module docs).

    Args:
        statistics: Per layer, in the same order on every rank: the running mean
            \(H_K\) over this rank's examples, the sum \(H_C\) and the number of
            examples (zero matrices and 0 where it has none); dense sides may be
            `GramRows`.
        owners: Per layer, the ranks that own its \(K\) and \(C\).
        keep_rows: Whether a side that travelled as rows stays rows on its
            owner (`GramRows` of all ranks' rows stacked: under
            `Shard(factors="owned")` the owner projects raw rows with its
            factors, `engine`) instead of being formed.
        check: The step check that rides at the head of the summary, which is
            then padded with zeros to the check's length (`collectives.StepCheck`);
            None: the summary alone.

    Returns:
        Per layer, the total number of examples \(N\); and per layer the
        statistics \((H_K, H_C)\) that replace this rank's: on the owner of a
        side the combined statistics, on the owner of the other side (alone)
        \(\bar{\mathrm{tr}}\) of them times the identity, elsewhere this rank's
        own (unused); and per layer whether every rank's statistics were
        finite (the probe: the same on every rank).
    """
    me, processes = rank(), world_size()
    sides = [[H_K, H_C] for H_K, H_C, _ in statistics]
    dtype = wire_dtype([matrix for pair in sides for matrix in pair])
    layout, combined = agree_on_layout(statistics, sides, check)
    for index, pair in enumerate(sides):  # sides that travel densely, formed
        for side in (0, 1):
            if layout.rows[index][side] is None:
                pair[side] = as_structured(pair[side])
    send = [0] * processes  # numbers bound for each rank
    receive = [0] * processes  # numbers each rank sends here
    for index, (owner_K, owner_C) in enumerate(owners):
        for side, owner in ((0, owner_K), (1, owner_C)):
            send[owner] += layout.size(index, side, me, sides)
            if owner == me:
                for sender in range(processes):
                    receive[sender] += layout.size(index, side, sender, sides)
    outgoing = torch.empty(sum(send), dtype=dtype, device=sides[0][0].device)
    ends = list(itertools.accumulate([0, *send[:-1]]))  # where each rank's part goes
    for index, ((_, _, count), pair, (owner_K, owner_C)) in enumerate(
        zip(statistics, sides, owners, strict=True)
    ):
        if count:  # (a rank without examples sends no rows, or zeros)
            ends[owner_K] = pack(outgoing, ends[owner_K], pair[0], count)
            ends[owner_C] = pack(outgoing, ends[owner_C], pair[1], 1)
        else:
            for side, owner in ((0, owner_K), (1, owner_C)):
                size = layout.size(index, side, me, sides)
                outgoing[ends[owner] : ends[owner] + size].zero_()
                ends[owner] += size
    incoming = outgoing.new_empty(sum(receive))
    with named_collective("The statistics reduction of the optimizer's step"):
        dist.all_to_all_single(incoming, outgoing, receive, send)
    parts = list(incoming.split(receive))  # per sender, this rank's sides in order
    offsets, totals, finite = [0] * processes, [], []
    for index, (pair, (owner_K, owner_C)) in enumerate(zip(sides, owners, strict=True)):
        total, trace_K, trace_C, probe = combined[index]
        totals.append(round(total))
        finite.append(math.isfinite(probe))
        for side, owner in ((0, owner_K), (1, owner_C)):
            if owner == me:
                pair[side] = _combine(
                    layout, index, side, pair[side], parts, offsets, keep_rows
                )
        if not totals[-1]:
            continue
        if not finite[-1]:
            pair[:] = [as_structured(M).mul_(float("nan")) for M in pair]
            continue
        scale_K, scale_C = 1.0 / total, 1.0 / processes**2
        pair[0] = _finish(pair[0], owner_K, owner_C, scale_K, trace_K * scale_K, me)
        pair[1] = _finish(pair[1], owner_C, owner_K, scale_C, trace_C * scale_C, me)
    return totals, [(H_K, H_C) for H_K, H_C in sides], finite


def _combine(
    layout: Layout,
    index: int,
    side: int,
    matrix: Any,
    parts: list[Tensor],
    offsets: list[int],
    keep_rows: bool,
) -> Any:
    r"""Return the sum over the ranks of a side this rank owns, from their parts.

    Args:
        layout: How the sides travel.
        index: The layer.
        side: 0 or 1.
        matrix: This rank's statistics of the side (structured if the side
            travelled as stored entries).
        parts: Per sender, what it sent this rank.
        offsets: Per sender, where the side starts in its part (advanced).
        keep_rows: Whether rows stay rows (`GramRows`) instead of \(R^\top R\).

    Returns:
        \(R^\top R\) of the rows \(R\) of all ranks stacked in rank order, or
        the sum of the ranks' stored entries, written into `matrix`.
    """
    rows = layout.rows[index][side]
    if rows is None:
        size = matrix.numel()
        total = parts[0][offsets[0] : offsets[0] + size].clone()
        for sender in range(1, len(parts)):
            total += parts[sender][offsets[sender] : offsets[sender] + size]
        for sender in range(len(parts)):
            offsets[sender] += size
        unpack(total, 0, matrix)
        return matrix
    dim, blocks = matrix.dim, []
    for sender, count in enumerate(rows):
        start = offsets[sender]
        blocks.append(parts[sender][start : start + count * dim].view(count, dim))
        offsets[sender] += count * dim
    stacked = torch.cat(blocks).to(matrix.dtype)
    return GramRows(stacked) if keep_rows else DenseMatrix(stacked.T @ stacked)


def _finish(
    matrix: Any,
    owner: int,
    other: int,
    scale: float,
    trace: float,
    me: int,
) -> Any:
    r"""Scale a side's combined statistics, or write its trace for the other owner.

    Args:
        matrix: This rank's statistics of the side.
        owner: The rank that owns the side.
        other: The rank that owns the layer's other side.
        scale: The side's scale (\(1/N\) or \(1/P^2\)).
        trace: The side's combined average trace.
        me: This rank.

    Returns:
        The statistics this rank keeps for the side.
    """
    if owner == me:
        return matrix.mul_(scale)
    if other != me:
        return matrix
    # \bar{tr}(t I) = t: all the other side's update reads
    if isinstance(matrix, GramRows):
        return DenseMatrix.zeros(
            matrix.dim, dtype=matrix.dtype, device=matrix.device
        ).diag_add_(trace)
    return matrix.mul_(0.0).diag_add_(trace)


def wire_dtype(matrices: Sequence[Any]) -> torch.dtype:
    """Return the dtype in which statistics travel: it holds every entry exactly.

    Args:
        matrices: Statistics (structured or `GramRows`).

    Returns:
        float64 if any of their tensors is float64, else float32.
    """
    tensors = [t for matrix in matrices for t in matrix.tensors()]
    wide = any(t.dtype == torch.float64 for t in tensors)
    return torch.float64 if wide else torch.float32


def pack(buffer: Tensor, offset: int, matrix: Any, scale: int) -> int:
    r"""Write a side's statistics, scaled, into `buffer` at `offset`.

    Stored entries are multiplied by `scale`, the rows of `GramRows` by
    \(\sqrt{\text{scale}}\) (their Gram matrix by `scale`).

    Args:
        buffer: The outgoing flat buffer (also the all-reduce's, `exchange`).
        offset: Where the side starts.
        matrix: The statistics (`GramRows` travel as their rows).
        scale: The example count (\(H_K\)) or 1 (\(H_C\)).

    Returns:
        The offset after the side.
    """
    if isinstance(matrix, GramRows):
        tensors, factor = [matrix.rows], math.sqrt(scale)
    else:
        tensors, factor = matrix.tensors(), scale
    for tensor in tensors:
        size = tensor.numel()
        part = buffer[offset : offset + size].view_as(tensor)
        part.copy_(tensor)  # in the buffer's dtype, then scaled there
        if factor != 1:
            part.mul_(factor)
        offset += size
    return offset


def unpack(buffer: Tensor, offset: int, matrix: StructuredMatrix) -> int:
    """Copy the next entries of `buffer` into `matrix`'s stored tensors.

    Args:
        buffer: A flat buffer of combined statistics (also the all-reduce's,
            `exchange`).
        offset: Position of the matrix's first entry.
        matrix: Receives the values (overwritten in place).

    Returns:
        The offset after the matrix.
    """
    for tensor in matrix.tensors():
        size = tensor.numel()
        tensor.copy_(buffer[offset : offset + size].view_as(tensor))
        offset += size
    return offset
