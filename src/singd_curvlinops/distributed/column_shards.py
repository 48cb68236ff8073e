r"""FSDP2 shards of a layer whose \(K\) is split by column blocks (owned factors).

Under `Shard(factors="owned")` a SINGD layer whose dense \(K\) holds more than a
rank's share of the factor state is split by column blocks (`columns`): rank
\(r\) keeps the columns \(K_r\) and computes its term \((\Gamma K_r) K_r^\top\)
of \(\Gamma K K^\top\), which needs the whole \(\Gamma\). Under FSDP2 each rank
holds only its block of \(\Gamma\) (rows, or columns and the bias column beside
them: `LayerStepper.gradient`), so one `all_gather` per step, for all such
layers, brings every rank every block (`whole_gradients`): \(d_C d_K\) numbers
per rank and layer, the parameters' size, with padding, as FSDP2's own gather
of the parameters. The terms then travel in the step's gather as under DDP,
every rank adds them and applies \(C C^\top\) (every rank keeps \(C\)), and each
rank applies its block of \(\Delta\) (`shards.own_block`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from singd_curvlinops.distributed.buffers import Buffers
from singd_curvlinops.distributed.collectives import all_gather_parts, named_collective
from singd_curvlinops.distributed.fsdp import ShardPosition, local
from singd_curvlinops.distributed.shards import (
    assemble,
    block_numel,
    block_shape,
    pad_share,
)
from singd_curvlinops.layers import Layer


def whole_gradients(
    stepper: Any,
    layers: Sequence[Layer],
    shards: ShardPosition,
    dtype: torch.dtype,
    buffers: Buffers | None = None,
) -> dict[Layer, Tensor | None]:
    r"""Return each layer's whole \(\Gamma\) on every rank, from one `all_gather`.

    A collective: every rank, the same layers in the same order (under HSDP
    among the ranks of each replica, which hold one block each).

    Args:
        stepper: The shell's per-layer operations (`LayerStepper`).
        layers: The sharded layers split by column blocks.
        shards: This rank's position among the ranks that hold the blocks
            (`fsdp.shards_across`).
        dtype: The message's dtype (holds every gradient exactly).
        buffers: The strategy's message buffers (None: allocated here).

    Returns:
        Per layer, \(\Gamma\) (`[d_C, d_K]`, in the gradient's dtype), or None
        if no rank had a gradient.
    """
    device = local(layers[0].weight).device
    world_size = shards.count
    parts, dtypes = [], {}
    for layer in layers:
        grad = stepper.gradient(layer)
        padded = torch.zeros(block_shape(layer, world_size), dtype=dtype, device=device)
        if grad is not None:
            pad_share(grad.to(dtype), layer, padded)
            dtypes[layer] = grad.dtype
        flag = float(grad is not None)
        parts += [padded, torch.tensor([flag], dtype=dtype, device=device)]
    numels = [block_numel(layer, world_size) for layer in layers]
    with named_collective("The all_gather of column-split FSDP2 shards"):
        sizes = [sum(numels)] * world_size
        gathered = all_gather_parts(
            parts, sizes, dtype, device, buffers, "column shards", shards.group
        )
    messages = [flat.split(numels) for flat in gathered]  # (per rank, per layer)
    flags = torch.stack([torch.cat([m[-1:] for m in mine]) for mine in messages])
    whole: dict[Layer, Tensor | None] = {}
    for index, (layer, flag) in enumerate(
        zip(layers, flags.amax(0).tolist(), strict=True)
    ):
        whole[layer] = None
        if flag:
            shape = block_shape(layer, world_size)
            blocks = [mine[index][:-1].view(shape) for mine in messages]
            grad_dtype = dtypes.get(layer, local(layer.weight).dtype)
            whole[layer] = assemble(layer, blocks).to(grad_dtype)
    return whole
