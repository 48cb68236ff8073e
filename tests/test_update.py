"""`update.precondition`: C Cᵀ Γ K Kᵀ for every route, and who may be overwritten."""

from __future__ import annotations

import pytest
import torch

from singd_curvlinops.structures import get_structure
from singd_curvlinops.update import parameter_step, precondition

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


@pytest.mark.parametrize("momentum, weight_decay", [(0.0, 0.0), (0.9, 0.0), (0.5, 0.1)])
def test_parameter_step_is_sgd_on_the_directions(momentum, weight_decay) -> None:
    """`parameter_step` equals `torch.optim.SGD` fed the directions as gradients."""
    generator = torch.Generator().manual_seed(0)
    ours = [torch.randn(4, 3, generator=generator, dtype=torch.float64)]
    ours.append(torch.randn(4, generator=generator, dtype=torch.float64))
    theirs = [torch.nn.Parameter(p.clone()) for p in ours]
    sgd = torch.optim.SGD(theirs, lr=0.1, momentum=momentum, weight_decay=weight_decay)
    buffers = [torch.zeros_like(p) for p in ours]
    for _ in range(4):
        directions = [torch.randn_like(p) for p in ours]
        for p, d in zip(theirs, directions, strict=True):
            p.grad = d.clone()
        sgd.step()
        parameter_step(
            ours,
            directions,
            buffers,
            lr=0.1,
            momentum=momentum,
            weight_decay=weight_decay,
        )
    for p, q in zip(ours, theirs, strict=True):
        torch.testing.assert_close(p, q.detach(), rtol=1e-14, atol=1e-14)
