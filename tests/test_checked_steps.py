"""Checked steps: kept, they are the unchecked arithmetic bit for bit; discarded,
they change nothing, also when their values are infinite or NaN.

`update.checked_parameter_steps` (the parameter step of a layer) and
`update.factor_step` (SINGD's factor step) decide on the device; `bounds.lands`
is their test that a step stays finite.
"""

from __future__ import annotations

import math

import pytest
import torch

from singd_curvlinops.bounds import lands, peaks
from singd_curvlinops.structures import get_structure
from singd_curvlinops.update import (
    FactorHyperparameters,
    checked_parameter_steps,
    factor_step,
    parameter_step,
)


def _layer(seed: int = 0) -> tuple[list, list, list, torch.Tensor]:
    """A weight [5, 4] and a bias [5] with directions that are views of one matrix."""
    generator = torch.Generator().manual_seed(seed)
    params = [
        torch.randn(5, 4, generator=generator),
        torch.randn(5, generator=generator),
    ]
    matrix = torch.randn(5, 5, generator=generator)
    directions = [matrix[:, :4], matrix[:, 4]]  # strided views, as `from_matrix`
    buffers = [torch.randn_like(p) for p in params]
    return params, directions, buffers, matrix


@pytest.mark.parametrize("momentum, weight_decay", [(0.0, 0.0), (0.9, 0.0), (0.5, 0.1)])
def test_a_kept_step_is_parameter_step_bit_for_bit(momentum, weight_decay) -> None:
    params, directions, buffers, matrix = _layer()
    expected = [p.clone() for p in params], [b.clone() for b in buffers]
    parameter_step(
        expected[0],
        [d.clone() for d in directions],
        expected[1],
        lr=0.1,
        momentum=momentum,
        weight_decay=weight_decay,
    )
    sound, apply = checked_parameter_steps(
        params,
        directions,
        buffers,
        lrs=[0.1, 0.1],
        momenta=[momentum] * 2,
        weight_decays=[weight_decay] * 2,
        whole=matrix,
    )
    assert bool(sound)
    apply(sound)
    for new, old in zip([*params, *buffers], [*expected[0], *expected[1]], strict=True):
        assert torch.equal(new, old)


@pytest.mark.parametrize("poison", [math.inf, math.nan])
def test_a_discarded_step_changes_nothing(poison: float) -> None:
    params, directions, buffers, matrix = _layer()
    before = [t.clone() for t in [*params, *buffers]]
    matrix[0, 0] = poison
    sound, apply = checked_parameter_steps(
        params,
        directions,
        buffers,
        lrs=[0.1, 0.1],
        momenta=[0.9, 0.9],
        weight_decays=[0.1, 0.1],
    )
    assert not bool(sound)
    apply(sound)
    for new, old in zip([*params, *buffers], before, strict=True):
        assert torch.equal(new, old)


@pytest.mark.parametrize(
    "lr, expected", [(0.1, True), (1e38, False), (math.inf, False), (math.nan, False)]
)
def test_a_step_is_sound_unless_it_overflows(lr: float, expected: bool) -> None:
    params, directions, buffers, _ = _layer()
    sound, _ = checked_parameter_steps(
        params,
        directions,
        buffers,
        lrs=[lr, 0.1],
        momenta=[0.0, 0.0],
        weight_decays=[0.0, 0.0],
    )
    assert bool(sound) is expected


def test_lands_is_false_for_overflow_infinity_and_nan() -> None:
    big = torch.tensor(3e38)
    values = [torch.tensor([1.0, -2.0]), torch.tensor([3.0])]
    peak_base, peak_change = peaks([values[:1], values[1:]])
    assert peak_base.item() == 2.0 and peak_change.item() == 3.0
    assert bool(lands(peak_base, peak_change, 0.5, torch.float32))
    assert not bool(lands(big, peak_change, 1.0, torch.float32))
    assert not bool(lands(peak_base, peak_change, math.inf, torch.float32))
    assert not bool(lands(torch.tensor(math.nan), peak_change, 1.0, torch.float32))
    assert bool(lands(big, peak_change, 1.0, torch.float64))  # float64 holds it


def _hyper(lr_cov: float, normalize: bool = False) -> FactorHyperparameters:
    return FactorHyperparameters(
        damping=1e-3,
        alpha1=0.5,
        lr_cov=lr_cov,
        kfac_like=False,
        normalize_lr_cov=normalize,
    )


@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
@pytest.mark.parametrize("case", ["rejected", "nan", "nan-lr"])
def test_a_discarded_factor_step_keeps_factor_and_momentum(case, normalize) -> None:
    dense = get_structure("dense")
    generator = torch.Generator().manual_seed(0)
    K = dense.from_dense(torch.eye(4) + 0.1 * torch.randn(4, 4, generator=generator))
    m_K = dense.from_dense(0.1 * torch.randn(4, 4, generator=generator))
    increment = dense.from_dense(0.1 * torch.randn(4, 4, generator=generator))
    before = K.to_dense().clone(), m_K.to_dense().clone()
    accept = torch.tensor(case != "rejected")
    if case == "nan":
        increment.mat[1, 2] = math.nan
    lr = math.nan if case == "nan-lr" else 0.1

    kept_momentum, ok = factor_step(K, m_K, increment, _hyper(lr, normalize), accept)

    assert not bool(ok)
    assert torch.equal(K.to_dense(), before[0])
    assert torch.equal(kept_momentum.to_dense(), before[1])
    assert torch.equal(m_K.to_dense(), before[1])
