r"""FSDP2 shards under owned factors: \(\Gamma\) to its owner, \(\Delta\) back.

Under owned factors only a layer's owner holds \(K\) and \(C\), so no other
rank can apply a side to its shard of \(\Gamma\), which the scheme of `shards`
needs. Instead the owner preconditions the whole layer, as under DDP:

1. `to_owners`: every rank sends its block of \(\Gamma\) (rows; or columns, and
   the bias column beside them: `LayerStepper.gradient`), padded to the largest
   (`shards.block_shape`), to the layer's owner, in one `all_to_all` for all
   such layers; the owner puts \(\Gamma\) together (`shards.assemble`).
2. The owner computes \(\Delta = P_C \Gamma P_K\).
3. `from_owners`: a second `all_to_all` brings every rank its block of
   \(\Delta\) (`shards.own_block`), which it applies like its own gradient.

Each block travels with one flag (1: the sender had a gradient; the owner's
flag says whether \(\Delta\) exists). Per layer and step the owner receives and
sends `W` blocks, every other rank sends and receives one: \(\Gamma\)'s and
\(\Delta\)'s size, with padding; no factor travels, and no other rank holds one
even for a moment. The owners of different layers compute at the same time;
`assignment` balances them over whole layers (an FSDP2 shard gets no helper and
no column blocks, which would need \(\Gamma\) on several ranks).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from singd_curvlinops.distributed.collectives import named_collective
from singd_curvlinops.distributed.fsdp import local
from singd_curvlinops.distributed.shards import (
    assemble,
    block_shape,
    held,
    own_block,
    pad_share,
    unpad,
)
from singd_curvlinops.layers import Layer

Owner = Callable[[Layer], int]


def block_numel(layer: Layer, world_size: int) -> int:
    """Return the numbers of one block's message: the padded block and its flag.

    Args:
        layer: A sharded layer.
        world_size: The number of ranks.

    Returns:
        The entries of `shards.block_shape`, plus one.
    """
    rows, columns = block_shape(layer, world_size)
    return rows * columns + 1


def precondition(
    stepper: Any,
    layers: Sequence[Layer],
    owner: Owner,
    me: int,
    world_size: int,
    dtype: torch.dtype,
) -> dict[Layer, Tensor | None]:
    r"""Gather \(\Gamma\) on the owners and compute \(\Delta\) there (steps 1, 2).

    Args:
        stepper: The shell's per-layer operations (`LayerStepper`).
        layers: The sharded layers whose owner preconditions them, in the same
            order on every rank.
        owner: The rank that preconditions a layer.
        me: This rank.
        world_size: The number of ranks.
        dtype: The messages' dtype (holds every block exactly).

    Returns:
        Per layer that this rank owns, \(\Delta\) (`[d_C, d_K]`; None: no
        gradient).
    """
    gradients = {layer: stepper.gradient(layer) for layer in layers}
    gathered = to_owners(layers, owner, gradients, me, world_size, dtype)
    return {
        layer: None
        if grad is None
        else stepper.preconditioner(layer, (0, 1)).apply(grad, overwrite=True)
        for layer, grad in gathered.items()
    }


def to_owners(
    layers: Sequence[Layer],
    owner: Owner,
    gradients: dict[Layer, Tensor | None],
    me: int,
    world_size: int,
    dtype: torch.dtype,
) -> dict[Layer, Tensor | None]:
    r"""Gather each layer's \(\Gamma\) on its owner (module docs, step 1).

    Args:
        layers: The sharded layers, in the same order on every rank.
        owner: The rank that preconditions a layer.
        gradients: This rank's block of each layer's \(\Gamma\) (None: no
            gradient).
        me: This rank.
        world_size: The number of ranks.
        dtype: The messages' dtype (holds every block exactly).

    Returns:
        For each layer that this rank owns, \(\Gamma\) (`[d_C, d_K]`), or None
        if no rank had a gradient.
    """
    mine = [layer for layer in layers if owner(layer) == me]
    outgoing = [[] for _ in range(world_size)]
    for layer in layers:
        message = _message(layer, gradients[layer], world_size, dtype)
        outgoing[owner(layer)].append(message)
    template = torch.empty(0, dtype=dtype, device=local(layers[0].weight).device)
    incoming, flags = _exchange(outgoing, [mine] * world_size, world_size, template)
    gathered: dict[Layer, Tensor | None] = {}
    for index, layer in enumerate(mine):
        gathered[layer] = None
        if any(flags[sender][index] for sender in range(world_size)):
            blocks = [_block(layer, sent[index], world_size) for sent in incoming]
            # (in the gradient's dtype, as the owner's own block would be)
            gathered[layer] = assemble(layer, blocks).to(local(layer.weight).dtype)
    return gathered


def from_owners(
    layers: Sequence[Layer],
    directions: dict[Layer, Tensor | None],
    owner: Owner,
    me: int,
    world_size: int,
    dtype: torch.dtype,
) -> dict[Layer, Tensor | None]:
    r"""Hand every rank its block of each layer's \(\Delta\) (module docs, step 3).

    Args:
        layers: The sharded layers, in the same order on every rank.
        directions: The layers' \(\Delta\) that this rank owns (None: no
            gradient).
        owner: The rank that preconditions a layer.
        me: This rank.
        world_size: The number of ranks.
        dtype: The messages' dtype.

    Returns:
        Per layer, this rank's block of \(\Delta\) (in the layout of its
        gradient), or None if the layer has no gradient.
    """
    mine = [layer for layer in layers if owner(layer) == me]
    outgoing = [[] for _ in range(world_size)]
    for layer in mine:
        full = directions[layer]
        for receiver in range(world_size):
            block = None
            if full is not None:
                rows = held(layer, receiver, world_size)
                block = own_block(layer, full, receiver, world_size, rows)
            outgoing[receiver].append(_message(layer, block, world_size, dtype))
    sources = [
        [layer for layer in layers if owner(layer) == r] for r in range(world_size)
    ]
    template = torch.empty(0, dtype=dtype, device=local(layers[0].weight).device)
    incoming, flags = _exchange(outgoing, sources, world_size, template)
    received: dict[Layer, Tensor | None] = {}
    for sender, sent in enumerate(sources):
        for index, layer in enumerate(sent):
            received[layer] = None
            if flags[sender][index]:
                padded = _block(layer, incoming[sender][index], world_size)
                received[layer] = unpad(layer, padded, local(layer.weight).shape[0])
    return received


def _message(
    layer: Layer, block: Tensor | None, world_size: int, dtype: torch.dtype
) -> Tensor:
    """Return a block padded to `shards.block_shape`, flattened, and its flag.

    Args:
        layer: The layer.
        block: A rank's block (None: zeros, flag 0).
        world_size: The number of ranks.
        dtype: The message's dtype.

    Returns:
        A new flat tensor of `block_numel` numbers, the flag last.
    """
    shape = block_shape(layer, world_size)
    device = local(layer.weight).device
    message = torch.zeros(shape[0] * shape[1] + 1, dtype=dtype, device=device)
    if block is not None:
        pad_share(block, layer, message[:-1].view(shape))
        message[-1] = 1
    return message


def _block(layer: Layer, message: Tensor, world_size: int) -> Tensor:
    """Return a received message's padded block.

    Args:
        layer: The layer.
        message: The numbers of `_message`.
        world_size: The number of ranks.

    Returns:
        The block: a view, in `block_shape` (the flag, last, left out).
    """
    return message[:-1].view(block_shape(layer, world_size))


def _exchange(
    outgoing: list[list[Tensor]],
    sources: list[list[Layer]],
    world_size: int,
    template: Tensor,
) -> tuple[list[list[Tensor]], list[list[bool]]]:
    """Send each rank its messages and receive this rank's, in one `all_to_all`.

    Args:
        outgoing: Per receiving rank, this rank's messages to it, in order.
        sources: Per sending rank, the layers of its messages to this rank, in
            order (each sender sends one message per layer).
        world_size: The number of ranks.
        template: A tensor of the messages' dtype and device.

    Returns:
        Per sending rank, its messages (views of one received buffer) and
        their flags (read from the device once).
    """
    send = [sum(m.numel() for m in messages) for messages in outgoing]
    sizes = [[block_numel(layer, world_size) for layer in layers] for layers in sources]
    receive = [sum(lengths) for lengths in sizes]
    parts = [m for messages in outgoing for m in messages]
    flat = torch.cat(parts) if parts else template.new_empty(0)
    incoming = template.new_empty(sum(receive))
    with named_collective("The exchange of FSDP2 shards with their owners"):
        dist.all_to_all_single(incoming, flat, receive, send)
    messages = [
        list(chunk.split(lengths))
        for chunk, lengths in zip(incoming.split(receive), sizes, strict=True)
    ]
    ends = list(itertools.accumulate(n for lengths in sizes for n in lengths))
    last = torch.tensor(ends, dtype=torch.long, device=incoming.device) - 1
    present = iter((incoming[last] > 0.5).tolist() if ends else [])
    flags = [[next(present) for _ in lengths] for lengths in sizes]
    return messages, flags
