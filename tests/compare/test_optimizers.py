"""The optimizer registry, the search spaces and the shared schedule."""

import math
import re

import pytest
import torch
from torch import nn

from singd_curvlinops import EKFAC, KFAC
from singd_curvlinops.compare.optimizers import (
    DEFAULT_OPTIMIZERS,
    FAMILIES,
    parse_optimizer,
    warmup_cosine,
)
from singd_curvlinops.compare.search import Dimension, points


def test_points_extend_and_stay_in_their_intervals():
    space = (Dimension("lr", 1e-4, 1e-1), Dimension("damping", 1e-3, 1.0))
    few, many = points(space, 4), points(space, 32)
    assert few == many[:4]  # a larger budget extends a smaller one
    for point in many:
        assert 1e-4 <= point["lr"] <= 1e-1 and 1e-3 <= point["damping"] <= 1.0
    # quasi-random on a log scale: every decade of lr gets points
    decades = {math.floor(math.log10(point["lr"])) for point in many}
    assert decades == {-4, -3, -2}
    assert points((), 3) == [{}, {}, {}]


def test_dimension_rejects_an_empty_interval():
    with pytest.raises(ValueError, match="needs 0 < low < high"):
        Dimension("lr", 0.1, 0.01)


@pytest.mark.parametrize(
    ("name", "canonical", "label"),
    [
        ("singd", "singd:dense", "SINGD (dense)"),
        ("SINGD:diagonal", "singd:diagonal", "SINGD (diagonal)"),
        ("ikfac", "ikfac:dense", "IKFAC"),
        ("ikfac:triltoeplitz", "ikfac:triltoeplitz", "IKFAC (triltoeplitz)"),
        ("kfac", "kfac", "KFAC"),
        ("EKFAC", "ekfac", "EKFAC"),
        ("soap", "soap", "SOAP"),
    ],
)
def test_names_and_labels(name, canonical, label):
    spec = parse_optimizer(name)
    assert (spec.name, spec.label) == (canonical, label)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("adam", "unknown optimizer 'adam'; choose from singd[:STRUCTURE], "),
        ("sgd:diagonal", "sgd takes no structure"),
        ("ekfac:diagonal", "ekfac takes no structure"),
        ("singd:banded", "Unknown structure 'banded'"),
    ],
)
def test_bad_names_raise_value_errors(name, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_optimizer(name)


def test_the_bf16_comparison_covers_the_kfac_family_only():
    precisions = {name: family.bf16_precisions for name, family in FAMILIES.items()}
    assert precisions == {
        "singd": ("bf16",),
        "ikfac": ("bf16",),
        "kfac": ("bf16", "bf16-fp32-factors"),
        "ekfac": (),
        "adamw": (),
        "sgd": (),
        "soap": (),
    }


@pytest.mark.parametrize("name", DEFAULT_OPTIMIZERS)
def test_every_default_optimizer_builds_and_steps(name):
    spec = parse_optimizer(name)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    before = [p.detach().clone() for p in model.parameters()]
    factor_dtype = torch.bfloat16 if spec.family.bf16_precisions else None
    optimizer = spec.build(
        model, points(spec.family.space, 1)[0], "batch", factor_dtype
    )
    for _ in range(2):  # SOAP's first step only sets up its preconditioner
        optimizer.zero_grad()
        nn.functional.mse_loss(model(torch.randn(16, 4)), torch.randn(16, 2)).backward()
        optimizer.step()
    after = list(model.parameters())
    assert all(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
    if factor_dtype is not None:  # the factors are kept in bfloat16
        state = optimizer.state[model[0].weight]
        factors = [v for k, v in state.items() if k[0] in "KCAG" and "." in k]
        assert factors and all(f.dtype == torch.bfloat16 for f in factors)


@pytest.mark.parametrize(("name", "optimizer"), [("kfac", KFAC), ("ekfac", EKFAC)])
def test_the_kfac_entries_build_their_own_optimizer(name, optimizer):
    spec = parse_optimizer(name)
    built = spec.build(nn.Linear(3, 2), {"lr": 0.1, "damping": 0.1}, "batch")
    assert type(built) is optimizer
    assert built.defaults["ema_decay"] == 0.95 and built.defaults["T"] == 5


def test_warmup_then_cosine_to_zero():
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=2.0)
    scheduler = warmup_cosine(optimizer, steps=100)  # 5 warm-up steps
    rates = []
    for _ in range(100):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates[0] == pytest.approx(2.0 * 0.2)
    assert rates[4] == pytest.approx(2.0 * 0.5 * (1 + math.cos(math.pi * 4 / 100)))
    assert max(rates) == rates[4]
    assert rates[50] == pytest.approx(1.0)
    assert rates[99] == pytest.approx(2.0 * 0.5 * (1 + math.cos(math.pi * 0.99)))
    assert all(a >= b for a, b in zip(rates[4:], rates[5:], strict=False))
