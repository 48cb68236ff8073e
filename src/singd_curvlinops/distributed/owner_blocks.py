r"""FSDP2 shards under owned factors: \(\Gamma\) to its owner, \(\Delta\) back.

Under owned factors only a layer's owner holds \(K\) and \(C\), so no other
rank can apply a side to its shard of \(\Gamma\), which the scheme of `shards`
needs. Instead the owner preconditions the whole layer, as under DDP.

`OwnerBlocks` holds one step's context (who owns which layer, this rank, the
messages' dtype, device and buffers):

1. `OwnerBlocks.to_owners`: every rank sends its block of \(\Gamma\) (rows;
   or columns, and the bias column beside them: `LayerStepper.gradient`),
   padded to the largest (`shards.block_shape`), to the layer's owner, in one
   `all_to_all` for all such layers; the owner puts \(\Gamma\) together
   (`shards.assemble`).
2. The owner computes \(\Delta = P_C \Gamma P_K\).
3. `OwnerBlocks.from_owners`: a second `all_to_all` brings every rank its block of
   \(\Delta\) (`shards.own_block`), which it applies like its own gradient.

Under HSDP (`fsdp`: \(R\) replicas of \(P\) shards, rank \(g P + s\) the
\(s\)-th shard of replica \(g\)) an owner gathers \(\Gamma\) from the \(P\)
ranks of its own replica (every replica holds the same blocks) and sends its
blocks of \(\Delta\) to every rank of every replica.

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
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from singd_curvlinops.distributed.buffers import Buffers, lend
from singd_curvlinops.distributed.collectives import named_collective
from singd_curvlinops.distributed.fsdp import local
from singd_curvlinops.distributed.shards import (
    assemble,
    block_numel,
    block_shape,
    held,
    own_block,
    pad_share,
    unpad,
)
from singd_curvlinops.layers import Layer

Owner = Callable[[Layer], int]


class OwnerBlocks:
    r"""One step's exchanges of FSDP2 blocks with their layers' owners.

    Args:
        owner: The rank that preconditions a layer.
        me: This rank.
        world_size: The number of ranks.
        dtype: The messages' dtype (holds every block exactly).
        device: The messages' device (the layers').
        buffers: The strategy's message buffers (None: allocated per exchange).
        shards: The number of shards of a layer, \(P\) (None: `world_size`;
            HSDP: a replica's, module docs).
    """

    def __init__(
        self,
        owner: Owner,
        me: int,
        world_size: int,
        dtype: torch.dtype,
        device: torch.device,
        buffers: Buffers | None = None,
        *,
        shards: int | None = None,
    ) -> None:
        self.owner, self.me, self.world_size = owner, me, world_size
        self.dtype, self.device, self.buffers = dtype, device, buffers
        self.shards = shards or world_size
        # the ranks of this rank's replica, in the order of their shards
        first = me - me % self.shards
        self.replica = range(first, first + self.shards)

    def precondition(
        self, stepper: Any, layers: Sequence[Layer]
    ) -> dict[Layer, Tensor | None]:
        r"""Gather \(\Gamma\) on the owners and compute \(\Delta\) there (steps 1, 2).

        Args:
            stepper: The shell's per-layer operations (`LayerStepper`).
            layers: The sharded layers whose owner preconditions them, in the
                same order on every rank.

        Returns:
            Per layer that this rank owns, \(\Delta\) (`[d_C, d_K]`; None: no
            gradient).
        """
        gradients = {layer: stepper.gradient(layer) for layer in layers}
        return {
            layer: None
            if grad is None
            else stepper.preconditioner(layer, (0, 1)).apply(grad, overwrite=True)
            for layer, grad in self.to_owners(layers, gradients).items()
        }

    def to_owners(
        self, layers: Sequence[Layer], gradients: dict[Layer, Tensor | None]
    ) -> dict[Layer, Tensor | None]:
        r"""Gather each layer's \(\Gamma\) on its owner (module docs, step 1).

        Args:
            layers: The sharded layers, in the same order on every rank.
            gradients: This rank's block of each layer's \(\Gamma\) (None: no
                gradient).

        Returns:
            For each layer that this rank owns, \(\Gamma\) (`[d_C, d_K]`), or
            None if no rank had a gradient.
        """
        mine = self._owned_by(layers)[self.me]
        outgoing = [[] for _ in range(self.world_size)]
        for layer in layers:  # (to the owners in this rank's replica)
            if self.owner(layer) in self.replica:
                outgoing[self.owner(layer)].append((layer, gradients[layer]))
        sources = [  # (every rank of this replica sends each of them)
            mine if sender in self.replica else [] for sender in range(self.world_size)
        ]
        incoming, flags = self._exchange(outgoing, sources, "to owners")
        gathered: dict[Layer, Tensor | None] = {}
        for index, layer in enumerate(mine):
            gathered[layer] = None
            if any(flags[sender][index] for sender in self.replica):
                blocks = [self._block(layer, incoming[s][index]) for s in self.replica]
                # (in the gradient's dtype, as the owner's own block would be)
                whole = assemble(layer, blocks)
                gathered[layer] = whole.to(local(layer.weight).dtype)
        return gathered

    def from_owners(
        self, layers: Sequence[Layer], directions: dict[Layer, Tensor | None]
    ) -> dict[Layer, Tensor | None]:
        r"""Hand every rank its block of each layer's \(\Delta\) (module docs, step 3).

        Args:
            layers: The sharded layers, in the same order on every rank.
            directions: The layers' \(\Delta\) that this rank owns (None: no
                gradient).

        Returns:
            Per layer, this rank's block of \(\Delta\) (in the layout of its
            gradient; views of a buffer, valid within the step), or None if the
            layer has no gradient.
        """
        sources = self._owned_by(layers)  # (each owner sends its layers' blocks)
        outgoing = [[] for _ in range(self.world_size)]
        for layer in sources[self.me]:
            full = directions[layer]
            for receiver in range(self.world_size):
                block, shard = None, receiver % self.shards
                if full is not None:
                    rows = held(layer, shard, self.shards)
                    block = own_block(layer, full, shard, self.shards, rows)
                outgoing[receiver].append((layer, block))
        incoming, flags = self._exchange(outgoing, sources, "from owners")
        received: dict[Layer, Tensor | None] = {}
        for sender, sent in enumerate(sources):
            for index, layer in enumerate(sent):
                received[layer] = None
                if flags[sender][index]:
                    padded = self._block(layer, incoming[sender][index])
                    rows = local(layer.weight).shape[0]
                    received[layer] = unpad(layer, padded, rows)
        return received

    def _owned_by(self, layers: Sequence[Layer]) -> list[list[Layer]]:
        """Return per rank the layers it owns, in the order of `layers`.

        Args:
            layers: The layers.

        Returns:
            One list per rank.
        """
        return [
            [layer for layer in layers if self.owner(layer) == rank]
            for rank in range(self.world_size)
        ]

    def _exchange(
        self,
        outgoing: list[list[tuple[Layer, Tensor | None]]],
        sources: list[list[Layer]],
        slot: str,
    ) -> tuple[list[list[Tensor]], list[list[bool]]]:
        """Send each rank its blocks and receive this rank's, in one `all_to_all`.

        Args:
            outgoing: Per receiving rank, this rank's `(layer, block)` for it,
                in order (None: no block, zeros and flag 0).
            sources: Per sending rank, the layers of its blocks for this rank,
                in order.
            slot: The exchange's name among the buffers.

        Returns:
            Per sending rank, its messages (padded blocks with their flag last:
            views of the received buffer, valid until `slot` is lent again) and
            their flags (read from the device once).
        """
        numel = partial(block_numel, world_size=self.shards)
        send = [sum(numel(layer) for layer, _ in messages) for messages in outgoing]
        sizes = [[numel(layer) for layer in layers] for layers in sources]
        receive = [sum(lengths) for lengths in sizes]
        flat = self._lend((slot, "sent"), sum(send))
        flat.zero_()  # (the padding, and the blocks of ranks without a gradient)
        offset = 0
        for layer, block in (message for messages in outgoing for message in messages):
            if block is not None:
                message = flat[offset : offset + numel(layer)]
                shape = block_shape(layer, self.shards)
                pad_share(block, layer, message[:-1].view(shape))
                message[-1] = 1
            offset += numel(layer)
        incoming = self._lend((slot, "received"), sum(receive))
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

    def _lend(self, slot: tuple[str, str], numel: int) -> Tensor:
        """Return a flat buffer of the messages' dtype and device.

        Args:
            slot: Its name.
            numel: Its entries.

        Returns:
            The buffer (contents undefined).
        """
        return lend(self.buffers, slot, numel, self.dtype, self.device)

    def _block(self, layer: Layer, message: Tensor) -> Tensor:
        """Return a received message's padded block.

        Args:
            layer: The layer.
            message: The numbers of one block's message (`block_numel`).

        Returns:
            The block: a view, in `block_shape` (the flag, last, left out).
        """
        return message[:-1].view(block_shape(layer, self.shards))
