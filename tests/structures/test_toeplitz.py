import torch
from torch import Tensor

from tests.structures._suite import StructureSuite

DIMS = (1, 2, 3, 5, 8, 17, 64, 100)


def band_averages(sym: Tensor) -> Tensor:
    """c_0 = mean of the diagonal; c_m = mean over i of S[i+m, i] + S[i, i+m]."""
    dim = sym.shape[0]
    c = torch.zeros(dim, dtype=sym.dtype)
    for m in range(dim):
        values = [sym[i + m, i] + (sym[i, i + m] if m else 0) for i in range(dim - m)]
        c[m] = sum(values) / len(values)
    return c


def toeplitz(c: Tensor, lower: bool) -> Tensor:
    dim = c.shape[0]
    rows = [
        [c[abs(i - j)] if (i >= j) == lower or i == j else 0.0 for j in range(dim)]
        for i in range(dim)
    ]
    return torch.tensor(rows, dtype=c.dtype)


class TestTrilToeplitz(StructureSuite):
    NAME, DIMS = "triltoeplitz", DIMS

    def project(self, sym: Tensor) -> Tensor:
        return toeplitz(band_averages(sym), lower=True)


class TestTriuToeplitz(StructureSuite):
    NAME, DIMS = "triutoeplitz", DIMS

    def project(self, sym: Tensor) -> Tensor:
        return toeplitz(band_averages(sym), lower=False)
