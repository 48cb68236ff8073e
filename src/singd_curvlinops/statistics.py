r"""curvlinops' KFAC conventions: the rows \(a\), \(\tilde g\) of a layer's factors.

For a layer's input \(x\) and the gradient \(g\) of the loss with respect to its
output, both laid out as `[batch, ..., features]` (the weight-sharing dimensions in
the middle), this module returns two *factor matrices* (rows are data):

- `input_rows`: \(a\) with \(a^\top a = U_K\), the input covariance (Kronecker factor
  \(A\)) that `curvlinops.KFACLinearOperator` computes on this batch: weight-sharing
  dimensions flattened (`"expand"`) or averaged (`"reduce"`), a column of ones for
  the bias, normalised by the number of examples \(N\) (and by the weight-sharing
  size for `"expand"`);
- `gradient_rows`: \(\tilde g\) with \(\tilde g^\top \tilde g \cdot \nu = U_C\), the
  gradient covariance (Kronecker factor \(G\)), where the scale \(\nu\)
  (`gradient_scale`) depends on the loss reduction: the loss-average rows below undo
  the \(1 / (N R)\) that a mean puts on every output gradient.

| `loss_average` | curvlinops' loss reduction | loss terms per example \(R\) | \(\nu\) |
|---|---|---|---|
| `None` | `"sum"` | — | \(1\) |
| `"batch"` | `"mean"` | \(1\) | \(N\) |
| `"batch+sequence"` | `"mean"` | weight-sharing size \(S\) of the layer | \(N\) |

(\(\tilde g\) already carries the \(\sqrt{R}\).) Both normalisations refer to the
whole batch, so micro-batches accumulate exactly: average the per-micro-batch \(U_K\)
weighted by their sizes, sum \(\tilde g^\top \tilde g\), and apply \(\nu\) with the
total \(N\) (the PyTorch convention divides each micro-batch loss by the number of
micro-batches, which makes the output gradients those of the concatenated batch).

For `"batch+sequence"`, \(R\) is the layer's weight-sharing size (the sequence
length for `Linear` layers on `[batch, sequence, features]`), which equals
curvlinops' `num_per_example_loss_terms` when every position carries a loss term.

A layer type enters through its adapter (`singd_curvlinops.layers`), which brings
its input and output gradient into this layout: a `Conv2d` by curvlinops' patch
extraction (`conv_patches`), a graph convolution by aggregating the node features.
This module knows no layer type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from curvlinops.kfac import KFACType
from curvlinops.kfac_utils import extract_averaged_patches, extract_patches
from einconv.utils import get_conv_paddings
from torch import Tensor
from torch.nn import Conv2d

LossAverage = Literal["batch", "batch+sequence"] | None
LOSS_AVERAGES: tuple[LossAverage, ...] = (None, "batch", "batch+sequence")
KFAC_APPROXES: tuple[str, ...] = tuple(kind.value for kind in KFACType)


@dataclass(frozen=True)
class SparseRows:
    r"""Rows \(a\) with few non-zero entries, e.g. one-hot inputs of an embedding.

    Only the non-zero entries are kept, as `(columns[j], values[j])`, without their
    row (no row has two entries in one column). The rows are never materialised:
    the only product the optimizers need is the diagonal of
    \(a^\top a\), \(\sum_j \text{values}_j^2 e_{\text{columns}_j}\)
    (`gram_diagonal`, one scatter-add), which is all of \(a^\top a\) when every row
    has a single entry (one-hot rows).

    Attributes:
        columns: Column of each entry, `[nnz]` (int64).
        values: Value of each entry, `[nnz]`.
        dim: Number of columns \(d\).
        num_rows: Number of rows.
        rows: Row of each entry, `[nnz]` (int64), for per-example gradients
            (EKFAC); None where unknown.
    """

    columns: Tensor
    values: Tensor
    dim: int
    num_rows: int
    rows: Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        """`(num_rows, dim)`, as for a dense row matrix."""
        return (self.num_rows, self.dim)

    def gram_diagonal(self) -> Tensor:
        r"""Return the diagonal of \(a^\top a\), `[dim]`.

        Returns:
            \(\sum_j \text{values}_j^2\) per column, in the dtype of `values`.
        """
        squares = self.values.square()
        return squares.new_zeros(self.dim).index_add_(0, self.columns, squares)

    def to(self, dtype: torch.dtype) -> SparseRows:
        """Return the rows with values of another dtype.

        Args:
            dtype: The new dtype.

        Returns:
            A `SparseRows` sharing `columns`.
        """
        return SparseRows(
            self.columns, self.values.to(dtype), self.dim, self.num_rows, self.rows
        )


def conv_patches(x: Tensor, module: Conv2d, kfac_approx: str) -> Tensor:
    """Extract the patches of a Conv2d input with curvlinops' extractors.

    String padding with unequal left/right amounts (`'same'` with an even kernel) is
    applied explicitly before extraction, which curvlinops does not support itself.

    Args:
        x: Layer input, `[batch, C_in, I1, I2]`.
        module: The convolution.
        kfac_approx: `"expand"` or `"reduce"`.

    Returns:
        `[batch, O1 * O2, d_in]` (expand, a view of a feature-major buffer) or
        `[batch, d_in]` (reduce).
    """
    padding = module.padding
    if isinstance(padding, str):
        pads = [
            get_conv_paddings(k, s, padding, d)
            for k, s, d in zip(
                module.kernel_size, module.stride, module.dilation, strict=True
            )
        ]
        if any(left != right for left, right in pads):
            (top, bottom), (left, right) = pads
            x = torch.nn.functional.pad(x, (left, right, top, bottom))
            padding = 0
    extract = (
        extract_patches if kfac_approx == KFACType.EXPAND else extract_averaged_patches
    )
    return extract(
        x, module.kernel_size, module.stride, padding, module.dilation, module.groups
    )


def _flat_rows(x: Tensor) -> Tensor:
    """Flatten `[batch, ..., d]` to rows `[batch * ..., d]`, keeping the layout.

    A row-major input becomes a view; a feature-major one (`stride(-1) != 1`, e.g.
    a convolution's `[batch, O1 O2, C]` view of `[batch, C, O1 O2]`) becomes the
    transposed view of a feature-major copy `[d, batch * ...]`: contiguous runs
    instead of a transposing copy.

    Args:
        x: Tensor `[batch, ..., d]`.

    Returns:
        The rows `[batch * ..., d]`.
    """
    if x.stride(-1) == 1 or x.ndim == 2:
        return x.reshape(-1, x.shape[-1])  # "b ... d -> (b ...) d"
    return x.movedim(-1, 0).flatten(1).T  # "b ... d -> d (b ...)", transposed


def _reduced_rows(x: Tensor, reduce_op: str) -> Tensor:
    """Average (inputs) or sum (output gradients) over the weight-sharing dimensions.

    Args:
        x: Tensor `[batch, ..., features]`.
        reduce_op: `"mean"` or `"sum"`.

    Returns:
        The rows `[batch, features]`.
    """
    if x.ndim == 2:
        return x
    rows = x.flatten(1, -2)  # "b ... d -> b (...) d"
    return rows.mean(1) if reduce_op == "mean" else rows.sum(1)


def input_rows(x: Tensor, kfac_approx: str, *, bias: bool) -> Tensor:
    r"""Return \(a\) with \(a^\top a\) equal to curvlinops' input covariance.

    Args:
        x: The layer's input `[batch, ..., d_in]` (for a convolution, its patches).
        kfac_approx: `"expand"` or `"reduce"`.
        bias: Whether the layer has a bias (a last column of the row scale).

    Returns:
        Tensor `[rows, d_K]`, normalised by \(\sqrt{N S}\) (expand) or
        \(\sqrt{N}\) (reduce) for a batch of \(N\) examples (no rows for an
        empty batch); a fresh buffer that the caller may overwrite. For a
        feature-major `x` (expand), the transposed view of a contiguous
        `[d_K, rows]` buffer.
    """
    batch_size = x.shape[0]
    if kfac_approx == KFACType.EXPAND:
        scale = _row_scale(batch_size * x.shape[1:-1].numel())
    else:
        x = _reduced_rows(x, "mean")
        scale = _row_scale(batch_size)
    # Scale into a preallocated buffer with the bias column: one pass over x,
    # without flattening copies or a concatenation. Its layout follows x's, so a
    # feature-major x gives a feature-major buffer, returned as its transpose.
    d_in, d_K = x.shape[-1], x.shape[-1] + int(bias)
    if x.stride(-1) == 1:
        a = x.new_empty(x.shape[:-1].numel(), d_K)
        torch.mul(x, scale, out=a[:, :d_in].unflatten(0, x.shape[:-1]))
        a[:, d_in:] = scale
        return a
    a_T = x.new_empty(d_K, *x.shape[:-1])
    torch.mul(x.movedim(-1, 0), scale, out=a_T[:d_in])
    a_T[d_in:] = scale
    return a_T.flatten(1).T


def _row_scale(count: int) -> float:
    r"""Return \(1 / \sqrt{\text{count}}\), the normalisation of `count` rows.

    Args:
        count: Number of rows the normalisation refers to.

    Returns:
        The scale; 0 for no rows (an empty batch has no rows to scale).
    """
    return count**-0.5 if count else 0.0


def gradient_rows(g: Tensor, kfac_approx: str, loss_average: LossAverage) -> Tensor:
    r"""Return \(\tilde g\) with \(\nu\,\tilde g^\top \tilde g\) = curvlinops' gradient covariance.

    Args:
        g: Gradient of the loss w.r.t. the layer's output, `[batch, ..., d_out]`.
        kfac_approx: `"expand"` or `"reduce"` (reduce sums over shared dimensions).
        loss_average: `None`, `"batch"` or `"batch+sequence"`.

    Returns:
        Tensor `[rows, d_out]`, multiplied by \(\sqrt{R}\) for `"batch+sequence"`;
        possibly a view of `g`.
    """  # noqa: E501
    shared = g.shape[1:-1].numel()
    rows = _flat_rows(g) if kfac_approx == KFACType.EXPAND else _reduced_rows(g, "sum")
    if loss_average == "batch+sequence":
        rows = rows * shared**0.5
    return rows


def gradient_scale(loss_average: LossAverage, num_examples: int) -> float:
    r"""Return \(\nu\), the factor from \(\sum \tilde g^\top \tilde g\) to \(U_C\).

    Args:
        loss_average: `None`, `"batch"` or `"batch+sequence"`.
        num_examples: Number of examples \(N\) of the (accumulated) batch.

    Returns:
        \(N\) for a mean loss, 1 for a sum loss.
    """
    return 1.0 if loss_average is None else float(num_examples)


def check_kfac_approx(kfac_approx: object) -> str:
    """Validate `kfac_approx`.

    Args:
        kfac_approx: Candidate value.

    Returns:
        The value as a plain string.

    Raises:
        ValueError: If it is not one of curvlinops' `KFACType` values.
    """
    if kfac_approx not in KFAC_APPROXES:
        raise ValueError(
            f"kfac_approx must be one of {list(KFAC_APPROXES)}, got {kfac_approx!r}."
        )
    return str(KFACType(kfac_approx).value)


def check_loss_average(loss_average: object) -> LossAverage:
    """Validate `loss_average`.

    Args:
        loss_average: Candidate value.

    Returns:
        The value.

    Raises:
        ValueError: If it is not `None`, `"batch"` or `"batch+sequence"`.
    """
    if loss_average not in LOSS_AVERAGES:
        raise ValueError(
            f"loss_average must be one of {list(LOSS_AVERAGES)}, got {loss_average!r}."
        )
    return loss_average
