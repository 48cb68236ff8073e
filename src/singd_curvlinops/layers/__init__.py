"""Layer adapters: how each module type enters the Kronecker optimizers.

Built in: `torch.nn.Linear`, `torch.nn.Conv2d` (zero padding), `torch.nn.Embedding`,
`torch.nn.MultiheadAttention`, Hugging Face's `Conv1D`,
`torch_geometric.nn.GCNConv`, torchvision's Swin window attention (V1 and V2) and
timm's BEiT and EVA attention (the last four when their packages are in use;
never imported here). Add a type by
subclassing `LayerAdapter` and calling `register_layer`.
"""

from singd_curvlinops.layers.attention import MultiheadAttentionAdapter
from singd_curvlinops.layers.base import LayerAdapter, Slot, Use
from singd_curvlinops.layers.conv1d import Conv1DAdapter
from singd_curvlinops.layers.conv2d import Conv2dAdapter
from singd_curvlinops.layers.embedding import EmbeddingAdapter
from singd_curvlinops.layers.functional_qkv import FunctionalQKVAdapter
from singd_curvlinops.layers.gcn import GCNConvAdapter
from singd_curvlinops.layers.layer import Layer, Site
from singd_curvlinops.layers.linear import LinearAdapter
from singd_curvlinops.layers.registry import (
    adapter_for,
    register_layer,
    supported_layers,
    unregister_layer,
)
from singd_curvlinops.layers.window_attention import ShiftedWindowAttentionAdapter

__all__ = [
    "Conv1DAdapter",
    "Conv2dAdapter",
    "EmbeddingAdapter",
    "FunctionalQKVAdapter",
    "GCNConvAdapter",
    "Layer",
    "LayerAdapter",
    "LinearAdapter",
    "MultiheadAttentionAdapter",
    "ShiftedWindowAttentionAdapter",
    "Site",
    "Slot",
    "Use",
    "adapter_for",
    "register_layer",
    "supported_layers",
    "unregister_layer",
]
