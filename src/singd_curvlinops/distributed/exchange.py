r"""Data parallelism: one all-reduce of the statistics per factor update.

(`Shard` reduces each side's statistics to its owner instead, with the same
semantics: `owner_statistics`.)

Semantics. Under `torch.distributed`, the gradients that reach `step` are averaged
over the \(P\) processes (what `DistributedDataParallel` does, and what users do
by hand without the wrapper), so SINGD optimises the average of the per-process
losses, \(\bar L = \frac1P \sum_r L_r\), and takes its statistics from that same
loss. Its output gradients are those of each process divided by \(P\), hence

\[
U_K = \frac{\sum_r N_r\, U_{K,r}}{\sum_r N_r}, \qquad
U_C = \frac{\nu(N)}{P^2} \sum_r \sum_{\text{rows of } r} \tilde g \tilde g^\top,
\qquad N = \sum_r N_r,
\]

with \(\nu\) from `statistics.gradient_scale`. For mean losses over equal local
batches, \(\bar L\) is the mean loss of the concatenated batch and training equals
one process on it. For sum losses, multiply each process's loss by \(P\) (DDP's
convention) to train on the sum over the concatenated batch.

Only the structures' stored tensors travel, packed with the example counts into a
single buffer per step (a diagonal factor sends \(d\) numbers, not \(d^2\)). Before
the first exchange, the processes compare a checksum of their factor rule, layers,
structures, options and distribution strategy
(`collectives.check_same_configuration`), so that a mismatch raises an error
instead of hanging.

A rule with per-example gradients (EKFAC) needs a second collective per layer and
factor update: its sums of squared per-example gradients \(\Sigma_r\) are taken in
the eigenbasis of the factors, which exists only after the first exchange. Every
process computes \(\Sigma_r\) from its own rows in that (common) basis, and
`sum_over_processes` all-reduces them, dividing by \(P^2\) as for \(U_C\):
\(\Sigma = \frac{1}{P^2} \sum_r \Sigma_r\), then scaled by \(\nu(N)\). The
processes call it in the same order, since each runs the factor updates of the same
due layers in the order of `layers` (under `Shard` too: such a rule's updates
run on every rank, `GatheredStep.replicated_updates`, or under
`Shard(factors="owned")` on the owner, the others contributing their
\(\Sigma_r\)). Where only the owner updates, the sum goes to it alone
(`sum_on_owner`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from singd_curvlinops.collector import PendingStatistics
from singd_curvlinops.distributed import formed_statistics
from singd_curvlinops.distributed.buffers import Buffers, lend
from singd_curvlinops.distributed.collectives import (
    StepCheck,
    check_same_options,
    fingerprint,
    named_collective,
    option_slots,
    world_size,
)
from singd_curvlinops.distributed.gram_rows import as_structured
from singd_curvlinops.distributed.owner_statistics import (
    Owners,
    pack,
    reduce_to_owners,
    unpack,
    wire_dtype,
)
from singd_curvlinops.layers import Layer
from singd_curvlinops.per_example import ExampleGradients
from singd_curvlinops.rules import FactorRule
from singd_curvlinops.structures import StructuredMatrix

# the group options that decide what a layer's statistics are
_EXCHANGE_OPTIONS = ("T", "loss_average", "kfac_approx")

ZeroStatistics = Callable[[Layer], tuple[StructuredMatrix, StructuredMatrix]]


def describe_layers(
    layers: Sequence[Layer], groups: Sequence[dict[str, Any]], rule: FactorRule
) -> str:
    """Describe the layers and options whose statistics the ranks exchange.

    Args:
        layers: The layers of this step, in the same order on every process.
        groups: The optimizer's parameter groups.
        rule: Its factor rule.

    Returns:
        The rule's name, then one line per layer: name, dimensions, structures and
        options.
    """
    return f"{type(rule).__name__};" + ";".join(
        f"{layer.name}:{layer.dims}:{layer.structures}:"
        + str([groups[layer.group_index][k] for k in _EXCHANGE_OPTIONS])
        for layer in layers
    )


def describe_options(groups: Sequence[dict[str, Any]], keys: Sequence[str]) -> str:
    """Describe the optimizer's options in every parameter group (`StepCheck`).

    Numbers by their exact `repr`, a one-number tensor (a tensor `lr`) by its
    value, a callable (`lr_cov`) by its name: the same text on every rank that
    has the same options. Other entries of a group (a scheduler's
    `initial_lr`, a user's own) are not compared.

    Args:
        groups: The optimizer's parameter groups.
        keys: Its option names (its `defaults`).

    Returns:
        One line per group: `key=value` for each of `keys` in it, sorted.
    """

    def text(value: Any) -> str:
        if isinstance(value, Tensor):
            return repr(value.tolist()) if value.numel() <= 16 else str(value.shape)
        if callable(value) and not isinstance(value, type):
            return getattr(value, "__qualname__", type(value).__name__)
        return repr(value)

    return ";".join(
        ",".join(f"{k}={text(g[k])}" for k in sorted(keys) if k in g) for g in groups
    )


def all_reduce_statistics(
    statistics: Sequence[tuple[StructuredMatrix, StructuredMatrix, int]],
    options: str | None = None,
    buffers: Buffers | None = None,
) -> list[int]:
    r"""Combine the pending statistics of all processes in place, one collective.

    Args:
        statistics: Per layer, in the same order on every process: the running
            mean \(H_K\) over this process's examples, the sum \(H_C\) and the
            number of examples (zero matrices and 0 where it has none).
        options: This rank's options (`describe_options`): their fingerprints
            travel in the same buffer, one slot per rank, and differing ones
            raise `check_same_options`'s error on every rank before any
            statistics are written back (None: not checked).
        buffers: Where the all-reduced buffer is kept between steps (None:
            allocated for this call); the statistics are copied out of it.

    Returns:
        Per layer, the total number of examples \(N\); the matrices then hold the
        combined \(H_K\) (mean over all \(N\) examples) and \(H_C / P^2\).
    """
    processes = world_size()
    dtype = wire_dtype([M for H_K, H_C, _ in statistics for M in (H_K, H_C)])
    slots = [] if options is None else option_slots(fingerprint(options), processes)
    size = sum(H_K.numel() + H_C.numel() + 1 for H_K, H_C, _ in statistics)
    device = statistics[0][0].device
    buffer = lend(buffers, "statistics", size + len(slots), dtype, device)
    buffer[size:] = torch.tensor(slots, dtype=dtype)
    counts, offset = [], 0  # (where the example counts are)
    for H_K, H_C, count in statistics:  # count x H_K, H_C, count
        offset = pack(buffer, pack(buffer, offset, H_K, count), H_C, 1)
        buffer[offset] = float(count)
        counts.append(offset)
        offset += 1
    with named_collective("The statistics all-reduce of the optimizer's step"):
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
    read = buffer[counts + list(range(size, size + len(slots)))].tolist()  # one sync
    if slots:
        check_same_options(read[len(counts) :], options)
    totals, offset = [round(n) for n in read[: len(counts)]], 0
    for H_K, H_C, _ in statistics:
        offset = unpack(buffer, unpack(buffer, offset, H_K), H_C) + 1
    for (H_K, H_C, _), total in zip(statistics, totals, strict=True):
        if total:
            H_K.mul_(1.0 / total)
            H_C.mul_(1.0 / processes**2)
    return totals


def sum_over_processes(tensor: Tensor) -> Tensor:
    r"""All-reduce a per-process sum of squared output gradients, divided by \(P^2\).

    The second collective of rules with per-example gradients (module docs).

    Args:
        tensor: This process's \(\Sigma_r\) (overwritten).

    Returns:
        `tensor`, now \(\frac{1}{P^2} \sum_r \Sigma_r\).
    """
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.div_(world_size() ** 2)


def sum_on_owner(owner: int, tensor: Tensor) -> Tensor:
    r"""Reduce the per-process sums to the layer's owner, divided by \(P^2\).

    `sum_over_processes` for a layer that only its owner updates
    (`Shard(factors="owned")`): every process sends its \(\Sigma_r\), none
    receives the sum but the owner.

    Args:
        owner: The rank that updates the layer.
        tensor: This process's \(\Sigma_r\) (overwritten; on the other ranks
            with numbers to be discarded).

    Returns:
        `tensor`, on the owner \(\frac{1}{P^2} \sum_r \Sigma_r\).
    """
    with named_collective("The eigenvalue sums' reduction of the optimizer's step"):
        dist.reduce(tensor, dst=owner, op=dist.ReduceOp.SUM)
    return tensor.div_(world_size() ** 2)


class StatisticsExchange:
    r"""Replaces the pending statistics of the due layers by those of all processes.

    Every process takes part for every due layer, with zero statistics where its
    hooks did not fire; layers without statistics on any process end up with none.

    Args:
        zeros: Zero statistics of a layer, shaped as its hooks produce them.
        grad_scale: The gradient scale a layer's statistics would carry.
        per_example: Whether the rule keeps per-example rows (EKFAC): their sums
            of squares are then all-reduced by the rule's update, in a second
            collective (`sum_over_processes`), or reduced to the layer's owner
            where its statistics have owners (`sum_on_owner`).
        owners: Given the due layers, per layer the ranks that read its \(K\)
            and \(C\) statistics (`Shard`: they are reduced there only, see
            `owner_statistics`), or None: all-reduced to every rank.
        keep_rows: Whether statistics that travel as rows stay rows on their
            owner (`Shard(factors="owned")`, see `owner_statistics`).
        options: This rank's options, checked in the all-reduce (None: not
            checked here; `Shard` checks them with the step count).
        check: The step check that rides in the exchange's first collective
            (`collectives.StepCheck`): in the statistics summary where the
            statistics go to their owners, else in an all-reduce of its own
            first; None: none.
        buffers: The strategy's message buffers (the all-reduce's, kept
            between steps; None: allocated at every exchange).
    """

    def __init__(
        self,
        zeros: ZeroStatistics,
        grad_scale: Callable[[Layer], float],
        *,
        per_example: bool = False,
        owners: Callable[[Sequence[Layer]], list[Owners] | None] | None = None,
        keep_rows: bool = False,
        options: str | None = None,
        check: StepCheck | None = None,
        buffers: Buffers | None = None,
    ):
        self._options = options
        self._check = check
        self._buffers = buffers
        self._zeros = zeros
        self._grad_scale = grad_scale
        self._per_example = per_example
        self._owners = owners
        self._keep_rows = keep_rows

    def __call__(
        self, pending: dict[Layer, PendingStatistics], due: Sequence[Layer]
    ) -> None:
        """Exchange the statistics of this step.

        Args:
            pending: The collector's pending statistics (updated in place).
            due: The layers whose factors update in this step, in the same order
                on every process.
        """
        if not due:
            if self._check is not None:
                self._check.alone()
            return
        records = []
        for layer in due:
            record = pending.get(layer)
            if record is None:
                H_K, H_C = self._zeros(layer)
                record = PendingStatistics(H_K, H_C, 0, self._grad_scale(layer))
                if self._per_example:
                    record.examples = ExampleGradients()
            records.append(record)
        owners = None if self._owners is None else self._owners(due)
        if owners is None:  # statistics kept as rows are formed for the all-reduce
            for record in records:
                record.H_K, record.H_C = map(as_structured, (record.H_K, record.H_C))
        statistics = [(r.H_K, r.H_C, r.num_examples) for r in records]
        if owners is None:
            if self._check is not None:
                self._check.alone()
            totals = all_reduce_statistics(statistics, self._options, self._buffers)
        else:
            totals, kept, finite = reduce_to_owners(
                statistics, owners, keep_rows=self._keep_rows, check=self._check
            )
            if not self._keep_rows:  # (the owned form checks in its step)
                finite = formed_statistics.agreed(kept, owners, finite)
            for record, (H_K, H_C), ok in zip(records, kept, finite, strict=True):
                record.H_K, record.H_C, record.agreed_finite = H_K, H_C, ok
        for index, (layer, record) in enumerate(zip(due, records, strict=True)):
            if totals[index] == 0:
                pending.pop(layer, None)
                continue
            record.num_examples = totals[index]
            pending[layer] = record
            if record.examples is not None:  # (EKFAC: K's owner updates the layer)
                record.examples.reduce = (
                    sum_over_processes
                    if owners is None
                    else partial(sum_on_owner, owners[index][0])
                )
