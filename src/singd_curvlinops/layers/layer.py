"""`Layer`: one preconditioned layer, resolved once when its group is registered."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import Module, Parameter

from singd_curvlinops.layers.base import LayerAdapter


@dataclass(frozen=True, eq=False)
class Layer:
    """A layer that an optimizer preconditions (compared and hashed by identity).

    Attributes:
        name: Its name in the model (`model.named_modules()`).
        module: The module whose forward calls feed the statistics.
        adapter: The adapter of its type.
        params: Its preconditioned parameters, weight first (`adapter.parameters`).
        dims: `(d_K, d_C)`, the dimensions of its Kronecker factors.
        group_index: Position of its parameter group in `optimizer.param_groups`.
    """

    name: str
    module: Module
    adapter: LayerAdapter
    params: tuple[Parameter, ...]
    dims: tuple[int, int]
    group_index: int

    @property
    def weight(self) -> Parameter:
        """The weight: the key of the layer's state in `optimizer.state`."""
        return self.params[0]

    def factor_dtypes(self, group: dict[str, Any]) -> tuple[torch.dtype, torch.dtype]:
        """Return the dtypes of the layer's input- and output-side factors.

        Args:
            group: Its parameter group.

        Returns:
            The group's `preconditioner_dtype`, None replaced by the weight's dtype.
        """
        dtype_K, dtype_C = group["preconditioner_dtype"]
        return dtype_K or self.weight.dtype, dtype_C or self.weight.dtype
