"""The EKFAC baseline: first step = −lr · curvlinops' damped EKFAC inverse @ gradient.

Also the conventions curvlinops cannot check (micro-batches, averaging over
updates, `"batch+sequence"`), against per-example gradients from `torch.func`.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from curvlinops import EKFACLinearOperator, FisherType, KFACInverseLinearOperator
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from singd_curvlinops import EKFAC, KFAC, SINGDLinearOperator
from singd_curvlinops.bench.memory import cache_bytes
from singd_curvlinops.rules.ekfac import _eigenbasis

DAMPING, LR = 0.1, 0.5
EXAMPLES = 24  # more than d_K = 19 of the convolution: see `test_first_step`


def model_of(kind: str, bias: bool = True) -> nn.Module:
    """A CNN (Conv2d + Linear) or a Linear layer shared over 3 positions + Linear."""
    torch.manual_seed(0)
    if kind == "conv":
        layers = [
            nn.Conv2d(2, 3, 3, stride=2, padding=1, bias=bias),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(48, 3, bias=bias),
        ]
    else:
        layers = [
            nn.Linear(4, 5, bias=bias),
            nn.Tanh(),
            nn.Flatten(),
            nn.Linear(15, 3, bias=bias),
        ]
    return nn.Sequential(*layers).double()


def batch(kind: str, seed: int = 1, size: int = EXAMPLES) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (size, 2, 8, 8) if kind == "conv" else (size, 3, 4)
    X = torch.randn(*shape, generator=generator, dtype=torch.float64)
    return X, torch.randint(0, 3, (size,), generator=generator)


def backward(model: nn.Module, X: Tensor, y: Tensor, reduction="mean") -> list[Tensor]:
    model.zero_grad()
    nn.functional.cross_entropy(model(X), y, reduction=reduction).backward()
    return [p.grad.clone() for p in model.parameters()]


def step_of(model: nn.Module, before: list[Tensor]) -> list[Tensor]:
    return [
        (p0 - p.detach()) / LR for p, p0 in zip(model.parameters(), before, strict=True)
    ]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("kind", ["conv", "shared_linear"])
def test_first_step_is_damped_ekfac_inverse_times_gradient(
    kind: str, approx: str, bias: bool, reduction: str
) -> None:
    """With `reduce`, the per-example gradients leave A's range unless A has full
    rank, and their eigenvalues there depend on eigh's basis of A's null space:
    `EXAMPLES` exceeds every d_K so that both sides pick the same basis."""
    model = model_of(kind, bias)
    X, y = batch(kind)
    ekfac = EKFACLinearOperator(
        model,
        nn.CrossEntropyLoss(reduction=reduction),
        list(model.parameters()),
        [(X, y)],
        fisher_type=FisherType.EMPIRICAL,
        kfac_approx=approx,
        separate_weight_and_bias=False,
        check_deterministic=False,
    )
    inverse = KFACInverseLinearOperator(ekfac, damping=DAMPING, use_exact_damping=True)
    expected = inverse @ backward(model, X, y, reduction)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = EKFAC(
        model,
        lr=LR,
        momentum=0.0,
        damping=DAMPING,
        T=1,
        kfac_approx=approx,
        loss_average=None if reduction == "sum" else "batch",
    )
    backward(model, X, y, reduction)
    optimizer.step()
    for step, e in zip(step_of(model, before), expected, strict=True):
        assert torch.allclose(step, e, rtol=1e-10, atol=1e-12 * e.abs().max())
    P = SINGDLinearOperator(optimizer)
    eye = np.eye(P.shape[0])
    dense = inverse.to_scipy() @ eye
    scale = np.abs(dense).max()
    assert np.allclose(P.to_scipy() @ eye, dense, rtol=1e-10, atol=1e-12 * scale)
    damped = ekfac.to_scipy() @ eye + DAMPING * eye  # P⁻¹ = EKFAC + λI
    assert np.allclose(P.inverse().to_scipy() @ eye, damped, rtol=1e-10, atol=1e-12)


def per_example_gradients(
    model: nn.Module, X: Tensor, y: Tensor, layer: nn.Module
) -> Tensor:
    """[∇W ∇b] of `layer` per example (summed loss terms), `[N, d_C, d_K]`."""
    params = dict(model.named_parameters())

    def loss(p: dict[str, Tensor], x: Tensor, target: Tensor) -> Tensor:
        logits = functional_call(model, p, (x.unsqueeze(0),))
        return nn.functional.cross_entropy(
            logits.flatten(0, -2), target.reshape(-1), reduction="sum"
        )

    grads = vmap(grad(loss), in_dims=(None, 0, 0))(params, X, y)
    name = next(n for n, m in model.named_modules() if m is layer)
    weight = grads[f"{name}.weight"].flatten(2)
    return torch.cat([weight, grads[f"{name}.bias"].unsqueeze(-1)], dim=-1)


def corrected(gradients: Tensor, Q_A: Tensor, Q_G: Tensor) -> Tensor:
    """Mean over examples of (Q_Gᵀ ∇_n Q_A)²."""
    return (Q_G.T @ gradients @ Q_A).square().mean(0)


def test_eigenvalues_average_over_updates_in_each_new_basis() -> None:
    """T=2, β=0.6: steps 0 and 2 update; E = 0.6 E₀ + 0.4 E₂, each in its basis."""
    model = model_of("conv")
    optimizer = EKFAC(model, lr=1e-3, momentum=0.0, T=2, ema_decay=0.6)
    layer, state = model[3], optimizer.state[model[3].weight]
    expected = None
    for seed in range(4):
        X, y = batch("conv", seed)
        gradients = per_example_gradients(model, X, y, layer)
        backward(model, X, y)
        optimizer.step()
        if seed % 2 == 0:
            Q_A, Q_G = state["Q_A.mat"], state["Q_G.mat"]
            for Q, F in ((Q_A, state["A.mat"]), (Q_G, state["G.mat"])):
                rotated = Q.T @ F @ Q  # the bases diagonalise the averaged factors
                off = rotated - torch.diag(rotated.diagonal())
                assert off.abs().max() < 1e-12 * F.abs().max()
            fresh = corrected(gradients, Q_A, Q_G)
            expected = fresh if expected is None else 0.6 * expected + 0.4 * fresh
    assert state["updates"] == 2
    assert torch.allclose(state["eigenvalues"], expected, rtol=1e-10, atol=1e-14)


def test_unequal_micro_batches_equal_one_batch() -> None:
    model, twin = model_of("conv"), model_of("conv")
    X, y = batch("conv")
    options = {"lr": LR, "momentum": 0.0, "damping": DAMPING, "T": 1}
    optimizer, twin_optimizer = EKFAC(model, **options), EKFAC(twin, **options)
    backward(model, X, y)
    optimizer.step()
    twin.zero_grad()
    for part in (slice(0, 10), slice(10, None)):  # 10 and 14 examples
        share = (part.stop or EXAMPLES) - part.start
        loss = nn.functional.cross_entropy(twin(X[part]), y[part]) * share / EXAMPLES
        loss.backward()
    twin_optimizer.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)


def test_batch_and_sequence_average_uses_summed_loss_terms() -> None:
    r"""`"batch+sequence"` on [N, S, C] outputs: E = (1 / (N S)) Σ_n (Q_Gᵀ ∇ℓ_n Q_A)²
    with ℓ_n the sum of example n's S loss terms (curvlinops' convention, whose
    EKFAC takes only 2d outputs)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    X, y = torch.randn(6, 7, 4, dtype=torch.float64), torch.randint(0, 3, (6, 7))
    optimizer = EKFAC(model, lr=0.0, T=1, loss_average="batch+sequence")
    gradients = per_example_gradients(model, X, y, model[0])
    model.zero_grad()
    nn.functional.cross_entropy(model(X).flatten(0, 1), y.flatten()).backward()
    optimizer.step()
    state = optimizer.state[model[0].weight]
    mean_of_sums = corrected(gradients, state["Q_A.mat"], state["Q_G.mat"]) / 7
    assert torch.allclose(state["eigenvalues"], mean_of_sums, rtol=1e-10, atol=0)


