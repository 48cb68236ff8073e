"""Frozen parameters (`requires_grad=False`) are never touched (issue 16, item 1).

A layer with a frozen bias is preconditioned as a layer without bias: its
statistics are those of the weight alone, curvlinops' factors of the weight
(no bias column). A layer with a frozen weight is a bias-only layer.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from curvlinops import KFACLinearOperator
from curvlinops.kfac import FisherType
from torch import nn

from singd_curvlinops import KFAC, SINGD

OPTIMIZERS = {
    "SINGD": (SINGD, {}),
    "IKFAC": (SINGD, {"kfac_like": True}),
    "KFAC": (KFAC, {}),
}
COMMON = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1, "T": 1}


def _model(frozen: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3)
    ).double()
    targets = {
        "bias": [model[0].bias],
        "weight": [model[2].weight],
        "layer": list(model[4].parameters()),
        "norm": [model[3].weight],
    }[frozen]
    for param in targets:
        param.requires_grad_(False)
    return model


@pytest.mark.parametrize("frozen", ["bias", "weight", "layer", "norm"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_frozen_parameters_never_change(name, frozen) -> None:
    cls, options = OPTIMIZERS[name]
    model = _model(frozen)
    optimizer = cls(model, **options, **COMMON)
    before = {n: p.clone() for n, p in model.named_parameters()}
    X, y = torch.randn(8, 4, dtype=torch.float64), torch.randint(0, 3, (8,))
    for _ in range(4):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(X), y).backward()
        optimizer.step()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) == (not p.requires_grad), n
    frozen_params = [p for p in model.parameters() if not p.requires_grad]
    assert all(not optimizer.state[p] for p in frozen_params)


def test_layer_structure_of_frozen_parts() -> None:
    dims = {layer.name: layer.dims for layer in SINGD(_model("bias")).layers}
    assert dims["0"] == (4, 6)  # no bias column
    dims = {layer.name: layer.dims for layer in SINGD(_model("weight")).layers}
    assert dims["2.bias"] == (1, 5)  # bias-only


def test_statistics_of_a_frozen_bias_are_the_weights_alone() -> None:
    model = _model("bias")
    X, y = torch.randn(8, 4, dtype=torch.float64), torch.randint(0, 3, (8,))
    kfac = KFACLinearOperator(
        model,
        nn.CrossEntropyLoss(),
        [model[0].weight],
        [(X, y)],
        fisher_type=FisherType.EMPIRICAL,
        separate_weight_and_bias=False,
        check_deterministic=False,
    )
    kfac.compute_kronecker_factors()
    state = kfac.state_dict()
    A_expected = state["input_covariances"]["0"]
    G_expected = state["gradient_covariances"]["0"]
    assert A_expected.shape == (4, 4)
    optimizer = KFAC(model, T=1)
    nn.functional.cross_entropy(model(X), y).backward()
    optimizer.step()
    layer_state = optimizer.state[model[0].weight]
    torch.testing.assert_close(layer_state["A.mat"], A_expected, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(layer_state["G.mat"], G_expected, rtol=1e-12, atol=1e-15)


def test_parameter_frozen_after_construction_is_not_touched() -> None:
    model = _model("norm")
    optimizer = SINGD(model, **COMMON)
    X, y = torch.randn(8, 4, dtype=torch.float64), torch.randint(0, 3, (8,))
    nn.functional.cross_entropy(model(X), y).backward()
    optimizer.step()
    optimizer.zero_grad()
    model[2].bias.requires_grad_(False)
    bias = model[2].bias.clone()
    nn.functional.cross_entropy(model(X), y).backward()
    optimizer.step()
    assert torch.equal(model[2].bias, bias)  # no momentum, no weight decay


class _TwoHeads(nn.Module):
    """A shared body and two heads, one used per step (multi-task training)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.h1, self.h2 = nn.Linear(3, 4), nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, X: torch.Tensor, head: nn.Module) -> torch.Tensor:
        return head(torch.tanh(self.body(X)))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_layer_without_gradient_sits_the_step_out(name) -> None:
    """Its counter stays, so it updates its factors every `T`-th step it takes part in.

    Heads alternate and `T = 2`: before, a head's counter advanced in every step,
    so the head that is due only on the steps it sits out never updated its
    factors.
    """
    cls, extra = OPTIMIZERS[name]
    model = _TwoHeads().double()
    optimizer = cls(model, **{**COMMON, "T": 2, **extra})
    factor = "K.mat" if cls is SINGD else "A.mat"
    generator = torch.Generator().manual_seed(3)
    uses = {model.h1: 0, model.h2: 0}
    for step in range(12):
        head = model.h1 if step % 2 == 0 else model.h2
        other = model.h2 if head is model.h1 else model.h1
        X = torch.randn(8, 3, dtype=torch.float64, generator=generator)
        y = torch.randint(0, 2, (8,), generator=generator)
        before = {h: optimizer.state[h.weight][factor].clone() for h in uses}
        resting = [p.detach().clone() for p in other.parameters()]
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(X, head), y).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # every due layer has its statistics
            optimizer.step()
        due = uses[head] % 2 == 0
        uses[head] += 1
        changed = not torch.equal(before[head], optimizer.state[head.weight][factor])
        assert changed == due, (step, due)
        assert torch.equal(before[other], optimizer.state[other.weight][factor])
        assert all(
            torch.equal(p, q) for p, q in zip(other.parameters(), resting, strict=True)
        )
        assert optimizer.state[other.weight]["step"] == uses[other]
        assert optimizer.state[head.weight]["step"] == uses[head]
    assert optimizer.state[model.body.weight]["step"] == 12


def test_frozen_layer_passed_explicitly_is_no_fallbacks() -> None:
    """`SINGD(model, model.parameters())` with a frozen layer: no rule trains it.

    Before, its parameters went to the AdamW fallback (with state), which trained
    the layer unpreconditioned once it was unfrozen, without a word.
    """
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    model[0].requires_grad_(False)
    optimizer = SINGD(model, model.parameters(), fallback=None)  # not refused
    optimizer = SINGD(model, model.parameters(), lr=0.1)
    assert [layer.name for layer in optimizer.layers] == ["2"]
    assert not optimizer.fallback_params
    assert not optimizer.state[model[0].weight] and not optimizer.state[model[0].bias]
    X = torch.randn(5, 3, dtype=torch.float64)
    model(X).square().sum().backward()
    optimizer.step()
    model[0].requires_grad_(True)
    frozen_before = [p.detach().clone() for p in model.parameters()]
    optimizer.zero_grad()
    model(X).square().sum().backward()
    with pytest.raises(ValueError, match=r"'0\.bias', '0\.weight': frozen"):
        optimizer.step()
    assert all(
        torch.equal(p, q)
        for p, q in zip(model.parameters(), frozen_before, strict=True)
    )
    # unfrozen and then registered, the layer is preconditioned
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    model[0].requires_grad_(False)
    optimizer = SINGD(model, model[2].parameters())
    model[0].requires_grad_(True)
    optimizer.add_param_group({"params": list(model[0].parameters())})
    assert [layer.name for layer in optimizer.layers] == ["2", "0"]
