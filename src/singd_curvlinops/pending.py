r"""A layer's statistics between two factor updates: passes, uses, micro-batches.

Each application of a layer (a *use*; usually one per forward pass) yields one
pair \((H_K, H_C)\) from its rows \(a\), \(\tilde g\) (`rule.project`). They
accumulate at two levels:

- **Uses of one pass.** The uses whose gradients arrive in the same backward pass
  (a weight applied several times in one forward pass: tied weights, a module
  called twice, an attention projection in cross-attention) are one layer applied
  at more weight-sharing positions, as curvlinops treats tied weights: their input
  rows concatenate, so \(H_K\) is the mean of the uses' \(H_K\) weighted by their
  numbers of rows, and \(H_C\) the sum. The pass has \(N\) examples (the largest
  batch among its uses), not one batch per use.
- **Passes** (micro-batches, and processes under data parallelism): \(H_K\) is the
  mean weighted by examples, \(H_C\) the sum; \(\nu(N)\) of the total \(N\) scales
  \(H_C\) when the statistics are taken (`statistics.gradient_scale`).

For one use per pass this is the old rule, so micro-batch accumulation still
equals one pass over the concatenated batch. A backward pass is recognised by
autograd's id of the running graph task.

`hand_out` turns a layer's records into the statistics of its factor update:
\(\nu(N)\) and the gradient-scale correction on \(H_C\), a twin's record in the
layer's orientation, and `kronecker_sum` combining the two orientations (a
weight tied across orientations, see `Layer.twin`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from singd_curvlinops import statistics
from singd_curvlinops.per_example import ExampleGradients
from singd_curvlinops.rules import FactorStatistics
from singd_curvlinops.structures import StructuredMatrix

Pair = tuple[Any, Any]  # one orientation's (H_K, H_C), in the layer's orientation


def backward_pass_id() -> int | None:
    """Return the id of the running backward pass (None outside one).

    Returns:
        Autograd's graph-task id, or None where torch does not expose it.
    """
    current = getattr(torch._C, "_current_graph_task_id", None)
    if current is None:  # pragma: no cover - every supported torch has it
        return None
    task = current()
    return None if task < 0 else task


@dataclass(slots=True)
class PendingStatistics:
    r"""A layer's statistics collected since its last factor update.

    Attributes:
        H_K: Mean of the closed passes' \(H_K\), weighted by their examples
            (None before the first pass closes).
        H_C: Sum of every use's \(H_C\) (before the scale \(\nu\)).
        num_examples: Examples \(N\) of the closed passes.
        grad_scale: The gradient scale that the rows \(\tilde g\) were divided by.
        pass_id: The backward pass of the open pass (None: none open).
        pass_H_K: Mean of the open pass's \(H_K\), weighted by rows.
        pass_rows: Rows of the open pass.
        pass_examples: Examples of the open pass.
        examples: The rows for per-example gradients (rules with `per_example`).
        agreed_finite: Set by an exchange after which the ranks hold different
            statistics of the layer (`Shard`'s owners): whether every rank's
            were finite. The step guard takes this verdict, the same on every
            rank, instead of reading `H_K`, `H_C` (None: read them).
    """

    H_K: StructuredMatrix | None
    H_C: StructuredMatrix
    num_examples: int
    grad_scale: float
    pass_id: int | None = None
    pass_H_K: StructuredMatrix | None = None
    pass_rows: int = 0
    pass_examples: int = 0
    examples: ExampleGradients | None = None
    agreed_finite: bool | None = None

    @classmethod
    def open(
        cls,
        H_K: StructuredMatrix,
        H_C: StructuredMatrix,
        *,
        rows: int,
        examples: int,
        grad_scale: float,
        pass_id: int | None,
    ) -> PendingStatistics:
        r"""Return the record of a layer's first use since its last update.

        Args:
            H_K: The use's \(H_K\).
            H_C: The use's \(H_C\).
            rows: Its number of input rows.
            examples: Its number of examples.
            grad_scale: The scale its output gradients were divided by.
            pass_id: Its backward pass.

        Returns:
            A record with one open pass.
        """
        return cls(None, H_C, 0, grad_scale, pass_id, H_K, rows, examples)

    def add(
        self,
        H_K: StructuredMatrix,
        H_C: StructuredMatrix,
        *,
        rows: int,
        examples: int,
        pass_id: int | None,
    ) -> None:
        r"""Add a use: to the open pass if it is of the same backward pass.

        Args:
            H_K: The use's \(H_K\).
            H_C: The use's \(H_C\).
            rows: Its number of input rows.
            examples: Its number of examples.
            pass_id: Its backward pass.
        """
        if not rows:
            return  # an empty use (no rows, zero H_C) adds nothing
        self.H_C.add_(H_C)
        if pass_id is None or pass_id != self.pass_id or self.pass_H_K is None:
            self.close()
            self.pass_id, self.pass_H_K = pass_id, H_K
            self.pass_rows, self.pass_examples = rows, examples
            return
        total = self.pass_rows + rows
        self.pass_H_K.mul_(self.pass_rows / total).add_(H_K, alpha=rows / total)
        self.pass_rows = total
        self.pass_examples = max(self.pass_examples, examples)

    def close(self) -> None:
        """Fold the open pass into the closed ones (weighted by examples)."""
        if self.pass_H_K is None:
            return
        if self.H_K is None:
            self.H_K, self.num_examples = self.pass_H_K, self.pass_examples
        else:
            total = self.num_examples + self.pass_examples
            self.H_K.mul_(self.num_examples / total).add_(
                self.pass_H_K, alpha=self.pass_examples / total
            )
            self.num_examples = total
        self.pass_id, self.pass_H_K = None, None
        self.pass_rows = self.pass_examples = 0


def hand_out(
    records: Sequence[tuple[PendingStatistics, bool]],
    loss_average: statistics.LossAverage,
    grad_scale: float,
    project: Callable[[Pair], Pair] | None = None,
) -> FactorStatistics:
    r"""Return a layer's statistics for its factor update from its pending records.

    A tied weight's per-example gradients sum both orientations' uses
    (`ExampleGradients.merge`) and take \(\nu\) of the larger of the two
    records' numbers of examples: in ordinary passes every example reaches both
    uses, and the numbers are equal.

    Args:
        records: The layer's record and its twin's (tied weights), each with
            whether its sides are the layer's swapped (consumed: scaled in
            place).
        loss_average: The group's `loss_average` (for \(\nu\)).
        grad_scale: Scale of the output gradients in this step's statistics.
        project: Applied to each orientation's raw statistics before they
            combine (an owner's projection: `formed_statistics`), or None.

    Returns:
        The statistics, \(H_C\) scaled to the convention of \(U_C\).
    """
    terms, examples, counts = [], None, []
    for record, swapped in records:
        unscale = (record.grad_scale / grad_scale) ** 2
        nu = statistics.gradient_scale(loss_average, record.num_examples)
        record.H_C.mul_(nu * unscale)
        H_K, H_C = record.H_K, record.H_C
        term = (H_C, H_K) if swapped else (H_K, H_C)
        terms.append(term if project is None else project(term))
        if record.examples is not None:  # (a twin's rows are in the layer's order)
            if examples is None:
                examples = record.examples
                examples.scale = unscale
            else:
                examples.merge(record.examples)
            counts.append(record.num_examples)
    if examples is not None:  # ν of the examples that reached the weight
        examples.scale *= statistics.gradient_scale(loss_average, max(counts))
    return FactorStatistics(collected=kronecker_sum(terms), examples=examples)


def kronecker_sum(
    terms: Sequence[tuple[StructuredMatrix, StructuredMatrix]],
) -> tuple[StructuredMatrix, StructuredMatrix]:
    r"""Return one Kronecker pair with the partial traces of a sum of pairs.

    For \(F = \sum_s X_s \otimes Y_s\) (input side \(X\), output side \(Y\)), with
    \(t_s = \bar{\mathrm{tr}}(Y_s)\), \(r_s = \bar{\mathrm{tr}}(X_s)\),
    \(T = \sum_s t_s\) and \(\tau = \sum_s r_s t_s\):

    \[
    X = \frac{1}{T} \sum_s t_s X_s, \qquad Y = \frac{T}{\tau} \sum_s r_s Y_s .
    \]

    Then \(\bar{\mathrm{tr}}(Y) X = \sum_s t_s X_s\) and
    \(\bar{\mathrm{tr}}(X) Y = \sum_s r_s Y_s\): both partial traces of \(X \otimes
    Y\) equal those of \(F\), which are what SINGD's coupled factor update reads
    (\(\bar{\mathrm{tr}}(H_C) H_K\), \(\bar{\mathrm{tr}}(H_K) H_C\)), so SINGD sees
    the sum exactly (up to the damping term). One pair is returned unchanged. The
    result does not depend on how each term splits its scale between its sides.

    Args:
        terms: Pairs \((X_s, Y_s)\), all \(X_s\) of one structure and dimension,
            all \(Y_s\) of another (consumed: updated in place).

    Returns:
        \((X, Y)\).
    """
    if len(terms) == 1:
        return terms[0]
    t = [Y.average_trace() for _, Y in terms]
    r = [X.average_trace() for X, _ in terms]
    T = _positive(sum(t))
    tau = _positive(sum(r_s * t_s for r_s, t_s in zip(r, t, strict=True)))
    X = terms[0][0].mul_(t[0] / T)
    Y = terms[0][1].mul_(T * r[0] / tau)
    for (X_s, Y_s), t_s, r_s in zip(terms[1:], t[1:], r[1:], strict=True):
        X.add_(X_s.mul_(t_s / T))
        Y.add_(Y_s.mul_(T * r_s / tau))
    return X, Y


def _positive(value: Tensor) -> Tensor:
    """Return `value`, raised to the smallest positive number of its dtype.

    Args:
        value: A non-negative 0-d tensor.

    Returns:
        A positive 0-d tensor (no host synchronisation).
    """
    return value.clamp(min=torch.finfo(value.dtype).tiny)
