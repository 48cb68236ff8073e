r"""Sparse triangular factors: a diagonal plus one dense row or column.

Each of the four structures is \(\mathrm{diag}(\delta)\) plus the off-diagonal part
\(v \in \mathbb{R}^{d-1}\) of one line through a corner, the *pivot* \(p\):

| name | triangle | line | pivot |
|---|---|---|---|
| `trilbottomrightdiag` | lower | first column | first |
| `triutopleftdiag` | upper | last column | last |
| `triubottomrightdiag` | upper | first row | first |
| `triltopleftdiag` | lower | last row | last |

A column structure is \(K = D + \hat v e_p^\top\) (\(\hat v\) is \(v\) with a zero
inserted at \(p\)), a row structure its transpose \(K = D + e_p \hat v^\top\). All
products are rank-one corrections of diagonal scalings: \(O(d)\) per column. So are
the solves: because \(\hat v_p = 0\), \((D + \hat v e_p^\top)^{-1} = D^{-1} - D^{-1}
\hat v e_p^\top / \delta_p\) and \((D + e_p \hat v^\top)^{-1} = D^{-1} - e_p \hat
v^\top D^{-1} / \delta_p\) (Sherman-Morrison, whose denominator is
\(1 + \hat v_p / \delta_p = 1\)).
"""

from __future__ import annotations

import torch
from torch import Tensor
from typing_extensions import override

from singd_curvlinops.structures.base import Scalar, StructuredMatrix


class _DiagonalPlusLineMatrix(StructuredMatrix):
    r"""Diagonal \(\delta \in \mathbb{R}^d\) plus an off-diagonal line \(v\).

    \(\Pi(S)\) keeps \(\mathrm{diag}(S)\) and folds the mirror of the line onto it:
    \(v = S_{\bar p, p} + S_{p, \bar p} = 2 S_{p, \bar p}\) (\(\bar p\): all indices
    but \(p\)).

    Args:
        diag: Diagonal \(\delta\), shape `[d]`.
        line: Off-diagonal entries \(v\) of the pivot's row or column, in index order,
            shape `[d - 1]`.
    """

    IS_COLUMN: bool
    PIVOT_FIRST: bool

    def __init__(self, diag: Tensor, line: Tensor) -> None:
        super().__init__()
        self.diag: Tensor
        self.register_tensor(diag, "diag")
        self.line: Tensor
        self.register_tensor(line, "line")
        if diag.ndim != 1 or diag.numel() == 0 or line.shape != (diag.numel() - 1,):
            raise ValueError(
                "diag and line must have shapes [d] and [d - 1] with d >= 1, got "
                f"{tuple(diag.shape)} and {tuple(line.shape)}."
            )

    @property
    @override
    def dim(self) -> int:
        return self.diag.shape[0]

    @classmethod
    def _pivot(cls, dim: int) -> tuple[int, slice]:
        """Return the pivot index and the slice of the other indices.

        Args:
            dim: Matrix dimension.

        Returns:
            `(p, rest)`.
        """
        if cls.PIVOT_FIRST:
            return 0, slice(1, dim)
        return dim - 1, slice(0, dim - 1)

    @classmethod
    @override
    def from_dense(cls, sym_mat: Tensor) -> _DiagonalPlusLineMatrix:
        p, rest = cls._pivot(cls._check_square(sym_mat).shape[0])
        # row p is contiguous; for symmetric input it equals the mirrored column
        return cls(sym_mat.diagonal().clone(), 2 * sym_mat[p, rest])

    @override
    def to_dense(self) -> Tensor:
        p, rest = self._pivot(self.dim)
        mat = torch.diag(self.diag)
        if self.IS_COLUMN:
            mat[rest, p] = self.line
        else:
            mat[p, rest] = self.line
        return mat

    @classmethod
    @override
    def _zeros(cls, dim, dtype, device) -> _DiagonalPlusLineMatrix:
        return cls(
            torch.zeros(dim, dtype=dtype, device=device),
            torch.zeros(dim - 1, dtype=dtype, device=device),
        )

    @classmethod
    @override
    def _eye(cls, dim, dtype, device) -> _DiagonalPlusLineMatrix:
        return cls._zeros(dim, dtype, device)._diag_add_inplace(1.0)

    @classmethod
    @override
    def _from_mat_inner(cls, X: Tensor) -> _DiagonalPlusLineMatrix:
        r"""\(\mathrm{diag}(XX^\top) = \sum_j X_{:j}^2\) and \((XX^\top)_{\bar p p} = X_{\bar p} X_p^\top\): \(O(dn)\)."""  # noqa: E501
        p, rest = cls._pivot(X.shape[0])
        return cls(X.square().sum(1), 2 * (X[rest] @ X[p]))

    def _apply_column(self, V: Tensor) -> Tensor:
        r"""Return \((D + \hat v e_p^\top) V\): scale rows, add \(v V_p\) to the others.

        Args:
            V: Matrix of shape `[d, n]`.

        Returns:
            Matrix of shape `[d, n]`.
        """
        p, rest = self._pivot(self.dim)
        out = self.diag.unsqueeze(1) * V
        out[rest] += self.line.unsqueeze(1) * V[p]
        return out

    def _apply_row(self, V: Tensor) -> Tensor:
        r"""Return \((D + e_p \hat v^\top) V\): scale rows, add \(v^\top V_{\bar p}\) to row \(p\).

        Args:
            V: Matrix of shape `[d, n]`.

        Returns:
            Matrix of shape `[d, n]`.
        """  # noqa: E501
        p, rest = self._pivot(self.dim)
        out = self.diag.unsqueeze(1) * V
        out[p] += self.line @ V[rest]
        return out

    def _solve_column(self, V: Tensor) -> Tensor:
        r"""Return \((D + \hat v e_p^\top)^{-1} V\): \(x_p = V_p / \delta_p\), then \(x_{\bar p} = (V_{\bar p} - v x_p) / \delta_{\bar p}\).

        Args:
            V: Matrix of shape `[d, n]`.

        Returns:
            Matrix of shape `[d, n]`.
        """  # noqa: E501
        p, rest = self._pivot(self.dim)
        out = V / self.diag.unsqueeze(1)
        out[rest] -= (self.line / self.diag[rest]).unsqueeze(1) * out[p]
        return out

    def _solve_row(self, V: Tensor) -> Tensor:
        r"""Return \((D + e_p \hat v^\top)^{-1} V\): \(x_{\bar p} = V_{\bar p} / \delta_{\bar p}\), then \(x_p = (V_p - v^\top x_{\bar p}) / \delta_p\).

        Args:
            V: Matrix of shape `[d, n]`.

        Returns:
            Matrix of shape `[d, n]`.
        """  # noqa: E501
        p, rest = self._pivot(self.dim)
        out = V / self.diag.unsqueeze(1)
        out[p] -= (self.line @ out[rest]) / self.diag[p]
        return out

    @override
    def _matmat(self, V: Tensor) -> Tensor:
        return self._apply_column(V) if self.IS_COLUMN else self._apply_row(V)

    @override
    def _rmatmat(self, V: Tensor) -> Tensor:
        return self._apply_row(V) if self.IS_COLUMN else self._apply_column(V)

    @override
    def _solve(self, V: Tensor) -> Tensor:
        """Column type: pivot first, then the rest; row type: the reverse. O(dn)."""
        return self._solve_column(V) if self.IS_COLUMN else self._solve_row(V)

    @override
    def _rsolve(self, V: Tensor) -> Tensor:
        r"""\(K^\top\) of a column structure is a row structure, and vice versa."""
        return self._solve_row(V) if self.IS_COLUMN else self._solve_column(V)

    @override
    def _matmul_structure(
        self, other: _DiagonalPlusLineMatrix
    ) -> _DiagonalPlusLineMatrix:
        r"""Column: \(v = \delta_{\bar p} v' + \delta'_p v\); row: \(v = \delta_p v' + \delta'_{\bar p} v\)."""  # noqa: E501
        p, rest = self._pivot(self.dim)
        if self.IS_COLUMN:
            line = self.diag[rest] * other.line + other.diag[p] * self.line
        else:
            line = self.diag[p] * other.line + other.diag[rest] * self.line
        return type(self)(self.diag * other.diag, line)

    @override
    def _from_inner_identity(self) -> _DiagonalPlusLineMatrix:
        r"""Column: \(\delta^2 + \|v\|^2 e_p\), \(2 \delta_{\bar p} v\); row: \(\delta^2 + \hat v^2\), \(2 \delta_p v\)."""  # noqa: E501
        p, rest = self._pivot(self.dim)
        diag = self.diag.square()
        if self.IS_COLUMN:
            diag[p] += self.line.square().sum()
            line = 2 * self.diag[rest] * self.line
        else:
            diag[rest] += self.line.square()
            line = 2 * self.diag[p] * self.line
        return type(self)(diag, line)

    @override
    def _diag_add_inplace(self, value: Scalar) -> _DiagonalPlusLineMatrix:
        self.diag.add_(value)
        return self

    @override
    def average_trace(self) -> Tensor:
        return (self.diag / self.dim).sum()

    @override
    def frobenius_norm(self) -> Tensor:
        return torch.cat([self.diag, self.line]).norm()


