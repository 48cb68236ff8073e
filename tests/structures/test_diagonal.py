import torch
from torch import Tensor

from tests.structures._suite import StructureSuite


class TestDiagonal(StructureSuite):
    NAME = "diagonal"
    IN_PLACE_MATMAT = True

    def project(self, sym: Tensor) -> Tensor:
        out = torch.zeros_like(sym)
        for i in range(sym.shape[0]):
            out[i, i] = sym[i, i]
        return out
