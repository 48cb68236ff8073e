import pytest
import torch
from torch import Tensor

from singd_curvlinops.structures import BlockDiagonalMatrix, block_diagonal
from tests.structures._suite import StructureSuite


class _BlockSuite(StructureSuite):
    BLOCK_DIM: int

    def project(self, sym: Tensor) -> Tensor:
        out = torch.zeros_like(sym)
        for i in range(sym.shape[0]):
            for j in range(sym.shape[0]):
                if i // self.BLOCK_DIM == j // self.BLOCK_DIM:
                    out[i, j] = sym[i, j]
        return out


class TestBlock1Diagonal(_BlockSuite):
    NAME, BLOCK_DIM, DIMS = "block1diagonal", 1, (1, 2, 5)


class TestBlock3Diagonal(_BlockSuite):
    NAME, BLOCK_DIM = "block3diagonal", 3


class TestBlock7Diagonal(_BlockSuite):
    NAME, BLOCK_DIM = "block7diagonal", 7


class TestBlock30Diagonal(_BlockSuite):
    NAME, BLOCK_DIM, DIMS = "block30diagonal", 30, (1, 29, 30, 31, 61, 64)


def test_classes_are_cached_per_block_size() -> None:
    assert block_diagonal(4) is block_diagonal(4)
    assert block_diagonal(4) is not block_diagonal(5)
    assert block_diagonal(4).__name__ == "Block4DiagonalMatrix"
    assert issubclass(block_diagonal(4), BlockDiagonalMatrix)


def test_template_and_bad_block_shapes_raise() -> None:
    with pytest.raises(TypeError, match="template"):
        BlockDiagonalMatrix(torch.zeros(1, 2, 2), torch.zeros(0, 0))
    with pytest.raises(ValueError, match="blocks must have shape"):
        block_diagonal(2)(torch.zeros(1, 3, 3), torch.zeros(0, 0))
    with pytest.raises(ValueError, match="last must have shape"):
        block_diagonal(2)(torch.zeros(1, 2, 2), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="block_dim"):
        block_diagonal(0)