def test_groups_bfloat16_factors_and_checkpoint(tmp_path) -> None:
    model, twin = model_of("conv"), model_of("conv")
    options = {"lr": 0.1, "momentum": 0.5, "weight_decay": 1e-2, "T": 2}

    def groups(m: nn.Module) -> list[dict]:
        return [
            {"params": m[0].parameters(), "ema_decay": 0.9},
            {
                "params": m[3].parameters(),
                "damping": 0.5,
                "preconditioner_dtype": (torch.bfloat16, torch.float32),
            },
        ]

    optimizer = EKFAC(model, groups(model), **options)
    assert [g["ema_decay"] for g in optimizer.param_groups] == [0.9, 0.95]
    assert [g["damping"] for g in optimizer.param_groups] == [0.001, 0.5]
    for seed in range(3):
        backward(model, *batch("conv", seed))
        optimizer.step()
    state = optimizer.state[model[3].weight]
    assert state["Q_A.mat"].dtype == torch.bfloat16
    assert state["Q_G.mat"].dtype == state["eigenvalues"].dtype == torch.float32
    assert all(torch.isfinite(p).all() for p in model.parameters())
    torch.save(optimizer.state_dict(), tmp_path / "ekfac.pt")
    twin.load_state_dict(model.state_dict())
    twin_optimizer = EKFAC(twin, groups(twin), **options)
    twin_optimizer.load_state_dict(torch.load(tmp_path / "ekfac.pt", weights_only=True))
    assert twin_optimizer.state[twin[3].weight]["Q_A.mat"].dtype == torch.bfloat16
    for seed in range(3, 6):
        for m, opt in ((model, optimizer), (twin, twin_optimizer)):
            backward(m, *batch("conv", seed))
            opt.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


