"""timm's BEiT and EVA attention: `qkv`, applied by `F.linear`, as a weight-only layer.

The reference for the factors is curvlinops' `KFACLinearOperator` on a copy of the
model whose attention modules take timm's `qkv_bias_separate` path: they call the
bias-free `qkv` as a module and add the biases after it, the same function, so
curvlinops' own hooks see the layer.
"""

from __future__ import annotations

import copy

import pytest
import timm
import torch
from torch import Tensor, nn

from singd_curvlinops import KFAC, SINGD
from singd_curvlinops.layers import FunctionalQKVAdapter, adapter_for
from tests.layers._helpers import (
    collected_as_unmodified,
    curvlinops_layer_factors,
    kfac_factors,
    train_without_warnings,
)

MODELS = {  # two blocks of width 16 on 4x4 patches
    "beit": ("beit_base_patch16_224", 32, 8),
    "eva": ("eva02_tiny_patch14_224", 28, 7),
}


def _model(name: str, dropout: float = 0.0) -> nn.Module:
    architecture, size, patch = MODELS[name]
    torch.manual_seed(0)
    return timm.create_model(
        architecture,
        pretrained=False,
        img_size=size,
        patch_size=patch,
        embed_dim=16,
        depth=2,
        num_heads=2,
        num_classes=3,
        attn_drop_rate=dropout,
        proj_drop_rate=dropout,
    ).double()


def _data(name: str) -> tuple[Tensor, Tensor]:
    size = MODELS[name][1]
    generator = torch.Generator().manual_seed(1)
    X = torch.randn(3, 3, size, size, dtype=torch.float64, generator=generator)
    return X, torch.randint(0, 3, (3,), generator=generator)


def _attentions(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "qkv_bias_separate")]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_qkv_is_a_weight_only_layer_and_the_biases_go_to_the_fallback(name) -> None:
    """Until 2026-12-02 `qkv` received no statistics, warned at every step and
    was stepped with identity factors."""
    model = _model(name)
    optimizer = SINGD(model, T=1, lr=0.01)
    dims = {layer.name: layer.dims for layer in optimizer.layers}
    fallback = {id(p) for p in optimizer.fallback_params}
    attentions = _attentions(model)
    assert len(attentions) == 2
    for index, attention in enumerate(attentions):
        assert isinstance(adapter_for(attention), FunctionalQKVAdapter)
        assert dims[f"blocks.{index}.attn.qkv"] == (16, 48)  # no bias column
        assert dims[f"blocks.{index}.attn.proj"] == (17, 16)
        assert {id(attention.q_bias), id(attention.v_bias)} <= fallback
    X, y = _data(name)
    before = [attention.qkv.weight.detach().clone() for attention in attentions]
    train_without_warnings(model, optimizer, X, y, 2)
    for attention, weight in zip(attentions, before, strict=True):
        assert not torch.equal(attention.qkv.weight, weight)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_outputs_and_gradients_equal_the_unmodified_model(name, dropout) -> None:
    model = _model(name, dropout)
    reference = copy.deepcopy(model)
    optimizer = SINGD(model, T=1)  # collects in every pass
    X, y = _data(name)
    pending = collected_as_unmodified(optimizer, model, reference, X, y)
    assert {"blocks.0.attn.qkv", "blocks.1.attn.qkv"} <= pending


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_factors_equal_curvlinops_on_module_calls(name, approx) -> None:
    model = _model(name)
    reference = copy.deepcopy(model)
    for attention in _attentions(reference):
        attention.qkv_bias_separate = True  # `qkv(x) + bias`: a module call
    X, y = _data(name)
    optimizer = KFAC(model, T=1, lr=0.0, kfac_approx=approx, fallback="sgd")
    nn.functional.cross_entropy(model(X), y).backward()
    optimizer.step()
    inputs, gradients = curvlinops_layer_factors(reference, X, y, approx)
    compared = 0
    for layer in optimizer.layers:
        A, G = kfac_factors(optimizer, layer)
        torch.testing.assert_close(A, inputs[layer.name], rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(G, gradients[layer.name], rtol=1e-10, atol=1e-13)
        compared += layer.name.endswith(".attn.qkv")
    assert compared == 2


def test_the_module_call_paths_keep_qkv_an_ordinary_linear_layer() -> None:
    """With `qkv_bias_separate` (or without biases) timm calls `qkv` as a module."""
    model = _model("beit")
    for attention in _attentions(model):
        attention.qkv_bias_separate = True
        assert adapter_for(attention) is None
    optimizer = SINGD(model, T=1)
    assert "blocks.0.attn.qkv" in {layer.name for layer in optimizer.layers}
