"""The KFAC baseline: first step = −lr · curvlinops' damped KFAC inverse @ gradient."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
from curvlinops import FisherType, KFACInverseLinearOperator, KFACLinearOperator
from torch import nn

from singd_curvlinops import EKFAC, KFAC, SINGD, SINGDLinearOperator

DAMPING, LR = 0.1, 0.5


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(48, 3),
    ).double()


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    X = torch.randn(8, 2, 8, 8, generator=generator, dtype=torch.float64)
    return X, torch.randint(0, 3, (8,), generator=generator)


def curvlinops_inverse(model: nn.Module, data) -> KFACInverseLinearOperator:
    kfac = KFACLinearOperator(
        model,
        nn.CrossEntropyLoss(),
        list(model.parameters()),
        data,
        fisher_type=FisherType.EMPIRICAL,
        separate_weight_and_bias=False,
        check_deterministic=False,
    )
    return KFACInverseLinearOperator(kfac, damping=(DAMPING, DAMPING))


def gradient(model: nn.Module, X, y) -> list[torch.Tensor]:
    model.zero_grad()
    nn.functional.cross_entropy(model(X), y).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_first_step_is_damped_kfac_inverse_times_gradient(approx: str) -> None:
    model = cnn()
    X, y = batch()
    kfac = KFACLinearOperator(
        model,
        nn.CrossEntropyLoss(),
        list(model.parameters()),
        [(X, y)],
        fisher_type=FisherType.EMPIRICAL,
        kfac_approx=approx,
        separate_weight_and_bias=False,
        check_deterministic=False,
    )
    inverse = KFACInverseLinearOperator(kfac, damping=(DAMPING, DAMPING))
    expected = inverse @ gradient(model, X, y)  # factors computed before the hooks
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = KFAC(
        model, lr=LR, momentum=0.0, damping=DAMPING, T=1, kfac_approx=approx
    )
    gradient(model, X, y)
    optimizer.step()
    for p, p0, e in zip(model.parameters(), before, expected, strict=True):
        step = (p0 - p.detach()) / LR
        assert torch.allclose(step, e, rtol=1e-10, atol=1e-12)
    P = SINGDLinearOperator(optimizer)
    n = P.shape[0]
    assert np.allclose(
        P.to_scipy() @ np.eye(n), inverse.to_scipy() @ np.eye(n), rtol=1e-10, atol=1e-12
    )


def test_exponential_averaging_and_update_interval() -> None:
    """Factors average the statistics of the update steps (every T-th step)."""
    model = cnn()
    optimizer = KFAC(model, lr=0.0, momentum=0.0, damping=DAMPING, T=2, ema_decay=0.6)
    batches = [batch(seed) for seed in range(4)]
    for X, y in batches:
        gradient(model, X, y)
        optimizer.step()
    # steps 0 and 2 update: A = 0.6 U_0 + 0.4 U_2 (the first takes U_0 as it is)
    U = [
        KFACLinearOperator(
            model,
            nn.CrossEntropyLoss(),
            list(model.parameters()),
            [batches[i]],
            fisher_type=FisherType.EMPIRICAL,
            separate_weight_and_bias=False,
            check_deterministic=False,
        )
        for i in (0, 2)
    ]
    for u in U:
        u.compute_kronecker_factors()
    state = optimizer.state[model[3].weight]
    assert state["updates"] == 2
    for key, factors in (
        ("A.mat", "input_covariances"),
        ("G.mat", "gradient_covariances"),
    ):
        expected = (
            0.6 * U[0].state_dict()[factors]["3"]
            + 0.4 * U[1].state_dict()[factors]["3"]
        )
        assert torch.allclose(state[key], expected, rtol=1e-12, atol=1e-14)


def test_momentum_weight_decay_groups_and_checkpoint(tmp_path) -> None:
    model, twin = cnn(), cnn()
    options = {"lr": 0.1, "momentum": 0.5, "weight_decay": 1e-2, "T": 2}
    groups = lambda m: [  # noqa: E731
        {"params": m[0].parameters(), "ema_decay": 0.9},
        {"params": m[3].parameters(), "damping": 0.5},
    ]
    optimizer = KFAC(model, groups(model), **options)
    assert optimizer.param_groups[0]["ema_decay"] == 0.9
    assert optimizer.param_groups[1]["damping"] == 0.5
    assert "alpha1" not in optimizer.param_groups[0]
    for seed in range(3):
        gradient(model, *batch(seed))
        optimizer.step()
    torch.save(optimizer.state_dict(), tmp_path / "kfac.pt")
    twin.load_state_dict(model.state_dict())
    twin_optimizer = KFAC(twin, groups(twin), **options)
    twin_optimizer.load_state_dict(torch.load(tmp_path / "kfac.pt", weights_only=True))
    for seed in range(3, 6):
        for m, opt in ((model, optimizer), (twin, twin_optimizer)):
            gradient(m, *batch(seed))
            opt.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("ema_decay", [1.0, -0.1])
def test_invalid_ema_decay(ema_decay: float) -> None:
    with pytest.raises(ValueError, match=r"ema_decay must be in \[0.0, 1.0\)"):
        KFAC(cnn(), ema_decay=ema_decay)


@pytest.mark.parametrize(
    ("cls", "options", "edit"),
    [
        (KFAC, {"T": 10}, {"damping": 10.0}),
        (EKFAC, {"T": 10}, {"damping": 10.0}),
        (SINGD, {"T": 1, "structures": ("dense", "dense")}, {"T": 4}),
    ],
    ids=["KFAC-damping", "EKFAC-damping", "SINGD-T"],
)
def test_an_edited_option_reaches_the_cached_preconditioner(cls, options, edit) -> None:
    """The edit takes effect at the next step, as after loading a checkpoint.

    Before, KFAC kept its damped inverses of the old `damping` until its next
    factor update, while a resumed optimizer built them with the new one.
    """
    X, y = batch()
    torch.manual_seed(0)
    live_model = cnn().double()
    live = cls(live_model, lr=0.1, **options)
    nn.functional.cross_entropy(live_model(X), y).backward()
    live.step()
    resumed_model = copy.deepcopy(live_model)
    resumed = cls(resumed_model, lr=0.1, **options)
    resumed.load_state_dict(copy.deepcopy(live.state_dict()))
    for optimizer in (live, resumed):
        optimizer.param_groups[0].update(edit)
    for model, optimizer in ((live_model, live), (resumed_model, resumed)):
        for _ in range(2):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(X), y).backward()
            optimizer.step()
    for p, q in zip(live_model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("cls", [KFAC, EKFAC])
@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        ({"lr_cov": 0.5, "alpha1": 0.3}, r"alpha1, lr_cov: options of SINGD's"),
        ({"kfac_like": True}, r"kfac_like: options of SINGD's that KFAC does not"),
        ({"structures": ("diagonal", "diagonal")}, r"structures must be 'auto'"),
    ],
)
def test_singd_options_in_a_group_raise(cls, options, pattern) -> None:
    """As their keywords do; before, a group's were dropped without a word."""
    model = cnn()
    with pytest.raises(ValueError, match=pattern):
        cls(model, [{"params": list(model.parameters()), **options}])
    optimizer = cls(model, lr=0.1)
    with pytest.raises(ValueError, match=pattern):
        optimizer.param_groups[0].update(options)
        nn.functional.cross_entropy(model(batch()[0]), batch()[1]).backward()


