"""`torch.nn.Linear`: the layer type that the adapter defaults describe."""

from __future__ import annotations

from torch.nn import Linear, Module

from singd_curvlinops.layers.base import LayerAdapter
from singd_curvlinops.layers.matching import plain_forward

# subclasses that override `forward` with the same function (read in their source)
SAME_FUNCTION = frozenset(
    {
        "timm.layers.linear.Linear",  # F.linear, with a cast under TorchScript
        "transformers.models.falcon.modeling_falcon.FalconLinear",  # x Wᵀ + b
    }
)


class LinearAdapter(LayerAdapter):
    r"""`torch.nn.Linear` on `[batch, ..., d_in]` inputs.

    Weight `[d_out, d_in]`, optional bias; the dimensions between batch and
    features (e.g. a sequence) share the weight.
    """

    description = "torch.nn.Linear"

    def matches(self, module: Module) -> bool:
        """Return whether `module` is a `Linear` layer.

        Args:
            module: A submodule of the model.

        Returns:
            True for `torch.nn.Linear` and its subclasses that keep its
            `forward` or compute the same (`SAME_FUNCTION`).
        """
        return isinstance(module, Linear) and plain_forward(
            module, Linear, SAME_FUNCTION
        )
