r"""`torch.nn.MultiheadAttention`: its projections as linear layers on their inputs.

The module applies its input projection(s) and its output projection inside
`torch.nn.functional.multi_head_attention_forward`, where no hook reaches them:
the hooks of `out_proj` never run. The adapter treats the module as a holder of
*slots*, one per projection:

| module | slots |
|---|---|
| `kdim == vdim == embed_dim` | `in_proj` (`in_proj_weight`, `_bias`), `out_proj` |
| otherwise | `q_proj`, `k_proj`, `v_proj` (weights), `in_proj_bias`, `out_proj` |

(`in_proj_bias` is a bias-only slot when the projection weights are separate.)

A projection's statistics are those of a linear layer on the inputs it is applied
to. In self-attention (`query is key is value`, or the three alias one tensor,
`_aliases`) the packed projection is one
linear map of the input, \([q\; k\; v] = x W_\text{in}^\top + b_\text{in}\). In
cross-attention its query rows and key/value rows act on different inputs: each
application is a *use* of the packed weight that covers some of its output rows
(`Use.out_rows`), and the uses of one pass combine as for any weight used several
times (curvlinops' rule: the inputs concatenate along the weight-sharing
dimension, the output gradients outside a use's rows are zero). `bias_k` and
`bias_v` are no projections; they go to the fallback rule.

Mechanism. On passes that collect statistics, `before_forward` enters a
`CallCapture` (a torch function mode) for the duration of the module's own call.
The module then runs as written until it calls
`torch.nn.functional.multi_head_attention_forward` with its weights; the mode
computes that call with the projections exposed: it applies them with
`torch.nn.functional.linear` (the products the function makes) and records their
uses, computes the attention between them, and applies the output projection.
The attention comes from `attention_core.attend` (the function's own
`scaled_dot_product_attention` call, for `need_weights=False` without `bias_k`,
`bias_v` or zero attention: how `nn.TransformerEncoderLayer`,
`nn.TransformerDecoderLayer` and torchvision's ViT call it); any other call runs
the function itself on the projected tensors with identity matrices and zero
biases in place of the projection weights, which reproduces them exactly and
costs four products of width \(E\) in the forward pass and as many in the
backward pass. Nothing is computed twice, and dropout draws its numbers once, at
the same point as without the optimizer. Outputs and gradients equal the
unmodified module's (the tests check 1e-12 in float64, and bit for bit where the
products are the same).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module, MultiheadAttention, Parameter
from torch.nn import functional as F

from singd_curvlinops import statistics
from singd_curvlinops.layers import attention_core
from singd_curvlinops.layers.base import Slot, Use
from singd_curvlinops.layers.capture import CallCapture, CapturingAdapter
from singd_curvlinops.layers.matching import plain_forward

_INPUTS = ("query", "key", "value")
_PROJECTIONS = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")
_FUNCTIONAL = inspect.signature(F.multi_head_attention_forward)


class MultiheadAttentionAdapter(CapturingAdapter):
    """`torch.nn.MultiheadAttention`: input and output projections (module docs)."""

    description = "torch.nn.MultiheadAttention"

    def matches(self, module: Module) -> bool:
        """Return whether `module` is a `MultiheadAttention`.

        Args:
            module: A submodule of the model.

        Returns:
            True for `MultiheadAttention` and its subclasses that keep its
            `forward` (the adapter's capture relies on the function it calls).
        """
        return isinstance(module, MultiheadAttention) and plain_forward(
            module, MultiheadAttention
        )

    def weight(self, module: Module) -> Parameter:
        """Return the first projection weight (for messages).

        Args:
            module: The attention module.

        Returns:
            `in_proj_weight` or `q_proj_weight`.
        """
        return self.slots(module)[0].weight

    def bias(self, module: Module) -> Parameter | None:
        """Return the input projection's bias.

        Args:
            module: The attention module.

        Returns:
            `in_proj_bias`.
        """
        return module.in_proj_bias

    def slots(self, module: Module) -> tuple[Slot, ...]:
        """Return the projections (see the module docs).

        Args:
            module: The attention module.

        Returns:
            The slots, input projection(s) first.
        """
        out = Slot("out_proj", module.out_proj.weight, module.out_proj.bias)
        if module._qkv_same_embed_dim:
            return (Slot("in_proj", module.in_proj_weight, module.in_proj_bias), out)
        separate = tuple(
            Slot(f"{name}_proj", getattr(module, f"{name}_proj_weight"), None)
            for name in "qkv"
        )
        if module.in_proj_bias is None:
            return (*separate, out)
        return (*separate, Slot("in_proj_bias", None, module.in_proj_bias), out)

    def submodules(self, module: Module) -> tuple[Module, ...]:
        """Return `out_proj`, which the module applies functionally.

        Args:
            module: The attention module.

        Returns:
            `(out_proj,)`.
        """
        return (module.out_proj,)

    def slot_dims(self, module: Module, slot: Slot) -> tuple[int, int]:
        """Return `(d_in, d_out)` of a projection.

        Args:
            module: The attention module.
            slot: One of its slots.

        Returns:
            The weight's `(columns, rows)`; `(0, 3E)` for the bias-only slot.
        """
        if slot.weight is None:
            return 0, slot.bias.shape[0]
        d_out, d_in = slot.weight.shape
        return d_in, d_out

    def capture(self, module: Module, args: tuple, kwargs: dict) -> _ExposedAttention:
        """Return the mode that exposes the projections of this call (module docs).

        Args:
            module: The attention module.
            args: Positional arguments of the call.
            kwargs: Keyword arguments of the call.

        Returns:
            The capture.
        """
        return _ExposedAttention(module)

    def use_input_rows(self, module: Module, use: Use, kfac_approx: str) -> Tensor:
        """Return the rows of a projection's input, with its slot's bias column.

        Args:
            module: The attention module.
            use: A use from `forward_uses`.
            kfac_approx: `"expand"` or `"reduce"`.

        Returns:
            The linear layer's rows.
        """
        (slot,) = (s for s in self.slots(module) if s.name == use.slot)
        return statistics.input_rows(use.x, kfac_approx, bias=slot.bias is not None)


def _batch_first(x: Tensor, batch_dim: int | None) -> Tensor:
    """Return a detached view of `x` with the batch dimension first.

    Args:
        x: A tensor in the module's layout.
        batch_dim: Its batch dimension (None: unbatched, one example).

    Returns:
        `[batch, ..., features]`.
    """
    x = x.detach()
    return x.unsqueeze(0) if batch_dim is None else x.movedim(batch_dim, 0)


class _ExposedAttention(CallCapture):
    """Computes a module's `multi_head_attention_forward` with the projections exposed.

    Args:
        module: The attention module whose call this captures.
    """

    def __init__(self, module: MultiheadAttention) -> None:
        super().__init__()
        self.module = module

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: PLW3201
        """Expose the module's attention call; run everything else as is."""
        kwargs = kwargs or {}
        if func is not F.multi_head_attention_forward:
            return func(*args, **kwargs)
        call = _FUNCTIONAL.bind(*args, **kwargs).arguments
        module = self.module
        own = call["out_proj_weight"] is module.out_proj.weight and all(
            call.get(name) is getattr(module, name) for name in _PROJECTIONS
        )
        tensors = [call[name] for name in _INPUTS] + list(module.parameters())
        if not own or not any(t.requires_grad for t in tensors):
            return func(*args, **kwargs)  # another module's weights, or no graph
        return _exposed_attention(module, func, call, self.uses)


@torch.compiler.disable
def _exposed_attention(
    module: MultiheadAttention, func: Any, call: dict[str, Any], uses: list[Use]
) -> tuple[Tensor, Tensor | None]:
    """Compute `multi_head_attention_forward` with the projections' uses recorded.

    Args:
        module: The attention module.
        func: `torch.nn.functional.multi_head_attention_forward`.
        call: Its arguments by name (sequence first: the module has transposed
            batch-first inputs).
        uses: Receives the projections' uses.

    Returns:
        `(attn_output, attn_weights)` as `func` returns them.
    """
    query, key, value = (call.pop(name) for name in _INPUTS)
    batch_dim = 1 if query.dim() == 3 else None
    projected = _project(module, query, key, value, batch_dim, uses)
    if attention_core.direct(call):
        weights = None
        attended = attention_core.attend(*projected, batch_dim, call)
    else:
        attended, weights = func(*projected, **{**call, **_identity_projections(call)})
    attn_output = F.linear(attended, module.out_proj.weight, module.out_proj.bias)
    uses.append(
        Use("out_proj", _batch_first(attended, batch_dim), attn_output, None, batch_dim)
    )
    return attn_output, weights


def _project(
    module: MultiheadAttention,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    batch_dim: int | None,
    uses: list[Use],
) -> tuple[Tensor, Tensor, Tensor]:
    """Apply the input projection(s) as the module does; record their uses.

    Args:
        module: The attention module.
        query: Its query, in the module's layout.
        key: Its key.
        value: Its value.
        batch_dim: The batch dimension (None: unbatched).
        uses: Receives the uses.

    Returns:
        The projected query, key and value.
    """
    E = module.embed_dim

    def apply(
        slot: str, x: Tensor, weight: Tensor, bias: Tensor | None, rows: slice | None
    ) -> Tensor:
        y = F.linear(x, weight, bias)
        uses.append(Use(slot, _batch_first(x, batch_dim), y, rows, batch_dim))
        return y

    W, b = module.in_proj_weight, module.in_proj_bias
    if not module._qkv_same_embed_dim:
        biases = (None,) * 3 if b is None else b.chunk(3)
        projected = []
        for index, (name, x) in enumerate(zip("qkv", (query, key, value), strict=True)):
            weight = getattr(module, f"{name}_proj_weight")
            y = apply(f"{name}_proj", x, weight, biases[index], None)
            if b is not None:  # the bias-only slot sees the same output
                rows = slice(index * E, (index + 1) * E)
                uses.append(Use("in_proj_bias", None, y, rows, batch_dim))
            projected.append(y)
        return tuple(projected)

    def packed(inputs: tuple[Tensor, ...], start: int) -> Tensor:
        """Project inputs that alias one tensor with rows `start E …`: one use."""
        rows = slice(start * E, (start + len(inputs)) * E)
        whole = rows == slice(0, 3 * E)
        if all(t is inputs[0] for t in inputs):  # one product
            weight = W if whole else W[rows]
            bias = b if whole or b is None else b[rows]
            y = F.linear(inputs[0], weight, bias)
        else:  # distinct for autograd (FSDP2's hook): one product each, as the module
            thirds = range(start, start + len(inputs))
            y = torch.cat(
                [
                    F.linear(t, W[i * E : (i + 1) * E], _rows(b, i, E))
                    for t, i in zip(inputs, thirds, strict=True)
                ],
                dim=-1,
            )
        x = _batch_first(inputs[0], batch_dim)
        uses.append(Use("in_proj", x, y, None if whole else rows, batch_dim))
        return y

    if _aliases(query, key) and _aliases(key, value):  # self-attention
        return packed((query, key, value), 0).chunk(3, dim=-1)
    if _aliases(key, value):  # encoder-decoder: query rows, then key-value rows
        return (packed((query,), 0), *packed((key, value), 1).chunk(2, dim=-1))
    return tuple(packed((x,), i) for i, x in enumerate((query, key, value)))


def _rows(bias: Tensor | None, third: int, E: int) -> Tensor | None:
    """Return one third of a packed bias (None without a bias).

    Args:
        bias: `in_proj_bias`, `[3 E]`, or None.
        third: 0 (query), 1 (key) or 2 (value).
        E: The embedding dimension.

    Returns:
        `bias[third E : (third + 1) E]`, or None.
    """
    return None if bias is None else bias[third * E : (third + 1) * E]


def _aliases(a: Tensor, b: Tensor) -> bool:
    """Return whether two inputs are one tensor: the same object or the same memory.

    A module's forward pre-hook may hand the module distinct tensors for one
    input passed three times: FSDP2's pre-forward hook passes each input through
    an autograd function of its own, whose outputs alias the input. Such inputs
    hold the same numbers, so their projections are one use of the packed weight
    (the rows and statistics of self-attention), computed as one product per
    input, as the module computes them, so that each input keeps its own
    gradient path.

    Args:
        a: An input of the attention call.
        b: Another.

    Returns:
        True for the same tensor, or tensors with the same storage, offset,
        shape, strides, dtype and device.
    """
    return a is b or (
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
    )


def _identity_projections(call: dict[str, Any]) -> dict[str, Any]:
    """Return identity weights and zero biases for the projections of a call.

    Args:
        call: The arguments of `multi_head_attention_forward` by name.

    Returns:
        Substitutes by argument name: the call then attends between its inputs
        as they are and returns the heads' outputs merged.
    """
    reference = call["out_proj_weight"]
    E = reference.shape[0]
    eye = torch.eye(E, dtype=reference.dtype, device=reference.device)
    substitutes: dict[str, Any] = {"out_proj_weight": eye}
    if call.get("use_separate_proj_weight", False):
        substitutes.update({f"{name}_proj_weight": eye for name in "qkv"})
    else:
        substitutes["in_proj_weight"] = eye.repeat(3, 1)
    for name, substitute in (("in_proj_bias", 3 * E), ("out_proj_bias", E)):
        if call.get(name) is not None:
            substitutes[name] = reference.new_zeros(substitute)
    return substitutes