def test_ekfac_differs_from_kfac_only_in_its_eigenvalues() -> None:
    """Same factors after a step; different steps (the correction matters)."""
    runs = []
    for optimizer_class in (KFAC, EKFAC):
        model = model_of("conv")
        optimizer = optimizer_class(model, lr=LR, momentum=0.0, damping=DAMPING, T=1)
        before = [p.detach().clone() for p in model.parameters()]
        backward(model, *batch("conv"))
        optimizer.step()
        runs.append((optimizer.state[model[0].weight], step_of(model, before)))
    (kfac_state, kfac_step), (ekfac_state, ekfac_step) = runs
    for key in ("A.mat", "G.mat"):
        assert torch.allclose(kfac_state[key], ekfac_state[key], rtol=1e-13, atol=0)
    assert isinstance(EKFAC(model_of("conv")), KFAC)
    difference = max(
        (a - b).abs().max() for a, b in zip(kfac_step, ekfac_step, strict=True)
    )
    assert difference > 1e-2 * max(s.abs().max() for s in kfac_step)


def test_set_curvature_is_refused() -> None:
    optimizer = EKFAC(model_of("conv"))
    with pytest.raises(TypeError, match="EKFAC does not support set_curvature"):
        optimizer.set_curvature(object())


@pytest.mark.parametrize(
    ("option", "value", "error", "message"),
    [
        ("ema_decay", 1.0, ValueError, r"ema_decay must be in \[0.0, 1.0\)"),
        ("damping", -1.0, ValueError, "damping must be >= 0"),
        ("kfac_approx", "full", ValueError, "kfac_approx must be one of"),
        ("T", 0.5, ValueError, "T must be a positive int"),
    ],
)
def test_invalid_options(option: str, value, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        EKFAC(model_of("conv"), **{option: value})


def test_failed_eigendecomposition_names_the_factor() -> None:
    with pytest.raises(ValueError, match=r"eigendecomposition of a \(3, 3\) factor"):
        _eigenbasis(torch.full((3, 3), float("nan"), dtype=torch.float64))


@pytest.mark.parametrize("failure", ["raises", "returns NaNs"])
def test_eigenbasis_retries_in_float64_where_float32_fails(monkeypatch, failure):
    """LAPACK's float32 eigh can fail on factors with many repeated eigenvalues,
    also silently (NaNs): seen on digits-cnn's 257 × 257 input factor."""
    eigh = torch.linalg.eigh

    def flaky(matrix: Tensor) -> SimpleNamespace:
        if matrix.dtype != torch.float32:
            return eigh(matrix)
        if failure == "raises":
            raise torch.linalg.LinAlgError("linalg.eigh: failed to converge")
        values, vectors = eigh(matrix)
        return SimpleNamespace(eigenvalues=values, eigenvectors=vectors * math.nan)

    monkeypatch.setattr(torch.linalg, "eigh", flaky)
    X = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    factor = X.T @ X
    basis = _eigenbasis(factor)
    assert basis.dtype == torch.float32
    assert torch.equal(basis, eigh(factor.double()).eigenvectors.float())


def test_memory_bench_counts_the_cached_inverse_eigenvalues() -> None:
    """The bases are state; the cache is D = 1 / (E + λ), d_C × d_K per layer."""
    model = model_of("conv")
    optimizer = EKFAC(model, T=1)
    identities = (19**2 + 3**2 + 49**2 + 3**2) * 8  # before the first update
    assert cache_bytes(optimizer) == identities
    backward(model, *batch("conv"))
    optimizer.step()
    assert cache_bytes(optimizer) == (3 * 19 + 3 * 49) * 8


def test_diagonal_factors_give_the_diagonal_empirical_fisher() -> None:
    """Over the memory budget a factor is diagonal, its basis the identity: with both
    sides diagonal, EKFAC's first step is the gradient divided by the mean squared
    per-example gradient plus damping (no dense matrix of the layer is formed)."""
    model = model_of("shared_linear")
    X, y = batch("shared_linear")
    layer = model[0]  # dims (5, 5) > 4: both sides diagonal
    gradients = per_example_gradients(model, X, y, layer)
    optimizer = EKFAC(model, lr=LR, momentum=0.0, damping=DAMPING, T=1, max_dense_dim=4)
    assert optimizer.layers[0].structures == ("diagonal", "diagonal")
    assert not any(key.startswith("Q_") for key in optimizer.state[layer.weight])
    before = [p.detach().clone() for p in model.parameters()]
    gradient = backward(model, X, y)
    optimizer.step()
    E = gradients.square().mean(0)
    expected = torch.cat([gradient[0], gradient[1].unsqueeze(1)], 1) / (E + DAMPING)
    step = step_of(model, before)
    actual = torch.cat([step[0], step[1].unsqueeze(1)], 1)
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kfac_approx", ["expand", "reduce"])
def test_a_tied_embedding_squares_the_sum_of_both_uses(kfac_approx: str) -> None:
    r"""An embedding tied to the output layer (GPT-2's layout; before 2026-12-04
    a `ValueError`): each example's gradient of the shared table is the sum of
    its one-hot use and the head's transposed use, and EKFAC squares that sum,
    E = (1 / (N S)) Σ_n (Q_Gᵀ ∇ℓ_n)² in the embedding's layout `[D, V]` (its
    one-hot side's basis is the identity), against `torch.func`."""
    torch.manual_seed(0)
    embedding = nn.Embedding(7, 4)
    head = nn.Linear(4, 7, bias=False)
    head.weight = embedding.weight  # tied, used transposed
    model = nn.Sequential(embedding, nn.Tanh(), head).double()
    optimizer = EKFAC(
        model, lr=0.05, T=1, loss_average="batch+sequence", kfac_approx=kfac_approx
    )
    tokens = torch.randint(0, 7, (6, 3), generator=torch.Generator().manual_seed(1))
    targets = tokens.roll(-1, dims=1)
    params = dict(model.named_parameters(remove_duplicate=False))  # both names

    def loss(p: dict[str, Tensor], x: Tensor, target: Tensor) -> Tensor:
        logits = functional_call(model, p, (x.unsqueeze(0),), tie_weights=False)
        return nn.functional.cross_entropy(
            logits.flatten(0, 1), target, reduction="sum"
        )

    per_example = vmap(grad(loss), in_dims=(None, 0, 0))
    uses = per_example(params, tokens, targets)  # each use's part of ∇ℓ_n
    uses = [uses["0.weight"].mT, uses["2.weight"].mT]  # [N, D, V]: Γ's layout
    gradients = uses[0] + uses[1]  # the shared table's
    nn.functional.cross_entropy(
        model(tokens).flatten(0, 1), targets.flatten()
    ).backward()
    optimizer.step()
    state = optimizer.state[embedding.weight]
    assert "A.diag" in state and state["eigenvalues"].shape == (4, 7)
    Q_G = state["Q_G.mat"]
    expected = (Q_G.T @ gradients).square().mean(0) / 3
    torch.testing.assert_close(state["eigenvalues"], expected, rtol=1e-10, atol=1e-14)
    apart = sum((Q_G.T @ use).square().mean(0) / 3 for use in uses)
    assert not torch.allclose(state["eigenvalues"], apart)  # the sum is squared
