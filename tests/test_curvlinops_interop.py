"""Cross-validation with curvlinops through scipy operators, and `set_curvature`.

The central check of the project: IKFAC (dense factors, no momentum, lr = 0, T = 1)
iterated on a fixed batch reaches the fixed point `K Kᵀ = (U_K + λI)⁻¹`, so its
preconditioner equals curvlinops' damped KFAC inverse, compared as dense matrices
obtained from `.to_scipy()` operators.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from curvlinops import FisherType, KFACInverseLinearOperator, KFACLinearOperator
from torch import nn

from singd_curvlinops import SINGD, SINGDLinearOperator

DAMPING = 0.5


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(48, 3),
    ).double()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    X = torch.randn(8, 2, 8, 8, generator=generator, dtype=torch.float64)
    return X, torch.randint(0, 3, (8,), generator=generator)


def kfac_operator(model, fisher_type, **kwargs) -> KFACLinearOperator:
    return KFACLinearOperator(
        model,
        nn.CrossEntropyLoss(),
        list(model.parameters()),
        [batch()],
        fisher_type=fisher_type,
        separate_weight_and_bias=False,
        check_deterministic=False,
        **kwargs,
    )


def dense(operator) -> np.ndarray:
    return operator.to_scipy() @ np.eye(operator.shape[1])


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    error = np.abs(actual - expected).max() / np.abs(expected).max()
    print(f"relative error {error:.2e}")
    return error


def ikfac(model: nn.Module, **options) -> SINGD:
    return SINGD(
        model,
        kfac_like=True,
        alpha1=0.0,
        lr=0.0,
        momentum=0.0,
        T=1,
        lr_cov=0.4,
        damping=DAMPING,
        **options,
    )


def test_ikfac_fixed_point_is_curvlinops_damped_kfac_inverse() -> None:
    model = cnn()
    X, y = batch()
    optimizer = ikfac(model)
    for _ in range(200):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(X), y).backward()
        optimizer.step()
    kfac = kfac_operator(model, FisherType.EMPIRICAL)
    expected = dense(KFACInverseLinearOperator(kfac, damping=(DAMPING, DAMPING)))
    assert relative_error(dense(SINGDLinearOperator(optimizer)), expected) < 1e-8
    # the implied curvature P⁻¹, by structured solves, is the damped KFAC matrix
    implied = dense(SINGDLinearOperator(optimizer).inverse())
    assert relative_error(implied, np.linalg.inv(expected)) < 1e-8


@pytest.mark.parametrize(
    "fisher_type", [FisherType.MC, FisherType.TYPE2, FisherType.FORWARD_ONLY], ids=str
)
def test_set_curvature_drives_ikfac_to_that_fisher(fisher_type) -> None:
    """Statistics handed over from a `KFACLinearOperator` (here not the empirical
    Fisher of the training pass) define the fixed point."""
    model = cnn()
    X, y = batch()
    optimizer = ikfac(model)
    kfac = kfac_operator(
        model,
        fisher_type,
        **({"mc_samples": 3} if fisher_type == FisherType.MC else {}),
    )
    for _ in range(200):
        optimizer.set_curvature(kfac)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(X), y).backward()
        optimizer.step()
    expected = dense(KFACInverseLinearOperator(kfac, damping=(DAMPING, DAMPING)))
    assert relative_error(dense(SINGDLinearOperator(optimizer)), expected) < 1e-8
    empirical = dense(
        KFACInverseLinearOperator(
            kfac_operator(model, FisherType.EMPIRICAL), damping=(DAMPING, DAMPING)
        )
    )
    assert relative_error(dense(SINGDLinearOperator(optimizer)), empirical) > 1e-3


def test_set_curvature_is_used_once() -> None:
    """Only the next update uses the handed-over statistics; then the training
    pass's empirical Fisher takes over again."""
    model_a, model_b = cnn(), cnn()
    X, y = batch()
    opt_a, opt_b = ikfac(model_a), ikfac(model_b)
    opt_a.set_curvature(kfac_operator(model_a, FisherType.EMPIRICAL))
    for model, opt in ((model_a, opt_a), (model_b, opt_b)):
        for _ in range(3):
            opt.zero_grad()
            nn.functional.cross_entropy(model(X), y).backward()
            opt.step()
    # the empirical KFAC of the same batch equals the training-pass statistics
    assert (
        relative_error(
            dense(SINGDLinearOperator(opt_a)), dense(SINGDLinearOperator(opt_b))
        )
        < 1e-12
    )
    assert not opt_a.curvature_pending


