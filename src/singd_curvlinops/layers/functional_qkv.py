r"""timm's BEiT and EVA attention: `qkv.weight` applied with `F.linear`, as a layer.

timm's `beit.Attention` and `eva.EvaAttention` keep the query and value biases as
parameters of their own (`q_bias`, `v_bias`; the key bias is a zero buffer) and,
by default, apply the bias-free `qkv` child's weight with
`F.linear(x, qkv.weight, cat(q_bias, k_bias, v_bias))`: no hook of `qkv` sees
it. (With `qkv_bias=False` or `qkv_bias_separate=True` they call `qkv` as a
module, which is an ordinary linear layer then, and this adapter leaves them.)

The adapter makes `qkv` a **weight-only** slot, \(y = W x\) on the rows
`[B, N, C]` of the attention's input, which is what the weight sees: the biases
are added after it and go to the fallback rule with the other parameters. On
passes that collect statistics `forward_uses` runs the module's `forward` again
with the one `F.linear` call with `qkv.weight` intercepted (`linear_calls`): it
records the call's input and output and hands the product on;
the recomputed output replaces the original one, and dropout's random state is
replayed (`replay`), as for torchvision's Swin attention (`window_attention`).
`proj` is called as a module: a linear layer of its own, whose statistics come
from the recomputed call (the original call's output gets no gradient).

Until 2026-12-02 `qkv` was a layer whose hooks never ran: it received no
statistics, warned at every step and was stepped with identity factors.
"""

from __future__ import annotations

import sys

from torch import Tensor
from torch.nn import Linear, Module, Parameter
from torch.nn import functional as F

from singd_curvlinops import statistics
from singd_curvlinops.layers.base import Slot, Use
from singd_curvlinops.layers.linear_calls import Apply, RecomputingAdapter
from singd_curvlinops.layers.matching import plain_forward

_CLASSES = (("timm.models.beit", "Attention"), ("timm.models.eva", "EvaAttention"))


def _attention_class(module: Module) -> type[Module] | None:
    """Return the timm attention class of `module` (BEiT's or EVA's), or None.

    Args:
        module: A submodule of the model.

    Returns:
        The class `module` is an instance of; None also while timm's modules
        have not been imported (no model can hold one then).
    """
    for name, attribute in _CLASSES:
        cls = getattr(sys.modules.get(name), attribute, None)
        if cls is not None and isinstance(module, cls):
            return cls
    return None


class FunctionalQKVAdapter(RecomputingAdapter):
    """timm's BEiT and EVA attention: a weight-only `qkv` slot (module docs)."""

    description = "timm's BEiT / EVA attention (qkv applied with F.linear)"
    unbatched_dims = None

    def matches(self, module: Module) -> bool:
        """Return whether `module` applies its `qkv.weight` with `F.linear`.

        Args:
            module: A submodule of the model.

        Returns:
            True for timm's `beit.Attention` and `eva.EvaAttention` (and
            subclasses that keep their `forward`) with a `Linear` `qkv` without
            bias, a `q_bias` parameter and `qkv_bias_separate` off.
        """
        base = _attention_class(module)
        qkv = getattr(module, "qkv", None)
        return (
            base is not None
            and plain_forward(module, base)
            and isinstance(qkv, Linear)
            and qkv.bias is None
            and isinstance(getattr(module, "q_bias", None), Parameter)
            and not getattr(module, "qkv_bias_separate", False)
        )

    def weight(self, module: Module) -> Parameter:
        """Return `qkv.weight`.

        Args:
            module: The attention module.

        Returns:
            The slot's weight.
        """
        return module.qkv.weight

    def bias(self, module: Module) -> Parameter | None:
        """Return None: the biases go to the fallback rule (module docs).

        Args:
            module: The attention module.

        Returns:
            None.
        """
        return None

    def slots(self, module: Module) -> tuple[Slot, ...]:
        """Return the weight-only slot `qkv`.

        Args:
            module: The attention module.

        Returns:
            One slot.
        """
        return (Slot("qkv", module.qkv.weight, None),)

    def submodules(self, module: Module) -> tuple[Module, ...]:
        """Return `qkv`, whose weight the module applies functionally.

        Args:
            module: The attention module.

        Returns:
            `(qkv,)`.
        """
        return (module.qkv,)

    def draws_random(self, module: Module) -> bool:
        """Return whether the call draws dropout masks.

        Args:
            module: The attention module.

        Returns:
            Whether it trains with attention or output dropout.
        """
        drops = (getattr(module, name, None) for name in ("attn_drop", "proj_drop"))
        return module.training and any(getattr(d, "p", 0.0) for d in drops)

    def exposed(
        self, module: Module, x: Tensor
    ) -> tuple[dict[str, Tensor], Apply, list[Use]]:
        """Return `qkv`, applied as the module applies it, recording its use.

        Args:
            module: The attention module.
            x: Its input `[B, N, C]`.

        Returns:
            `qkv`'s weight, its application, and the uses.
        """
        uses: list[Use] = []

        def apply(name: str, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
            y = F.linear(x, weight, bias)
            uses.append(Use(name, x.detach(), y))
            return y

        return {"qkv": module.qkv.weight}, apply, uses

    def use_input_rows(self, module: Module, use: Use, kfac_approx: str) -> Tensor:
        """Return the rows of the slot's input (no bias column).

        Args:
            module: The attention module.
            use: A use from `forward_uses`.
            kfac_approx: `"expand"` or `"reduce"`.

        Returns:
            The linear layer's rows.
        """
        return statistics.input_rows(use.x, kfac_approx, bias=False)
