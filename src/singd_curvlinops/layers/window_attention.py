r"""torchvision's Swin attention (V1, V2): `qkv`, `proj` as linear layers on windows.

`torchvision.models.swin_transformer.ShiftedWindowAttention` (Swin V1) holds two
`torch.nn.Linear` children, `qkv` and `proj`, but applies their weights inside the
function `shifted_window_attention` through `torch.nn.functional.linear`, on the
input cut into windows: the children's hooks never run. The adapter treats the
attention module as a holder of two slots, `qkv` and `proj` (layer names
`<module>.qkv`, `<module>.proj`, as the children's); the relative position bias
table is not a slot (it goes to the fallback rule).

**Rows.** The module pads its input `[B, H, W, C]` to whole windows, shifts it,
and applies `qkv` to `[B n_W, N, C]` (`n_W` windows of `N` positions each, the
windows of one image consecutive); `proj` acts on the attention's output in the
same layout. All windows of an image share the weights, so the adapter regroups
each application's rows by image, `[B, n_W N, C]`: every image is one example
whose weight-sharing dimension holds all its windows' positions, as for a linear
layer applied to a sequence (curvlinops' convention for such a layer; padded
positions are rows too, as the module computes them). The output is unchanged:
the products are the same rows.

**Mechanism.** On passes that collect statistics, the module's own call runs
under a `torch.overrides.TorchFunctionMode` (`linear_calls.LinearCalls`, a
`capture.CallCapture`) that intercepts exactly the two `F.linear` calls whose
weight is `qkv.weight` or `proj.weight`: it applies them to the regrouped rows,
records their input and output, and hands the product on in the module's
layout. Nothing runs twice, and dropout draws its masks as without the
optimizer. Outputs and gradients equal the unmodified module's (tested to 1e-12
in float64).

**Swin V2.** `ShiftedWindowAttentionV2` applies the same two weights, with two
differences that change what its `qkv` is as a layer:

- It zeroes the key third of the `qkv` bias inside the function (a copy: the
  parameter's key entries receive no gradient). So `qkv` is a **weight-only**
  slot, \(y = W x\) with \(K\) of dimension \(C\), and `qkv.bias` goes to the
  fallback rule: a bias column in \(K\) would mix gradients of the used query
  and value biases into the unused key bias (and into EKFAC's per-example
  gradients, which would credit it with the key rows' output gradients).
- It normalises the keys (cosine attention). At padded positions the input row
  is zero, so the key is the zero vector and `F.normalize`'s gradient there is
  about `1/eps` (1e12). Such a row adds nothing to the weight's gradient (its
  input is zero), but as a row of \(G\) it made the key rows' curvature 1e20
  to 1e24 in an audit of an adapter that kept it (KFAC and EKFAC stopped
  training the key weights, float32 SINGD overflowed). So `qkv`'s rows whose
  input is zero at every image (the padding, which sits at the same positions
  in every image) are **left out** of its statistics: the adapter applies the
  weight to them apart, outside the recorded use. For a weight-only map this is
  exact for the gradient, \(\nabla_W = \sum_r g_r a_r^\top\) has no term from
  them, and the Kronecker factors then describe the rows that carry it.

`proj` is as in V1. The continuous position bias (`cpb_mlp`) is a model of its
own (linear layers on the coordinate table, see the layers guide on layers that
see no batch); it runs once per call, under the capture, which leaves its
`F.linear` calls alone.

**timm's Swin V2** (`timm.models.swin_transformer_v2.WindowAttention`) has the
same two properties, but its windows reach the module already cut, with the
padding in the edge windows only, at positions that differ between windows; it
applies `qkv.weight` with `F.linear` on the windows and is
`functional_qkv.FunctionalQKVAdapter`'s, which leaves the padded rows out of
the statistics by zeroing their output-gradient rows instead.
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

_SWIN = "torchvision.models.swin_transformer"
_SLOTS = ("qkv", "proj")


def _attention_class(module: Module) -> type[Module] | None:
    """Return torchvision's Swin attention class of `module` (V2 before V1).

    Args:
        module: A submodule of the model.

    Returns:
        `ShiftedWindowAttentionV2` or `ShiftedWindowAttention` if `module` is an
        instance, else None (also while torchvision's Swin module has not been
        imported: no model can hold one then).
    """
    swin = sys.modules.get(_SWIN)
    if swin is None:
        return None
    for base in (swin.ShiftedWindowAttentionV2, swin.ShiftedWindowAttention):
        if isinstance(module, base):
            return base
    return None


def _is_v2(module: Module) -> bool:
    """Return whether `module` is torchvision's Swin V2 attention (module docs)."""
    swin = sys.modules.get(_SWIN)
    return swin is not None and isinstance(module, swin.ShiftedWindowAttentionV2)


