import pytest
import torch
from torch import Tensor

from singd_curvlinops.structures import DenseMatrix
from tests.structures._suite import StructureSuite


class TestDense(StructureSuite):
    NAME = "dense"

    def project(self, sym: Tensor) -> Tensor:
        return sym.clone()


@pytest.mark.parametrize("columns", [1, 10, 31, 32, 40])
@pytest.mark.parametrize("side", ["matmat", "rmatmat"])
def test_products_with_a_transposed_operand_match_dense_algebra(
    columns: int, side: str
) -> None:
    """Few transposed columns take the operand's layout; the product is the same."""
    torch.manual_seed(columns)
    mat = torch.randn(37, 37, dtype=torch.float64)
    rows = torch.randn(columns, 37, dtype=torch.float64)
    V = rows.T  # a transposed view, as preconditioning passes Γᵀ
    expected = (mat if side == "matmat" else mat.T) @ rows.T.contiguous()
    K = DenseMatrix(mat)
    result = K @ V if side == "matmat" else K.rmatmat(V)
    torch.testing.assert_close(result, expected, rtol=1e-13, atol=1e-13)