def test_set_curvature_rejects_mismatched_operators() -> None:
    model = cnn()
    optimizer = ikfac(model)
    with pytest.raises(ValueError, match="separate_weight_and_bias=False"):
        optimizer.set_curvature(
            KFACLinearOperator(
                model,
                nn.CrossEntropyLoss(),
                list(model.parameters()),
                [batch()],
                fisher_type=FisherType.EMPIRICAL,
                check_deterministic=False,
            )
        )
    partial = KFACLinearOperator(
        model,
        nn.CrossEntropyLoss(),
        list(model[3].parameters()),
        [batch()],
        fisher_type=FisherType.EMPIRICAL,
        separate_weight_and_bias=False,
        check_deterministic=False,
    )
    with pytest.raises(ValueError, match=r"missing \['0'\]"):
        optimizer.set_curvature(partial)
    with pytest.raises(TypeError, match="KFACLinearOperator"):
        optimizer.set_curvature(dense)
    assert not optimizer.curvature_pending


@pytest.mark.parametrize(
    "structures",
    [
        ("diagonal", "diagonal"),
        ("block3diagonal", "triltoeplitz"),
        ("hierarchical2_3", "triutopleftdiag"),
        ("triubottomrightdiag", "dense"),
    ],
    ids=str,
)
def test_structured_ikfac_fixed_point(structures) -> None:
    """With structured factors the fixed point is Π(Kᵀ(U_K + λI)K) = I (and for C)."""
    model = cnn()
    X, y = batch()
    optimizer = ikfac(model, structures=structures)
    for _ in range(200):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(X), y).backward()
        optimizer.step()
    kfac = kfac_operator(model, FisherType.EMPIRICAL)
    kfac.compute_kronecker_factors()
    factors = kfac.state_dict()
    for name in ("0", "3"):
        layer = model.get_submodule(name)
        preconditioner = optimizer.preconditioner(layer)
        K, C = preconditioner.K, preconditioner.C
        for M, U in (
            (K, factors["input_covariances"][name]),
            (C, factors["gradient_covariances"][name]),
        ):
            damped = U + DAMPING * torch.eye(U.shape[0], dtype=U.dtype)
            dense_M = M.to_dense()
            projected = M.from_dense(dense_M.T @ damped @ dense_M).to_dense()
            identity = torch.eye(U.shape[0], dtype=U.dtype)
            error = (projected - identity).abs().max().item()
            print(name, type(M).__name__, f"max |Π(Kᵀ(U+λI)K) − I| = {error:.2e}")
            assert error < 1e-8


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def test_set_curvature_takes_a_bias_only_layer() -> None:
    """A frozen weight leaves a bias-only layer (before: a bare `KeyError`).

    With the empirical Fisher, the handed-over statistics are the optimizer's own:
    the step equals one with collected statistics.
    """
    X, y = torch.randn(8, 4, dtype=torch.float64), torch.randint(0, 3, (8,))
    results = []
    for hand_over in (False, True):
        model = _mlp()
        model[0].weight.requires_grad_(False)
        optimizer = SINGD(model, lr=0.1, T=1, lr_cov=0.5, kfac_like=True)
        assert [layer.dims for layer in optimizer.layers] == [(1, 5), (6, 3)]
        if hand_over:
            params = [p for p in model.parameters() if p.requires_grad]
            optimizer.set_curvature(
                KFACLinearOperator(
                    model,
                    nn.CrossEntropyLoss(),
                    params,
                    [(X, y)],
                    fisher_type=FisherType.EMPIRICAL,
                    separate_weight_and_bias=False,
                    check_deterministic=False,
                )
            )
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(X), y).backward()
        optimizer.step()
        results.append([p.detach().clone() for p in model.parameters()])
    for p, q in zip(*results, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


def test_set_curvature_refuses_tied_weights() -> None:
    """curvlinops factors each use; the optimizer's layer needs all uses' rows."""
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
    b.weight = a.weight
    model = nn.Sequential(a, nn.Tanh(), b).double()
    optimizer = SINGD(model, lr=0.1)
    X = torch.randn(8, 4, dtype=torch.float64)
    kfac = KFACLinearOperator(
        model,
        nn.MSELoss(reduction="sum"),
        [model[0].weight],
        [(X, torch.zeros(8, 4, dtype=torch.float64))],
        fisher_type=FisherType.EMPIRICAL,
        separate_weight_and_bias=False,
        check_deterministic=False,
    )
    with pytest.raises(ValueError, match=r"'0' and '2' share a parameter"):
        optimizer.set_curvature(kfac)
