from torch import Tensor

from tests.structures._suite import StructureSuite


class TestDense(StructureSuite):
    NAME = "dense"

    def project(self, sym: Tensor) -> Tensor:
        return sym.clone()
