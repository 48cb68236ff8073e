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
to. In self-attention (`query is key is value`) the packed projection is one
linear map of the input, \([q\; k\; v] = x W_\text{in}^\top + b_\text{in}\). In
cross-attention its query rows and key/value rows act on different inputs: each
application is a *use* of the packed weight that covers some of its output rows
(`Use.out_rows`), and the uses of one pass combine as for any weight used several
times (curvlinops' rule: the inputs concatenate along the weight-sharing
dimension, the output gradients outside a use's rows are zero). `bias_k` and
`bias_v` are no projections; they go to the fallback rule.

Mechanism. On passes that collect statistics, `forward_uses` recomputes the
module's output with the projections exposed: it applies them with
`torch.nn.functional.linear` (the same calls the module makes), computes the
attention between them, applies the output projection, and returns that output in
place of the original one, whose graph is dropped. The attention comes from
`attention_core.attend` (the module's own `scaled_dot_product_attention` call, for
`need_weights=False` without `bias_k`, `bias_v` or zero attention: how
`nn.TransformerEncoderLayer`, `nn.TransformerDecoderLayer` and torchvision's ViT
call it); any other call lets the module run its attention with identity
projections (`torch.func.functional_call` with \(I\) and zero biases in place of
the projection parameters, which reproduces the projected tensors exactly).
Outputs and gradients equal the unmodified module's (the tests check 1e-12 in
float64); with attention dropout, the random state of the original call is
replayed. The cost: the attention runs twice on collecting passes (every `T`
steps), and the identity route adds four products of width \(E\) to the forward
pass and as many to the backward pass.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor
from torch.func import functional_call
from torch.nn import Module, MultiheadAttention, Parameter
from torch.nn import functional as F

from singd_curvlinops import statistics
from singd_curvlinops.layers import attention_core
from singd_curvlinops.layers.base import LayerAdapter, Slot, Use
from singd_curvlinops.layers.matching import plain_forward
from singd_curvlinops.layers.replay import random_state, replayed

_INPUTS = ("query", "key", "value")


class MultiheadAttentionAdapter(LayerAdapter):
    """`torch.nn.MultiheadAttention`: input and output projections (module docs)."""

    description = "torch.nn.MultiheadAttention"
    needs_before_forward = True

    def matches(self, module: Module) -> bool:
        """Return whether `module` is a `MultiheadAttention`.

        Args:
            module: A submodule of the model.

        Returns:
            True for `MultiheadAttention` and its subclasses that keep its
            `forward` (the adapter recomputes the module's output from it).
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

    def before_forward(self, module: Module, args: tuple, kwargs: dict) -> Any:
        """Return the random state before a call whose dropout must be replayed.

        Args:
            module: The attention module.
            args: Positional arguments of the call.
            kwargs: Keyword arguments of the call.

        Returns:
            The CPU (and the input's CUDA device's) random state, or None
            without attention dropout.
        """
        if not (module.training and module.dropout > 0):
            return None
        query = args[0] if args else kwargs["query"]
        return random_state(query.device)

    def forward_uses(
        self,
        module: Module,
        args: tuple,
        kwargs: dict[str, Any],
        output: Any,
        before: Any,
    ) -> tuple[list[Use], Any]:
        """Recompute the output with the projections exposed (module docs).

        Args:
            module: The attention module, after its forward call.
            args: Positional arguments of the call.
            kwargs: Keyword arguments of the call.
            output: `(attn_output, attn_weights)` of the call.
            before: The random state from `before_forward`.

        Returns:
            The projections' uses and the recomputed `(attn_output,
            attn_weights)`.
        """
        bound = inspect.signature(module.forward).bind(*args, **kwargs).arguments
        query, key, value = (bound.pop(name) for name in _INPUTS)
        if not any(t.requires_grad for t in (query, key, value)) and not any(
            p.requires_grad for p in module.parameters()
        ):
            return [], None
        batch_dim = (0 if module.batch_first else 1) if query.dim() == 3 else None
        uses: list[Use] = []
        projected = _project(module, query, key, value, batch_dim, uses)
        if attention_core.direct(module, bound):
            weights = None
            attended = replayed(
                before,
                query.device,
                lambda: attention_core.attend(module, *projected, batch_dim, bound),
            )
        else:
            attended, weights = replayed(
                before,
                query.device,
                lambda: functional_call(
                    module, _identity_projections(module), projected, bound
                ),
            )
            attended = attention_core.sequence_first(attended, batch_dim)
        # sequence first, as the module applies it: its output is then laid out
        # in memory as the module's, and a dropout after it draws the same mask
        attn_output = F.linear(attended, module.out_proj.weight, module.out_proj.bias)
        sequence_dim = None if batch_dim is None else 1
        uses.append(
            Use(
                "out_proj",
                _batch_first(attended, sequence_dim),
                attn_output,
                None,
                sequence_dim,
            )
        )
        # back to the module's layout (the swap is its own inverse)
        output = attention_core.sequence_first(attn_output, batch_dim)
        return uses, (output, weights)

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
    part = (lambda t, rows: None) if b is None else (lambda t, rows: t[rows])
    if query is key and key is value:  # self-attention: one packed product
        return apply("in_proj", query, W, b, None).chunk(3, dim=-1)
    if key is value:  # encoder-decoder attention: query rows, then key-value rows
        q_rows, kv_rows = slice(0, E), slice(E, 3 * E)
        q = apply("in_proj", query, W[q_rows], part(b, q_rows), q_rows)
        kv = apply("in_proj", key, W[kv_rows], part(b, kv_rows), kv_rows)
        return (q, *kv.chunk(2, dim=-1))
    return tuple(
        apply("in_proj", x, W[rows], part(b, rows), rows)
        for x, rows in zip(
            (query, key, value),
            (slice(0, E), slice(E, 2 * E), slice(2 * E, 3 * E)),
            strict=True,
        )
    )


def _identity_projections(module: MultiheadAttention) -> dict[str, Tensor]:
    """Return identity weights and zero biases for every projection parameter.

    Args:
        module: The attention module.

    Returns:
        Substitutes for `torch.func.functional_call`, by parameter name.
    """
    E = module.embed_dim
    reference = module.out_proj.weight
    eye = torch.eye(E, dtype=reference.dtype, device=reference.device)
    substitutes = {"out_proj.weight": eye}
    if module._qkv_same_embed_dim:
        substitutes["in_proj_weight"] = eye.repeat(3, 1)
    else:
        substitutes.update({f"{name}_proj_weight": eye for name in "qkv"})
    for name, bias in (
        ("in_proj_bias", module.in_proj_bias),
        ("out_proj.bias", module.out_proj.bias),
    ):
        if bias is not None:
            substitutes[name] = torch.zeros_like(bias, requires_grad=False)
    return substitutes
