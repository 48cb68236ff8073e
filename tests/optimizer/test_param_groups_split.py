"""A layer's weight and bias in different groups (timm's weight-decay recipe).

The layer is preconditioned jointly, with the factor options of its weight's
group; each parameter takes the learning rate, momentum and weight decay of its
own group.
"""

from __future__ import annotations

import pytest
import torch
from timm.optim import param_groups_weight_decay
from torch import nn

from singd_curvlinops import KFAC, SINGD


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 3)
    ).double()


def _one_step(model, optimizer) -> dict:
    X, y = torch.randn(8, 4, dtype=torch.float64), torch.randint(0, 3, (8,))
    before = {n: p.clone() for n, p in model.named_parameters()}
    nn.functional.cross_entropy(model(X), y).backward()
    optimizer.step()
    return before


@pytest.mark.parametrize("cls", [SINGD, KFAC])
def test_split_layer_is_preconditioned_jointly_with_per_parameter_options(cls) -> None:
    model = _model()
    groups = param_groups_weight_decay(model, weight_decay=0.1)
    no_decay, decay = groups
    assert no_decay["weight_decay"] == 0.0 and len(decay["params"]) == 2  # weights
    no_decay["lr"] = 0.02
    optimizer = cls(model, groups, lr=0.05, momentum=0.0, T=1)
    assert {layer.name: layer.dims for layer in optimizer.layers} == {
        "0": (5, 6),
        "3": (7, 3),
    }
    torch.manual_seed(1)
    before = _one_step(model, optimizer)

    reference_model = _model()  # one group, lr = 1, no decay: the raw directions
    reference = cls(reference_model, lr=1.0, momentum=0.0, T=1)
    torch.manual_seed(1)
    _one_step(reference_model, reference)
    for layer, ref_layer in zip(optimizer.layers, reference.layers, strict=True):
        for key, value in reference.state[ref_layer.weight].items():
            if torch.is_tensor(value):  # the same joint factors
                torch.testing.assert_close(optimizer.state[layer.weight][key], value)
    reference_params = dict(reference_model.named_parameters())
    for name, param in model.named_parameters():
        if name.startswith("1."):
            continue  # LayerNorm: the AdamW fallback
        direction = before[name] - reference_params[name]
        lr, decay = (0.05, 0.1) if name.endswith("weight") else (0.02, 0.0)
        expected = before[name] - lr * (direction + decay * before[name])
        torch.testing.assert_close(param, expected, rtol=1e-12, atol=1e-14)


def test_split_across_add_param_group_calls_is_refused() -> None:
    model = _model()
    optimizer = SINGD(model, [model[3].weight, model[3].bias])
    with pytest.raises(
        ValueError, match=r"layer '0' must be in the same parameter group"
    ):
        optimizer.add_param_group({"params": [model[0].weight]})
    assert len(optimizer.param_groups) == 1
