"""torchvision's Swin V1 attention: unchanged outputs, curvlinops' factors, trained.

The reference for the factors is curvlinops' `KFACLinearOperator` on a copy of the
model in which `shifted_window_attention` calls the `qkv` and `proj` children as
modules (on the windows' rows grouped by image) instead of applying their weights
with `F.linear`: curvlinops' own hooks then see the two layers.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torchvision.models.swin_transformer as swin
from torch import Tensor, nn

from singd_curvlinops import KFAC, SINGD
from singd_curvlinops.layers import ShiftedWindowAttentionAdapter, adapter_for
from tests.layers._helpers import kfac_factors
from tests.test_statistics import curvlinops_factors

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


def _v2_projections(model: nn.Module) -> set[nn.Parameter]:
    return {
        p
        for attention in _attentions(model)
        for child in (attention.qkv, attention.proj)
        for p in child.parameters()
    }


def test_swin_v2_projections_go_to_the_fallback_rule() -> None:
    """V2 has no adapter (module docs of `window_attention`): it applies `qkv` and
    `proj` with `F.linear`, so they go to the fallback rule, as the children of
    an unmatched `nn.MultiheadAttention` do, instead of warning at every step."""
    torch.manual_seed(0)
    model = tiny_swin(2)
    for attention in _attentions(model):
        assert adapter_for(attention) is None
    optimizer = SINGD(model, T=1)
    projections = _v2_projections(model)
    assert len(projections) == 16  # 4 attentions, weight and bias of 2 children
    assert projections <= set(optimizer.fallback_params)
    layered = {p for layer in optimizer.layers for p in layer.params}
    assert not projections & layered
    assert any("cpb_mlp" in layer.name for layer in optimizer.layers)
    before = {p: p.detach().clone() for p in projections}
    X, y = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "received no statistics", nothing
        for _ in range(2):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(X), y).backward()
            optimizer.step()
    weights = [attention.qkv.weight for attention in _attentions(model)]
    assert all(not torch.equal(w, before[w]) for w in weights)


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


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_outputs_and_gradients_equal_the_unmodified_model(dropout) -> None:
    torch.manual_seed(0)
    model = tiny_swin(dropout=dropout)
    reference = copy.deepcopy(model)
    optimizer = SINGD(model, T=1)  # collects in every pass
    X, y = _data()
    results, states = [], []
    for net in (model, reference):
        torch.manual_seed(2)  # the same dropout masks
        loss = nn.functional.cross_entropy(net(X), y)
        results.append((loss, torch.autograd.grad(loss, list(net.parameters()))))
        states.append(torch.get_rng_state())
    (loss, grads), (loss_ref, grads_ref) = results
    torch.testing.assert_close(loss, loss_ref, rtol=0, atol=1e-12)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-12)
    assert states[0].equal(states[1]), "the replay must draw no extra numbers"
    pending = {layer.name for layer in optimizer._collector._pending}
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
        return curvlinops_factors(
            model,
            X,
            y,
            nn.CrossEntropyLoss(),
            approx,
            params=[  # (curvlinops takes the parameters of its layer types only)
                p
                for m in model.modules()
                if isinstance(m, (nn.Linear, nn.Conv2d))
                for p in m.parameters()
            ],
        )


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
    X, y = _data()
    before = {n: p.clone() for n, p in model.named_parameters()}
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(X), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert not [w for w in recwarn if "received no statistics" in str(w.message)]
    assert losses[-1] < losses[0]
    for attention in _attentions(model):
        layer_names = {id(p) for layer in optimizer.layers for p in layer.params}
        for child in (attention.qkv, attention.proj):
            assert id(child.weight) in layer_names  # preconditioned, not fallback
    for name, param in model.named_parameters():
        assert not torch.equal(param, before[name]), name
