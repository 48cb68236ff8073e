r"""The middle of `nn.MultiheadAttention`: attention on projected queries, keys, values.

`MultiheadAttentionAdapter` applies the module's projections itself on
collecting passes (their inputs and outputs are the statistics' rows). What the
module does between its input and output projections is computed here, from the
projected tensors, for the calls that use `scaled_dot_product_attention`
(`need_weights=False`, as `nn.TransformerEncoderLayer`, `nn.TransformerDecoderLayer`
and torchvision's ViT call it) and have no `bias_k`, `bias_v` or zero attention
(`direct`). For \(H\) heads of width \(h = E / H\), with \(q, k, v\) split into
heads,

\[
    o = \operatorname{softmax}\!\Bigl(\frac{q k^\top}{\sqrt{h}} + M\Bigr) v,
\]

where the additive mask \(M\) combines `attn_mask` and `key_padding_mask` (a
boolean mask is \(-\infty\) where it is true), or is causal under the
`is_causal` hint, with attention dropout in training: the same
`scaled_dot_product_attention` call with the same arguments as
`torch.nn.functional.multi_head_attention_forward` makes, so that it draws the
dropout mask the function would draw. For every other call the adapter runs
that function itself on the projected tensors with identity projections
(`attention`), which costs four extra products of the width \(E\) in the
forward pass and as many in the backward pass.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
from torch.nn import functional as F


def direct(call: dict[str, Any]) -> bool:
    """Return whether `attend` computes this call's attention.

    Args:
        call: The arguments of `multi_head_attention_forward` by name.

    Returns:
        True for `need_weights=False` without `bias_k`, `bias_v`, zero attention
        and static keys or values.
    """
    return (
        call.get("need_weights", True) is False
        and not call.get("add_zero_attn", False)
        and all(
            call.get(name) is None
            for name in ("bias_k", "bias_v", "static_k", "static_v")
        )
    )


def attend(
    q: Tensor, k: Tensor, v: Tensor, batch_dim: int | None, call: dict[str, Any]
) -> Tensor:
    """Return the heads' attention outputs, merged.

    Args:
        q: Projected queries, `[L, B, E]` or unbatched `[L, E]`.
        k: Projected keys, `[S, B, E]` or `[S, E]`.
        v: Projected values, like `k`.
        batch_dim: 1, or None for unbatched inputs.
        call: The arguments of `multi_head_attention_forward` by name (a call
            that is `direct`).

    Returns:
        The input of the output projection, `[L, B, E]` or `[L, E]`.
    """
    q, k, v = (_batched(t, batch_dim) for t in (q, k, v))
    length, batch, width = q.shape
    heads = call["num_heads"]
    mask, is_causal = _mask(
        call.get("attn_mask"),
        call.get("key_padding_mask"),
        bool(call.get("is_causal", False)),
        (batch, heads, length, k.shape[0]),
        q,
    )
    dropout = call["dropout_p"] if call.get("training", True) else 0.0
    out = F.scaled_dot_product_attention(
        *(_split_heads(t, batch, heads) for t in (q, k, v)),
        mask,
        dropout,
        is_causal,
    )
    merged = out.permute(2, 0, 1, 3).reshape(length, batch, width)
    return merged.squeeze(1) if batch_dim is None else merged


def _batched(x: Tensor, batch_dim: int | None) -> Tensor:
    """Return a sequence-first tensor with a batch dimension (of one if unbatched).

    Args:
        x: `[L, B, E]`, or unbatched `[L, E]`.
        batch_dim: 1, or None for unbatched inputs.

    Returns:
        `[L, B, E]`.
    """
    return x.unsqueeze(1) if batch_dim is None else x


def _split_heads(x: Tensor, batch: int, heads: int) -> Tensor:
    """Return `[positions, batch, E]` as `[batch, heads, positions, E / heads]`.

    Args:
        x: Projected tensor, sequence first.
        batch: Batch size.
        heads: Number of heads.

    Returns:
        The heads (contiguous per position, as the module lays them out).
    """
    positions, width = x.shape[0], x.shape[-1] // heads  # explicit: B may be 0
    split = x.contiguous().view(positions, batch * heads, width).transpose(0, 1)
    return split.view(batch, heads, positions, width)


def _mask(
    attn_mask: Tensor | None,
    key_padding_mask: Tensor | None,
    is_causal: bool,
    shape: tuple[int, int, int, int],
    q: Tensor,
) -> tuple[Tensor | None, bool]:
    """Return the additive mask and causal flag of the attention call.

    Args:
        attn_mask: `[L, S]` or `[B H, L, S]`, boolean (true: not attended) or
            additive, or None.
        key_padding_mask: `[B, S]` (or `[S]` unbatched), boolean or additive, or
            None.
        is_causal: The call's hint that `attn_mask` is the causal mask.
        shape: `(B, H, L, S)`.
        q: The queries (for the masks' floating-point type).

    Returns:
        The mask for `scaled_dot_product_attention` (broadcastable to `shape`)
        and its `is_causal`: with the hint and no padding mask the attention is
        causal without a mask, as in the module.
    """
    batch, heads, length, source = shape
    padding = _additive(key_padding_mask, q)
    if is_causal and padding is None:
        return None, True
    mask = _additive(attn_mask, q)
    if mask is not None and mask.dim() == 3:  # per head; [L, S] broadcasts
        mask = mask.view(batch, heads, length, source)
    if padding is not None:
        padding = padding.view(batch, 1, 1, source)
        mask = padding if mask is None else mask + padding
        is_causal = False
    return mask, is_causal


def _additive(mask: Tensor | None, q: Tensor) -> Tensor | None:
    r"""Return a boolean mask as an additive one (\(-\infty\) where true).

    Args:
        mask: Boolean or floating-point mask, or None.
        q: The queries (the additive mask's type).

    Returns:
        The additive mask (a floating-point mask as it is), or None.
    """
    if mask is None or mask.is_floating_point():
        return mask
    return q.new_zeros(mask.shape).masked_fill_(mask, float("-inf"))
