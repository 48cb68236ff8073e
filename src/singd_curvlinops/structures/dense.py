r"""Dense factors: the structure of KFAC, IKFAC and SINGD without sparsity."""

from __future__ import annotations

import torch
from torch import Tensor
from typing_extensions import override

from singd_curvlinops.structures._aligned import matmul_into_aligned_rows
from singd_curvlinops.structures._linalg import solve_dense
from singd_curvlinops.structures.base import Scalar, StructuredMatrix


class DenseMatrix(StructuredMatrix):
    r"""An unstructured \(d \times d\) matrix; its projection \(\Pi\) is the identity.

    Products of two dense matrices (`K @ L`, \(K^\top K\) in `from_inner()`)
    are, in float32 on the CPU and from \(d = 512\) on, views of rows padded to
    64 bytes, which MKL writes up to a quarter faster
    (`structures._aligned`); their entries are those of the contiguous product.

    Args:
        mat: The matrix, shape `[d, d]`. Stored as given (no copy).

    Examples:
        >>> K = DenseMatrix.eye(2)
        >>> (K * 3.0).average_trace()
        tensor(3.)
    """

    def __init__(self, mat: Tensor) -> None:
        super().__init__()
        self.mat: Tensor
        self.register_tensor(self._check_square(mat), "mat")

    @property
    @override
    def dim(self) -> int:
        return self.mat.shape[0]

    @classmethod
    @override
    def from_dense(cls, sym_mat: Tensor) -> DenseMatrix:
        """Keep every entry (copied): the dense projection is the identity."""
        return cls(cls._check_square(sym_mat).clone())

    @override
    def to_dense(self) -> Tensor:
        return self.mat.clone()

    @classmethod
    @override
    def _zeros(cls, dim, dtype, device) -> DenseMatrix:
        return cls(torch.zeros(dim, dim, dtype=dtype, device=device))

    @classmethod
    @override
    def _eye(cls, dim, dtype, device) -> DenseMatrix:
        return cls(torch.eye(dim, dtype=dtype, device=device))

    @classmethod
    @override
    def _from_mat_inner(cls, X: Tensor) -> DenseMatrix:
        return cls(X @ X.T)

    @override
    def _matmat(self, V: Tensor) -> Tensor:
        if _few_transposed_columns(V):
            return (V.T @ self.mat.T).T
        return self.mat @ V

    @override
    def _rmatmat(self, V: Tensor) -> Tensor:
        if _few_transposed_columns(V):
            return (V.T @ self.mat).T
        return self.mat.T @ V

    @override
    def _solve(self, V: Tensor) -> Tensor:
        r"""LU solve with the stored matrix, \(O(d^3 + d^2 n)\); no inverse formed."""
        return solve_dense(self.mat, V)

    @override
    def _rsolve(self, V: Tensor) -> Tensor:
        r"""LU solve with the transposed stored matrix; no inverse is formed."""
        return solve_dense(self.mat, V, transpose=True)

    @override
    def _matmul_structure(self, other: DenseMatrix) -> DenseMatrix:
        return DenseMatrix(matmul_into_aligned_rows(self.mat, other.mat))

    @override
    def _from_inner(self, X: Tensor) -> DenseMatrix:
        r"""Pick the cheaper route: \(S S^\top\) costs \(2d^2n\), \(K^\top(XX^\top)K\) \(d^2n + 2d^3\)."""  # noqa: E501
        if X.shape[1] > 2 * self.dim:
            return DenseMatrix(self.mat.T @ (X @ X.T) @ self.mat)
        S = self.mat.T @ X
        return DenseMatrix(S @ S.T)

    @override
    def _from_inner_identity(self) -> DenseMatrix:
        return DenseMatrix(matmul_into_aligned_rows(self.mat.T, self.mat))

    @override
    def outer_self(self) -> DenseMatrix:
        return DenseMatrix(self.mat @ self.mat.T)

    @override
    def _diag_add_inplace(self, value: Scalar) -> DenseMatrix:
        self.mat.diagonal().add_(value)
        return self

    @override
    def average_trace(self) -> Tensor:
        return (self.mat.diagonal() / self.dim).sum()

    @override
    def frobenius_norm(self) -> Tensor:
        return torch.linalg.vector_norm(self.mat)


FEW_COLUMNS = 32  # (the measured threshold, see `_few_transposed_columns`)


def _few_transposed_columns(V: Tensor) -> bool:
    r"""Return whether `V` is a transposed matrix of fewer than 32 columns.

    Preconditioning multiplies \(\Gamma^\top\), a transposed view, and a
    classifier's \(\Gamma\) has few rows. CPU BLAS multiplies a transposed
    \(d \times d\) factor with such a view about ten times slower than the same
    product in the view's own layout, \((V^\top M)^\top = M^\top V\) (one
    thread, \(d = 513\), 10 columns: 1.27 against 0.12 ms; from 32 columns on
    both take the same time, and from 64 on the usual order is up to 9% faster).

    Args:
        V: The right operand, `[d, n]`.

    Returns:
        True if it has fewer than 32 columns and is stored as its transpose.
    """
    return V.dim() == 2 and V.shape[1] < FEW_COLUMNS and V.T.is_contiguous()
