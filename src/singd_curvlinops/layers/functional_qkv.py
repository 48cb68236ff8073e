r"""timm's BEiT, EVA and Swin V2 attention: `qkv.weight` applied by `F.linear`, a layer.

timm's `beit.Attention` and `eva.EvaAttention` keep the query and value biases as
parameters of their own (`q_bias`, `v_bias`; the key bias is a zero buffer) and,
by default, apply the bias-free `qkv` child's weight with
`F.linear(x, qkv.weight, cat(q_bias, k_bias, v_bias))`: no hook of `qkv` sees
it. (With `qkv_bias=False` or `qkv_bias_separate=True` they call `qkv` as a
module, which is an ordinary linear layer then, and this adapter leaves them.)

The adapter makes `qkv` a **weight-only** slot, \(y = W x\) on the rows
`[B, N, C]` of the attention's input, which is what the weight sees: the biases
are added after it and go to the fallback rule with the other parameters. On
passes that collect statistics the module's own call runs with the one
`F.linear` call with `qkv.weight` intercepted (`linear_calls.LinearCalls`, a
`capture.CallCapture`): it records the call's input and output and hands the
product on, as for torchvision's Swin attention (`window_attention`). `proj` is
called as a module: a linear layer of its own.

**timm's Swin V2** (`swin_transformer_v2.WindowAttention`) applies its `qkv`
the same way, on windows `[B n_W, N, C]` (one window is one example, as for its
`proj`, an ordinary linear layer on the same rows), and normalises the keys
(cosine attention). A window at the image's edge holds padding: input rows that
are zero, whose keys are zero vectors, and `F.normalize`'s gradient there is
about `1/eps` (1e12). Such a row adds nothing to the weight's gradient
\(\nabla_W = \sum_r g_r a_r^\top\) (its \(a_r\) is zero), but as a row of
\(\tilde g\) it would make the key rows' curvature 1e20 and more (the reason
torchvision's Swin V2 leaves such rows out, `window_attention`). timm cuts the
windows before this module, so the padding is in the edge windows only, at
positions that differ between windows: instead of leaving rows out, this
adapter **zeroes the output-gradient rows of the input rows that are zero**
(`use_gradient_rows`) for the statistics only; the gradients themselves are
untouched (any input row that is exactly zero counts, padding or not).
\(U_K\) does not change (those rows of \(a\) are zero),
\(U_C\) loses exactly the padded rows' terms, and EKFAC's per-example
gradients are unchanged. With `qkv_bias=False` or `qkv_bias_separate=True` timm
calls `qkv` as a module, whose hooks would keep the padded rows: that `qkv` goes
to the fallback rule (`fallback_children`).

Until 2026-12-02 `qkv` was a layer whose hooks never ran: it received no
statistics, warned at every step and was stepped with identity factors (timm's
Swin V2 `qkv` then went to the fallback rule for a few hours).
"""

from __future__ import annotations

import sys

from torch import Tensor
from torch.nn import Linear, Module, Parameter
from torch.nn import functional as F

from singd_curvlinops import statistics
from singd_curvlinops.layers.base import Slot, Use
from singd_curvlinops.layers.linear_calls import Apply, LinearCallsAdapter
from singd_curvlinops.layers.matching import plain_forward

_CLASSES = (
    ("timm.models.beit", "Attention"),
    ("timm.models.eva", "EvaAttention"),
    ("timm.models.swin_transformer_v2", "WindowAttention"),
)
_NORMALISED_KEYS = _CLASSES[2]  # (zero input rows: their gradient rows are left out)


def _attention_class(module: Module) -> type[Module] | None:
    """Return the timm attention class of `module` (BEiT's, EVA's, Swin V2's), or None.

    Args:
        module: A submodule of the model.

    Returns:
        The class `module` is an instance of; None also while timm's modules
        have not been imported (no model can hold one then).
    """
    for name in _CLASSES:
        cls = _class(name)
        if cls is not None and isinstance(module, cls):
            return cls
    return None


def fallback_children(module: Module) -> tuple[Module, ...]:
    """Return the children of timm's Swin V2 attention that go to the fallback rule.

    `layers.find_sites` gives their parameters to the fallback rule, as it does
    for an unmatched `nn.MultiheadAttention`'s children.

    Args:
        module: A submodule of the model.

    Returns:
        `(qkv,)` for timm's `swin_transformer_v2.WindowAttention` (and subclasses
        that keep its `forward`) that calls `qkv` as a module (`qkv_bias=False`
        or `qkv_bias_separate=True`): its hooks would keep the padded rows
        (module docs); else `()`.
    """
    base = _class(_NORMALISED_KEYS)
    if (
        base is None
        or not isinstance(module, base)
        or not plain_forward(module, base)
        or FunctionalQKVAdapter().matches(module)
    ):
        return ()
    qkv = getattr(module, "qkv", None)
    return (qkv,) if isinstance(qkv, Module) else ()


def _class(name: tuple[str, str]) -> type[Module] | None:
    """Return a timm class by module and attribute name, or None if not imported.

    Args:
        name: `(module, attribute)`.

    Returns:
        The class, or None.
    """
    return getattr(sys.modules.get(name[0]), name[1], None)


class FunctionalQKVAdapter(LinearCallsAdapter):
    """timm's BEiT, EVA and Swin V2 attention: a weight-only `qkv` (module docs)."""

    description = "timm's BEiT / EVA / Swin V2 attention (qkv applied with F.linear)"
    unbatched_dims = None

    def matches(self, module: Module) -> bool:
        """Return whether `module` applies its `qkv.weight` with `F.linear`.

        Args:
            module: A submodule of the model.

        Returns:
            True for timm's `beit.Attention`, `eva.EvaAttention` and
            `swin_transformer_v2.WindowAttention` (and subclasses that keep
            their `forward`) with a `Linear` `qkv` without
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

    def use_gradient_rows(
        self,
        module: Module,
        use: Use,
        grad_output: Tensor,
        kfac_approx: str,
        loss_average: statistics.LossAverage,
    ) -> Tensor:
        r"""Return the rows \(\tilde g\); zero where the input row is zero (Swin V2).

        Under normalised keys (timm's Swin V2) the padded rows' gradients are
        about `1/eps`; their input rows are zero, so they add nothing to the
        weight's gradient and are left out of the statistics (module docs).

        Args:
            module: The attention module.
            use: A use from `forward_uses`.
            grad_output: Gradient w.r.t. `use.output`, `[B, N, 3C]`.
            kfac_approx: `"expand"` or `"reduce"`.
            loss_average: `None`, `"batch"` or `"batch+sequence"`.

        Returns:
            The output-gradient rows.
        """
        if _attention_class(module) is _class(_NORMALISED_KEYS):  # (no host read)
            zero = use.x.eq(0).all(dim=-1, keepdim=True)
            grad_output = grad_output.masked_fill(zero, 0.0)
        return super().use_gradient_rows(
            module, use, grad_output, kfac_approx, loss_average
        )
