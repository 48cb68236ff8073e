"""Training-loop behaviour: accumulation, in-place activations, closures, clipping,
schedulers, parameter groups and layers whose hooks never fire."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import Tensor, nn

from singd_curvlinops import SINGD


def cnn(inplace: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, stride=2, padding=1),
        nn.ReLU(inplace=inplace),
        nn.Flatten(),
        nn.Linear(3 * 4 * 4, 5),
        nn.ReLU(inplace=inplace),
        nn.Linear(5, 3),
    ).double()


def data(n: int = 12, seed: int = 1) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 2, 8, 8, generator=generator, dtype=torch.float64)
    return X, torch.randint(0, 3, (n,), generator=generator)


def max_relative_error(model_a: nn.Module, model_b: nn.Module) -> float:
    return max(
        ((a - b).abs().max() / b.abs().max()).item()
        for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True)
    )


HYPER = {"lr": 0.1, "lr_cov": 0.1, "momentum": 0.5, "alpha1": 0.5, "damping": 1e-3}
ACCUMULATION_CASES = {
    "SINGD-dense-T1": {"structures": ("dense", "dense"), "T": 1},
    "SINGD-sparse-T2": {"structures": ("block3diagonal", "triltoeplitz"), "T": 2},
    "IKFAC-dense": {"structures": ("dense", "dense"), "T": 1, "kfac_like": True},
    "IKFAC-hierarchical": {
        "structures": ("hierarchical2_3", "triutopleftdiag"),
        "T": 1,
        "kfac_like": True,
        "alpha1": 0.0,
    },
    "SINGD-sum-loss": {
        "structures": ("diagonal", "dense"),
        "T": 1,
        "loss_average": None,
    },
}


@pytest.mark.parametrize("sizes", [(4, 4, 4), (5, 3, 4)], ids=["equal", "unequal"])
@pytest.mark.parametrize("config", ACCUMULATION_CASES.values(), ids=ACCUMULATION_CASES)
def test_accumulation_equals_concatenated_batch(config: dict, sizes: tuple) -> None:
    """Micro-batch losses weighted by their share (1/k for equal sizes: PyTorch's
    convention) give exactly the step of the concatenated batch."""
    options = {**HYPER, **config}
    mean = options.get("loss_average", "batch") is not None
    loss_func = nn.CrossEntropyLoss(reduction="mean" if mean else "sum")
    whole, split = cnn(), cnn()
    opt_whole, opt_split = SINGD(whole, **options), SINGD(split, **options)
    for step in range(4):
        X, y = data(sum(sizes), seed=step)
        opt_whole.zero_grad()
        loss_func(whole(X), y).backward()
        opt_whole.step()
        opt_split.zero_grad()
        for X_i, y_i in zip(X.split(sizes), y.split(sizes), strict=True):
            weight = len(y_i) / len(y) if mean else 1.0
            (loss_func(split(X_i), y_i) * weight).backward()
        opt_split.step()
    error = max_relative_error(split, whole)
    print(f"max relative error {error:.2e}")
    assert error < 1e-10
    assert max_relative_error(whole, cnn()) > 1e-3, "the parameters did not move"


@pytest.mark.parametrize("kfac_like", [True, False], ids=["IKFAC", "SINGD"])
def test_reference_accumulation_deviates(kfac_like: bool) -> None:
    """The reference `singd==0.0.5` normalises each micro-batch on its own: its
    accumulated `H_K` is k times too large and `H_C` k times too small. SINGD's
    trace coupling cancels that for equal micro-batches, IKFAC's update does not,
    and unequal micro-batches break both (the bug fixed here)."""
    from singd.optim.optimizer import SINGD as ReferenceSINGD

    whole, split = cnn(), cnn()
    options = {**HYPER, "T": 1, "kfac_like": kfac_like, "alpha1": 0.0}
    sizes = (4, 4, 4) if kfac_like else (6, 2, 4)
    opt_whole, opt_split = (
        ReferenceSINGD(whole, **options),
        ReferenceSINGD(split, **options),
    )
    loss_func = nn.CrossEntropyLoss()
    for step in range(3):
        X, y = data(12, seed=step)
        opt_whole.zero_grad()
        loss_func(whole(X), y).backward()
        opt_whole.step()
        opt_split.zero_grad()
        for X_i, y_i in zip(X.split(sizes), y.split(sizes), strict=True):
            (loss_func(split(X_i), y_i) * len(y_i) / len(y)).backward()
        opt_split.step()
    error = max_relative_error(split, whole)
    print(f"reference: max relative deviation {error:.2e}")
    assert error > 1e-3


def train(model: nn.Module, optimizer, steps: int = 4) -> list[float]:
    losses = []
    for step in range(steps):
        X, y = data(seed=step)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(X), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    "structures", [("dense", "dense"), ("triltoeplitz", "diagonal")]
)
def test_inplace_activations_match_out_of_place(structures) -> None:
    inplace, outofplace = cnn(inplace=True), cnn(inplace=False)
    options = {**HYPER, "T": 1, "structures": structures}
    train(inplace, SINGD(inplace, **options))
    train(outofplace, SINGD(outofplace, **options))
    for a, b in zip(inplace.parameters(), outofplace.parameters(), strict=True):
        assert torch.equal(a, b)


def test_step_with_closure_returns_loss_and_matches_manual_loop() -> None:
    model_a, model_b = cnn(), cnn()
    opt_a, opt_b = SINGD(model_a, **HYPER, T=1), SINGD(model_b, **HYPER, T=1)
    losses_b = train(model_b, opt_b)
    for step in range(4):
        X, y = data(seed=step)

        def closure(X=X, y=y) -> Tensor:
            opt_a.zero_grad()
            loss = nn.functional.cross_entropy(model_a(X), y)
            loss.backward()
            return loss

        with torch.no_grad():  # step evaluates the closure with gradients enabled
            loss = opt_a.step(closure)
        assert loss.item() == pytest.approx(losses_b[step], rel=1e-12)
    assert max_relative_error(model_a, model_b) < 1e-12


def test_gradient_clipping_and_scheduler_act_like_any_optimizer() -> None:
    """Clipping rescales the gradient that SINGD preconditions; a scheduler sets lr."""
    clipped, manual = cnn(), cnn()
    opt_clipped = SINGD(clipped, **HYPER, T=1)
    opt_manual = SINGD(manual, **HYPER, T=1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt_clipped, step_size=1, gamma=0.5)
    for step in range(4):
        X, y = data(seed=step)
        for model, opt in ((clipped, opt_clipped), (manual, opt_manual)):
            opt.zero_grad()
            nn.functional.cross_entropy(model(X), y).backward()
        norm = torch.nn.utils.clip_grad_norm_(clipped.parameters(), max_norm=0.1)
        factor = min(1.0, 0.1 / (norm.item() + 1e-6))
        for p in manual.parameters():
            p.grad.mul_(factor)
        for group in opt_manual.param_groups:
            group["lr"] = HYPER["lr"] * 0.5**step
        assert opt_clipped.param_groups[0]["lr"] == pytest.approx(
            HYPER["lr"] * 0.5**step
        )
        opt_clipped.step()
        opt_manual.step()
        scheduler.step()
    assert max_relative_error(clipped, manual) < 1e-12


def test_param_groups_have_their_own_hyperparameters() -> None:
    model = cnn()
    opt = SINGD(
        model,
        params=[
            {
                "params": model[0].parameters(),
                "structures": ("diagonal", "triltoeplitz"),
                "lr": 0.0,
            },
            {"params": [*model[3].parameters(), *model[5].parameters()], "T": 2},
        ],
        **{k: v for k, v in HYPER.items() if k != "lr"},
        lr=0.1,
    )
    conv_weight = model[0].weight.clone()
    train(model, opt, steps=3)
    assert torch.equal(model[0].weight, conv_weight), "lr=0 group moved"
    assert not torch.equal(model[5].weight, cnn()[5].weight)
    assert {"K.diag", "C.diags", "step"} <= set(opt.state[model[0].weight])
    assert "K.mat" in opt.state[model[3].weight]
    assert opt.state[model[3].weight]["step"] == 3


def test_add_param_group_trains_new_layers() -> None:
    model = cnn()
    opt = SINGD(model, params=model[0].parameters(), **HYPER, T=1)
    train(model, opt, steps=1)
    opt.add_param_group({"params": [*model[3].parameters(), *model[5].parameters()]})
    before = model[5].weight.clone()
    train(model, opt, steps=2)
    assert not torch.equal(model[5].weight, before)
    K = opt.state[model[5].weight]["K.mat"]
    assert not torch.allclose(K, torch.eye(K.shape[0], dtype=K.dtype)), (
        "no factor update"
    )
    assert opt.state[model[5].weight]["step"] == 2


def test_add_param_group_rejects_foreign_parameters_atomically() -> None:
    model = cnn()
    opt = SINGD(model, params=model[0].parameters(), **HYPER, fallback=None)
    with pytest.raises(ValueError, match="do not belong to a supported layer"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
    with pytest.raises(ValueError, match="same parameter group"):
        opt.add_param_group({"params": [model[3].weight]})
    with pytest.raises(ValueError, match="alpha1"):
        opt.add_param_group({"params": model[3].parameters(), "alpha1": 1.0})
    assert len(opt.param_groups) == 1
    train(model, opt, steps=1)


class Functional(nn.Module):
    """`out_proj` is applied through `F.linear` (as `MultiheadAttention` did before
    it had an adapter): its hooks never run."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.attn = nn.Module()
        self.attn.out_proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.embed(x))
        out_proj = self.attn.out_proj
        h = nn.functional.linear(h, out_proj.weight, out_proj.bias)
        return self.head(h.mean(1))


