r"""FSDP2 (`torch.distributed.fsdp.fully_shard`): layers whose weights are sharded.

`fully_shard` turns a layer's weight and bias into `DTensor`s sharded along their
dimension 0 (`Shard(0)`) over a one-dimensional device mesh: rank \(r\) holds
slices \([r c, \min((r+1) c, n))\) of the \(n\) entries of that dimension,
\(c = \lceil n / P \rceil\) (as `torch.chunk` splits). The forward pass runs with
the full weight, so the statistics hooks see whole layers and the statistics are
all-reduced as under DDP; after the backward pass every rank holds the averaged
gradient of its slices.

**Row shards** (weights stored `[d_out, ...]`: linear and convolution layers).
Rank \(r\) holds rows of the gradient matrix \(\Gamma\). \(\Delta = P_C \Gamma
P_K\) mixes the rows only through \(P_C\): each rank computes its rows of
\(Y = \Gamma P_K\) locally (the input side, split evenly over the ranks), one
`all_gather` per step brings the full \(Y\) of every layer to every rank, and each
rank applies \(P_C\) and keeps its rows of \(\Delta\). The alternative — gather
\(\Gamma\) to an owner, precondition there, scatter \(\Delta\) back — takes two
collectives per step and leaves all other ranks idle during the product. The
price of the row scheme is that every rank holds every factor and applies every
output side.

**Column shards** (weights stored transposed, `[d_in, d_out]`: `nn.Embedding`'s
table, Hugging Face's `Conv1D` without a bias). Rank \(r\) holds columns of
\(\Gamma\), and the same scheme runs with the sides swapped: each rank computes
its columns of \(Z = P_C \Gamma\), the step's `all_gather` brings the full \(Z\),
and each rank applies \(P_K\) and keeps its columns of \(\Delta\). A transposed
layer with a bias (GPT-2's `Conv1D`) is refused: FSDP2 splits its weight by
\(\Gamma\)'s columns and its bias, \(\Gamma\)'s last column, by rows.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

from singd_curvlinops.layers import Layer, LayerAdapter


def is_sharded(layer: Layer) -> bool:
    r"""Return whether the layer's weight is an FSDP2 shard.

    Args:
        layer: The layer.

    Returns:
        True for a `DTensor` weight sharded along dimension 0 on a 1-d mesh.

    Raises:
        ValueError: For a `DTensor` weight with another placement (tensor
            parallelism, HSDP), of a layer type whose weight's dimension 0 is
            neither the rows nor the columns of \(\Gamma\) (an adapter with its
            own `to_matrix` that does not store the weight transposed), or of a
            transposed layer with a bias (its two shards split different axes).
    """
    weight = layer.weight
    if not isinstance(weight, DTensor):
        return False
    adapter = layer.adapter
    own_layout = type(adapter).to_matrix is not LayerAdapter.to_matrix
    if own_layout and not layer.bias_only and not splits_columns(layer):
        raise ValueError(
            f"Layer {layer.name!r} ({adapter.description}) arranges its weight "
            "into Γ in its own way: its FSDP2 shards are neither rows nor "
            "columns of Γ, which sharded preconditioning needs."
        )
    if splits_columns(layer) and len(layer.params) > 1:
        raise ValueError(
            f"Layer {layer.name!r} ({adapter.description}) stores its weight "
            "transposed and has a bias: FSDP2 shards the weight by columns of Γ "
            "and the bias by rows, which sharded preconditioning cannot combine. "
            "Keep the layer out of fully_shard's units (a unit of its own "
            "replicated with DDP), or train its bias without it."
        )
    if weight.device_mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise ValueError(
            f"Layer {layer.name!r}: its weight is a DTensor with placements "
            f"{tuple(weight.placements)} on a {weight.device_mesh.ndim}-d mesh; "
            "only FSDP2's sharding along dimension 0 (Shard(0) on a 1-d mesh) is "
            "supported."
        )
    return True


def splits_columns(layer: Layer) -> bool:
    r"""Return whether the layer's weight stores \(\Gamma\)'s columns in dimension 0.

    For such a layer FSDP2's shards are column blocks of \(\Gamma\) (module docs).

    Args:
        layer: The layer.

    Returns:
        True for an adapter that stores the weight transposed (an embedding's
        table, `Conv1D`), seen in its own orientation (not as a twin).
    """
    return layer.adapter.transposed and not layer.swapped and not layer.bias_only


def any_shards(layers: Iterable[Layer], params: Iterable[Tensor]) -> bool:
    """Return whether FSDP2 shards any of the layers or (fallback) parameters.

    Args:
        layers: Layers (`is_sharded`).
        params: Parameters trained without a layer.

    Returns:
        True if a layer is sharded or a parameter is a `DTensor`.
    """
    return any(map(is_sharded, layers)) or any(isinstance(p, DTensor) for p in params)


def local(tensor: Tensor) -> Tensor:
    """Return the local shard of a `DTensor`, or the tensor itself.

    Args:
        tensor: A parameter, its gradient or its momentum buffer.

    Returns:
        A plain tensor sharing the storage (in-place updates reach the parameter).
    """
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def chunk_size(layer: Layer, world_size: int) -> int:
    r"""Return \(c = \lceil n / P \rceil\), the slices of the largest shard.

    Args:
        layer: A sharded layer.
        world_size: \(P\).

    Returns:
        The number of rows (columns, for column shards) of \(\Gamma\) that
        every rank's share of \(Y\) (of \(Z\)) is padded to.
    """
    d_K, d_C = layer.dims
    return -(-(d_K if splits_columns(layer) else d_C) // world_size)
