r"""Dense statistics kept as their rows until their owner forms them (`Shard`).

A dense side's statistics are a Gram matrix: SINGD's \(H_K = K^\top a^\top a K =
B^\top B\) with \(B = a K\) (one row per row of \(a\)), KFAC's \(U_K = a^\top a\)
with \(B = a\). When a layer sees fewer rows than its dimension \(d\) (an MLP's
batch against its widths), \(B\) holds fewer numbers than \(B^\top B\): the MLP
benchmark's first layer has 64 rows of 785 per process against \(785^2\) entries.

Under `Shard` (factors replicated) only a side's owner reads its combined
statistics, so the statistics hooks keep \(B\) (`project_to_rows`), the ranks send
their rows to the owner instead of \(d \times d\) sums (`owner_statistics`), and
the owner forms \(\sum_r B_r^\top B_r = R^\top R\) once, from the rows \(R\) of all
ranks stacked. The other ranks skip their product \(B^\top B\) for that side, and
the bytes of the exchange shrink by \(d / \text{rows}\).

`GramRows` carries \(H = D + B^\top B\) through the accumulation of uses and
micro-batches (`pending`), which only scales and adds statistics: a scale \(c \ge
0\) multiplies \(B\) by \(\sqrt c\), a sum stacks the rows. Once \(B\) has more
rows than \(d\), they are folded into the dense part \(D\) (memory stays at most
\(d^2\) numbers, as for dense statistics), and the side travels as \(d \times d\)
numbers (`owner_statistics` decides per side, from every rank's row count).

Under `Shard(factors="owned")` no rank but the owner holds a layer's factors, so
the hooks keep the raw rows (\(B = a\), `raw_statistics`), the owner receives
them stacked, and `statistics_on_owner` projects them with the rule as one
process would. A side whose factor is diagonal (always that of one-hot rows, an
embedding's input: `SparseRows`) keeps the diagonal of \(a^\top a\) instead:
that is all its projection reads, and a vocabulary-sized \(V \times V\) matrix
is never formed (`diagonal_statistics`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from singd_curvlinops.layers import Layer
from singd_curvlinops.rules import (
    FactorRule,
    FactorStatistics,
    KFACRule,
    Preconditioner,
    SINGDRule,
)
from singd_curvlinops.rules.factors import project_diagonal_gram
from singd_curvlinops.statistics import SparseRows
from singd_curvlinops.structures import DenseMatrix, DiagonalMatrix, StructuredMatrix

Projection = Callable[[Tensor, Tensor], tuple[StructuredMatrix, StructuredMatrix]]


class GramRows:
    r"""Statistics \(H = D + B^\top B\) of a dense side, with the rows \(B\) kept.

    It offers what accumulating statistics needs (`mul_`, `add_`,
    `average_trace`, `tensors`); `dense()` forms the matrix.

    Args:
        rows: \(B\), `[n, d]` (used as given; folded into \(D\) if \(n > d\)).
    """

    def __init__(self, rows: Tensor) -> None:
        self.rows = rows
        self.dense_part: Tensor | None = None  # D (None: zero)
        self._fold()

    @property
    def dim(self) -> int:
        r"""The dimension \(d\)."""
        return self.rows.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the rows."""
        return self.rows.dtype

    @property
    def device(self) -> torch.device:
        """The device of the rows."""
        return self.rows.device

    @property
    def num_rows(self) -> int | None:
        """The number of rows, or None once a dense part exists."""
        return self.rows.shape[0] if self.dense_part is None else None

    def tensors(self) -> list[Tensor]:
        """Return the stored tensors (for finiteness checks).

        Returns:
            The rows, and the dense part if there is one.
        """
        return [self.rows] + ([] if self.dense_part is None else [self.dense_part])

    def mul_(self, value: float) -> GramRows:
        r"""Scale by \(c \ge 0\) in place (the rows by \(\sqrt c\)).

        Args:
            value: A non-negative number (NaN makes every entry NaN; a negative
                one raises a `ValueError`: no real rows represent it).

        Returns:
            `self`.
        """
        self.rows.mul_(_root(value))
        if self.dense_part is not None:
            self.dense_part.mul_(float(value))
        return self

    def add_(self, other: GramRows, alpha: float = 1.0) -> GramRows:
        """Add `alpha * other` in place (its rows, scaled, are stacked below).

        Args:
            other: Statistics of the same side (left unchanged).
            alpha: A non-negative number (a negative one raises a `ValueError`).

        Returns:
            `self`.

        Raises:
            TypeError: If `other` is not `GramRows`.
        """
        if not isinstance(other, GramRows):
            raise TypeError(f"GramRows can only add GramRows, got {type(other)}.")
        self.rows = torch.cat([self.rows, other.rows * _root(alpha)])
        if other.dense_part is not None:
            part = other.dense_part * float(alpha)
            self.dense_part = (
                part if self.dense_part is None else self.dense_part.add_(part)
            )
        self._fold()
        return self

    def average_trace(self) -> Tensor:
        r"""Return \(\bar{\mathrm{tr}}(H) = (\|B\|_F^2 + \mathrm{tr}(D)) / d\).

        Returns:
            A 0-d tensor.
        """
        trace = self.rows.square().sum()
        if self.dense_part is not None:
            trace = trace + self.dense_part.diagonal().sum()
        return trace / self.dim

    def dense(self) -> DenseMatrix:
        r"""Return \(H = D + B^\top B\) as a dense matrix.

        Returns:
            A new `DenseMatrix`.
        """
        gram = self.rows.T @ self.rows
        return DenseMatrix(
            gram if self.dense_part is None else gram.add_(self.dense_part)
        )

    def _fold(self) -> None:
        """Fold the rows into the dense part once there are more than `dim`."""
        if self.rows.shape[0] > self.rows.shape[1]:
            gram = self.rows.T @ self.rows
            self.dense_part = (
                gram if self.dense_part is None else self.dense_part.add_(gram)
            )
            self.rows = self.rows[:0]


