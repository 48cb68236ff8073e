"""The fallback rule trains every parameter that no layer owns (AdamW or SGD)."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from singd_curvlinops import KFAC, SINGD, FallbackRule, register_fallback
from singd_curvlinops.rules.fallback import (
    FALLBACK_RULES,
    RESERVED_KEYS,
    fallback_names,
    unregister_fallback,
)
from singd_curvlinops.verdicts import COUNTERS
from tests.layers._helpers import train_without_warnings


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 6),
        nn.LayerNorm(6),
        nn.Tanh(),
        nn.Linear(6, 6),
        nn.BatchNorm1d(6),
        nn.Linear(6, 3),
    ).double()


def _data(step: int):
    generator = torch.Generator().manual_seed(step)
    X = torch.randn(8, 4, generator=generator, dtype=torch.float64)
    return X, torch.randint(0, 3, (8,), generator=generator)


def _norms(model):
    return [
        p
        for m in model
        if isinstance(m, (nn.LayerNorm, nn.BatchNorm1d))
        for p in m.parameters()
    ]


def _linears(model):
    return [p for m in model if isinstance(m, nn.Linear) for p in m.parameters()]


def _train(model, optimizer, steps: int, scheduler=None):
    for step in range(steps):
        optimizer.zero_grad()
        X, y = _data(step)
        nn.functional.cross_entropy(model(X), y).backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


OPTIONS = {"lr": 0.02, "fallback_lr_ratio": 0.5, "weight_decay": 0.05, "momentum": 0.5}


@pytest.mark.parametrize("fallback", ["adamw", "sgd"])
@pytest.mark.parametrize("cls", [SINGD, KFAC])
def test_fallback_equals_torch_optimizer_and_follows_the_scheduler(
    cls, fallback
) -> None:
    """Layers at lr=0 stay fixed, so the norms see the gradients of the reference."""
    model, reference = _model(), _model()
    groups = [{"params": _linears(model), "lr": 0.0}, {"params": _norms(model)}]
    optimizer = cls(
        model,
        groups,
        fallback=fallback,
        fallback_betas=(0.8, 0.99),
        fallback_eps=1e-6,
        **OPTIONS,
    )
    lr = OPTIONS["lr"] * OPTIONS["fallback_lr_ratio"]
    if fallback == "adamw":
        torch_optimizer = torch.optim.AdamW(
            _norms(reference), lr=lr, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05
        )
    else:
        torch_optimizer = torch.optim.SGD(
            _norms(reference), lr=lr, momentum=0.5, weight_decay=0.05
        )
    schedules = [
        torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        for opt in (optimizer, torch_optimizer)
    ]
    _train(model, optimizer, 5, schedules[0])
    _train(reference, torch_optimizer, 5, schedules[1])
    for p, q in zip(_norms(model), _norms(reference), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-12)
    assert optimizer.param_groups[1]["lr"] == OPTIONS["lr"] / 4
    for p, q in zip(_linears(model), _linears(_model()), strict=True):
        assert torch.equal(p, q)


def test_default_trains_every_parameter_without_warning() -> None:
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer = SINGD(model, lr=0.05)
        before = [p.clone() for p in model.parameters()]
        _train(model, optimizer, 1)
    for p, q in zip(model.parameters(), before, strict=True):
        assert not torch.equal(p, q)
    assert set(optimizer.fallback_params) == set(_norms(model))
    for p in _norms(model):
        assert set(optimizer.state[p]) == {
            "step",
            "exp_avg",
            "exp_avg_sq",
            "skipped_steps",  # the step guard's count (issue 16)
        }


def test_parameters_outside_the_model_go_to_the_fallback() -> None:
    model = _model()
    log_scale = nn.Parameter(torch.zeros((), dtype=torch.float64))
    optimizer = SINGD(model, [{"params": model.parameters()}, {"params": [log_scale]}])
    optimizer.zero_grad()
    X, y = _data(0)
    (nn.functional.cross_entropy(model(X), y) * log_scale.exp()).backward()
    optimizer.step()
    assert log_scale.item() != 0.0
    assert any(p is log_scale for p in optimizer.fallback_params)


@pytest.mark.parametrize("api", ["state_dict", "dcp"])
def test_fallback_state_round_trip(tmp_path: Path, api: str) -> None:
    def make(net):
        return SINGD(net, lr=0.05, T=2)

    model = _model()
    optimizer = make(model)
    _train(model, optimizer, 3)
    saved_model = copy.deepcopy(model.state_dict())
    if api == "state_dict":
        torch.save(optimizer.state_dict(), tmp_path / "opt.pt")
        saved = torch.load(tmp_path / "opt.pt", weights_only=True)
    else:
        saved = copy.deepcopy(get_optimizer_state_dict(model, optimizer))
    _train(model, optimizer, 3)
    twin_model = _model()
    twin_model.load_state_dict(saved_model)
    twin = make(twin_model)
    if api == "state_dict":
        twin.load_state_dict(saved)
    else:
        set_optimizer_state_dict(twin_model, twin, optim_state_dict=saved)
    for step in range(3):  # the same batches as the uninterrupted run's last three
        twin.zero_grad()
        X, y = _data(step)
        nn.functional.cross_entropy(twin_model(X), y).backward()
        twin.step()
    for p, q in zip(model.parameters(), twin_model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_grad_scaler_and_closure_equal_the_plain_run() -> None:
    model, scaled_model = _model(), _model()
    optimizer, scaled = SINGD(model, lr=0.05, T=1), SINGD(scaled_model, lr=0.05, T=1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for step in range(3):
        X, y = _data(step)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(X), y).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()

        def closure(X=X, y=y):
            scaled.zero_grad()
            loss = nn.functional.cross_entropy(scaled_model(X), y)
            scaler.scale(loss).backward()
            scaler.unscale_(scaled)
            scaled.set_current_grad_scale(scaler.get_scale())
            nn.utils.clip_grad_norm_(scaled_model.parameters(), 0.5)
            return loss

        closure()
        scaler.step(scaled)
        scaler.update()
    for p, q in zip(model.parameters(), scaled_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("cls", [SINGD, KFAC])
def test_sparse_embeddings_are_refused_when_registered(cls) -> None:
    """Their gradients are sparse, which no fallback rule takes.

    Before, construction passed and every `step()` failed inside the finiteness
    check with torch's `NotImplementedError` for sparse tensors.
    """
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(10, 4, sparse=True), nn.Flatten(), nn.Linear(12, 2)
    )
    with pytest.raises(ValueError, match=r"'0\.weight': sparse gradients"):
        cls(model)
    optimizer = cls(model, model[2].parameters())
    with pytest.raises(ValueError, match=r"'0\.weight': sparse gradients"):
        optimizer.add_param_group({"params": list(model[0].parameters())})
    assert len(optimizer.param_groups) == 1
    X, y = torch.randint(0, 10, (5, 3)), torch.randint(0, 2, (5,))
    nn.functional.cross_entropy(model(X), y).backward()
    optimizer.step()  # the rest trains
    model[0].requires_grad_(False)  # frozen, it never gets a gradient: accepted
    cls(model, model.parameters())


@pytest.mark.parametrize("parametrize", ["weight_norm", "spectral_norm"])
def test_parametrized_layers_go_to_the_fallback(parametrize) -> None:
    """Their weight is computed from other parameters (before: a torch error).

    `SINGD(model)` raised "can't optimize a non-leaf Tensor"; the parameters that
    compute the weight are now the fallback's, and the model trains.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    getattr(nn.utils.parametrizations, parametrize)(model[0])
    optimizer = SINGD(model, lr=0.05)
    assert [layer.name for layer in optimizer.layers] == ["2"]
    computing = set(model[0].parameters())
    assert computing == set(optimizer.fallback_params)
    X, y = torch.randn(16, 4, dtype=torch.float64), torch.randint(0, 3, (16,))
    losses = train_without_warnings(model, optimizer, X, y, steps=5)
    assert losses[-1] < losses[0]
    assert all(optimizer.state[p]["step"] == 5 for p in computing)


