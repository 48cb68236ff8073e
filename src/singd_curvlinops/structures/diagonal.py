r"""Diagonal factors: the cheapest structure, as memory-light as Adam."""

from __future__ import annotations

import torch
from torch import Tensor
from typing_extensions import override

from singd_curvlinops.structures.base import Scalar, StructuredMatrix


class DiagonalMatrix(StructuredMatrix):
    r"""A diagonal matrix \(\mathrm{diag}(\delta)\); \(\Pi(S) = \mathrm{diag}(S)\).

    Args:
        diag: The diagonal \(\delta\), shape `[d]`. Stored as given (no copy).

    Examples:
        >>> K = DiagonalMatrix(torch.tensor([1.0, 2.0]))
        >>> K @ torch.tensor([3.0, 4.0])
        tensor([3., 8.])
    """

    def __init__(self, diag: Tensor) -> None:
        super().__init__()
        self.diag: Tensor
        self.register_tensor(diag, "diag")
        if diag.ndim != 1 or diag.numel() == 0:
            raise ValueError(
                f"diag must have shape [d] with d >= 1, got {tuple(diag.shape)}."
            )

    @property
    @override
    def dim(self) -> int:
        return self.diag.shape[0]

    @classmethod
    @override
    def from_dense(cls, sym_mat: Tensor) -> DiagonalMatrix:
        return cls(cls._check_square(sym_mat).diagonal().clone())

    @override
    def to_dense(self) -> Tensor:
        return torch.diag(self.diag)

    @classmethod
    @override
    def _zeros(cls, dim, dtype, device) -> DiagonalMatrix:
        return cls(torch.zeros(dim, dtype=dtype, device=device))

    @classmethod
    @override
    def _eye(cls, dim, dtype, device) -> DiagonalMatrix:
        return cls(torch.ones(dim, dtype=dtype, device=device))

    @classmethod
    @override
    def _from_mat_inner(cls, X: Tensor) -> DiagonalMatrix:
        r"""\(\mathrm{diag}(X X^\top)_i = \sum_j X_{ij}^2\), O(dn)."""
        return cls(X.square().sum(1))

    @override
    def _matmat(self, V: Tensor) -> Tensor:
        return self.diag.unsqueeze(1) * V

    @override
    def _matmat_inplace(self, V: Tensor) -> Tensor:
        r"""\(D V\) scales the rows of `V`: in place, no result buffer."""
        return V.mul_(self.diag.unsqueeze(1))

    @override
    def _rmatmat(self, V: Tensor) -> Tensor:
        return self.diag.unsqueeze(1) * V

    @override
    def _solve(self, V: Tensor) -> Tensor:
        r"""\(D^{-1} V\) divides row \(i\) by \(\delta_i\), O(dn)."""
        return V / self.diag.unsqueeze(1)

    @override
    def _rsolve(self, V: Tensor) -> Tensor:
        r"""\(D^{-\top} = D^{-1}\) for a diagonal \(D\)."""
        return V / self.diag.unsqueeze(1)

    @override
    def _matmul_structure(self, other: DiagonalMatrix) -> DiagonalMatrix:
        return DiagonalMatrix(self.diag * other.diag)

    @override
    def _from_inner(self, X: Tensor) -> DiagonalMatrix:
        r"""\(\mathrm{diag}(D X X^\top D) = \delta^2 \odot \sum_j X_{:j}^2\), O(dn)."""
        return DiagonalMatrix(self.diag.square() * X.square().sum(1))

    @override
    def _from_inner_inplace(self, X: Tensor) -> DiagonalMatrix:
        r"""\(\delta^2 \odot \sum_j X_{:j}^2\) with the squares written into `X`."""
        return DiagonalMatrix(self.diag.square() * X.square_().sum(1))

    @override
    def _from_inner_identity(self) -> DiagonalMatrix:
        return DiagonalMatrix(self.diag.square())

    @override
    def outer_self(self) -> DiagonalMatrix:
        return DiagonalMatrix(self.diag.square())

    @override
    def _diag_add_inplace(self, value: Scalar) -> DiagonalMatrix:
        self.diag.add_(value)
        return self

    @override
    def average_trace(self) -> Tensor:
        return (self.diag / self.dim).sum()

    @override
    def frobenius_norm(self) -> Tensor:
        return torch.linalg.vector_norm(self.diag)