def applies(layer: Layer, rule: FactorRule, group: Mapping[str, Any]) -> bool:
    """Return whether a layer's statistics may be kept as rows.

    For SINGD (and IKFAC) and KFAC, whose statistics are the Gram matrices above,
    with dense factors on both sides; not for a layer with a transposed twin,
    whose two orientations combine non-linearly (`pending.kronecker_sum`).

    Args:
        layer: The layer.
        rule: The factor rule (other rules project differently: never).
        group: The layer's options.

    Returns:
        Whether `project_to_rows` may replace the rule's projection.
    """
    dense = all(name == "dense" for name in rule.structures(group))
    known = type(rule) in (SINGDRule, KFACRule) and not rule.per_example
    return dense and known and layer.twin is None and not layer.swapped


def _root(value: float) -> float:
    r"""Return \(\sqrt c\), the factor of the rows for a scale \(c \ge 0\).

    Args:
        value: The scale \(c\) (NaN gives NaN).

    Returns:
        Its square root.

    Raises:
        ValueError: If `value` is negative (no real rows represent it).
    """
    if float(value) < 0:
        raise ValueError(f"GramRows can only be scaled by c >= 0, got {value}.")
    return math.sqrt(float(value))


def _matrix(factor: StructuredMatrix) -> Tensor:
    """Return a dense factor's matrix (without a copy).

    Args:
        factor: A `DenseMatrix` (or another structure, formed densely).

    Returns:
        Its `[d, d]` matrix.
    """
    return factor.mat if isinstance(factor, DenseMatrix) else factor.to_dense()


def as_structured(matrix: Any) -> StructuredMatrix:
    """Return statistics as a structured matrix (`GramRows` formed densely).

    Args:
        matrix: A `StructuredMatrix` or `GramRows`.

    Returns:
        The same matrix, or the dense form of `GramRows`.
    """
    return matrix.dense() if isinstance(matrix, GramRows) else matrix


