r"""Hierarchical factors: two dense corners coupled through a diagonal core."""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from typing_extensions import override

from singd_curvlinops.structures._checks import check_size
from singd_curvlinops.structures._linalg import solve_dense
from singd_curvlinops.structures.base import Scalar, StructuredMatrix


class HierarchicalMatrix(StructuredMatrix):
    r"""Hierarchical matrix with dense corners of sizes \(K_1\) and \(K_2\).

    \[
    K = \begin{pmatrix} A & B_C & B_E \\ 0 & \mathrm{diag}(c) & 0 \\ 0 & D & E
    \end{pmatrix},\qquad B = (B_C \; B_E),
    \]

    with dense \(A\) (\(k_1 \times k_1\)), \(E\) (\(k_2 \times k_2\)), \(B\)
    (\(k_1 \times (d - k_1)\)), \(D\) (\(k_2 \times d_c\)) and a diagonal core
    \(c \in \mathbb{R}^{d_c}\). When \(d < K_1 + K_2\) the blocks are filled in the
    reference's priority: \(A\) first (\(k_1 = \min(d, K_1)\)), then \(E\)
    (\(k_2 = \min(d - k_1, K_2)\)), then the core (\(d_c = d - k_1 - k_2\)).

    \(\Pi(S)\) keeps \(S\)'s entries on \(A, c, E\) and folds the mirror images of the
    off-diagonal blocks onto \(B\) and \(D\) (\(B = 2 S_{12}\), \(D = 2 S_{32}\) for
    symmetric \(S\)). All operations are block products of cost
    \(O((K_1 + K_2) d)\) per column.

    Use `hierarchical(K1, K2)` (or `get_structure("hierarchical15_15")`) for the
    class with corner sizes `K1`, `K2`.

    Args:
        A: Top-left block, `[k1, k1]`.
        B: Top-right rows, `[k1, d - k1]`.
        C: Diagonal core, `[d_c]`.
        D: Bottom-left of the bottom rows, `[k2, d_c]`.
        E: Bottom-right block, `[k2, k2]`.
    """

    MAX_K1: int
    MAX_K2: int

    def __init__(self, A: Tensor, B: Tensor, C: Tensor, D: Tensor, E: Tensor) -> None:
        super().__init__()
        if getattr(type(self), "MAX_K1", None) is None:
            raise TypeError(
                "HierarchicalMatrix is a template: use hierarchical(K1, K2)."
            )
        for name, tensor in zip("ABCDE", (A, B, C, D, E), strict=True):
            self.register_tensor(tensor, name)
        k1, dc, k2 = (t.shape[0] if t.ndim else 0 for t in (A, C, E))
        expected = self._block_dims(k1 + dc + k2) if k1 + dc + k2 else None
        shapes = (A.shape, B.shape, C.shape, D.shape, E.shape)
        wanted = ((k1, k1), (k1, dc + k2), (dc,), (k2, dc), (k2, k2))
        if expected != (k1, dc, k2) or shapes != wanted:
            raise ValueError(
                f"Invalid block shapes {[tuple(s) for s in shapes]} for "
                f"{type(self).__name__}; expected {wanted} with (k1, d_c, k2) = "
                f"{expected}."
            )

    A: Tensor
    B: Tensor
    C: Tensor
    D: Tensor
    E: Tensor

    @classmethod
    def _block_dims(cls, dim: int) -> tuple[int, int, int]:
        """Return `(k1, d_c, k2)` for dimension `dim` in the reference's priority.

        Args:
            dim: Matrix dimension.

        Returns:
            Sizes of the top corner, the diagonal core and the bottom corner.
        """
        k1 = min(dim, cls.MAX_K1)
        k2 = min(dim - k1, cls.MAX_K2)
        return k1, dim - k1 - k2, k2

    @property
    @override
    def dim(self) -> int:
        return self.A.shape[0] + self.C.shape[0] + self.E.shape[0]

    def _sizes(self) -> list[int]:
        """Return `[k1, d_c, k2]` for splitting rows or columns.

        Returns:
            The block sizes.
        """
        return [self.A.shape[0], self.C.shape[0], self.E.shape[0]]

    @classmethod
    @override
    def from_dense(cls, sym_mat: Tensor) -> HierarchicalMatrix:
        k1, dc, k2 = cls._block_dims(cls._check_square(sym_mat).shape[0])
        mid, bot = slice(k1, k1 + dc), slice(k1 + dc, None)
        return cls(
            sym_mat[:k1, :k1].clone(),
            2 * sym_mat[:k1, k1:],  # contiguous rows; the mirror is equal
            sym_mat.diagonal()[mid].clone(),
            2 * sym_mat[bot, mid],
            sym_mat[bot, bot].clone(),
        )

    @override
    def to_dense(self) -> Tensor:
        k1, dc, _ = self._sizes()
        mat = self.A.new_zeros(self.dim, self.dim)
        mat[:k1, :k1] = self.A
        mat[:k1, k1:] = self.B
        mat[k1 : k1 + dc, k1 : k1 + dc].diagonal().copy_(self.C)
        mat[k1 + dc :, k1 : k1 + dc] = self.D
        mat[k1 + dc :, k1 + dc :] = self.E
        return mat

    @classmethod
    @override
    def _zeros(cls, dim, dtype, device) -> HierarchicalMatrix:
        k1, dc, k2 = cls._block_dims(dim)

        def new(*shape: int) -> Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        return cls(new(k1, k1), new(k1, dc + k2), new(dc), new(k2, dc), new(k2, k2))

    @classmethod
    @override
    def _eye(cls, dim, dtype, device) -> HierarchicalMatrix:
        return cls._zeros(dim, dtype, device)._diag_add_inplace(1.0)

    @classmethod
    @override
    def _from_mat_inner(cls, X: Tensor) -> HierarchicalMatrix:
        r"""Only the stored blocks of \(X X^\top\) are formed: \(O((K_1+K_2) dn)\)."""
        k1, dc, k2 = cls._block_dims(X.shape[0])
        X_top, X_mid, X_bot = X.split([k1, dc, k2])
        return cls(
            X_top @ X_top.T,
            2 * (X_top @ X[k1:].T),
            X_mid.square().sum(1),
            2 * (X_bot @ X_mid.T),
            X_bot @ X_bot.T,
        )

    @override
    def _matmat(self, V: Tensor) -> Tensor:
        k1 = self.A.shape[0]
        V_top, V_mid, V_bot = V.split(self._sizes())
        out = V.new_empty(V.shape)  # blocks written in place: no temporaries
        top, mid, bot = out.split(self._sizes())
        torch.mm(self.A, V_top, out=top).addmm_(self.B, V[k1:])
        torch.mul(self.C.unsqueeze(1), V_mid, out=mid)
        torch.mm(self.D, V_mid, out=bot).addmm_(self.E, V_bot)
        return out

    @override
    def _rmatmat(self, V: Tensor) -> Tensor:
        V_top, V_mid, V_bot = V.split(self._sizes())
        B_C, B_E = self.B.split(self._sizes()[1:], dim=1)
        out = V.new_empty(V.shape)
        top, mid, bot = out.split(self._sizes())
        torch.mm(self.A.T, V_top, out=top)
        torch.mul(self.C.unsqueeze(1), V_mid, out=mid)
        mid.addmm_(B_C.T, V_top).addmm_(self.D.T, V_bot)
        torch.mm(B_E.T, V_top, out=bot).addmm_(self.E.T, V_bot)
        return out

    @override
    def _solve(self, V: Tensor) -> Tensor:
        r"""Back substitution: \(x_c = v_c / c\), \(x_E = E^{-1}(v_E - D x_c)\), \(x_A = A^{-1}(v_A - B x_{cE})\)."""  # noqa: E501
        V_top, V_mid, V_bot = V.split(self._sizes())
        mid = V_mid / self.C.unsqueeze(1)
        rest = torch.cat([mid, solve_dense(self.E, V_bot - self.D @ mid)])
        return torch.cat([solve_dense(self.A, V_top - self.B @ rest), rest])

    @override
    def _rsolve(self, V: Tensor) -> Tensor:
        r"""\(K^\top\) is block lower triangular: \(y_A = A^{-\top} v_A\), \(y_E = E^{-\top}(v_E - B_E^\top y_A)\), \(y_c = (v_c - B_C^\top y_A - D^\top y_E) / c\)."""  # noqa: E501
        V_top, V_mid, V_bot = V.split(self._sizes())
        B_C, B_E = self.B.split(self._sizes()[1:], dim=1)
        top = solve_dense(self.A, V_top, transpose=True)
        bot = solve_dense(self.E, V_bot - B_E.T @ top, transpose=True)
        mid = (V_mid - B_C.T @ top - self.D.T @ bot) / self.C.unsqueeze(1)
        return torch.cat([top, mid, bot])

    @override
    def _matmul_structure(self, other: HierarchicalMatrix) -> HierarchicalMatrix:
        r"""Block product; the zero pattern is preserved (the structure is a group)."""
        B_C, B_E = self.B.split(self._sizes()[1:], dim=1)
        B_C2, B_E2 = other.B.split(other._sizes()[1:], dim=1)
        B = torch.cat(
            [
                self.A @ B_C2 + B_C * other.C + B_E @ other.D,
                self.A @ B_E2 + B_E @ other.E,
            ],
            dim=1,
        )
        D = self.D * other.C + self.E @ other.D
        return type(self)(self.A @ other.A, B, self.C * other.C, D, self.E @ other.E)

    @override
    def _from_inner_identity(self) -> HierarchicalMatrix:
        r"""Stored blocks of \(K^\top K\): \(A^\top A\), \(A^\top B\), \(c^2 + \sum B_C^2 + \sum D^2\), \(B_E^\top B_C + E^\top D\), \(B_E^\top B_E + E^\top E\)."""  # noqa: E501
        B_C, B_E = self.B.split(self._sizes()[1:], dim=1)
        return type(self)(
            self.A.T @ self.A,
            2 * (self.A.T @ self.B),
            self.C.square() + B_C.square().sum(0) + self.D.square().sum(0),
            2 * (B_E.T @ B_C + self.E.T @ self.D),
            B_E.T @ B_E + self.E.T @ self.E,
        )

    @override
    def _diag_add_inplace(self, value: Scalar) -> HierarchicalMatrix:
        self.A.diagonal().add_(value)
        self.C.add_(value)
        self.E.diagonal().add_(value)
        return self

    @override
    def average_trace(self) -> Tensor:
        d = self.dim
        return (
            (self.A.diagonal() / d).sum()
            + (self.C / d).sum()
            + (self.E.diagonal() / d).sum()
        )

    @override
    def frobenius_norm(self) -> Tensor:
        norms = torch.stack([torch.linalg.vector_norm(t) for t in self.tensors()])
        return torch.linalg.vector_norm(norms)


def hierarchical(K1: int, K2: int) -> type[HierarchicalMatrix]:
    """Return the hierarchical structure class with corner sizes `K1` and `K2`.

    Args:
        K1: Maximum size of the top-left dense block, an int in `[0, MAX_SIZE]`.
        K2: Maximum size of the bottom-right dense block, an int in `[0, MAX_SIZE]`.

    Returns:
        A subclass of `HierarchicalMatrix` named `Hierarchical{K1}_{K2}Matrix`; the
        same class object for every call with the same sizes.
    """
    # checked before the cache: 1.0 and True hash like 1 and would hit its entry
    return _hierarchical(check_size(K1, "K1", 0), check_size(K2, "K2", 0))


@functools.cache
def _hierarchical(K1: int, K2: int) -> type[HierarchicalMatrix]:
    """Create the class for valid sizes, once per pair (see `hierarchical`).

    Args:
        K1: Maximum size of the top-left dense block.
        K2: Maximum size of the bottom-right dense block.

    Returns:
        The class.
    """
    name = f"Hierarchical{K1}_{K2}Matrix"
    return type(
        name,
        (HierarchicalMatrix,),
        {"MAX_K1": K1, "MAX_K2": K2, "__module__": __name__, "__qualname__": name},
    )
