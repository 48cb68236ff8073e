r"""Triangular Toeplitz factors: \(d\) parameters, products by FFT convolution."""

from __future__ import annotations

import torch
from torch import Tensor
from typing_extensions import override

from singd_curvlinops.structures._fft import (
    anticausal_convolution,
    causal_convolution,
    cross_correlation,
    diagonal_sums,
    diagonal_sums_of_gram,
    power_series_inverse,
)
from singd_curvlinops.structures.base import Scalar, StructuredMatrix


class _TriangularToeplitzMatrix(StructuredMatrix):
    r"""Shared algebra of lower and upper triangular Toeplitz matrices.

    Both are parametrised by \(c \in \mathbb{R}^d\), the value on each diagonal
    from the main one outwards. Their projection averages each diagonal band of a
    symmetric \(S\) and folds the mirror band onto it:
    \(c_0 = \mathrm{tr}(S)/d\), \(c_m = 2\, t_m(S) / (d - m)\) where \(t_m\) sums the
    \(m\)-th subdiagonal. Both \(L^\top L\) and \(L L^\top\) have the band sums
    \(t_m = \sum_{u \ge m} (d - u)\, c_u c_{u-m}\) (reversing rows and columns maps
    one onto the other), a cross-correlation evaluated by FFT.

    Args:
        diags: The diagonal values \(c\), shape `[d]`, main diagonal first.
    """

    def __init__(self, diags: Tensor) -> None:
        super().__init__()
        self.diags: Tensor
        self.register_tensor(diags, "diags")
        if diags.ndim != 1 or diags.numel() == 0:
            raise ValueError(
                f"diags must have shape [d] with d >= 1, got {tuple(diags.shape)}."
            )

    @property
    @override
    def dim(self) -> int:
        return self.diags.shape[0]

    @classmethod
    def _from_band_sums(cls, band_sums: Tensor) -> _TriangularToeplitzMatrix:
        """Project from the sums `t_m` of the `m`-th subdiagonals of a symmetric matrix.

        Args:
            band_sums: Vector `[d]` with `t_0` (the trace) first.

        Returns:
            The projected matrix.
        """
        dim = band_sums.shape[0]
        lengths = torch.arange(
            dim, 0, -1, dtype=band_sums.dtype, device=band_sums.device
        )
        folded = torch.cat([band_sums[:1], 2 * band_sums[1:]])
        return cls(folded / lengths)

    @classmethod
    @override
    def from_dense(cls, sym_mat: Tensor) -> _TriangularToeplitzMatrix:
        """Average each band of `sym_mat`, adding the band and its mirror image."""
        dim = cls._check_square(sym_mat).shape[0]
        sums = diagonal_sums(sym_mat)
        lower, upper = sums[: dim - 1].flip(0), sums[dim:]
        diags = torch.cat([sums[dim - 1 : dim], lower + upper])
        lengths = torch.arange(dim, 0, -1, dtype=diags.dtype, device=diags.device)
        return cls(diags / lengths)

    @classmethod
    @override
    def _zeros(cls, dim, dtype, device) -> _TriangularToeplitzMatrix:
        return cls(torch.zeros(dim, dtype=dtype, device=device))

    @classmethod
    @override
    def _eye(cls, dim, dtype, device) -> _TriangularToeplitzMatrix:
        return cls._zeros(dim, dtype, device)._diag_add_inplace(1.0)

    @classmethod
    @override
    def _from_mat_inner(cls, X: Tensor) -> _TriangularToeplitzMatrix:
        r"""Band sums of \(X X^\top\) are column autocorrelations: FFT per column."""
        return cls._from_band_sums(diagonal_sums_of_gram(X))

    @override
    def _from_inner_identity(self) -> _TriangularToeplitzMatrix:
        r"""Band sums \(t_m = \sum_u (d - u) c_u c_{u-m}\) of \(K^\top K\), by FFT."""
        c = self.diags
        weights = torch.arange(self.dim, 0, -1, dtype=c.dtype, device=c.device)
        return self._from_band_sums(cross_correlation(weights * c, c))

    @override
    def _matmul_structure(
        self, other: _TriangularToeplitzMatrix
    ) -> _TriangularToeplitzMatrix:
        r"""Triangular Toeplitz matrices multiply like polynomials mod \(x^d\)."""
        product = causal_convolution(self.diags, other.diags.unsqueeze(1))
        return type(self)(product.squeeze(1))

    @override
    def _diag_add_inplace(self, value: Scalar) -> _TriangularToeplitzMatrix:
        self.diags[0].add_(value)
        return self

    @override
    def average_trace(self) -> Tensor:
        return self.diags[0].clone()

    @override
    def frobenius_norm(self) -> Tensor:
        r"""\(\|K\|_F^2 = \sum_m (d - m) c_m^2\): band \(m\) has \(d - m\) entries."""
        c = self.diags
        lengths = torch.arange(self.dim, 0, -1, dtype=c.dtype, device=c.device)
        return (lengths * c.square()).sum().sqrt()

    def _inverse_diags(self) -> Tensor:
        r"""Return the diagonals of \(K^{-1}\), the power series inverse of \(c\).

        The inverse of a triangular Toeplitz matrix is triangular Toeplitz (the
        structure is a group), and its diagonals \(g\) satisfy
        \(c(x)\, g(x) = 1 \bmod x^d\) because products are polynomial products.

        Returns:
            Vector \(g\) of shape `[d]`, in at least float32.
        """
        return power_series_inverse(self.diags)

    def _band_offsets(self) -> Tensor:
        """Return the matrix `i - j` of row minus column indices.

        Returns:
            Integer matrix of shape `[d, d]`.
        """
        index = torch.arange(self.dim, device=self.device)
        return index.unsqueeze(1) - index.unsqueeze(0)