class TrilBottomRightDiagonalMatrix(_DiagonalPlusLineMatrix):
    r"""Lower triangular with a dense first column and a diagonal bottom-right block.

    \(K = \begin{pmatrix} a & 0 \\ b & \mathrm{diag}(c) \end{pmatrix}\).

    Examples:
        >>> K = TrilBottomRightDiagonalMatrix(torch.ones(3), torch.tensor([2.0, 3.0]))
        >>> K.to_dense()
        tensor([[1., 0., 0.],
                [2., 1., 0.],
                [3., 0., 1.]])
    """

    IS_COLUMN = True
    PIVOT_FIRST = True


class TriuTopLeftDiagonalMatrix(_DiagonalPlusLineMatrix):
    r"""Upper triangular: \(\begin{pmatrix} \mathrm{diag}(c) & b \\ 0 & a \end{pmatrix}\)."""  # noqa: E501

    IS_COLUMN = True
    PIVOT_FIRST = False


class TriuBottomRightDiagonalMatrix(_DiagonalPlusLineMatrix):
    r"""Upper triangular: \(\begin{pmatrix} a & b^\top \\ 0 & \mathrm{diag}(c) \end{pmatrix}\)."""  # noqa: E501

    IS_COLUMN = False
    PIVOT_FIRST = True


class TrilTopLeftDiagonalMatrix(_DiagonalPlusLineMatrix):
    r"""Lower triangular: \(\begin{pmatrix} \mathrm{diag}(c) & 0 \\ b^\top & a \end{pmatrix}\)."""  # noqa: E501

    IS_COLUMN = False
    PIVOT_FIRST = False
