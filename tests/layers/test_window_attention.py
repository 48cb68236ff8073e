"""torchvision's Swin attention, V1 and V2: unchanged outputs, curvlinops' factors.

The reference for the factors is curvlinops' `KFACLinearOperator` on a copy of the
model in which `shifted_window_attention` calls the `qkv` and `proj` children as
modules (on the windows' rows grouped by image) instead of applying their weights
with `F.linear`: curvlinops' own hooks then see the two layers. For V2 the copy
calls a weight-only module sharing `qkv.weight` on the rows that are not padding,
as the adapter defines the layer (module docs of `window_attention`).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torchvision.models.swin_transformer as swin
from torch import Tensor, nn

from singd_curvlinops import EKFAC, KFAC, SINGD
from singd_curvlinops.layers import ShiftedWindowAttentionAdapter, adapter_for
from tests.layers._helpers import (
    assert_keys_trained,
    collected_as_unmodified,
    curvlinops_layer_factors,
    kfac_factors,
    train_without_warnings,
)

B = 3


def tiny_swin(version: int = 1, dropout: float = 0.0) -> nn.Module:
    """A two-stage Swin on 10x10 images: 5x5 patches, windows of 3 (padded to 6x6,
    shifted in every second block), a 3x3 second stage (one unshifted window)."""
    v2 = version == 2
    return swin.SwinTransformer(
        patch_size=[2, 2],
        embed_dim=8,
        depths=[2, 2],
        num_heads=[2, 2],
        window_size=[3, 3],
        stochastic_depth_prob=0.0,
        dropout=dropout,
        attention_dropout=dropout,
        num_classes=3,
        block=swin.SwinTransformerBlockV2 if v2 else swin.SwinTransformerBlock,
        downsample_layer=swin.PatchMergingV2 if v2 else swin.PatchMerging,
    ).double()


def _data(seed: int = 1, batch: int = B) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    X = torch.randn(batch, 3, 10, 10, dtype=torch.float64, generator=generator)
    return X, torch.randint(0, 3, (batch,), generator=generator)


def _train(
    model: nn.Module, optimizer: Any, dtype: torch.dtype = torch.float64
) -> list[float]:
    """Take five steps on `_data()` without warnings; return the losses."""
    X, y = _data()
    return train_without_warnings(model, optimizer, X.to(dtype), y, 5)


def _attentions(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, swin.ShiftedWindowAttention)]


def test_the_attention_is_one_layer_holder_with_two_slots() -> None:
    torch.manual_seed(0)
    model = tiny_swin()
    attentions = _attentions(model)
    assert len(attentions) == 4
    for attention in attentions:
        assert isinstance(adapter_for(attention), ShiftedWindowAttentionAdapter)
    names = {layer.name: layer.dims for layer in SINGD(model).layers}
    for name in ("features.1.0.attn", "features.3.1.attn"):
        dim = 8 if name.startswith("features.1") else 16
        assert names[f"{name}.qkv"] == (dim + 1, 3 * dim)
        assert names[f"{name}.proj"] == (dim + 1, dim)


class _Overridden(swin.ShiftedWindowAttention):
    """A subclass with a `forward` of its own: not torchvision's function."""

    def forward(self, x: Tensor) -> Tensor:
        return 2 * super().forward(x)


def test_a_subclass_with_its_own_forward_is_not_matched() -> None:
    attention = _Overridden(8, [3, 3], [1, 1], 2)
    assert adapter_for(attention) is None
    assert adapter_for(attention.qkv) is not None  # its children stay linear layers


def test_swin_v2_projections_are_layers_with_the_key_bias_on_the_fallback() -> None:
    """V2's `qkv` is a weight-only slot and `proj` a slot with its bias; `qkv.bias`
    (whose key third V2 zeroes) goes to the fallback rule. Until 2026-12-02 both
    projections went to the fallback rule."""
    torch.manual_seed(0)
    model = tiny_swin(2)
    optimizer = SINGD(model, T=1)
    dims = {layer.name: layer.dims for layer in optimizer.layers}
    fallback = {id(p) for p in optimizer.fallback_params}
    for name in ("features.1.0.attn", "features.3.1.attn"):
        dim = 8 if name.startswith("features.1") else 16
        assert dims[f"{name}.qkv"] == (dim, 3 * dim)  # no bias column
        assert dims[f"{name}.proj"] == (dim + 1, dim)
    for attention in _attentions(model):
        assert isinstance(adapter_for(attention), ShiftedWindowAttentionAdapter)
        assert id(attention.qkv.bias) in fallback
        assert not {id(attention.qkv.weight), id(attention.proj.weight)} & fallback
    X, y = _data()
    train_without_warnings(model, optimizer, X, y, 2)


