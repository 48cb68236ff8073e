import pytest
import torch
from torch import Tensor

from singd_curvlinops.structures._fft import _fft_size, power_series_inverse
from tests.structures._suite import StructureSuite, assert_close

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


def lower_toeplitz(c: Tensor) -> Tensor:
    index = torch.arange(c.shape[0])
    offsets = index.unsqueeze(1) - index.unsqueeze(0)
    return torch.where(offsets >= 0, c[offsets.clamp(min=0)], 0.0)


@pytest.mark.parametrize("dim", [1, 2, 3, 5, 17, 64, 100, 600])
@pytest.mark.parametrize("leaf_dim", [1, 3, 256])
def test_power_series_inverse_is_first_column_of_inverse(dim, leaf_dim) -> None:
    """Small leaves exercise the blocked substitution at the suite's dimensions."""
    c = torch.randn(dim, dtype=torch.float64)
    c[0] = 1.0 + c.abs().sum()
    g = power_series_inverse(c, leaf_dim=leaf_dim)
    expected = torch.linalg.solve(lower_toeplitz(c), torch.eye(dim)[:, 0].double())
    assert_close(g, expected, rtol=1e-13)


@pytest.mark.parametrize("rho", [0.999, 1.0])
def test_power_series_inverse_of_a_double_root(rho) -> None:
    """1 / (1 - rho x)² = sum_k (k + 1) rho^k x^k: g grows to hundreds or d.

    Newton's iteration loses every digit here (its rounding error is multiplied by
    max |g_k| at each doubling); blocked forward substitution keeps ~1e-11.
    """
    dim = 20_000
    c = torch.zeros(dim, dtype=torch.float64)
    c[:3] = torch.tensor([1.0, -2 * rho, rho**2], dtype=torch.float64)
    k = torch.arange(dim, dtype=torch.float64)
    assert_close(power_series_inverse(c), (k + 1) * rho**k, rtol=1e-9)


def _is_even_5_smooth(n: int) -> bool:
    if n % 2:
        return False
    for prime in (2, 3, 5):
        while n % prime == 0:
            n //= prime
    return n == 1


def test_fft_size_is_the_smallest_even_5_smooth_length_without_wrap_around() -> None:
    for dim in range(1, 2500):
        smallest = 2 * dim - 1
        while not _is_even_5_smooth(smallest):
            smallest += 1
        assert _fft_size(dim) == smallest
    assert _fft_size(1025) == 2160  # instead of 4096
