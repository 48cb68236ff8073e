"""timm's Swin V2 attention: `qkv`, applied by `F.linear` on windows, as a weight-only
layer whose padded rows are left out of its statistics (`layers.functional_qkv`).

The reference for the factors is curvlinops' `KFACLinearOperator` on a copy of the
model whose attention modules take timm's `qkv_bias_separate` path (they call the
bias-free `qkv` as a module and add the biases after it, the same function) and
whose `qkv` passes no gradient to the outputs of zero input rows: what the
adapter leaves out of the statistics, expressed with module calls.
"""

from __future__ import annotations

import copy

import pytest
import torch
from timm.models import swin_transformer_v2 as timm_v2
from torch import Tensor, nn

from singd_curvlinops import EKFAC, KFAC, SINGD
from singd_curvlinops.layers import FunctionalQKVAdapter, adapter_for
from tests.layers._helpers import (
    assert_keys_trained,
    collected_as_unmodified,
    curvlinops_layer_factors,
    kfac_factors,
    train_without_warnings,
)


def _model(dropout: float = 0.0) -> nn.Module:
    """Four stages of one block on 40x40 images: 10x10 patches in windows of 4
    (padded to 12x12: the last row and column of windows hold padding), then 5x5
    (padded to 8x8), 3x3 and 2x2 (one window each, no padding). The blocks'
    post-norms get weights near one instead of timm's zeros."""
    torch.manual_seed(0)
    model = timm_v2.SwinTransformerV2(
        img_size=40,
        patch_size=4,
        window_size=4,
        embed_dim=8,
        depths=(1, 1, 1, 1),
        num_heads=(1, 2, 2, 2),
        num_classes=3,
        attn_drop_rate=dropout,
        proj_drop_rate=dropout,
        drop_path_rate=0.0,  # (timm's default draws at random)
    )
    for block in model.modules():  # timm zero-initialises the post-norms: no
        if isinstance(block, timm_v2.SwinTransformerV2Block):  # gradient would
            for norm in (block.norm1, block.norm2):  # reach the blocks' layers
                nn.init.normal_(norm.weight, 1.0, 0.1)
    return model


def _attentions(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, timm_v2.WindowAttention)]


