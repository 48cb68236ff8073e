"""Frozen parameters (`requires_grad=False`) are never touched (issue 16, item 1).

A layer with a frozen bias is preconditioned as a layer without bias: its
statistics are those of the weight alone, curvlinops' factors of the weight
(no bias column). A layer with a frozen weight is a bias-only layer.
"""

from __future__ import annotations

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
