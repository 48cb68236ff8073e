r"""The statistics summary of `owner_statistics`: what every rank needs to know first.

Before the all-to-all that reduces each side's statistics to its owner, the
ranks meet in one all-reduce of \(6 + 2P\) float64 numbers per layer
(`summary_length`), which carries what every rank needs:

- the example count \(N_r\): every rank learns \(N\), and drops a layer that
  has no statistics anywhere, as the all-reduce does;
- \(N_r\, \bar{\mathrm{tr}}(H_{K,r})\) and \(\bar{\mathrm{tr}}(H_{C,r})\): the owner
  of one side of a split layer reads the other side's average trace
  (`SINGDRule.update`), and gets it as \(\bar{\mathrm{tr}}(H) I\) with the
  combined trace (average traces add up);
- a probe of the layer's packed entries, 0 if they are all finite and NaN
  otherwise (`_probe`): it is non-finite on every rank iff some rank's
  statistics hold an infinity or NaN, and then every rank fills the layer's
  statistics with NaN, so that all ranks skip the step together as they do
  after the all-reduce (`KroneckerOptimizer`'s finiteness check);
- every rank's number of rows per side, and per side how many ranks hold it
  densely: every rank chooses each side's form alike, and knows the sizes of
  the all-to-all;
- at its head, `Shard`'s step check (`collectives.StepCheck`: every rank's
  step count, options and configuration, \(3P\) numbers), padded with zeros
  to the length of every step's first all-reduce: one collective fewer per
  update step than a check of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from singd_curvlinops.distributed.collectives import (
    StepCheck,
    named_collective,
    rank,
    world_size,
)
from singd_curvlinops.distributed.gram_rows import GramRows
from singd_curvlinops.structures import StructuredMatrix

Statistics = tuple[StructuredMatrix, StructuredMatrix, int]


@dataclass(frozen=True)
class Layout:
    """How every side travels.

    Attributes:
        rows: Per layer and side, every rank's number of rows (the side travels
            as rows), or None (it travels as its stored entries).
    """

    rows: list[list[list[int] | None]]

    def size(self, index: int, side: int, sender: int, sides: list) -> int:
        """Return how many numbers `sender` sends for a side.

        Args:
            index: The layer.
            side: 0 or 1.
            sender: The sending rank.
            sides: This rank's statistics per layer (a side that travels as
                stored entries has the same shape on every rank).

        Returns:
            The count.
        """
        rows, matrix = self.rows[index][side], sides[index][side]
        return matrix.numel() if rows is None else rows[sender] * matrix.dim


def summary_length(layers: int, processes: int) -> int:
    r"""Return the numbers of the statistics summary (`agree_on_layout`).

    Args:
        layers: The number of layers (and transposed twins) exchanged.
        processes: The number of ranks.

    Returns:
        \(6 + 2P\) per layer.
    """
    return layers * (6 + 2 * processes)


def agree_on_layout(
    statistics: Sequence[Statistics], sides: list, check: StepCheck | None
) -> tuple[Layout, list[list[float]]]:
    r"""Sum the layers' summaries and every rank's rows; choose each side's form.

    One all-reduce (sum, float64): per layer the example count, the traces and
    the probe; every rank's rows per side; per side how many ranks hold it
    densely (`summary_length` numbers). A side travels as rows iff no rank with
    examples holds it densely and all ranks together have some rows, but fewer
    than its dimension. A step check rides at the head and is verified first
    (`StepCheck.verify` raises on every rank where they disagree); zeros pad the
    buffer to its length (every rank's first all-reduce of the step has that
    length, `collectives.StepCheck`).

    Args:
        statistics: As for `owner_statistics.reduce_to_owners`.
        sides: This rank's `[H_K, H_C]` per layer.
        check: The step check, or None.

    Returns:
        The layout, and per layer \((N, N\,\bar{\mathrm{tr}}(H_K),
        \bar{\mathrm{tr}}(H_C), \text{probe})\) summed over the ranks.
    """
    me, processes, layers = rank(), world_size(), len(statistics)
    device = sides[0][0].device
    summary: list[Tensor] = []
    rows = [[[0.0, 0.0] for _ in range(layers)] for _ in range(processes)]
    dense = [[0.0, 0.0] for _ in range(layers)]
    for index, ((_, _, count), (H_K, H_C)) in enumerate(
        zip(statistics, sides, strict=True)
    ):
        summary += [
            torch.tensor(float(count), dtype=torch.float64, device=device),
            H_K.average_trace().to(torch.float64) * count,
            H_C.average_trace().to(torch.float64),
            _probe(*H_K.tensors(), *H_C.tensors()),
        ]
        for side, matrix in enumerate((H_K, H_C)):
            held = matrix.num_rows if isinstance(matrix, GramRows) else None
            if count and held is None:
                dense[index][side] = 1.0
            elif count:
                rows[me][index][side] = float(held)
    flat = [n for table in rows for pair in table for n in pair]
    flat += [n for pair in dense for n in pair]
    numbers = torch.tensor(flat, dtype=torch.float64, device=device)
    parts = [torch.stack(summary), numbers]
    # (the step check's slots first, zeros last: see `StepCheck`)
    buffer = torch.cat(parts) if check is None else check.message(*parts)
    with named_collective("The statistics summary of the optimizer's step"):
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
    values = buffer.tolist()  # one synchronisation
    if check is not None:
        head = StepCheck.size(processes)
        check.verify(values[:head])
        values = values[head:]
    combined = [values[4 * i : 4 * i + 4] for i in range(layers)]
    table = values[4 * layers : 4 * layers + 2 * layers * processes]
    held_densely = values[4 * layers + 2 * layers * processes :]
    forms: list[list[list[int] | None]] = []
    for index, pair in enumerate(sides):
        forms.append([])
        for side, matrix in enumerate(pair):
            counts = [
                round(table[(r * layers + index) * 2 + side]) for r in range(processes)
            ]
            total = sum(counts)
            as_rows = not held_densely[2 * index + side] and 0 < total < matrix.dim
            forms[-1].append(counts if as_rows else None)
    return Layout(forms), combined


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
