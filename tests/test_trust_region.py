"""`bounds.trust_region`: SINGD's factor step keeps `β₁ ‖m_K‖₂ ≤ 3/2`.

- Inside the region the step is the paper's, bit for bit.
- Outside it the step keeps its direction and is scaled into the range where
  the truncated step contracts: with K = I and a momentum with one large
  eigenvalue (the blow-up of a large `lr_cov`), the paper's step enlarges K
  ninefold along it, the bounded one halves it and leaves the rest.
- The power-iteration estimate of ‖m_K‖₂ lies below the norm, is exact for rank
  one and free of the dimension for `-I/2` (SINGD's momentum far from the fixed
  point); a zero momentum is inside, a NaN momentum or learning rate gives NaN
  (for the guard to catch).
"""

from __future__ import annotations

import math

import pytest
import torch

from singd_curvlinops.bounds import MAX_FACTOR_STEP, peaks, spectral_norm
from singd_curvlinops.bounds import trust_region as _trust_region
from singd_curvlinops.structures import get_structure
from singd_curvlinops.update import FactorHyperparameters, factor_step

STRUCTURES = ["dense", "diagonal", "block2diagonal", "triltoeplitz", "hierarchical2_1"]
DIM = 7


def trust_region(lr: float, m):
    """The scale `factor_step` gives the step of momentum `m`."""
    return _trust_region(lr, spectral_norm(m, peaks([m.tensors()])[0]))


def _matrix(name: str, seed: int, scale: float):
    generator = torch.Generator().manual_seed(seed)
    A = torch.randn(DIM, DIM, generator=generator, dtype=torch.float64)
    return get_structure(name).from_dense(scale * (A + A.T) / 2)


def _eye(name: str):
    return get_structure(name).eye(DIM, dtype=torch.float64)


def _hyper(lr_cov: float) -> FactorHyperparameters:
    return FactorHyperparameters(
        damping=1e-3, alpha1=0.0, lr_cov=lr_cov, kfac_like=True, normalize_lr_cov=False
    )


@pytest.mark.parametrize("name", STRUCTURES)
def test_a_step_inside_the_region_is_the_papers_bit_for_bit(name: str) -> None:
    K = _eye(name).add_(_matrix(name, seed=0, scale=0.1))
    m = _matrix(name, seed=1, scale=0.1)
    lr = 0.05
    assert lr * torch.linalg.matrix_norm(m.to_dense(), ord=2) < MAX_FACTOR_STEP
    paper = type(K).from_tensors({k: t.clone() for k, t in K.named_tensors()})
    paper.add_(paper @ m, alpha=-lr)  # K ← K - β₁ K m_K, as before the bound

    factor_step(K, get_structure(name).zeros(DIM, dtype=torch.float64), m, _hyper(lr))

    assert torch.equal(K.to_dense(), paper.to_dense())


@pytest.mark.parametrize("name", STRUCTURES)
@pytest.mark.parametrize("lr_cov", [3.0, 1e30])
def test_a_long_step_keeps_its_direction_and_contracts(
    name: str, lr_cov: float
) -> None:
    K = _eye(name).add_(_matrix(name, seed=0, scale=0.1))
    m = _matrix(name, seed=2, scale=5.0)
    before, direction = K.to_dense(), (K @ m).to_dense()
    scale = trust_region(lr_cov, m)

    factor_step(
        K, get_structure(name).zeros(DIM, dtype=torch.float64), m, _hyper(lr_cov)
    )

    change = K.to_dense() - before
    cosine = -(change * direction).sum() / (change.norm() * direction.norm())
    assert cosine.item() == pytest.approx(1.0, abs=1e-12)
    step = lr_cov * scale.item() * torch.linalg.matrix_norm(m.to_dense(), ord=2)
    assert MAX_FACTOR_STEP - 1e-9 <= step.item() < 2.0


@pytest.mark.parametrize("dim", [4, 64])
def test_a_dominant_direction_shrinks_instead_of_blowing_up(dim: int) -> None:
    """m_K = μ v vᵀ - I/2 with μ = 1000 (K far too large along v): the paper's
    step at lr_cov = 0.01 multiplies K along v by 1 - 9.995, the bounded one by
    1 - 3/2; no direction collapses or grows by more than 1 + 3/4000."""
    generator = torch.Generator().manual_seed(0)
    v = torch.randn(dim, 1, generator=generator, dtype=torch.float64)
    v /= v.norm()
    M = 1000.0 * v @ v.T - 0.5 * torch.eye(dim, dtype=torch.float64)
    dense = get_structure("dense")
    K = dense.eye(dim, dtype=torch.float64)
    paper = torch.eye(dim, dtype=torch.float64) - 0.01 * M

    factor_step(
        K, dense.zeros(dim, dtype=torch.float64), dense.from_dense(M), _hyper(0.01)
    )

    assert torch.linalg.matrix_norm(paper, ord=2) > 8.9  # the blow-up
    along = (v.T @ K.to_dense() @ v).item()
    assert along == pytest.approx(1 - MAX_FACTOR_STEP, rel=1e-9)
    singular = torch.linalg.svdvals(K.to_dense())
    assert singular.min() >= 0.5 - 1e-9 and singular.max() <= 1 + 1e-3


def _estimate(m) -> float:
    """‖m‖₂ as `trust_region` estimates it."""
    return MAX_FACTOR_STEP / trust_region(1e30, m).item() / 1e30


@pytest.mark.parametrize("name", STRUCTURES)
def test_the_estimate_is_below_the_norm_and_exact_where_it_matters(name: str) -> None:
    m = _matrix(name, seed=3, scale=1.0)
    norm = torch.linalg.matrix_norm(m.to_dense(), ord=2).item()
    assert 0.5 * norm <= _estimate(m) <= norm * (1 + 1e-12)
    for dim in (3, 300):  # m_K = -I/2: 1/2 (its Frobenius norm is √dim / 2)
        half = get_structure(name).eye(dim, dtype=torch.float64).mul_(-0.5)
        assert _estimate(half) == pytest.approx(0.5, rel=1e-9)
        assert trust_region(1.0, half).item() == 1.0
    v = torch.randn(DIM, 1, dtype=torch.float64)
    rank_one = get_structure("dense").from_dense(7.0 * v @ v.T / v.square().sum())
    assert _estimate(rank_one) == pytest.approx(7.0, rel=1e-9)


def test_zero_is_inside_and_nan_stays_nan() -> None:
    zero = get_structure("dense").zeros(DIM, dtype=torch.float64)
    assert trust_region(1.0, zero).item() == 1.0
    m = _matrix("dense", seed=0, scale=1.0)
    assert math.isnan(trust_region(math.nan, m).item())
    m.mat[0, 0] = math.nan
    assert math.isnan(trust_region(0.1, m).item())
