"""Layer adapters: how each module type enters the Kronecker optimizers.

Built in: `torch.nn.Linear`, `torch.nn.Conv2d` (zero padding) and
`torch_geometric.nn.GCNConv` (when PyG is installed; never imported here). Add a
type by subclassing `LayerAdapter` and calling `register_layer`.
"""

from singd_curvlinops.layers.base import LayerAdapter
from singd_curvlinops.layers.conv2d import Conv2dAdapter
from singd_curvlinops.layers.gcn import GCNConvAdapter
from singd_curvlinops.layers.layer import Layer
from singd_curvlinops.layers.linear import LinearAdapter
from singd_curvlinops.layers.registry import (
    adapter_for,
    register_layer,
    supported_layers,
    unregister_layer,
)

__all__ = [
    "Conv2dAdapter",
    "GCNConvAdapter",
    "Layer",
    "LayerAdapter",
    "LinearAdapter",
    "adapter_for",
    "register_layer",
    "supported_layers",
    "unregister_layer",
]
