r"""FSDP2 (`torch.distributed.fsdp.fully_shard`): layers whose weights are sharded.

`fully_shard` turns a layer's weight and bias into `DTensor`s sharded along their
dimension 0 (`Shard(0)`) over a one-dimensional device mesh: rank \(r\) holds
slices \([r c, \min((r+1) c, n))\) of the \(n\) entries of that dimension,
\(c = \lceil n / P \rceil\) (as `torch.chunk` splits). The forward pass runs with
the full weight, so the statistics hooks see whole layers and the statistics are
all-reduced as under DDP; after the backward pass every rank holds the averaged
gradient of its slices.

**HSDP** (`fully_shard(..., mesh=...)` on a two-dimensional mesh, placements
`(Replicate(), Shard(0))`): the processes form \(R\) replicas of \(P\) shards
each. The \(P\) processes of a replica hold the slices above (\(r\) is a
process's position along the mesh's shard dimension, `shard_position`), and
every replica holds the same slices of the same averaged gradient. The
statistics still combine the examples of all \(R P\) processes (the default
process group), and the collectives that combine shards (the step's
`all_gather`, grafting's norms) run within a replica, over the mesh's shard
dimension: each replica computes what one FSDP2 job of \(P\) processes would.

**Row shards** (weights stored `[d_out, ...]`: linear and convolution layers).
Rank \(r\) holds rows of the gradient matrix \(\Gamma\). \(\Delta = P_C \Gamma
P_K\) mixes the rows only through \(P_C\): each rank computes its rows of
\(Y = \Gamma P_K\) locally (the input side, split evenly over the ranks), one
`all_gather` per step brings the full \(Y\) of every layer to every rank, and each
rank applies \(P_C\) and keeps its rows of \(\Delta\). The alternative — gather
\(\Gamma\) to an owner, precondition there, scatter \(\Delta\) back — takes two
collectives per step and leaves the other ranks to the work of the layers they
own; it is what `Shard(factors="owned")` does (`owner_blocks`), where no other
rank holds the factors. The price of the row scheme is that every rank holds
every factor and applies every output side.

**Column shards** (weights stored transposed, `[d_in, d_out]`: `nn.Embedding`'s
table, Hugging Face's `Conv1D`). Rank \(r\) holds columns of \(\Gamma\), and the
same scheme runs with the sides swapped: each rank computes its columns of
\(Z = P_C \Gamma\), the step's `all_gather` brings the full \(Z\), and each rank
applies \(P_K\) and keeps its columns of \(\Delta\). Where \(P_K\) is diagonal
(a `"diagonal"` input side, as an embedding's one-hot side always is), each
rank scales its columns of \(Z\) by its entries of \(P_K\)'s diagonal and
nothing travels (`independent_columns`).

**A bias beside column shards** (GPT-2's `Conv1D`): FSDP2 splits the bias,
\(\Gamma\)'s last column \(g\), by rows. Rank \(r\)'s block of \(\Gamma\) is
its weight columns and \(\tilde g_r\), \(g\) with zeros outside its rows
(`column_block`); \(P_C\) is linear, so the sum of the ranks' last columns of
\(P_C [\,\Gamma_r\;\tilde g_r\,]\) is \(P_C g\). The direction's block holds this
rank's weight columns of \(\Delta\) and \(\Delta\)'s whole last column, of which
the bias takes its rows (`block_parts`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor, Replicate, Shard

from singd_curvlinops.distributed.collectives import rank, world_size
from singd_curvlinops.layers import Layer, LayerAdapter

# a weight's placements on a 1-d mesh (FSDP2) and on a 2-d mesh (HSDP)
SHARDED = (Shard(0),)
HYBRID = (Replicate(), Shard(0))


@dataclass(frozen=True)
class ShardPosition:
    r"""Where this process's shards lie among a sharded layer's (module docs).

    Attributes:
        index: This process's position \(r\) along the mesh's shard dimension.
        count: The number of shards \(P\).
        group: The processes that hold a layer's shards together (None: the
            default process group, which a 1-d mesh spans).
    """

    index: int
    count: int
    group: ProcessGroup | None = None


def is_sharded(layer: Layer) -> bool:
    r"""Return whether the layer's weight is an FSDP2 shard.

    Args:
        layer: The layer.

    Returns:
        True for a `DTensor` weight sharded along dimension 0 on a 1-d mesh
        (FSDP2), or replicated and sharded on a 2-d mesh (HSDP).

    Raises:
        ValueError: For a `DTensor` weight with another placement (tensor
            parallelism), or of a layer type whose weight's dimension 0
            is neither the rows nor the columns of \(\Gamma\) (an adapter with
            its own `to_matrix` that does not declare the weight transposed).
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
    if tuple(weight.placements) not in (SHARDED, HYBRID):
        raise ValueError(
            f"Layer {layer.name!r}: its weight is a DTensor with placements "
            f"{tuple(weight.placements)} on a {weight.device_mesh.ndim}-d mesh; "
            "only FSDP2's sharding along dimension 0 (Shard(0) on a 1-d mesh) "
            "and HSDP's (Replicate(), Shard(0)) on a 2-d mesh are supported."
        )
    return True


def is_hybrid(tensor: Tensor) -> bool:
    """Return whether a parameter is an HSDP shard (replicated and sharded).

    Args:
        tensor: A parameter.

    Returns:
        True for a `DTensor` with placements `(Replicate(), Shard(0))`.
    """
    return isinstance(tensor, DTensor) and tuple(tensor.placements) == HYBRID


