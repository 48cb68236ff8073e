r"""An FSDP2-sharded layer's part in a gathered step (the schemes: `fsdp`).

Each rank computes its share of a sharded layer's half product (`half_product`:
its rows of \(Y = \Gamma P_K\), or its columns of \(Z = P_C \Gamma\) and the bias
column beside them), sends it padded to the largest share (`share_shape`,
`pad_share`) in the step's `all_gather`, and finishes its own slice of
\(\Delta\) from every rank's share (`finish`). A column-sharded layer with a
diagonal \(P_K\) sends nothing: each rank finishes its columns alone
(`scaled_columns`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from singd_curvlinops.distributed.fsdp import (
    chunk_size,
    independent_columns,
    local,
    split_bias,
    splits_columns,
)
from singd_curvlinops.layers import Layer


def share_shape(layer: Layer, world_size: int) -> tuple[int, int] | None:
    """Return the shape of every rank's share of the layer in the gather.

    Args:
        layer: A sharded layer.
        world_size: The number of ranks.

    Returns:
        `(c, d_K)` for row shards, `(d_C, c)` for column shards (`c + 1` with a
        bias beside them), `c` the largest shard; None where each rank finishes
        its columns alone (`fsdp.independent_columns`).
    """
    if independent_columns(layer):
        return None
    return block_shape(layer, world_size)


def half_product(layer: Layer, record: Any, grad: Tensor) -> Tensor:
    r"""Return its rows of \(\Gamma P_K\), or its columns of \(P_C \Gamma\).

    Args:
        layer: A sharded layer that sends a share (`share_shape`).
        record: Its preconditioner.
        grad: This rank's block of \(\Gamma\) (`LayerStepper.gradient`;
            overwritten).

    Returns:
        The share, unpadded.
    """
    return record.shard_half(int(splits_columns(layer)), grad)


def pad_share(share: Tensor, layer: Layer, padded: Tensor) -> Tensor:
    """Copy a short shard's share into zeros of the full share's shape.

    Args:
        share: This rank's share (fewer rows, or columns, than the largest).
        layer: Its layer.
        padded: Zeros of the shape of `share_shape` (written).

    Returns:
        `padded`: the rows (columns) first, a bias column last.
    """
    if split_bias(layer):
        padded[:, -1], share = share[:, -1], share[:, :-1]
    axis = int(splits_columns(layer))
    padded.narrow(axis, 0, share.shape[axis]).copy_(share)
    return padded


def finish(
    layer: Layer, record: Any, shares: list[Tensor], rank: int, mine: int
) -> Tensor:
    r"""Finish this rank's slice of the layer's \(\Delta\) from every rank's share.

    Args:
        layer: A sharded layer that sends a share.
        record: Its preconditioner.
        shares: Per rank, its padded share.
        rank: This rank.
        mine: The number of rows (columns) that this rank holds.

    Returns:
        \(P_C Y\) (\(Z P_K\)) at this rank's rows (columns, and the whole bias
        column beside them: the layout of `LayerStepper.gradient`).
    """
    half = assemble(layer, shares)
    full = record.shard_finish(int(splits_columns(layer)), half)
    return own_block(layer, full, rank, len(shares), mine)


def assemble(layer: Layer, shares: list[Tensor]) -> Tensor:
    r"""Put every rank's padded block back together into one `[d_C, d_K]` matrix.

    The blocks are rows (columns) of a matrix in the layout of \(\Gamma\): shares
    of \(Y\) or \(Z\), or (`owner_blocks`) of \(\Gamma\) itself. With a bias
    beside column shards each block's last column is the bias column with zeros
    outside the sender's rows (`fsdp.column_block`), and these columns add up.

    Args:
        layer: A sharded layer.
        shares: Per rank, its block padded to `share_shape`.

    Returns:
        A new tensor `[d_C, d_K]`.
    """
    d_K, d_C = layer.dims
    if not splits_columns(layer):
        return torch.cat(shares)[:d_C]
    if not split_bias(layer):
        return torch.cat(shares, dim=1)[:, :d_K]
    d_in = d_K - 1  # the weight's columns, then the sum of the bias columns
    weight_part = torch.cat([share[:, :-1] for share in shares], dim=1)
    bias = torch.stack([share[:, -1] for share in shares], dim=1).sum(1)
    return torch.cat([weight_part[:, :d_in], bias[:, None]], dim=1)


def own_block(
    layer: Layer, full: Tensor, rank: int, world_size: int, mine: int
) -> Tensor:
    r"""Return a rank's block of a `[d_C, d_K]` matrix (the layout of its gradient).

    Args:
        layer: A sharded layer.
        full: The whole matrix (\(\Delta\)).
        rank: The rank.
        world_size: The number of ranks.
        mine: The number of rows (columns) that the rank holds.

    Returns:
        Its rows, or its columns (and the whole bias column beside them, of
        which `fsdp.block_parts` takes the rank's rows): views of `full`,
        except for a new tensor where a bias column is put beside them.
    """
    first = rank * chunk_size(layer, world_size)
    if not splits_columns(layer):
        return full[first : first + mine]
    if not split_bias(layer):
        return full[:, first : first + mine]
    return torch.cat([full[:, first : first + mine], full[:, -1:]], dim=1)


def block_shape(layer: Layer, world_size: int) -> tuple[int, int]:
    """Return the shape that every rank's block of the layer is padded to.

    Args:
        layer: A sharded layer.
        world_size: The number of ranks.

    Returns:
        `(c, d_K)` for row shards, `(d_C, c)` for column shards (`c + 1` with a
        bias beside them), `c` the largest shard (`fsdp.chunk_size`).
    """
    d_K, d_C = layer.dims
    size = chunk_size(layer, world_size)
    if splits_columns(layer):
        return d_C, size + split_bias(layer)
    return size, d_K


def block_numel(layer: Layer, world_size: int) -> int:
    """Return the numbers of one block's message: the padded block and its flag.

    Args:
        layer: A sharded layer.
        world_size: The number of ranks.

    Returns:
        The entries of `block_shape`, plus one.
    """
    rows, columns = block_shape(layer, world_size)
    return rows * columns + 1


def held(layer: Layer, rank: int, world_size: int) -> int:
    r"""Return how many rows (columns) of the layer's weight part a rank holds.

    Args:
        layer: A sharded layer.
        rank: The rank.
        world_size: The number of ranks.

    Returns:
        \(\max(0, \min(c, n - r c))\) of the weight's \(n\) slices along
        dimension 0 (`torch.chunk`'s split; 0 for an empty shard).
    """
    size = chunk_size(layer, world_size)
    return max(0, min(size, layer.weight.shape[0] - rank * size))


def unpad(layer: Layer, padded: Tensor, mine: int) -> Tensor:
    """Return a block without the padding of `pad_share`.

    Args:
        layer: A sharded layer.
        padded: A block of `block_shape`.
        mine: The rows (columns) that its rank holds.

    Returns:
        Its first `mine` rows (columns; and the bias column last): views,
        except for a new tensor where a bias column is put beside them.
    """
    if not splits_columns(layer):
        return padded[:mine]
    if not split_bias(layer):
        return padded[:, :mine]
    return torch.cat([padded[:, :mine], padded[:, -1:]], dim=1)


def scaled_columns(
    layer: Layer, record: Any, grad: Tensor, rank: int, world_size: int
) -> Tensor:
    r"""Return \((P_C \Gamma_r) P_K[r, r]\) for a diagonal \(P_K\).

    Args:
        layer: A layer with `fsdp.independent_columns`.
        record: Its preconditioner.
        grad: This rank's columns \(\Gamma_r\) (overwritten).
        rank: This rank.
        world_size: The number of ranks.

    Returns:
        This rank's columns of \(\Delta\), in the weight's dtype.
    """
    first = rank * chunk_size(layer, world_size)
    direction = record.shard_columns(grad, slice(first, first + grad.shape[1]))
    return direction.to(local(layer.weight).dtype)
