"""timm's Swin V2 attention: its `qkv` goes to the fallback rule (module docs of
`layers.window_attention`), its `proj` and `cpb_mlp` are preconditioned layers."""

from __future__ import annotations

import warnings

import pytest
import torch
from timm.models import swin_transformer_v2 as timm_v2
from torch import Tensor, nn

from singd_curvlinops import KFAC, SINGD


def _model() -> nn.Module:
    """Four stages of one block on 40x40 images: 10x10 patches in windows of 4
    (padded to 12x12), then 5x5 (padded to 8x8), 3x3 and 2x2 (one window)."""
    torch.manual_seed(0)
    return timm_v2.SwinTransformerV2(
        img_size=40,
        patch_size=4,
        window_size=4,
        embed_dim=8,
        depths=(1, 1, 1, 1),
        num_heads=(1, 2, 2, 2),
        num_classes=3,
    )


def _attentions(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, timm_v2.WindowAttention)]


@pytest.mark.parametrize("optimizer_class", [SINGD, KFAC])
def test_qkv_goes_to_the_fallback_rule_and_trains_without_warnings(
    optimizer_class,
) -> None:
    """Until 2026-12-02 `qkv` (applied with `F.linear`) was a layer that received no
    statistics, warned at every step and was stepped with identity factors."""
    model = _model()
    optimizer = optimizer_class(model, T=1, lr=0.01)
    attentions = _attentions(model)
    assert len(attentions) == 4
    fallback = {id(p) for p in optimizer.fallback_params}
    names = {layer.name for layer in optimizer.layers}
    for index, attention in enumerate(attentions):
        assert id(attention.qkv.weight) in fallback
        assert f"layers.{index}.blocks.0.attn.proj" in names
        assert f"layers.{index}.blocks.0.attn.cpb_mlp.0" in names
    before = [attention.qkv.weight.detach().clone() for attention in attentions]
    generator = torch.Generator().manual_seed(1)
    X = torch.randn(2, 3, 40, 40, generator=generator)
    y = torch.randint(0, 3, (2,), generator=generator)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "received no statistics", nothing
        for _ in range(3):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(X), y).backward()
            optimizer.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    for attention, weight in zip(attentions, before, strict=True):
        assert not torch.equal(attention.qkv.weight, weight)


class _OwnForward(timm_v2.WindowAttention):
    """A subclass with a `forward` of its own, which may call `qkv` as a module."""

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        return super().forward(x, mask)


def test_a_subclass_with_its_own_forward_keeps_its_qkv_layer() -> None:
    attention = _OwnForward(8, window_size=(2, 2), num_heads=2)
    optimizer = SINGD(nn.Sequential(attention), T=1)
    assert "0.qkv" in {layer.name for layer in optimizer.layers}
    assert attention.qkv.weight not in set(optimizer.fallback_params)
