r"""FSDP2 (`torch.distributed.fsdp.fully_shard`): layers whose weights are row shards.

`fully_shard` turns a layer's weight `[d_out, ...]` and bias `[d_out]` into
`DTensor`s sharded along dimension 0 (`Shard(0)`) over a one-dimensional device
mesh: rank \(r\) holds rows \([r c, \min((r+1) c, d_C))\) of the gradient matrix
\(\Gamma\), \(c = \lceil d_C / P \rceil\) (as `torch.chunk` splits). The forward
pass runs with the full weight, so the statistics hooks see whole layers and the
statistics are all-reduced as under DDP; after the backward pass every rank
holds the averaged gradient of its rows.

**Preconditioning the rows.** \(\Delta = P_C \Gamma P_K\) mixes the rows only
through \(P_C\). Each rank computes its rows of \(Y = \Gamma P_K\) locally (the
input side, split evenly over the ranks), one `all_gather` per step brings the
full \(Y\) of every layer to every rank, and each rank applies \(P_C\) and keeps
its rows of \(\Delta\). The alternative — gather \(\Gamma\) to an owner,
precondition there, scatter \(\Delta\) back — takes two collectives per step and
leaves all other ranks idle during the product. The price of the row scheme is
that every rank holds every factor and applies every output side.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

from singd_curvlinops.layers import Layer, LayerAdapter


def is_sharded(layer: Layer) -> bool:
    r"""Return whether the layer's weight is an FSDP2 row shard.

    Args:
        layer: The layer.

    Returns:
        True for a `DTensor` weight sharded along dimension 0 on a 1-d mesh.

    Raises:
        ValueError: For a `DTensor` weight with another placement (tensor
            parallelism, HSDP), or of a layer type whose weight rows are not the
            rows of \(\Gamma\) (an adapter with its own `to_matrix`).
    """
    weight = layer.weight
    if not isinstance(weight, DTensor):
        return False
    if type(layer.adapter).to_matrix is not LayerAdapter.to_matrix:
        raise ValueError(
            f"Layer {layer.name!r} ({layer.adapter.description}) arranges its "
            "weight into Γ in its own way: its FSDP2 row shards are not rows of "
            "Γ, which sharded preconditioning needs."
        )
    if weight.device_mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise ValueError(
            f"Layer {layer.name!r}: its weight is a DTensor with placements "
            f"{tuple(weight.placements)} on a {weight.device_mesh.ndim}-d mesh; "
            "only FSDP2's row sharding (Shard(0) on a 1-d mesh) is supported."
        )
    return True


def any_row_shards(layers: Iterable[Layer], params: Iterable[Tensor]) -> bool:
    """Return whether FSDP2 shards any of the layers or (fallback) parameters.

    Args:
        layers: Layers (`is_sharded`).
        params: Parameters trained without a layer.

    Returns:
        True if a layer is row-sharded or a parameter is a `DTensor`.
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


def chunk_rows(layer: Layer, world_size: int) -> int:
    r"""Return \(c = \lceil d_C / P \rceil\), the rows of the largest shard.

    Args:
        layer: A row-sharded layer.
        world_size: \(P\).

    Returns:
        The number of rows every rank's share of \(Y\) is padded to.
    """
    return -(-layer.dims[1] // world_size)
