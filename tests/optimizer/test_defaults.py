"""Defaults and signatures: IKFAC without Riemannian momentum, keyword-only options.

`SINGD(model, kfac_like=True)` is the paper's IKFAC (`alpha1` resolves to 0), so it
follows the reference `singd==0.0.5` with default arguments, which forces
`alpha1 = 0` for `kfac_like=True`. Plain `SINGD(model)` resolves `alpha1` to 0.5.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from singd.optim.optimizer import SINGD as ReferenceSINGD
from torch import nn

from singd_curvlinops import KFAC, SINGD
from singd_curvlinops.rules.singd import resolved_alpha1

STEPS = 21  # three factor updates at the default T = 10


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def train(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        X = torch.randn(16, 6, generator=generator, dtype=torch.float64)
        y = torch.randint(0, 3, (16,), generator=generator)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(X), y).backward()
        optimizer.step()


def dense_K(optimizer: SINGD, layer: nn.Module) -> torch.Tensor:
    preconditioner = optimizer.preconditioner(layer)
    return preconditioner.K.to_dense()


def test_default_ikfac_follows_the_reference_with_default_arguments() -> None:
    ours_model, reference_model, hybrid_model = mlp(), mlp(), mlp()
    ours = SINGD(ours_model, kfac_like=True)
    hybrid = SINGD(hybrid_model, kfac_like=True, alpha1=0.5)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*kfac_like=True")
        reference = ReferenceSINGD(reference_model, kfac_like=True)
        train(reference_model, reference)
    train(ours_model, ours)
    train(hybrid_model, hybrid)
    assert ours.param_groups[0]["alpha1"] is None
    for p, p_ref in zip(
        ours_model.parameters(), reference_model.parameters(), strict=True
    ):
        torch.testing.assert_close(p, p_ref, rtol=1e-10, atol=1e-12)
    for name in ("0", "2"):
        K = dense_K(ours, ours_model.get_submodule(name))
        K_ref = reference.Ks[name].to_dense()
        torch.testing.assert_close(K, K_ref, rtol=1e-10, atol=1e-12)
        assert (K - torch.eye(len(K), dtype=K.dtype)).abs().max() > 1e-3
        # the hybrid with Riemannian momentum follows another trajectory
        K_hybrid = dense_K(hybrid, hybrid_model.get_submodule(name))
        assert (K_hybrid - K).abs().max() > 1e-6


@pytest.mark.parametrize(
    "options, expected",
    [
        ({"alpha1": None, "kfac_like": False}, 0.5),
        ({"alpha1": None, "kfac_like": True}, 0.0),
        ({"alpha1": 0.3, "kfac_like": True}, 0.3),
        ({"alpha1": 0.0, "kfac_like": False}, 0.0),
    ],
)
def test_alpha1_resolution(options: dict, expected: float) -> None:
    assert resolved_alpha1(options) == expected


def test_default_singd_uses_riemannian_momentum() -> None:
    """`alpha1=None` and `alpha1=0.5` give bit-identical SINGD trajectories."""
    default_model, explicit_model = mlp(), mlp()
    default, explicit = SINGD(default_model), SINGD(explicit_model, alpha1=0.5)
    train(default_model, default)
    train(explicit_model, explicit)
    for p, q in zip(
        default_model.parameters(), explicit_model.parameters(), strict=True
    ):
        assert torch.equal(p, q)


@pytest.mark.parametrize("optimizer_cls", [SINGD, KFAC])
def test_options_after_params_are_keyword_only(optimizer_cls: type) -> None:
    model = mlp()
    with pytest.raises(TypeError, match="positional argument"):
        optimizer_cls(model, None, 0.1)
    optimizer_cls(model, list(model.parameters()), lr=0.1)  # params stays positional
