r"""`torch.nn.Conv2d` as a linear layer on its input patches.

A convolution applies its weight, flattened to `[C_out, C_in / groups * k1 * k2]`,
to every patch under the kernel: the patches (curvlinops' extraction, with stride,
groups, dilation and string padding) are the input rows, the output locations
the weight-sharing dimension.
"""

from __future__ import annotations

from torch import Tensor
from torch.nn import Conv2d, Module

from singd_curvlinops import statistics
from singd_curvlinops.layers.base import LayerAdapter
from singd_curvlinops.layers.matching import plain_forward


class Conv2dAdapter(LayerAdapter):
    """`torch.nn.Conv2d` with zero padding (`padding_mode="zeros"`)."""

    description = "torch.nn.Conv2d (padding_mode='zeros')"
    unbatched_dims = 3  # [C, H, W]

    def matches(self, module: Module) -> bool:
        """Return whether `module` is a zero-padded `Conv2d`.

        Args:
            module: A submodule of the model.

        Returns:
            True for `Conv2d` (and subclasses that keep its `forward`) with
            `padding_mode="zeros"`.
        """
        return (
            isinstance(module, Conv2d)
            and plain_forward(module, Conv2d)
            and module.padding_mode == "zeros"
        )

    def input_rows(self, module: Conv2d, x: Tensor, kfac_approx: str) -> Tensor:
        r"""Return \(a\) from the patches of `x`, `[batch, C_in, I1, I2]`.

        Args:
            module: The convolution.
            x: Its input.
            kfac_approx: `"expand"` or `"reduce"`.

        Returns:
            `[rows, d_K]` (expand: the transposed view of a feature-major buffer).
        """
        patches = statistics.conv_patches(x, module, kfac_approx)
        return statistics.input_rows(patches, kfac_approx, bias=module.bias is not None)

    def gradient_rows(
        self,
        module: Conv2d,
        grad_output: Tensor,
        kfac_approx: str,
        loss_average: statistics.LossAverage,
    ) -> Tensor:
        r"""Return \(\tilde g\) from the output gradient `[batch, C_out, O1, O2]`.

        Args:
            module: The convolution.
            grad_output: Gradient w.r.t. its output.
            kfac_approx: `"expand"` or `"reduce"`.
            loss_average: `None`, `"batch"` or `"batch+sequence"`.

        Returns:
            `[rows, C_out]`.
        """
        locations = grad_output.flatten(2).transpose(1, 2)  # "b c o1 o2 -> b (o1 o2) c"
        return statistics.gradient_rows(locations, kfac_approx, loss_average)
