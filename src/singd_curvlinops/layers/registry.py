"""Which adapter handles which module: the built-in layer types and user additions.

`adapter_for(module)` asks the registered adapters in order, users' first (so a
user's adapter may take over a subclass of a built-in type), then `Linear`,
`Conv2d`, `Embedding`, `MultiheadAttention`, Hugging Face's `Conv1D`, PyG's
`GCNConv`, torchvision's Swin window attention (V1 and V2) and timm's BEiT and
EVA attention. `register_layer` adds an adapter; see the docs page "Adding a
layer type".
"""

from __future__ import annotations

from torch.nn import Module

from singd_curvlinops.layers.attention import MultiheadAttentionAdapter
from singd_curvlinops.layers.base import LayerAdapter
from singd_curvlinops.layers.conv1d import Conv1DAdapter
from singd_curvlinops.layers.conv2d import Conv2dAdapter
from singd_curvlinops.layers.embedding import EmbeddingAdapter
from singd_curvlinops.layers.functional_qkv import FunctionalQKVAdapter
from singd_curvlinops.layers.gcn import GCNConvAdapter
from singd_curvlinops.layers.linear import LinearAdapter
from singd_curvlinops.layers.window_attention import ShiftedWindowAttentionAdapter

_BUILTIN: tuple[LayerAdapter, ...] = (
    LinearAdapter(),
    Conv2dAdapter(),
    EmbeddingAdapter(),
    MultiheadAttentionAdapter(),
    Conv1DAdapter(),
    GCNConvAdapter(),
    ShiftedWindowAttentionAdapter(),
    FunctionalQKVAdapter(),
)
_USER: list[LayerAdapter] = []


def adapter_for(module: Module) -> LayerAdapter | None:
    """Return the adapter that handles `module`, or None for unsupported modules.

    Args:
        module: A submodule of a model.

    Returns:
        The first registered adapter (users' before the built-in ones) that matches.
    """
    for adapter in (*_USER, *_BUILTIN):
        if adapter.matches(module):
            return adapter
    return None


def supported_layers() -> str:
    """Return the supported layer types as a phrase for messages.

    Returns:
        E.g. `"torch.nn.Linear, torch.nn.Conv2d (padding_mode='zeros') and ..."`.
    """
    names = [adapter.description for adapter in (*_USER, *_BUILTIN)]
    return ", ".join(names[:-1]) + " and " + names[-1]


def register_layer(adapter: LayerAdapter) -> LayerAdapter:
    """Make the optimizers precondition the layers that `adapter` matches.

    Adapters registered later are asked first. Optimizers built afterwards use it.

    Args:
        adapter: An instance of a `LayerAdapter` subclass with a `description`.

    Returns:
        `adapter` (so that registration can decorate an instantiation).

    Raises:
        TypeError: If `adapter` is not a `LayerAdapter` instance.
        ValueError: If it has no description, or an adapter of its class is
            registered already.
    """
    if not isinstance(adapter, LayerAdapter):
        raise TypeError(
            f"adapter must be a LayerAdapter instance, got {type(adapter).__name__}."
        )
    if not isinstance(adapter.description, str) or not adapter.description:
        raise ValueError(
            f"{type(adapter).__name__}.description must name the layer type it "
            "handles (a non-empty str), for messages."
        )
    if any(type(other) is type(adapter) for other in (*_USER, *_BUILTIN)):
        raise ValueError(f"An adapter of class {type(adapter).__name__} is registered.")
    _USER.insert(0, adapter)
    return adapter


def unregister_layer(adapter: LayerAdapter) -> None:
    """Remove an adapter added with `register_layer`.

    Args:
        adapter: The registered instance.

    Raises:
        ValueError: If it was not registered by a user.
    """
    if not any(other is adapter for other in _USER):
        raise ValueError(f"{adapter!r} is not a user-registered layer adapter.")
    _USER.remove(adapter)
