r"""Graph convolutions (`torch_geometric.nn.GCNConv`) as linear layers on \(\hat A X\).

A GCNConv computes \(\hat A (X W^\top) + b\) with the normalised adjacency
\(\hat A\) (Kipf & Welling, 2017). Since aggregation is linear in the features,
this equals \((\hat A X) W^\top + b\): a linear layer applied to the aggregated
node features, with the nodes as the batch dimension. Its weight gradient is
exactly that of `nn.Linear` on the input \(\hat A X\), which is how Izadi, Fang,
Stevens and Li (IEEE BigData 2020) apply KFAC to graph networks.

`GCNConvAdapter` treats the layer so: weight `lin.weight`, its own `bias`, input
\(\hat A X\) with the nodes as examples. `aggregated_input` forms \(\hat A X\)
with the layer's own normalisation (its cache when `cached=True`, else PyG's
`gcn_norm` with the layer's `improved`, `add_self_loops` and `flow`, or no
normalisation when `normalize=False`) and its own `propagate`, so \(\hat A\) is
the matrix the layer used, for `edge_index` (with or without edge weights),
`torch.sparse` and `SparseTensor` adjacencies.

torch_geometric is optional: this module never imports it at import time, and
`is_gcn` recognises a GCNConv only if PyG's module that defines it is loaded
(otherwise no GCNConv instance can exist).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module, Parameter
from torch.nn.parameter import is_lazy

from singd_curvlinops.layers.base import LayerAdapter

_GCN_MODULE = "torch_geometric.nn.conv.gcn_conv"
_FORWARD_ARGUMENTS = ("x", "edge_index", "edge_weight")


def is_gcn(module: Module) -> bool:
    """Return whether `module` is a `torch_geometric.nn.GCNConv` (or a subclass).

    Args:
        module: A layer.

    Returns:
        False whenever torch_geometric's GCNConv has not been imported.
    """
    gcn_class = getattr(sys.modules.get(_GCN_MODULE), "GCNConv", None)
    return gcn_class is not None and isinstance(module, gcn_class)


def is_materialized(module: Module) -> bool:
    """Return whether a GCNConv's weight has its shape (not a lazy `in_channels=-1`).

    Args:
        module: A GCNConv.

    Returns:
        False until the first forward pass of a lazily initialised layer.
    """
    return not is_lazy(module.lin.weight)


def _bound_arguments(args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Map the positional and keyword arguments of `GCNConv.forward` to their names.

    Args:
        args: Positional arguments of the call.
        kwargs: Keyword arguments of the call.

    Returns:
        `x`, `edge_index` and `edge_weight` (None if not given).
    """
    bound = {"edge_weight": None}
    bound.update(zip(_FORWARD_ARGUMENTS, args, strict=False))
    bound.update(kwargs)
    return bound


def _normalized_adjacency(
    module: Module, x: Tensor, edge_index: Any, edge_weight: Tensor | None
) -> tuple[Any, Tensor | None]:
    """Return the adjacency and edge weights the layer propagated with.

    Mirrors the normalisation branch of `GCNConv.forward`: the layer's cache (filled
    by the forward pass that just ran, if `cached=True`) or PyG's `gcn_norm` with the
    layer's settings.

    Args:
        module: A GCNConv after its forward pass.
        x: Its node features.
        edge_index: Its `edge_index`, `torch.sparse` or `SparseTensor` adjacency.
        edge_weight: Its edge weights, or None.

    Returns:
        `(edge_index, edge_weight)` to pass to `module.propagate`.
    """
    if not module.normalize:
        return edge_index, edge_weight
    from torch_geometric.nn.conv.gcn_conv import gcn_norm

    norm_args = (
        x.size(module.node_dim),
        module.improved,
        module.add_self_loops,
        module.flow,
        x.dtype,
    )
    if isinstance(edge_index, Tensor):
        cache = module._cached_edge_index
        if cache is not None:
            return cache[0], cache[1]
        return gcn_norm(edge_index, edge_weight, *norm_args)
    cache = module._cached_adj_t  # a torch_sparse.SparseTensor
    if cache is not None:
        return cache, None
    return gcn_norm(edge_index, edge_weight, *norm_args), None


def aggregated_input(module: Module, args: tuple, kwargs: dict[str, Any]) -> Tensor:
    r"""Return the aggregated node features \(\hat A X\) of a GCNConv's forward call.

    Costs one propagation of the \(d_\text{in}\) input features (the layer itself
    propagates the \(d_\text{out}\) transformed features).

    Args:
        module: A GCNConv, after the forward pass with these arguments.
        args: Positional arguments of the call.
        kwargs: Keyword arguments of the call.

    Returns:
        Detached tensor shaped like the input `x`, `[nodes, d_in]`.
    """
    bound = _bound_arguments(args, kwargs)
    x = bound["x"].detach()
    with torch.no_grad():
        edge_index, edge_weight = _normalized_adjacency(
            module, x, bound["edge_index"], bound["edge_weight"]
        )
        return module.propagate(edge_index, x=x, edge_weight=edge_weight)


# PyG's aggregations that are linear in the features (GCNConv's default is "add")
LINEAR_AGGREGATIONS = ("add", "sum", "mean")


class GCNConvAdapter(LayerAdapter):
    r"""`torch_geometric.nn.GCNConv`: a linear layer on \(\hat A X\) (module docs)."""

    description = "torch_geometric.nn.GCNConv"

    def matches(self, module: Module) -> bool:
        """Return whether `module` is a GCNConv with a materialised weight.

        Args:
            module: A submodule of the model.

        Returns:
            False for lazily initialised layers before their first forward pass,
            and for an aggregation that is not linear in the features (`"max"`,
            `"min"`, ...: the layer is then no linear map of `Â X`).
        """
        return (
            is_gcn(module)
            and is_materialized(module)
            and getattr(module, "aggr", None) in LINEAR_AGGREGATIONS
        )

    def weight(self, module: Module) -> Parameter:
        """Return the weight of the layer's linear map, `lin.weight`.

        Args:
            module: A GCNConv.

        Returns:
            The weight `[d_out, d_in]`.
        """
        return module.lin.weight

    def layer_input(
        self, module: Module, args: tuple, kwargs: dict[str, Any]
    ) -> Tensor:
        r"""Return \(\hat A X\), `[nodes, d_in]` (see `aggregated_input`).

        Args:
            module: The GCNConv, after its forward call.
            args: Positional arguments of the call.
            kwargs: Keyword arguments of the call.

        Returns:
            The aggregated node features, detached.
        """
        return aggregated_input(module, args, kwargs)
