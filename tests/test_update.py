"""`update.precondition`: C Cᵀ Γ K Kᵀ for every route, and who may be overwritten."""

from __future__ import annotations

import pytest
import torch

from singd_curvlinops.structures import get_structure
from singd_curvlinops.update import precondition

STRUCTURES = ["dense", "diagonal", "block2diagonal", "hierarchical2_1", "triltoeplitz"]


def factor(name: str, dim: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    A = torch.randn(dim, dim, generator=generator, dtype=torch.float64)
    return get_structure(name).from_dense(
        torch.eye(dim, dtype=torch.float64) + A @ A.T / dim
    )


@pytest.mark.parametrize("cached", [False, True], ids=["applied", "cached-outer"])
@pytest.mark.parametrize("overwrite", [False, True], ids=["copy", "overwrite"])
@pytest.mark.parametrize("name", STRUCTURES)
def test_precondition_equals_the_dense_formula(name, overwrite, cached) -> None:
    K, C = factor(name, 7, seed=0), factor(name, 5, seed=1)
    grad = torch.randn(5, 7, dtype=torch.float64)
    original = grad.clone()
    KKt, CCt = (K.outer_self(), C.outer_self()) if cached else (None, None)
    K_dense, C_dense = K.to_dense(), C.to_dense()
    expected = C_dense @ C_dense.T @ original @ K_dense @ K_dense.T

    result = precondition(grad, K, C, KKt, CCt, overwrite=overwrite)

    torch.testing.assert_close(result, expected, rtol=1e-12, atol=1e-12)
    if not overwrite:
        assert torch.equal(grad, original)


def test_diagonal_factors_overwrite_the_gradient_instead_of_allocating() -> None:
    K, C = factor("diagonal", 7, seed=0), factor("diagonal", 5, seed=1)
    grad = torch.randn(5, 7, dtype=torch.float64)
    result = precondition(grad, K, C, K.outer_self(), C.outer_self(), overwrite=True)
    assert result.data_ptr() == grad.data_ptr()


def test_a_cast_to_the_factor_dtype_never_writes_into_the_gradient() -> None:
    K, C = factor("diagonal", 7, seed=0), factor("diagonal", 5, seed=1)
    grad = torch.randn(5, 7, dtype=torch.float32)
    original = grad.clone()
    result = precondition(grad, K, C, K.outer_self(), C.outer_self())
    assert result.dtype == torch.float32
    assert torch.equal(grad, original)
    expected = (C.to_dense() ** 2) @ original.double() @ (K.to_dense() ** 2)
    torch.testing.assert_close(result.double(), expected, rtol=1e-6, atol=1e-6)