class ShiftedWindowAttentionAdapter(LinearCallsAdapter):
    """torchvision's Swin window attention, V1 and V2: `qkv`, `proj` (module docs)."""

    description = "torchvision's ShiftedWindowAttention (Swin V1 and V2)"
    unbatched_dims = None

    def matches(self, module: Module) -> bool:
        """Return whether `module` is torchvision's Swin window attention.

        Args:
            module: A submodule of the model.

        Returns:
            True for `ShiftedWindowAttention`, `ShiftedWindowAttentionV2` and
            subclasses that keep its `forward`, with `Linear` children `qkv` and
            `proj`.
        """
        base = _attention_class(module)
        return (
            base is not None
            and plain_forward(module, base)
            and all(isinstance(getattr(module, name, None), Linear) for name in _SLOTS)
        )

    def weight(self, module: Module) -> Parameter:
        """Return `qkv.weight` (for messages).

        Args:
            module: The attention module.

        Returns:
            The first slot's weight.
        """
        return module.qkv.weight

    def bias(self, module: Module) -> Parameter | None:
        """Return the first slot's bias (V1's `qkv.bias`; V2: none).

        Args:
            module: The attention module.

        Returns:
            The first slot's bias, if any.
        """
        return self.slots(module)[0].bias

    def slots(self, module: Module) -> tuple[Slot, ...]:
        """Return the slots `qkv` and `proj`.

        Args:
            module: The attention module.

        Returns:
            Two slots with the children's weights and biases (V2's `qkv`
            without its bias, which goes to the fallback rule: module docs).
        """
        qkv, proj = module.qkv, module.proj
        qkv_bias = None if _is_v2(module) else qkv.bias
        return (Slot("qkv", qkv.weight, qkv_bias), Slot("proj", proj.weight, proj.bias))

    def submodules(self, module: Module) -> tuple[Module, ...]:
        """Return `qkv` and `proj`, which the module applies functionally.

        Args:
            module: The attention module.

        Returns:
            `(qkv, proj)`.
        """
        return tuple(getattr(module, name) for name in _SLOTS)

    def exposed(
        self, module: Module, x: Tensor
    ) -> tuple[dict[str, Tensor], Apply, list[Use]]:
        """Return `qkv` and `proj`, applied to rows grouped by image (module docs).

        Args:
            module: The attention module.
            x: Its input `[B, H, W, C]`.

        Returns:
            The slots' weights, `_WindowRows.apply`, and its uses.
        """
        rows = _WindowRows(x.shape[0], _is_v2(module))
        weights = {name: getattr(module, name).weight for name in _SLOTS}
        return weights, rows.apply, rows.uses

    def use_input_rows(self, module: Module, use: Use, kfac_approx: str) -> Tensor:
        """Return the rows of a slot's input, with its bias column.

        Args:
            module: The attention module.
            use: A use from `forward_uses`.
            kfac_approx: `"expand"` or `"reduce"`.

        Returns:
            The linear layer's rows.
        """
        slot = next(slot for slot in self.slots(module) if slot.name == use.slot)
        return statistics.input_rows(use.x, kfac_approx, bias=slot.bias is not None)


class _WindowRows:
    """Apply the slots to rows grouped by image; record their uses (`LinearCalls`).

    Args:
        images: The batch size `B` of the attention's input.
        drop_zero_rows: Whether `qkv`'s rows that are zero in every image (V2's
            padding) are applied apart and left out of its use (module docs).
    """

    def __init__(self, images: int, drop_zero_rows: bool) -> None:
        self.images = images
        self.drop_zero_rows = drop_zero_rows
        self.uses: list[Use] = []

    def apply(
        self, name: str, x: Tensor, weight: Tensor, bias: Tensor | None
    ) -> Tensor:
        """Apply a slot to the rows of `x` grouped by image; record the use.

        Args:
            name: The slot.
            x: Its input in the module's layout, `[B n_W, N, C]`.
            weight: Its weight.
            bias: The bias the module passes.

        Returns:
            The product in the module's layout.
        """
        grouped = x.reshape(self.images, -1, x.shape[-1])  # [B, n_W N, C]
        kept = None
        if self.drop_zero_rows and name == "qkv":
            kept = grouped.detach().ne(0).any(dim=2).any(dim=0)  # [n_W N]
            if bool(kept.all()):
                kept = None
        if kept is None:
            y = F.linear(grouped, weight, bias)  # (the mode is off in its handler)
            self.uses.append(Use(name, grouped.detach(), y))
            return y.reshape(*x.shape[:-1], y.shape[-1])
        rows = grouped[:, kept]
        y_rows = F.linear(rows, weight, bias)
        self.uses.append(Use(name, rows.detach(), y_rows))
        y = y_rows.new_empty(*grouped.shape[:-1], y_rows.shape[-1])
        y[:, kept] = y_rows
        y[:, ~kept] = F.linear(grouped[:, ~kept], weight, bias)  # (not recorded)
        return y.reshape(*x.shape[:-1], y.shape[-1])
