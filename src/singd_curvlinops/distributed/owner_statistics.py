r"""`Shard`'s statistics exchange: each side's statistics reduced to its owner only.

Under `Shard(factors="replicated")` only the rank that updates a side reads that
side's statistics (`engine`): the others keep their factors from the step's
`all_gather`. Instead of all-reducing every layer's \(H_K\), \(H_C\) to every
rank (`exchange.all_reduce_statistics`), each rank packs the stored entries of
its sides into one flat buffer, grouped by the rank that owns them, and one
`all_to_all_single` delivers every group to its owner, which adds up the \(P\)
parts it receives (its own included) in rank order: a reduce-scatter with parts
of different sizes, where every number crosses the wire once. (It replaced one
`reduce` per owner: on two gloo processes, the MLP benchmark's statistics took
10.5-12.4 ms that way and 8.7-9.4 ms this way, with the packing and the probe
below: medians of three runs of 40 calls each, the two interleaved.) A side's
owner then holds exactly the combined statistics of the all-reduce,

\[
H_K = \frac{\sum_r N_r\, H_{K,r}}{\sum_r N_r}, \qquad
H_C = \frac{1}{P^2} \sum_r H_{C,r}
\]

(added in rank order, which may differ from the all-reduce's in the last bit
for \(P > 2\)). One small all-reduce of 4 numbers per layer carries
what every rank needs:

- the example count \(N_r\): every rank learns \(N\), and drops a layer that
  has no statistics anywhere, as the all-reduce does;
- \(N_r\, \bar{\mathrm{tr}}(H_{K,r})\) and \(\bar{\mathrm{tr}}(H_{C,r})\): the owner
  of one side of a split layer reads the other side's average trace
  (`SINGDRule.update`), and gets it as \(\bar{\mathrm{tr}}(H) I\) with the
  combined trace (average traces add up);
- a probe of the layer's packed entries, 0 if they are all finite and NaN
  otherwise (`_probe`): it is non-finite on every rank iff some rank's
  statistics hold an infinity or NaN, and then every rank fills
  the layer's statistics with NaN, so that all ranks skip the step together as
  they do after the all-reduce (`KroneckerOptimizer`'s finiteness check).

A rank's statistics of sides it neither owns nor needs the trace of stay its own,
unused. Rules with per-example rows (EKFAC), twins (tied weights, whose
statistics combine non-linearly: `pending.kronecker_sum`), owned factors and
replicated layers keep the all-reduce (`owner_ranks` returns None).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from singd_curvlinops.distributed.assignment import Assignment
from singd_curvlinops.distributed.collectives import named_collective, rank, world_size
from singd_curvlinops.layers import Layer
from singd_curvlinops.rules import FactorRule
from singd_curvlinops.structures import StructuredMatrix

Owners = tuple[int, int]
Statistics = tuple[StructuredMatrix, StructuredMatrix, int]


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
        owned: Whether only owners keep factors (then: None).

    Returns:
        Per layer `(owner of K, owner of C)`, or None where the statistics must
        reach every rank (see the module docs).
    """
    if owned or rule.per_example:
        return None
    owners = []
    for layer in layers:
        assignment = plan.get(layer)
        if (
            assignment is None
            or assignment.columns
            or layer.twin is not None
            or layer.swapped
        ):
            return None
        K, C = assignment.owners
        owners.append((K, C) if rule.splits_sides else (K, K))
    return owners