def test_a_batch_of_fallback_parameters_keeps_each_ones_step_count() -> None:
    """The fallback steps a group's parameters together (`torch._foreach_*`); a
    parameter without a gradient in some steps keeps its own AdamW step count,
    and groups with other options or another rule step apart, as in torch.optim."""
    generator = torch.Generator().manual_seed(0)
    values = [torch.randn(3, generator=generator, dtype=torch.float64) for _ in "abc"]
    model = nn.Linear(3, 2).double()
    ours = [nn.Parameter(v.clone()) for v in values]
    theirs = [nn.Parameter(v.clone()) for v in values]
    optimizer = SINGD(
        model,
        [
            {"params": model.parameters(), "lr": 0.0},
            {"params": ours[:2], "lr": 0.05, "weight_decay": 0.1},
            {"params": ours[2:], "lr": 0.02, "fallback": "sgd", "momentum": 0.9},
        ],
    )
    references = [
        torch.optim.AdamW(theirs[:2], lr=0.05, weight_decay=0.1),
        torch.optim.SGD(theirs[2:], lr=0.02, momentum=0.9),
    ]
    for step in range(6):
        for params, opt in ((ours, optimizer), (theirs, None)):
            if opt is not None:
                opt.zero_grad(set_to_none=True)
            else:
                for reference in references:
                    reference.zero_grad(set_to_none=True)
            X = torch.randn(4, 3, generator=torch.Generator().manual_seed(step))
            X = X.double()
            used = params if step % 2 == 0 else [params[0], params[2]]
            loss = sum(((X * p).sum(1) ** 2).mean() for p in used)
            if opt is not None:
                loss = loss + 0.0 * model(X).sum()
            loss.backward()
        optimizer.step()
        for reference in references:
            reference.step()
    assert optimizer.state[ours[0]]["step"] == 6
    assert optimizer.state[ours[1]]["step"] == 3
    for p, q in zip(ours, theirs, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-14)