class TrilToeplitzMatrix(_TriangularToeplitzMatrix):
    r"""Lower-triangular Toeplitz matrix, \(K_{ij} = c_{i-j}\) for \(i \ge j\).

    Examples:
        >>> TrilToeplitzMatrix(torch.tensor([1.0, 2.0, 3.0])).to_dense()
        tensor([[1., 0., 0.],
                [2., 1., 0.],
                [3., 2., 1.]])
    """

    @override
    def to_dense(self) -> Tensor:
        offsets = self._band_offsets()
        return torch.where(offsets >= 0, self.diags[offsets.clamp(min=0)], 0.0)

    @override
    def _matmat(self, V: Tensor) -> Tensor:
        return causal_convolution(self.diags, V)

    @override
    def _rmatmat(self, V: Tensor) -> Tensor:
        return anticausal_convolution(self.diags, V)

    @override
    def _solve(self, V: Tensor) -> Tensor:
        r"""\(L^{-1}\) is lower Toeplitz with diagonals \(g = 1/c \bmod x^d\): one convolution."""  # noqa: E501
        return causal_convolution(self._inverse_diags(), V)

    @override
    def _rsolve(self, V: Tensor) -> Tensor:
        r"""\(L^{-\top} = (L^{-1})^\top\) is upper Toeplitz with diagonals \(g\)."""
        return anticausal_convolution(self._inverse_diags(), V)


class TriuToeplitzMatrix(_TriangularToeplitzMatrix):
    r"""Upper-triangular Toeplitz matrix, \(K_{ij} = c_{j-i}\) for \(j \ge i\).

    Examples:
        >>> TriuToeplitzMatrix(torch.tensor([1.0, 2.0, 3.0])).to_dense()
        tensor([[1., 2., 3.],
                [0., 1., 2.],
                [0., 0., 1.]])
    """

    @override
    def to_dense(self) -> Tensor:
        offsets = -self._band_offsets()
        return torch.where(offsets >= 0, self.diags[offsets.clamp(min=0)], 0.0)

    @override
    def _matmat(self, V: Tensor) -> Tensor:
        return anticausal_convolution(self.diags, V)

    @override
    def _rmatmat(self, V: Tensor) -> Tensor:
        return causal_convolution(self.diags, V)

    @override
    def _solve(self, V: Tensor) -> Tensor:
        r"""\(U^{-1} = (L^{-1})^\top\) for \(L = U^\top\): upper Toeplitz with diagonals \(g\)."""  # noqa: E501
        return anticausal_convolution(self._inverse_diags(), V)

    @override
    def _rsolve(self, V: Tensor) -> Tensor:
        r"""\(U^{-\top} = L^{-1}\) is lower Toeplitz with diagonals \(g = 1/c \bmod x^d\)."""  # noqa: E501
        return causal_convolution(self._inverse_diags(), V)
