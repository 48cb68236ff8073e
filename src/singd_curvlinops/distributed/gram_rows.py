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

Under `Shard(factors="owned")` the hooks keep the raw rows instead (\(B = a\)),
which the owner projects itself (`raw_gram`). EKFAC's statistics are KFAC's
(\(B = a\), \(g\)); they travel as rows to the layer's owner under
`Shard(factors="owned")` only, since under `"shard"` every rank updates every
factor from the all-reduced statistics (`DistributionStrategy.keeps_rows`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from singd_curvlinops.layers import Layer
from singd_curvlinops.rules import (
    EKFACRule,
    FactorRule,
    KFACRule,
    Preconditioner,
    SINGDRule,
)
from singd_curvlinops.structures import DenseMatrix, StructuredMatrix

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

    For SINGD (and IKFAC), KFAC and EKFAC, whose statistics are the Gram
    matrices above, with dense factors on both sides; not for a layer with a
    transposed twin, whose two orientations combine non-linearly
    (`pending.kronecker_sum`).

    Args:
        layer: The layer.
        rule: The factor rule (other rules project differently: never).
        group: The layer's options.

    Returns:
        Whether `project_to_rows` may replace the rule's projection.
    """
    dense = all(name == "dense" for name in rule.structures(group))
    known = type(rule) in (SINGDRule, KFACRule, EKFACRule)
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
    preconditioner: Preconditioner | None,
    fallback: Projection,
    *,
    shared_inputs: bool = False,
) -> Projection:
    r"""Return the hooks' projection that keeps rows (see the module docs).

    Args:
        preconditioner: The layer's current factors (SINGD: \(B = a K\),
            \(g C\)), or None (KFAC, EKFAC: \(B = a\), \(g\)).
        fallback: The rule's projection, for rows that are not a dense tensor.
        shared_inputs: Whether the hooks keep `a` elsewhere too (EKFAC's
            per-example gradients): then the rows are a copy, since scaling
            `GramRows` scales its rows in place.

    Returns:
        `(a, g) -> (GramRows, GramRows)`.
    """

    def project(a: Any, g: Any) -> tuple[Any, Any]:
        if not (isinstance(a, Tensor) and isinstance(g, Tensor)):
            return fallback(a, g)
        if preconditioner is None:  # `a` is the hooks' buffer, `g` maybe autograd's
            return GramRows(a.clone() if shared_inputs else a), GramRows(g.clone())
        K, C = preconditioner.K, preconditioner.C
        return GramRows(a @ _matrix(K)), GramRows(g @ _matrix(C))

    return project