def reduce_to_owners(
    statistics: Sequence[Statistics], owners: Sequence[Owners]
) -> list[int]:
    r"""Combine the ranks' statistics on their owners, in place (module docs).

    Args:
        statistics: Per layer, in the same order on every rank: the running mean
            \(H_K\) over this rank's examples, the sum \(H_C\) and the number of
            examples (zero matrices and 0 where it has none).
        owners: Per layer, the ranks that own its \(K\) and \(C\).

    Returns:
        Per layer, the total number of examples \(N\). On the owner of a side its
        matrix holds the combined statistics; on the owner of the other side
        (alone) \(\bar{\mathrm{tr}}\) of them times the identity.
    """
    me, processes = rank(), world_size()
    wide = any(
        t.dtype == torch.float64
        for H_K, H_C, _ in statistics
        for t in (*H_K.tensors(), *H_C.tensors())
    )
    dtype = torch.float64 if wide else torch.float32
    device = statistics[0][0].device
    sizes = [0] * processes  # numbers bound for each rank
    for (H_K, H_C, _), (owner_K, owner_C) in zip(statistics, owners, strict=True):
        sizes[owner_K] += H_K.numel()
        sizes[owner_C] += H_C.numel()
    outgoing = torch.empty(sum(sizes), dtype=dtype, device=device)
    ends = list(itertools.accumulate([0, *sizes[:-1]]))  # where each rank's part goes
    summary: list[Tensor] = []
    for (H_K, H_C, count), (owner_K, owner_C) in zip(statistics, owners, strict=True):
        start_K = ends[owner_K]
        ends[owner_K] = _pack(outgoing, start_K, H_K, count)
        start_C = ends[owner_C]
        ends[owner_C] = _pack(outgoing, start_C, H_C, 1)
        probe = _probe(
            outgoing[start_K : ends[owner_K]], outgoing[start_C : ends[owner_C]]
        )
        summary += [
            torch.tensor(float(count), dtype=torch.float64, device=device),
            H_K.average_trace().to(torch.float64) * count,
            H_C.average_trace().to(torch.float64),
            probe,
        ]
    counts = torch.stack(summary)
    incoming = outgoing.new_empty(processes * sizes[me])
    with named_collective("The statistics reduction of the optimizer's step"):
        work = dist.all_reduce(counts, op=dist.ReduceOp.SUM, async_op=True)
        dist.all_to_all_single(incoming, outgoing, [sizes[me]] * processes, sizes)
        work.wait()
    mine = incoming.view(processes, sizes[me]).sum(0)  # every rank's part, in order
    combined = counts.view(-1, 4).tolist()  # one synchronisation
    offset, totals = 0, []
    for (H_K, H_C, _), (owner_K, owner_C), (total, trace_K, trace_C, probe) in zip(
        statistics, owners, combined, strict=True
    ):
        totals.append(round(total))
        for matrix, owner in ((H_K, owner_K), (H_C, owner_C)):
            if owner == me:
                offset = _unpack(mine, offset, matrix)
        if not totals[-1]:
            continue
        scale_K, scale_C = 1.0 / total, 1.0 / processes**2
        if not math.isfinite(probe):
            H_K.mul_(float("nan"))
            H_C.mul_(float("nan"))
            continue
        _finish(H_K, owner_K, owner_C, scale_K, trace_K * scale_K, me)
        _finish(H_C, owner_C, owner_K, scale_C, trace_C * scale_C, me)
    return totals


def _finish(
    matrix: StructuredMatrix,
    owner: int,
    other: int,
    scale: float,
    trace: float,
    me: int,
) -> None:
    r"""Scale a side's combined statistics, or write its trace for the other owner.

    Args:
        matrix: This rank's matrix of the side.
        owner: The rank that owns the side.
        other: The rank that owns the layer's other side.
        scale: The side's scale (\(1/N\) or \(1/P^2\)).
        trace: The side's combined average trace.
        me: This rank.
    """
    if owner == me:
        matrix.mul_(scale)
    elif other == me:  # \bar{tr}(t I) = t: all the other side's update reads
        matrix.mul_(0.0).diag_add_(trace)


def _probe(*parts: Tensor) -> Tensor:
    r"""Return 0 if every entry of `parts` is finite, else NaN (a float64 0-d tensor).

    It takes the extremes of each part (one pass, no copy) and multiplies them
    by 0: an infinity or NaN among the entries makes an extreme non-finite and
    the product NaN, and finite entries never overflow. (A float64 sum of the
    entries, as before, converted every entry first: about 1.5 ms of the MLP
    benchmark's step.)

    Args:
        parts: Flat tensors (empty ones are skipped).

    Returns:
        The probe.
    """
    extremes = [
        extreme for part in parts if part.numel() for extreme in torch.aminmax(part)
    ]
    if not extremes:
        return torch.zeros((), dtype=torch.float64, device=parts[0].device)
    return torch.stack(extremes).to(torch.float64).mul_(0.0).sum()


def _pack(buffer: Tensor, offset: int, matrix: StructuredMatrix, scale: int) -> int:
    r"""Write `scale` times `matrix`'s stored entries into `buffer` at `offset`.

    Args:
        buffer: The outgoing flat buffer.
        offset: Position of the matrix's first entry.
        matrix: The statistics.
        scale: The example count (\(H_K\)) or 1 (\(H_C\)).

    Returns:
        The offset after the matrix.
    """
    for tensor in matrix.tensors():
        size = tensor.numel()
        part = buffer[offset : offset + size].view_as(tensor)
        part.copy_(tensor)  # in the buffer's dtype, then scaled there
        if scale != 1:
            part.mul_(scale)
        offset += size
    return offset


def _unpack(buffer: Tensor, offset: int, matrix: StructuredMatrix) -> int:
    """Copy the next entries of `buffer` into `matrix`'s stored tensors.

    Args:
        buffer: This rank's combined part.
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