@pytest.mark.parametrize("optimizer_class", [KFAC, EKFAC, SINGD])
def test_swin_v2_trains_its_key_weights_in_float32(optimizer_class) -> None:
    """The padded rows' keys are zero vectors whose normalisation has a gradient of
    about 1/eps: kept as rows of G they made the key rows' curvature 1e20 and
    more (KFAC stopped training the key weights, float32 SINGD overflowed).

    Damping 0.1, as for timm's Swin V2: the random tiny model's factors are badly
    conditioned, and at the default 1e-3 KFAC's and EKFAC's float32 losses rose
    again by the fifth step on one machine (AMD EPYC) while they fell on others.
    The padded keys' curvature (1e20) dwarfs any such damping."""
    torch.manual_seed(0)
    model = tiny_swin(2).float()
    optimizer = optimizer_class(model, T=1, lr=0.03, damping=0.1)
    first = _attentions(model)[0]  # (10x10 images: 5x5 patches padded to 6x6)
    before = first.qkv.weight.detach().clone()
    losses = _train(model, optimizer, torch.float32)
    name = "features.1.0.attn.qkv"
    assert_keys_trained(optimizer, first.qkv, name, before, losses)
    assert all(torch.isfinite(p).all() for p in model.parameters())


class _V2CallingChildren(swin.ShiftedWindowAttentionV2):
    """A V2 whose own `forward` may call its children as modules."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x)


def test_a_v2_subclass_with_its_own_forward_keeps_its_children() -> None:
    attention = _V2CallingChildren(8, [3, 3], [1, 1], 2)
    optimizer = SINGD(nn.Sequential(attention), T=1)
    names = {layer.name for layer in optimizer.layers}
    assert {"0.qkv", "0.proj"} <= names
    assert not {attention.qkv.weight, attention.proj.weight} & set(
        optimizer.fallback_params
    )


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_outputs_and_gradients_equal_the_unmodified_model(dropout, version) -> None:
    torch.manual_seed(0)
    model = tiny_swin(version, dropout=dropout)
    reference = copy.deepcopy(model)
    optimizer = SINGD(model, T=1)  # collects in every pass
    X, y = _data()
    pending = collected_as_unmodified(optimizer, model, reference, X, y)
    assert {
        f"features.{s}.{b}.attn.{n}"
        for s in (1, 3)
        for b in (0, 1)
        for n in (
            "qkv",
            "proj",
        )
    } <= pending


class _ModuleCalls:
    """`torch.nn.functional` for `swin`, with the slots applied as their modules."""

    def __init__(self, model: nn.Module) -> None:
        self.children = {}
        for attention in _attentions(model):
            for child in (attention.qkv, attention.proj):
                self.children[child.weight] = child

    def __getattr__(self, name: str):
        return getattr(nn.functional, name)

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        child = self.children.get(weight)
        if child is None:
            return nn.functional.linear(x, weight, bias)
        assert bias is child.bias
        y = child(x.reshape(B, -1, x.shape[-1]))  # the windows of one image together
        return y.reshape(*x.shape[:-1], -1)


def _curvlinops_factors(model, X, y, approx, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(swin, "F", _ModuleCalls(model))
        return curvlinops_layer_factors(model, X, y, approx)


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_factors_equal_curvlinops_on_module_calls(approx, monkeypatch) -> None:
    torch.manual_seed(0)
    model = tiny_swin()
    reference = copy.deepcopy(model)
    X, y = _data()
    optimizer = KFAC(model, T=1, lr=0.0, kfac_approx=approx, fallback="sgd")
    nn.functional.cross_entropy(model(X), y).backward()
    optimizer.step()
    inputs, gradients = _curvlinops_factors(reference, X, y, approx, monkeypatch)
    compared = 0
    for layer in optimizer.layers:
        A, G = kfac_factors(optimizer, layer)
        torch.testing.assert_close(A, inputs[layer.name], rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(G, gradients[layer.name], rtol=1e-10, atol=1e-13)
        compared += ".attn." in layer.name
    assert compared == 8  # qkv and proj of four attention modules


class _WeightOnlyCalls(_ModuleCalls):
    """V2's `qkv` as the adapter defines it: a weight-only module (`qkv_weight`,
    sharing the weight) on the rows that are not zero in every image; the bias V2
    passes is added outside it, the padded rows are applied functionally."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        for attention in _attentions(model):
            weight_only = nn.Linear(1, 1, bias=False)
            weight_only.weight = attention.qkv.weight
            attention.add_module("qkv_weight", weight_only)
            self.children[attention.qkv.weight] = weight_only
        self.padded = 0  # calls with padded rows

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        child = self.children.get(weight)
        if child is None or child.bias is not None:  # (proj: as for V1)
            return super().linear(x, weight, bias)
        grouped = x.reshape(B, -1, x.shape[-1])
        kept = grouped.ne(0).any(dim=2).any(dim=0)
        self.padded += int(not kept.all())
        y = grouped.new_empty(*grouped.shape[:-1], weight.shape[0])
        y[:, kept] = child(grouped[:, kept]) + bias
        y[:, ~kept] = nn.functional.linear(grouped[:, ~kept], weight, bias)
        return y.reshape(*x.shape[:-1], -1)


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_v2_factors_equal_curvlinops_on_module_calls(approx, monkeypatch) -> None:
    """`cpb_mlp` is left out: a layer on a tensor without a batch counts its own
    example (layers guide), curvlinops the loader's batch."""
    torch.manual_seed(0)
    model = tiny_swin(2)
    reference = copy.deepcopy(model)
    X, y = _data()
    optimizer = KFAC(model, T=1, lr=0.0, kfac_approx=approx, fallback="sgd")
    nn.functional.cross_entropy(model(X), y).backward()
    optimizer.step()
    calls = _WeightOnlyCalls(reference)
    with monkeypatch.context() as patch:
        patch.setattr(swin, "F", calls)
        qkv = frozenset(id(attention.qkv) for attention in _attentions(reference))
        inputs, gradients = curvlinops_layer_factors(reference, X, y, approx, qkv)
    compared = 0
    for layer in optimizer.layers:
        if "cpb_mlp" in layer.name:
            continue
        name = f"{layer.name}_weight" if layer.name.endswith(".qkv") else layer.name
        A, G = kfac_factors(optimizer, layer)
        torch.testing.assert_close(A, inputs[name], rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(G, gradients[name], rtol=1e-10, atol=1e-13)
        compared += ".attn." in layer.name
    assert compared == 8  # qkv and proj of four attention modules
    assert calls.padded == 2  # the first stage's blocks pad 5x5 patches to 6x6


def test_micro_batches_equal_one_pass() -> None:
    """Two half batches (loss halved) before a step equal the whole batch."""
    X, y = _data(batch=6)
    results = []
    for halves in (False, True):
        torch.manual_seed(0)
        model = tiny_swin()
        optimizer = SINGD(model, T=1, lr=0.05)
        parts = list(zip(X.chunk(2), y.chunk(2), strict=True)) if halves else [(X, y)]
        for _ in range(2):
            optimizer.zero_grad()
            for X_part, y_part in parts:
                loss = nn.functional.cross_entropy(model(X_part), y_part)
                (loss / len(parts)).backward()
            optimizer.step()
        results.append([p.detach().clone() for p in model.parameters()])
    for whole, halves in zip(*results, strict=True):
        torch.testing.assert_close(halves, whole, rtol=1e-10, atol=1e-12)


def test_singd_trains_the_projections_without_warnings(recwarn) -> None:
    torch.manual_seed(0)
    model = tiny_swin()
    optimizer = SINGD(model, T=1, lr=0.05)
    before = {n: p.clone() for n, p in model.named_parameters()}
    losses = _train(model, optimizer)
    assert not [w for w in recwarn if "received no statistics" in str(w.message)]
    assert losses[-1] < losses[0]
    for attention in _attentions(model):
        layer_names = {id(p) for layer in optimizer.layers for p in layer.params}
        for child in (attention.qkv, attention.proj):
            assert id(child.weight) in layer_names  # preconditioned, not fallback
    for name, param in model.named_parameters():
        assert not torch.equal(param, before[name]), name
