"""`bounds.peaks` and `bounds.finite` against direct computations.

These tests pin what the guard relies on: the peak is the exact largest absolute
entry in a dtype that holds it, NaN and infinities are carried, strided views and
empty tensors are handled, and the inputs are not changed. Every test runs both
reductions of `bounds.abs_peaks`: each tensor's extremes (the CPU's) and one
`torch._foreach_norm` of order infinity (CUDA's), forced here on the CPU, where
that norm computes the same numbers, only more slowly.
"""

from __future__ import annotations

import math

import pytest
import torch

from singd_curvlinops import bounds
from singd_curvlinops.bounds import finite, finite_each, peaks

CPU = torch.device("cpu")
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@pytest.fixture(autouse=True, params=["extremes", "foreach_norm"])
def reduction(request, monkeypatch) -> str:
    """Run each test with either reduction of `bounds.abs_peaks`."""
    fused = request.param == "foreach_norm"
    monkeypatch.setattr(bounds, "fused_peaks", lambda tensors: fused)
    return request.param


def _tensors(dtype: torch.dtype) -> list[torch.Tensor]:
    """A contiguous matrix, a transposed one, a column view and a vector."""
    generator = torch.Generator().manual_seed(0)
    matrix = torch.randn(12, 7, generator=generator).to(dtype)
    other = (3 * torch.randn(5, 9, generator=generator)).to(dtype)
    vector = torch.randn(4, generator=generator).to(dtype)
    return [matrix, other.T, matrix[:, 2], vector]


def _direct(tensors: list[torch.Tensor]) -> float:
    return max(t.abs().max().item() for t in tensors if t.numel())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_peaks_are_the_largest_absolute_entries_of_each_group(dtype) -> None:
    a, b, column, vector = _tensors(dtype)
    empty = torch.zeros(0, 3, dtype=dtype)
    groups = [[a, b], [column], [empty], [vector, empty], []]
    before = [t.clone() for t in (a, b, vector)]

    result = peaks(groups)

    expected = [_direct([a, b]), _direct([column]), 0.0, _direct([vector]), 0.0]
    assert [r.item() for r in result] == expected  # exact: a maximum rounds nothing
    wide = torch.promote_types(dtype, torch.float32)
    assert all(r.dtype == wide and r.shape == () for r in result)
    assert all(
        torch.equal(t, old) for t, old in zip((a, b, vector), before, strict=True)
    )


def test_peaks_of_mixed_dtypes_are_in_the_widest() -> None:
    small = torch.tensor([1.0, -70000.0], dtype=torch.float32)
    huge = torch.tensor([1e300, -2.0], dtype=torch.float64)
    half = torch.tensor([-3.0], dtype=torch.float16)

    result = peaks([[small], [huge], [half]])

    assert [r.item() for r in result] == [70000.0, 1e300, 3.0]
    assert all(r.dtype == torch.float64 for r in result)


def test_peaks_of_only_empty_tensors_are_zero() -> None:
    result = peaks([[torch.zeros(0)], []])
    assert [r.item() for r in result] == [0.0, 0.0]


@pytest.mark.parametrize("poison", [math.inf, -math.inf, math.nan], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_peaks_and_finite_carry_infinity_and_nan(poison, dtype) -> None:
    a, b, column, vector = _tensors(dtype)
    a[5, 2] = poison  # also inside `column`, a strided view of `a`

    peak_a, peak_b, peak_column = peaks([[a], [b], [column]])

    if math.isnan(poison):
        assert math.isnan(peak_a.item()) and math.isnan(peak_column.item())
    else:
        assert peak_a.item() == peak_column.item() == math.inf
    assert peak_b.item() == _direct([b])
    assert not finite([b, column], CPU)
    assert not finite([vector, a], CPU)
    assert finite([b, vector], CPU)


def test_finite_keeps_float64_numbers_beyond_float32() -> None:
    huge = torch.tensor([1e300], dtype=torch.float64)
    assert finite([huge, torch.ones(3)], CPU)
    assert finite([torch.tensor([65504.0], dtype=torch.float16)], CPU)


def test_finite_passes_empty_and_integer_tensors() -> None:
    counter = torch.tensor(3, dtype=torch.int64)  # e.g. a grafting step counter
    assert finite([], CPU)
    assert finite([torch.zeros(0), counter], CPU)
    assert not finite([counter, torch.tensor([math.nan])], CPU)
    result = finite([torch.ones(2)], CPU)
    assert result.dtype == torch.bool and result.shape == ()


def test_finite_each_gives_one_verdict_per_group() -> None:
    good, bad = torch.ones(4), torch.tensor([1.0, math.inf])
    counter = torch.tensor(2, dtype=torch.int64)
    verdicts = finite_each(
        [[good], [good, bad], [], [torch.zeros(0), counter], [bad[:1], good.double()]],
        CPU,
    )
    assert [bool(v) for v in verdicts] == [True, False, True, True, True]
    assert all(v.dtype == torch.bool and v.shape == () for v in verdicts)
