r"""Block-diagonal factors with dense blocks of a fixed size \(B\)."""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from typing_extensions import override

from singd_curvlinops.structures._checks import check_size
from singd_curvlinops.structures._linalg import solve_dense
from singd_curvlinops.structures.base import Scalar, StructuredMatrix


class BlockDiagonalMatrix(StructuredMatrix):
    r"""Block-diagonal matrix \(\mathrm{blockdiag}(A_1, \dots, A_N, L)\).

    The \(N = \lfloor d / B \rfloor\) blocks \(A_i\) are dense \(B \times B\); the
    last block \(L\) holds the remaining \(d - NB < B\) rows (it may be empty).
    \(\Pi(S)\) keeps the diagonal blocks of \(S\). Every operation is a batched
    matrix operation on the blocks, so its cost is \(O(dB)\) per column of a dense
    operand instead of \(O(d^2)\).

    The block size is a class attribute so that class methods such as `eye` know
    it: use `block_diagonal(B)` (or `get_structure("block30diagonal")`) to obtain the
    class for block size `B`; each size is created once and cached.

    Args:
        blocks: The full blocks, shape `[N, B, B]` (`N` may be 0).
        last: The last block, shape `[r, r]` with `0 <= r < B`.

    Examples:
        >>> Block2 = block_diagonal(2)
        >>> Block2.eye(3).to_dense()
        tensor([[1., 0., 0.],
                [0., 1., 0.],
                [0., 0., 1.]])
    """

    BLOCK_DIM: int

    def __init__(self, blocks: Tensor, last: Tensor) -> None:
        super().__init__()
        B = getattr(type(self), "BLOCK_DIM", None)
        if B is None:
            raise TypeError(
                "BlockDiagonalMatrix is a template: use block_diagonal(block_dim)."
            )
        self.blocks: Tensor
        self.register_tensor(blocks, "blocks")
        self.last: Tensor
        self.register_tensor(last, "last")
        if blocks.ndim != 3 or blocks.shape[1:] != (B, B):
            raise ValueError(
                f"blocks must have shape [N, {B}, {B}], got {tuple(blocks.shape)}."
            )
        if last.ndim != 2 or last.shape[0] != last.shape[1] or last.shape[0] >= B:
            raise ValueError(
                f"last must have shape [r, r] with r < {B}, got {tuple(last.shape)}."
            )
        if blocks.shape[0] + last.shape[0] == 0:
            raise ValueError("A block-diagonal matrix needs dimension >= 1.")

    @property
    @override
    def dim(self) -> int:
        return self.blocks.shape[0] * self.BLOCK_DIM + self.last.shape[0]

    @classmethod
    def _split_dim(cls, dim: int) -> tuple[int, int]:
        """Return the number of full blocks and the size of the last block.

        Args:
            dim: Matrix dimension.

        Returns:
            `(N, r)` with `dim = N * B + r`.
        """
        return divmod(dim, cls.BLOCK_DIM)

    @classmethod
    def _split_rows(cls, X: Tensor) -> tuple[Tensor, Tensor]:
        """Split the rows of `X` into `[N, B, n]` (full blocks) and `[r, n]`.

        Args:
            X: Matrix of shape `[d, n]`.

        Returns:
            The block rows and the rows of the last block.
        """
        N, _ = cls._split_dim(X.shape[0])
        top, bottom = X.split([N * cls.BLOCK_DIM, X.shape[0] - N * cls.BLOCK_DIM])
        return top.unflatten(0, (N, cls.BLOCK_DIM)), bottom

    @classmethod
    @override
    def from_dense(cls, sym_mat: Tensor) -> BlockDiagonalMatrix:
        dim = cls._check_square(sym_mat).shape[0]
        N, _ = cls._split_dim(dim)
        NB = N * cls.BLOCK_DIM
        grid = sym_mat[:NB, :NB].unflatten(0, (N, cls.BLOCK_DIM))
        grid = grid.unflatten(2, (N, cls.BLOCK_DIM))  # [N, B, N, B]
        blocks = grid.diagonal(dim1=0, dim2=2).permute(2, 0, 1).clone()
        return cls(blocks, sym_mat[NB:, NB:].clone())

    @override
    def to_dense(self) -> Tensor:
        N, NB = self.blocks.shape[0], self.blocks.shape[0] * self.BLOCK_DIM
        mat = self.blocks.new_zeros(self.dim, self.dim)
        grid = mat[:NB, :NB].unflatten(0, (N, self.BLOCK_DIM))
        grid = grid.unflatten(2, (N, self.BLOCK_DIM))
        grid.diagonal(dim1=0, dim2=2).copy_(self.blocks.permute(1, 2, 0))
        mat[NB:, NB:] = self.last
        return mat

    @classmethod
    @override
    def _zeros(cls, dim, dtype, device) -> BlockDiagonalMatrix:
        N, r = cls._split_dim(dim)
        B = cls.BLOCK_DIM
        return cls(
            torch.zeros(N, B, B, dtype=dtype, device=device),
            torch.zeros(r, r, dtype=dtype, device=device),
        )

    @classmethod
    @override
    def _eye(cls, dim, dtype, device) -> BlockDiagonalMatrix:
        return cls._zeros(dim, dtype, device)._diag_add_inplace(1.0)

    @classmethod
    @override
    def _from_mat_inner(cls, X: Tensor) -> BlockDiagonalMatrix:
        r"""Block \(i\) of \(X X^\top\) is \(X_i X_i^\top\) for the rows \(X_i\) of block \(i\)."""  # noqa: E501
        X_blocks, X_last = cls._split_rows(X)
        return cls(X_blocks @ X_blocks.mT, X_last @ X_last.T)

    @override
    def _matmat(self, V: Tensor) -> Tensor:
        V_blocks, V_last = self._split_rows(V)
        return torch.cat([(self.blocks @ V_blocks).flatten(0, 1), self.last @ V_last])

    @override
    def _rmatmat(self, V: Tensor) -> Tensor:
        V_blocks, V_last = self._split_rows(V)
        return torch.cat(
            [(self.blocks.mT @ V_blocks).flatten(0, 1), self.last.T @ V_last]
        )

    @override
    def _solve(self, V: Tensor) -> Tensor:
        r"""Block \(i\) of \(K^{-1} V\) is \(A_i^{-1} V_i\): one batched LU solve, \(O(dB^2 + dBn)\)."""  # noqa: E501
        V_blocks, V_last = self._split_rows(V)
        return torch.cat(
            [
                solve_dense(self.blocks, V_blocks).flatten(0, 1),
                solve_dense(self.last, V_last),
            ]
        )

    @override
    def _rsolve(self, V: Tensor) -> Tensor:
        r"""Block \(i\) of \(K^{-\top} V\) is \(A_i^{-\top} V_i\): batched LU solve."""
        V_blocks, V_last = self._split_rows(V)
        blocks = solve_dense(self.blocks, V_blocks, transpose=True)
        return torch.cat(
            [blocks.flatten(0, 1), solve_dense(self.last, V_last, transpose=True)]
        )

    @override
    def _matmul_structure(self, other: BlockDiagonalMatrix) -> BlockDiagonalMatrix:
        return type(self)(self.blocks @ other.blocks, self.last @ other.last)

    @override
    def _from_inner_identity(self) -> BlockDiagonalMatrix:
        return type(self)(self.blocks.mT @ self.blocks, self.last.T @ self.last)

    @override
    def outer_self(self) -> BlockDiagonalMatrix:
        return type(self)(self.blocks @ self.blocks.mT, self.last @ self.last.T)

    @override
    def _diag_add_inplace(self, value: Scalar) -> BlockDiagonalMatrix:
        self.blocks.diagonal(dim1=1, dim2=2).add_(value)
        self.last.diagonal().add_(value)
        return self

    @override
    def average_trace(self) -> Tensor:
        diagonal = self.blocks.diagonal(dim1=1, dim2=2)
        return (diagonal / self.dim).sum() + (self.last.diagonal() / self.dim).sum()

    @override
    def frobenius_norm(self) -> Tensor:
        return torch.linalg.vector_norm(
            torch.stack(
                [
                    torch.linalg.vector_norm(self.blocks),
                    torch.linalg.vector_norm(self.last),
                ]
            )
        )


def block_diagonal(block_dim: int) -> type[BlockDiagonalMatrix]:
    r"""Return the block-diagonal structure class with block size `block_dim`.

    Args:
        block_dim: Block size \(B\), an int in `[1, MAX_SIZE]` (\(2^{31} - 1\)).

    Returns:
        A subclass of `BlockDiagonalMatrix` named `Block{B}DiagonalMatrix`; the same
        class object for every call with the same size.
    """
    # checked before the cache: 1.0 and True hash like 1 and would hit its entry
    return _block_diagonal(check_size(block_dim, "block_dim", 1))


@functools.cache
def _block_diagonal(block_dim: int) -> type[BlockDiagonalMatrix]:
    """Create the class for a valid block size, once per size (see `block_diagonal`).

    Args:
        block_dim: Block size.

    Returns:
        The class.
    """
    name = f"Block{block_dim}DiagonalMatrix"
    return type(
        name,
        (BlockDiagonalMatrix,),
        {"BLOCK_DIM": block_dim, "__module__": __name__, "__qualname__": name},
    )
