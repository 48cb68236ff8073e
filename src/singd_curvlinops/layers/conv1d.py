r"""Hugging Face `transformers`' `Conv1D`: a linear layer with a transposed weight.

GPT-2 and related models compute \(y = x W + b\) with a weight \(W\) of shape
`[d_in, d_out]`: `nn.Linear` with weight \(W^\top\). The adapter keeps the linear
layer's statistics and maps \([W^\top\; b]\) to \(\Gamma\).

`transformers` is optional: this module never imports it, and `is_conv1d`
recognises a `Conv1D` only if the `transformers` module that defines it is loaded
(otherwise no instance can exist).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module, Parameter

from singd_curvlinops.layers.base import LayerAdapter

# where transformers defines Conv1D (today's and older releases)
_CONV1D_MODULES = ("transformers.pytorch_utils", "transformers.modeling_utils")


def is_conv1d(module: Module) -> bool:
    """Return whether `module` is a `transformers` `Conv1D` (or a subclass).

    Args:
        module: A layer.

    Returns:
        False whenever transformers' module defining `Conv1D` is not imported.
    """
    for name in _CONV1D_MODULES:
        cls = getattr(sys.modules.get(name), "Conv1D", None)
        if isinstance(cls, type) and isinstance(module, cls):
            return True
    return False


class Conv1DAdapter(LayerAdapter):
    """`transformers.pytorch_utils.Conv1D`: `x @ weight + bias`, weight `[in, out]`."""

    description = "transformers Conv1D"
    transposed = True

    def matches(self, module: Module) -> bool:
        """Return whether `module` is a `Conv1D`.

        Args:
            module: A submodule of the model.

        Returns:
            True for transformers' `Conv1D` and its subclasses.
        """
        return is_conv1d(module)

    def dims(self, module: Module) -> tuple[int, int]:
        """Return `(d_in (+1), d_out)` for a weight `[d_in, d_out]`.

        Args:
            module: A Conv1D.

        Returns:
            The factor dimensions.
        """
        d_in, d_out = module.weight.shape
        return d_in + int(module.bias is not None), d_out

    def to_matrix(self, tensors: Any, params: tuple[Parameter, ...]) -> Tensor:
        r"""Return \([W^\top\; b]\), `[d_out, d_K, *extra]`.

        Args:
            tensors: `[d_in, d_out, *extra]` (and `[d_out, *extra]`).
            params: The layer's parameters, weight first.

        Returns:
            A view for the weight alone, else a new tensor.
        """
        matrix = tensors[0].transpose(0, 1)
        if len(params) == 1:
            return matrix
        return torch.cat([matrix, tensors[1].unsqueeze(1)], dim=1)

    def from_matrix(
        self, matrix: Tensor, params: tuple[Parameter, ...]
    ) -> list[Tensor]:
        r"""Split \([W^\top\; b]\) into `[d_in, d_out, ...]` and `[d_out, ...]`.

        Args:
            matrix: `[d_out, d_K, *extra]`.
            params: The layer's parameters.

        Returns:
            Views of `matrix`.
        """
        d_in = params[0].shape[0]
        parts = [matrix[:, :d_in].transpose(0, 1)]
        if len(params) == 2:
            parts.append(matrix[:, d_in])
        return parts