def project_to_rows(
    preconditioner: Preconditioner | None, fallback: Projection
) -> Projection:
    r"""Return the hooks' projection that keeps rows (see the module docs).

    Args:
        preconditioner: The layer's current factors (SINGD: \(B = a K\),
            \(g C\)), or None (KFAC: \(B = a\), \(g\)).
        fallback: The rule's projection, for rows that are not a dense tensor.

    Returns:
        `(a, g) -> (GramRows, GramRows)`.
    """

    def project(a: Any, g: Any) -> tuple[Any, Any]:
        if not (isinstance(a, Tensor) and isinstance(g, Tensor)):
            return fallback(a, g)
        if preconditioner is None:  # `a` is the hooks' buffer, `g` maybe autograd's
            return GramRows(a), GramRows(g.clone())
        K, C = preconditioner.K, preconditioner.C
        return GramRows(a @ _matrix(K)), GramRows(g @ _matrix(C))

    return project


def diagonal_statistics(
    layer: Layer, rule: FactorRule, group: Mapping[str, Any]
) -> tuple[bool, bool]:
    r"""Return which sides keep only the diagonal of their raw statistics.

    A side of one-hot rows (an embedding's input), and under SINGD or KFAC a
    side whose factor is `"diagonal"`: its projection reads only the diagonal
    of \(U = a^\top a\) (`project_diagonal_gram`), so \(d\) numbers stand for
    the \(d \times d\) matrix (or the rows, which a wide layer can have more of
    than \(d\)).

    Args:
        layer: The layer.
        rule: The factor rule.
        group: The layer's options.

    Returns:
        `(K, C)`.
    """
    names = rule.structures(group) if projects_raw(rule) else ("", "")
    return tuple(  # type: ignore[return-value]
        one_hot or name == "diagonal"
        for one_hot, name in zip(layer.diagonal_sides, names, strict=True)
    )


def raw_statistics(diagonal: tuple[bool, bool]) -> Projection:
    r"""Return the hooks' raw statistics \(a^\top a\), \(g^\top g\) (owned factors).

    Dense rows are kept as `GramRows`, except on a side that keeps only the
    diagonal (`diagonal_statistics`): then the diagonal of the Gram matrix, as
    a `DiagonalMatrix` (one-hot rows, `SparseRows`, always are).

    Args:
        diagonal: Per side, whether it keeps only the diagonal.

    Returns:
        `(a, g) -> (statistics of a, statistics of g)`; `a` is the hooks'
        buffer (kept), `g` may be autograd's (copied if kept).
    """

    def project(a: Any, g: Any) -> tuple[Any, Any]:
        return _raw(a, diagonal[0], copy=False), _raw(g, diagonal[1], copy=True)

    return project


def _raw(rows: Any, diagonal: bool, *, copy: bool) -> GramRows | DiagonalMatrix:
    """Return one side's raw statistics (see `raw_statistics`).

    Args:
        rows: Dense or one-hot rows.
        diagonal: Whether only the diagonal is kept.
        copy: Whether dense rows kept as `GramRows` must be copied.

    Returns:
        `GramRows`, or the diagonal of the rows' Gram matrix.
    """
    if isinstance(rows, SparseRows):
        return DiagonalMatrix(rows.gram_diagonal())
    if diagonal:
        return DiagonalMatrix(rows.square().sum(0))
    return GramRows(rows.clone() if copy else rows)


def raw_zeros(
    dims: tuple[int, int],
    dtypes: tuple[torch.dtype, torch.dtype],
    device: torch.device,
    diagonal: tuple[bool, bool],
) -> tuple[StructuredMatrix, StructuredMatrix]:
    """Return zero raw statistics, for a rank whose hooks saw no examples.

    Args:
        dims: `(d_K, d_C)`.
        dtypes: Their dtypes.
        device: Their device.
        diagonal: Per side, whether it keeps only the diagonal.

    Returns:
        Per side a zero `DiagonalMatrix` or `DenseMatrix` (`raw_statistics`).
    """
    return tuple(  # type: ignore[return-value]
        (DiagonalMatrix if keep else DenseMatrix).zeros(dim, dtype=dtype, device=device)
        for dim, dtype, keep in zip(dims, dtypes, diagonal, strict=True)
    )