def test_layer_without_forward_hook_warns_once_and_trains() -> None:
    torch.manual_seed(0)
    model = Functional().double()
    opt = SINGD(model, **HYPER, T=1)
    out_proj = model.attn.out_proj
    before = out_proj.weight.clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            X = torch.randn(6, 5, 4, dtype=torch.float64)
            y = torch.randint(0, 3, (6,))
            opt.zero_grad()
            nn.functional.cross_entropy(model(X), y).backward()
            opt.step()
    messages = [str(w.message) for w in caught if "no statistics" in str(w.message)]
    assert len(messages) == 1 and "'attn.out_proj'" in messages[0]
    assert not torch.equal(out_proj.weight, before)
    K = opt.state[out_proj.weight]["K.mat"]
    assert torch.equal(K, torch.eye(9, dtype=torch.float64)), (
        "identity until statistics"
    )
    assert not torch.equal(
        opt.state[model.head.weight]["K.mat"], torch.eye(9, dtype=torch.float64)
    )


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_same_padding_with_even_kernel_trains(approx: str) -> None:
    """curvlinops and the reference refuse unequal 'same' padding; SINGD trains it."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 4, padding="same"), nn.ReLU(), nn.Flatten(), nn.Linear(256, 3)
    ).double()
    opt = SINGD(model, **HYPER, T=1, kfac_approx=approx)
    X, y = data()
    losses = []
    for _ in range(6):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(X), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0]
    K = opt.state[model[0].weight]["K.mat"]
    assert K.shape == (2 * 16 + 1, 2 * 16 + 1)
    assert not torch.allclose(K, torch.eye(33, dtype=K.dtype))