def shard_position(tensor: Tensor) -> ShardPosition:
    """Return where this process's shard of a parameter lies (module docs).

    Args:
        tensor: A parameter: an FSDP2 or HSDP shard, or a plain tensor.

    Returns:
        Along an HSDP mesh's shard dimension: this process's position, the
        number of shards and their process group; else this process's rank and
        the number of processes (the default group).
    """
    if not is_hybrid(tensor):
        return ShardPosition(rank(), world_size())
    mesh = tensor.device_mesh
    return ShardPosition(mesh.get_local_rank(1), mesh.size(1), mesh.get_group(1))


def shards_across(layers: Iterable[Layer]) -> ShardPosition:
    """Return the shard position that the sharded layers of a step share.

    Args:
        layers: The step's layers.

    Returns:
        The first sharded layer's `shard_position` (the default group's without
        one; `groups.check_data_parallel` makes every parameter's mesh the same).
    """
    for layer in layers:
        if is_sharded(layer):
            return shard_position(layer.weight)
    return ShardPosition(rank(), world_size())


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


def gamma_zeros(layer: Layer) -> Tensor:
    r"""Return zeros in the layout of \(\Gamma\), `[d_C, d_K]`, sharded as its blocks.

    For a layer's state in \(\Gamma\)'s layout (grafting's AdamW moments): a
    `DTensor` of this rank's rows (`Shard(0)`) or columns (`Shard(1)`) of
    \(\Gamma\) for an FSDP2 shard, so that DCP saves and loads it block by
    block; a plain tensor otherwise.

    Args:
        layer: The layer (not one with `split_bias`, whose blocks are not
            shards of \(\Gamma\)).

    Returns:
        Zeros in the weight's dtype and on its device.
    """
    d_K, d_C = layer.dims
    weight = layer.weight
    if not is_sharded(layer):
        return torch.zeros(d_C, d_K, dtype=weight.dtype, device=weight.device)
    mine = local(weight).shape[0]  # rows of the stored weight
    by_columns = splits_columns(layer)
    block = (d_C, mine) if by_columns else (mine, d_K)
    zeros = torch.zeros(block, dtype=weight.dtype, device=local(weight).device)
    return DTensor.from_local(
        zeros,
        weight.device_mesh,
        [*weight.placements[:-1], Shard(int(by_columns))],  # (HSDP: replicated)
        run_check=False,
        shape=torch.Size((d_C, d_K)),
        stride=(d_K, 1),
    )


def independent_columns(layer: Layer) -> bool:
    r"""Return whether each rank finishes its column shard of \(\Delta\) alone.

    With a `"diagonal"` input side (an embedding's one-hot side is always
    stored as one) \(P_K\) is diagonal, so this rank's columns
    \(\Delta_r = (P_C \Gamma_r) P_K[r, r]\) need no other rank's, and nothing
    travels (module docs).

    Args:
        layer: A sharded layer.

    Returns:
        True for column shards without a bias and with a diagonal input side.
    """
    return (
        splits_columns(layer)
        and not split_bias(layer)
        and layer.structures[0] == "diagonal"
    )


def chunk_size(layer: Layer, world_size: int) -> int:
    r"""Return \(c = \lceil n / P \rceil\), the slices of the weight's largest shard.

    Args:
        layer: A sharded layer.
        world_size: \(P\).

    Returns:
        The number of rows (columns, for column shards) of \(\Gamma\)'s weight
        part that every rank's share of \(Y\) (of \(Z\)) is padded to.
    """
    return -(-layer.weight.shape[0] // world_size)


def split_bias(layer: Layer) -> bool:
    """Return whether FSDP2 splits the weight by columns of Γ and the bias by rows.

    Args:
        layer: The layer.

    Returns:
        True for an FSDP2 shard by columns with a bias (module docs); its
        blocks are `column_block`s, not shards of Γ.
    """
    return is_sharded(layer) and splits_columns(layer) and len(layer.params) == 2


def bias_rows(layer: Layer) -> slice:
    r"""Return the rows of \(\Gamma\) whose bias entries this rank holds.

    Args:
        layer: A layer with `split_bias`.

    Returns:
        Rows \([r c', r c' + n_r)\), \(c' = \lceil d_C / P \rceil\) and
        \(n_r\) the length of the local shard (\(r\), \(P\): the bias's
        `shard_position`).
    """
    bias = layer.params[1]
    position = shard_position(bias)
    first = position.index * -(-bias.shape[0] // position.count)
    return slice(first, first + local(bias).shape[0])


def column_block(layer: Layer, grads: list[Tensor | None]) -> Tensor:
    r"""Return \([\,\Gamma_r\;\tilde g_r\,]\), this rank's block of \(\Gamma\).

    Args:
        layer: A layer with `split_bias`.
        grads: The local shards of its weight's and bias's gradients (None:
            zero).

    Returns:
        A new tensor `[d_C, n + 1]`: the weight's \(n\) local columns of
        \(\Gamma\), then the bias column, zero outside this rank's rows.
    """
    weight = local(layer.params[0])
    grad_weight, grad_bias = grads
    if grad_weight is None:
        grad_weight = torch.zeros_like(weight)
    columns = layer.adapter.to_matrix([grad_weight], (weight,))
    block = columns.new_zeros(layer.dims[1], columns.shape[1] + 1)
    block[:, :-1] = columns
    if grad_bias is not None:
        block[bias_rows(layer), -1] = grad_bias
    return block


def block_parts(layer: Layer, block: Tensor) -> list[Tensor]:
    r"""Split a direction's block into the local shards of weight and bias.

    Args:
        layer: A layer with `split_bias`.
        block: `[d_C, n + 1]`: this rank's weight columns of \(\Delta\), then
            \(\Delta\)'s whole last column.

    Returns:
        The weight's part (in its layout) and the bias's rows.
    """
    weight = local(layer.params[0])
    (part,) = layer.adapter.from_matrix(block[:, :-1], (weight,))
    return [part, block[bias_rows(layer), -1]]