def projects_raw(rule: FactorRule) -> bool:
    r"""Return whether owners project raw statistics with the rule's projection.

    SINGD's and KFAC's statistics are Gram matrices, which their owners project
    from the raw rows as the hooks would (`statistics_on_owner`, each orientation
    of a tied weight apart); other rules get the dense \(U_K\), \(U_C\) handed
    over (`as_dense`).

    Args:
        rule: The factor rule.

    Returns:
        Whether `statistics_on_owner` serves it.
    """
    return type(rule) in (SINGDRule, KFACRule)


def as_dense(statistics: FactorStatistics | None) -> FactorStatistics | None:
    r"""Return collected dense statistics as handed-over dense \(U_K\), \(U_C\).

    Args:
        statistics: Collected dense statistics (or already handed over, or None).

    Returns:
        The same numbers, in the form rules project themselves.
    """
    if statistics is None or statistics.collected is None:
        return statistics
    return FactorStatistics(
        handed_over=tuple(as_structured(M).to_dense() for M in statistics.collected)
    )


def statistics_on_owner(
    stepper: Any, layer: Layer, raw: tuple[Any, Any]
) -> tuple[StructuredMatrix, StructuredMatrix]:
    r"""Return the owner's statistics of a layer from the raw rows of all ranks.

    Under `Shard(factors="owned")` the hooks keep the raw rows \(a\),
    \(\tilde g\) (no rank but the owner holds the factors); SINGD and KFAC
    (`projects_raw`) project the sides that arrived as rows here as their hooks
    would on one process (`project`: \(\Pi(K^\top R^\top R K)\) costs
    \(2 N d^2\) for \(N\) rows, against \(2 d^3\) for \(\Pi(K^\top U K)\)
    from the dense \(U = R^\top R\)), a side that arrived as \(U\) with
    `project_dense`, and a one-hot side from its diagonal
    (`project_diagonal_gram`).

    Args:
        stepper: The shell's `LayerStepper`.
        layer: A layer this rank owns.
        raw: One orientation's raw statistics after the exchange, in the
            layer's orientation.

    Returns:
        \((H_K, H_C)\) as the rule's hooks would form them.
    """
    rule = stepper.rule
    rows = [
        M.rows if isinstance(M, GramRows) and M.num_rows is not None else None
        for M in raw
    ]
    record = stepper.preconditioner(layer, ()) if rule.reads_preconditioner else None
    group = stepper.group(layer)
    projected: list[Any] = [None, None]
    present = next((R for R in rows if R is not None), None)
    if present is not None:
        stand_ins = [  # no rows for a side that arrived formed (projected below)
            present.new_zeros(0, dim) if R is None else R
            for R, dim in zip(rows, layer.dims, strict=True)
        ]
        projected = list(rule.project(record, *stand_ins, group=group))
    for side, R in enumerate(rows):
        if R is None:
            projected[side] = _project_formed(rule, record, raw[side], side, group)
    return projected[0], projected[1]


def _project_formed(
    rule: FactorRule,
    record: Preconditioner | None,
    matrix: Any,
    side: int,
    group: Mapping[str, Any],
) -> StructuredMatrix:
    r"""Project a side that arrived formed: a one-hot side's diagonal, or \(U\).

    Args:
        rule: SINGD's or KFAC's rule.
        record: The layer's factors (None for KFAC).
        matrix: The side's combined raw statistics: the diagonal of
            \(a^\top a\) of one-hot rows (`raw_statistics`), or \(U\).
        side: 0 (\(K\)) or 1 (\(C\)).
        group: The layer's options.

    Returns:
        The side's statistics as the rule's hooks would form them.
    """
    if isinstance(matrix, DiagonalMatrix):  # (no V x V matrix is formed)
        factor = None if record is None else (record.K, record.C)[side]
        return project_diagonal_gram(factor, matrix.diag)
    U = as_structured(matrix).to_dense()
    return rule.project_dense(record, U, side, group=group)