def _singular_first_layer(side: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A model whose first layer's damped factor is singular with `damping=0`.

    Rank-one inputs of a linear layer (its dense input side), or an embedding
    whose vocabulary the batch does not cover (its one-hot side, diagonal); then
    a linear layer with its own damping.
    """
    torch.manual_seed(0)
    if side == "dense":
        first = nn.Linear(6, 4)
        X = torch.zeros(4, 6, dtype=torch.float64)
        X[:, 0] = 1.0
        model = nn.Sequential(first, nn.Tanh(), nn.Linear(4, 3)).double()
    else:
        first = nn.Embedding(8, 4)
        X = torch.tensor([[0], [1], [2], [1]])
        model = nn.Sequential(first, nn.Flatten(), nn.Linear(4, 3)).double()
    return model, X, torch.tensor([0, 1, 2, 0])


def _kfac_by_layer(model: nn.Module, first_damping: float) -> KFAC:
    head = list(model[2].parameters())
    groups = [
        {"params": list(model[0].parameters()), "damping": first_damping},
        {"params": head, "damping": 1.0},
    ]
    return KFAC(model, groups, lr=0.1, momentum=0.5, T=1)


@pytest.mark.parametrize("side", ["dense", "diagonal"])
def test_a_singular_damped_factor_skips_its_layer_and_names_damping(side: str) -> None:
    """With `damping=0` the damped factor is singular, and its inverse NaN.

    The step skips that layer's update with a warning naming damping (the
    guard's third stage), and every other layer takes the step it takes
    without that layer; nothing raises in the middle of the step.
    `preconditioner` refuses the NaN record. Once later statistics make the
    averaged factor regular, the layer steps again.
    """
    model, X, y = _singular_first_layer(side)
    reference = copy.deepcopy(model)
    optimizer = _kfac_by_layer(model, 0.0)
    before = [p.detach().clone() for p in model[0].parameters()]
    nn.functional.cross_entropy(model(X), y).backward()
    with pytest.warns(UserWarning, match=r"layer '0' at step 1.*raise damping"):
        optimizer.step()
    for param, old in zip(model[0].parameters(), before, strict=True):
        assert torch.equal(param.detach(), old)
        assert optimizer.state[param]["skipped_steps"] == 1
        buffer = optimizer.state[param].get("momentum_buffer")
        assert buffer is None or not buffer.any()  # as before the step
    assert optimizer.state[model[2].weight]["skipped_steps"] == 0
    # the head's step is the one it takes in an optimizer without the first layer
    alone = KFAC(reference[2], lr=0.1, momentum=0.5, T=1, damping=1.0)
    nn.functional.cross_entropy(reference(X), y).backward()
    alone.step()
    for mine, expected in zip(
        model[2].parameters(), reference[2].parameters(), strict=True
    ):
        torch.testing.assert_close(mine, expected, rtol=1e-13, atol=1e-15)
    with pytest.raises(ValueError, match=r"Layer '0'.*not finite.*raise the group's"):
        optimizer.preconditioner(model[0])

    regular = torch.randn(16, 6, dtype=torch.float64) if side == "dense" else None
    covering = torch.arange(16).remainder(8)[:, None]  # every token of the vocabulary
    optimizer.zero_grad()
    X = regular if side == "dense" else covering
    nn.functional.cross_entropy(model(X), torch.arange(16) % 3).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer.step()
    assert optimizer.skipped_steps == 1  # the first step's, only
    assert all(
        not torch.equal(p.detach(), old)
        for p, old in zip(model[0].parameters(), before, strict=True)
    )
    assert optimizer.preconditioner(model[0]).tensors()[0].isfinite().all()