class _Lion(FallbackRule):
    """Lion (Chen et al., 2023) as the fallback guide writes it."""

    state_keys = ("exp_avg",)

    def init_state(self, param):
        return {"exp_avg": torch.zeros_like(param)}

    def step(self, params, grads, states, group):
        beta1, beta2 = group["fallback_betas"]
        lr = group["lr"] * group["fallback_lr_ratio"]
        params, grads = list(params), list(grads)
        moments = [state["exp_avg"] for state in states]
        directions = torch._foreach_lerp(moments, grads, 1 - beta1)
        torch._foreach_sign_(directions)
        if group["weight_decay"]:
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
        torch._foreach_add_(params, directions, alpha=-lr)
        torch._foreach_lerp_(moments, grads, 1 - beta2)


@pytest.fixture
def lion():
    rule = register_fallback("lion", _Lion())
    yield rule
    unregister_fallback("lion")


def _lion_reference(param, grad, moment, *, lr, betas, weight_decay) -> None:
    """One Lion step of one parameter, written out."""
    direction = torch.sign(betas[0] * moment + (1 - betas[0]) * grad)
    param.mul_(1 - lr * weight_decay).sub_(lr * direction)
    moment.mul_(betas[1]).add_((1 - betas[1]) * grad)


def test_a_registered_rule_trains_its_groups_and_round_trips(lion, tmp_path) -> None:
    model = _model()
    optimizer = SINGD(
        model,
        [
            {"params": _linears(model)},
            {"params": _norms(model)[:2], "fallback": "lion", "lr": 0.01},
            {"params": _norms(model)[2:]},  # the BatchNorm: AdamW
        ],
        fallback_betas=(0.8, 0.95),
        weight_decay=0.1,
    )
    assert all("exp_avg" in optimizer.state[p] for p in _norms(model))
    lion_params = _norms(model)[:2]
    expected = [p.detach().clone() for p in lion_params]
    moments = [torch.zeros_like(p) for p in lion_params]
    for step in range(4):
        optimizer.zero_grad()
        X, y = _data(step)
        nn.functional.cross_entropy(model(X), y).backward()
        for value, moment, param in zip(expected, moments, lion_params, strict=True):
            _lion_reference(
                value, param.grad, moment, lr=0.01, betas=(0.8, 0.95), weight_decay=0.1
            )
        optimizer.step()
    for param, value in zip(lion_params, expected, strict=True):
        torch.testing.assert_close(param.detach(), value, rtol=0, atol=1e-14)
    assert set(optimizer.state[lion_params[0]]) == {"exp_avg", "skipped_steps"}

    path = tmp_path / "lion.pt"
    torch.save(optimizer.state_dict(), path)
    twin = copy.deepcopy(model)
    clone = SINGD(
        twin,
        [
            {"params": _linears(twin)},
            {"params": _norms(twin)[:2], "fallback": "lion", "lr": 0.01},
            {"params": _norms(twin)[2:]},
        ],
        fallback_betas=(0.8, 0.95),
        weight_decay=0.1,
    )
    clone.load_state_dict(torch.load(path, weights_only=True))
    _train(model, optimizer, 2)
    _train(twin, clone, 2)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)


def test_registration_checks_its_arguments(lion) -> None:
    with pytest.raises(ValueError, match="'lion' is already taken by _Lion"):
        register_fallback("lion", _Lion())
    with pytest.raises(ValueError, match="'adamw' is already taken"):
        register_fallback("adamw", _Lion())
    with pytest.raises(TypeError, match="name must be a non-empty str"):
        register_fallback("", _Lion())
    with pytest.raises(TypeError, match="rule must be a FallbackRule instance"):
        register_fallback("other", torch.optim.SGD)

    class Counting(_Lion):
        state_keys = ("exp_avg", "skipped_steps")

    with pytest.raises(ValueError, match="'skipped_steps', which the step guard"):
        register_fallback("counting", Counting())

    class Listed(_Lion):
        state_keys = ["exp_avg"]

    with pytest.raises(TypeError, match="state_keys must be a tuple of str"):
        register_fallback("listed", Listed())
    with pytest.raises(ValueError, match="not a registered fallback rule"):
        unregister_fallback("sgd")
    assert "counting" not in fallback_names() and "listed" not in fallback_names()
    assert RESERVED_KEYS == COUNTERS


def test_an_unregistered_name_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="fallback must be one of 'adamw', 'sgd'"):
        SINGD(_model(), fallback="lion")
    register_fallback("lion", _Lion())
    try:
        model = _model()
        optimizer = SINGD(model, fallback="lion")
        assert fallback_names()[-1] == "lion" and "lion" in FALLBACK_RULES
    finally:
        unregister_fallback("lion")
    with pytest.raises(ValueError, match="fallback must be one of 'adamw', 'sgd'"):
        _train(model, optimizer, 1)  # the group's option names no rule now