def _data(dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    X = torch.randn(3, 3, 40, 40, generator=generator).to(dtype)
    return X, torch.randint(0, 3, (3,), generator=generator)


def _train(model: nn.Module, optimizer, steps: int) -> list[float]:
    X, y = _data(torch.float32)
    return train_without_warnings(model, optimizer, X, y, steps)


def test_qkv_is_a_weight_only_layer_and_the_biases_go_to_the_fallback() -> None:
    """Until 2026-12-02 `qkv` received no statistics and warned at every step,
    then it went to the fallback rule."""
    model = _model()
    optimizer = SINGD(model, T=1, lr=0.01)
    dims = {layer.name: layer.dims for layer in optimizer.layers}
    fallback = {id(p) for p in optimizer.fallback_params}
    attentions = _attentions(model)
    assert len(attentions) == 4
    for index, attention in enumerate(attentions):
        name, dim = f"layers.{index}.blocks.0.attn", 8 * 2**index
        assert isinstance(adapter_for(attention), FunctionalQKVAdapter)
        assert dims[f"{name}.qkv"] == (dim, 3 * dim)  # no bias column
        assert dims[f"{name}.proj"] == (dim + 1, dim)
        assert f"{name}.cpb_mlp.0" in dims
        assert {id(attention.q_bias), id(attention.v_bias)} <= fallback
        assert id(attention.qkv.weight) not in fallback
    before = [attention.qkv.weight.detach().clone() for attention in attentions]
    losses = _train(model, optimizer, 3)
    assert losses[-1] < losses[0]
    for attention, weight in zip(attentions, before, strict=True):
        assert not torch.equal(attention.qkv.weight, weight)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_outputs_and_gradients_equal_the_unmodified_model(dropout) -> None:
    model = _model(dropout).double()
    reference = copy.deepcopy(model)
    optimizer = SINGD(model, T=1)  # collects in every pass
    X, y = _data()
    pending = collected_as_unmodified(optimizer, model, reference, X, y)
    assert {f"layers.{i}.blocks.0.attn.qkv" for i in range(4)} <= pending


class _NoGradientAtZeroRows(nn.Module):
    """`qkv` as a module whose outputs at zero input rows pass no gradient back
    (their weight gradient is zero either way: the input rows are zero)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear
        self.zero_rows: list[Tensor] = []

    def forward(self, x: Tensor) -> Tensor:
        y = self.linear(x)
        zero = x.eq(0).all(dim=-1, keepdim=True)
        self.zero_rows.append(zero.squeeze(-1))
        return torch.where(zero, y.detach(), y)


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_factors_equal_curvlinops_on_module_calls(approx) -> None:
    """One window is one example of `qkv` and `proj` (the module sees windows, not
    images), where curvlinops counts the loader's images: with `n_W` windows per
    image both factors are `1 / n_W` of curvlinops' (as for any linear layer whose
    input's leading dimension is not the batch; layers guide). `cpb_mlp` is left
    out: a layer on a tensor without a batch counts its own example."""
    model = _model().double()
    reference = copy.deepcopy(model)
    wrappers = []
    for attention in _attentions(reference):
        attention.qkv_bias_separate = True  # `qkv(x) + bias`: a module call
        attention.qkv = _NoGradientAtZeroRows(attention.qkv)
        wrappers.append(attention.qkv)
    X, y = _data()
    optimizer = KFAC(model, T=1, lr=0.0, kfac_approx=approx, fallback="sgd")
    nn.functional.cross_entropy(model(X), y).backward()
    optimizer.step()
    inputs, gradients = curvlinops_layer_factors(reference, X, y, approx)
    windows = [w.zero_rows[0].shape[0] // len(X) for w in wrappers]
    assert windows == [9, 4, 1, 1]
    compared = 0
    for layer in optimizer.layers:
        if "cpb_mlp" in layer.name:
            continue
        name = f"{layer.name}.linear" if layer.name.endswith(".qkv") else layer.name
        n_W = windows[int(name.split(".")[1])] if ".attn." in name else 1
        A, G = kfac_factors(optimizer, layer)
        torch.testing.assert_close(n_W * A, inputs[name], rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(n_W * G, gradients[name], rtol=1e-10, atol=1e-13)
        assert G.abs().max() > 0  # (the post-norms pass gradients)
        compared += ".attn." in layer.name
    assert compared == 8  # qkv and proj of four attention modules
    # The padding: zero rows in the first two stages' edge windows only, so no
    # row position holds padding in every window.
    padded = [torch.cat(w.zero_rows) for w in wrappers]
    for rows in padded[:2]:
        assert rows.any() and not rows.any(dim=1).all()
        assert not rows.all(dim=0).any()
    assert not any(rows.any() for rows in padded[2:])


@pytest.mark.parametrize("optimizer_class", [KFAC, EKFAC, SINGD])
def test_trains_its_key_weights_in_float32(optimizer_class) -> None:
    """The padded rows' keys are zero vectors whose normalisation has a gradient of
    about 1/eps: kept as rows of G they would make the key rows' curvature 1e20
    and more (as they did for torchvision's Swin V2)."""
    model = _model()
    optimizer = optimizer_class(model, T=1, lr=0.03, damping=0.1)
    first = _attentions(model)[0]
    before = first.qkv.weight.detach().clone()
    losses = _train(model, optimizer, 4)
    name = "layers.0.blocks.0.attn.qkv"
    assert_keys_trained(optimizer, first.qkv, name, before, losses)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("options", [{"qkv_bias_separate": True}, {"qkv_bias": False}])
def test_qkv_called_as_a_module_goes_to_the_fallback_rule(options) -> None:
    """Its hooks would keep the padded rows, so it is not a layer."""
    attention = timm_v2.WindowAttention(8, window_size=(2, 2), num_heads=2, **options)
    assert adapter_for(attention) is None
    optimizer = SINGD(nn.Sequential(attention), T=1)
    assert "0.qkv" not in {layer.name for layer in optimizer.layers}
    assert id(attention.qkv.weight) in {id(p) for p in optimizer.fallback_params}
    assert "0.proj" in {layer.name for layer in optimizer.layers}


class _OwnForward(timm_v2.WindowAttention):
    """A subclass with a `forward` of its own, which may call `qkv` as a module."""

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        return super().forward(x, mask)


def test_a_subclass_with_its_own_forward_keeps_its_qkv_layer() -> None:
    attention = _OwnForward(8, window_size=(2, 2), num_heads=2)
    optimizer = SINGD(nn.Sequential(attention), T=1)
    assert "0.qkv" in {layer.name for layer in optimizer.layers}
    assert attention.qkv.weight not in set(optimizer.fallback_params)
