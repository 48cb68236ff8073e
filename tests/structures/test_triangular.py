import pytest
import torch
from torch import Tensor

from singd_curvlinops.structures import TrilBottomRightDiagonalMatrix
from tests.structures._suite import StructureSuite


def keep(sym: Tensor, in_line) -> Tensor:
    """Diagonal, plus entries (i, j) with in_line(i, j, d) folded with their mirror."""
    dim = sym.shape[0]
    out = torch.zeros_like(sym)
    for i in range(dim):
        out[i, i] = sym[i, i]
        for j in range(dim):
            if i != j and in_line(i, j, dim):
                out[i, j] = sym[i, j] + sym[j, i]
    return out


class TestTrilBottomRightDiag(StructureSuite):
    NAME = "trilbottomrightdiag"

    def project(self, sym: Tensor) -> Tensor:
        return keep(sym, lambda i, j, d: j == 0)


class TestTrilTopLeftDiag(StructureSuite):
    NAME = "triltopleftdiag"

    def project(self, sym: Tensor) -> Tensor:
        return keep(sym, lambda i, j, d: i == d - 1)


class TestTriuBottomRightDiag(StructureSuite):
    NAME = "triubottomrightdiag"

    def project(self, sym: Tensor) -> Tensor:
        return keep(sym, lambda i, j, d: i == 0)


class TestTriuTopLeftDiag(StructureSuite):
    NAME = "triutopleftdiag"

    def project(self, sym: Tensor) -> Tensor:
        return keep(sym, lambda i, j, d: j == d - 1)


def test_bad_shapes_raise() -> None:
    with pytest.raises(ValueError, match=r"shapes \[d\] and \[d - 1\]"):
        TrilBottomRightDiagonalMatrix(torch.ones(3), torch.ones(3))
