r"""`Layer`: one preconditioned layer, resolved once when its group is registered.

A layer is a weight \(W\) (with an optional bias \(b\)), or a bias alone, whose
gradient matrix \(\Gamma\) is preconditioned by one pair of Kronecker factors. Its
statistics come from its *sites*, the module slots that apply it: usually one,
several for a weight used by several modules or slots (weight tying). A site
applied in the layer's orientation feeds the layer's statistics directly; a site
that applies the weight transposed (an embedding table tied to an output layer)
feeds the statistics of the layer's `twin`, the same layer seen in the opposite
orientation (see `singd_curvlinops.pending` for how the two combine).
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor
from torch.nn import Module, Parameter

from singd_curvlinops.layers.base import LayerAdapter, Slot

# What a site's input rows need at their end for the layer: keep the slot's bias
# column, append a zero column (the layer has a bias the slot does not use), zero
# the slot's column (a bias that is not the layer's), drop it (the layer has no
# bias), nothing, or only the constant bias column (a bias-only layer).
BiasColumn = Literal["keep", "append_zero", "zero", "drop", "none", "only"]


@dataclass(frozen=True, eq=False)
class Site:
    """One slot of one module that applies a layer's parameters.

    Attributes:
        name: The module's name in the model, with the slot's (`"attn.in_proj"`).
        module: The module.
        adapter: Its adapter.
        slot: The slot.
        transposed: Whether the slot applies the weight in the orientation opposite
            to the layer's (its statistics go to the layer's twin).
        bias_column: How its input rows end for the layer (see `BiasColumn`).
        batch_dim: The batch dimension of the module's inputs and outputs where
            its adapter expects it first (1: the feed-forward layers of a
            sequence-first Transformer layer; `collector` moves it first).
        sequence: Whether the module's inputs are sequences (the feed-forward
            layers of a Transformer layer), so that a 2-D input is one unbatched
            sequence, not rows of examples.
    """

    name: str
    module: Module
    adapter: LayerAdapter
    slot: Slot
    transposed: bool = False
    bias_column: BiasColumn = "keep"
    batch_dim: int = 0
    sequence: bool = False


def diagonal_sides(sites: Sequence[Site]) -> tuple[bool, bool]:
    """Return which factors of a layer with these sites are exactly diagonal.

    Args:
        sites: The layer's sites.

    Returns:
        `(K, C)`: a one-hot slot makes its input side diagonal (the output side
        for a transposed use).
    """
    one_hot = [s for s in sites if s.slot.one_hot]
    return any(not s.transposed for s in one_hot), any(s.transposed for s in one_hot)


@dataclass(frozen=True, eq=False)
class Layer:
    r"""A layer that an optimizer preconditions (compared and hashed by identity).

    Attributes:
        name: Its name: the module's (`model.named_modules()`), with the slot's
            for modules of several slots; a bias-only layer's is its bias's name.
        module: The module of its first site.
        adapter: That module's adapter: it defines the layout of \(\Gamma\).
        params: Its preconditioned parameters: `(weight,)`, `(weight, bias)` or
            `(bias,)`.
        dims: `(d_K, d_C)`, the dimensions of its Kronecker factors.
        group_index: Position of the parameter group of `params[0]`, which holds
            the layer's options (`T`, `damping`, structures, ...).
        group_indices: The group of each parameter (learning rate, momentum and
            weight decay are read per parameter); empty: all in `group_index`.
        sites: Where its statistics come from.
        structures: The structure names of its factors `(K, C)`.
        bias_only: Whether its only parameter is a bias (\\(d_K = 1\\)).
        twin: The layer seen transposed, which collects the statistics of the
            transposed sites; None without such sites.
        swapped: Whether this record is a twin (its sides are the layer's swapped).
    """

    name: str
    module: Module
    adapter: LayerAdapter
    params: tuple[Parameter, ...]
    dims: tuple[int, int]
    group_index: int
    group_indices: tuple[int, ...] = ()
    sites: tuple[Site, ...] = ()
    structures: tuple[str, str] = ("dense", "dense")
    bias_only: bool = False
    twin: Layer | None = None
    swapped: bool = False

    @property
    def weight(self) -> Parameter:
        """The first parameter: the key of the layer's state in `optimizer.state`."""
        return self.params[0]

    @property
    def diagonal_sides(self) -> tuple[bool, bool]:
        """Which factors are exactly diagonal (one-hot inputs), `(K, C)`."""
        return diagonal_sides(self.sites)

    def param_groups(self, groups: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Return the parameter group of each of `params`.

        Args:
            groups: The optimizer's parameter groups.

        Returns:
            One group per parameter.
        """
        indices = self.group_indices or (self.group_index,) * len(self.params)
        return [groups[index] for index in indices]

    def options(self, group: Mapping[str, Any]) -> Mapping[str, Any]:
        """Return the options a rule reads for this layer: its group's, own structures.

        Args:
            group: Its parameter group.

        Returns:
            A live view of `group` whose `"structures"` are the layer's.
        """
        return ChainMap({"structures": self.structures}, group)

    def factor_dtypes(
        self, group: Mapping[str, Any]
    ) -> tuple[torch.dtype, torch.dtype]:
        """Return the dtypes of the layer's input- and output-side factors.

        Args:
            group: Its parameter group.

        Returns:
            The group's `preconditioner_dtype`, None replaced by the weight's dtype
            (swapped for a twin).
        """
        dtype_K, dtype_C = group["preconditioner_dtype"]
        dtypes = (dtype_K or self.weight.dtype, dtype_C or self.weight.dtype)
        return dtypes[::-1] if self.swapped else dtypes

    # ------------------------------------------------------------ matrices
    def to_matrix(
        self, tensors: Sequence[Tensor], params: Sequence[Tensor] | None = None
    ) -> Tensor:
        r"""Arrange one tensor per parameter into the layout of \(\Gamma\).

        Args:
            tensors: `[*param.shape, *extra]` for each of `params`.
            params: The parameters they belong to (default: `self.params`; under
                FSDP2, the local shards).

        Returns:
            `[d_C, d_K, *extra]` (see `LayerAdapter.to_matrix`).
        """
        if self.bias_only:
            return tensors[0].unsqueeze(1)
        return self.adapter.to_matrix(tensors, tuple(params or self.params))

    def from_matrix(
        self, matrix: Tensor, params: Sequence[Tensor] | None = None
    ) -> list[Tensor]:
        r"""Split a tensor in the layout of \(\Gamma\) into one per parameter.

        Args:
            matrix: `[d_C, d_K, *extra]`.
            params: The parameters (default: `self.params`; see `to_matrix`).

        Returns:
            `[*param.shape, *extra]` per parameter (views where possible).
        """
        if self.bias_only:
            return [matrix[:, 0]]
        return self.adapter.from_matrix(matrix, tuple(params or self.params))

    def gradient_matrix(
        self,
        params: Sequence[Tensor] | None = None,
        grads: Sequence[Tensor | None] | None = None,
    ) -> Tensor | None:
        r"""Return \(\Gamma\) from the parameters' gradients, `[d_C, d_K]`.

        Args:
            params: The parameters (default: `self.params`; under FSDP2 the local
                shards).
            grads: Their gradients (default: each parameter's `.grad`).

        Returns:
            A new tensor (the caller may overwrite it), or None if no parameter
            has a gradient. A missing gradient counts as zero.
        """
        params = tuple(params or self.params)
        grads = [p.grad for p in params] if grads is None else list(grads)
        if all(g is None for g in grads):
            return None
        grads = [
            torch.zeros_like(p) if g is None else g
            for p, g in zip(params, grads, strict=True)
        ]
        matrix = self.to_matrix(grads, params)
        storages = {g.untyped_storage().data_ptr() for g in grads}
        if matrix.untyped_storage().data_ptr() in storages:
            return matrix.clone()  # a view of a gradient
        return matrix
