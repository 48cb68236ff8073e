r"""Split layers: the cheaper side goes first and travels to the anchor's owner.

A layer split over two ranks (`Assignment.anchor`) is preconditioned by both,
one after the other, so that no rank repeats work:

1. the `sender` applies the side that is not the anchor to the gradient
   (\(P_C \Gamma\) for \(C\), \(\Gamma P_K\) for \(K\)) and sends the half
   product point-to-point (`isend`) to the anchor's owner;
2. the anchor's owner applies the anchor side, \(\Delta = P_C \Gamma P_K\), and
   shares the whole \(\Delta\) in the step's `all_gather`.

With replicated factors the sender is the other side's owner, right after its
update. With owned factors (both sides on one owner) it is a *helper*: the owner
updates the other side first and sends it the factor (`ship`), then updates
the anchor side; the helper applies the factor after its own updates (`help`)
and keeps nothing of it.

The alternative, the anchor's half product in the gather and the other side
applied after it by every rank, costs every rank that side's cached product and
application (the benchmark MLP's first layer: \(C C^\top\) and \(C C^\top Y\),
about 9 ms of a 94 ms step on each of two processes), and it needs that factor
on every rank.

Every rank derives from the plan which messages it sends and receives (per
split layer a half product, tagged with the layer's position in the step, and
a factor for a helper, tagged after them); a half product carries one extra
number, 0 if the sender had no gradient. Each rank sends in one order — during
the updates, layer by layer, the split layers' half products and the helpers'
factors; after them the helpers' half products — and posts its receives in the
same order, so that backends that match a pair's messages by order (NCCL)
pair them as gloo does by tag. All of them complete before the step ends
(`finish`).

Gloo sends and receives CPU tensors only: given a CUDA tensor, it hands the
device address to the socket, which fails ("Bad address"; its collectives do
take CUDA tensors). Where the process group runs gloo for the weights' device,
the messages are staged through the CPU (`message_device`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from singd_curvlinops.distributed.assignment import Assignment
from singd_curvlinops.distributed.buffers import Buffers, lend
from singd_curvlinops.distributed.collectives import named_collective
from singd_curvlinops.distributed.fsdp import local
from singd_curvlinops.layers import Layer
from singd_curvlinops.rules.factors import load_factor
from singd_curvlinops.rules.records import FactorStatistics
from singd_curvlinops.rules.singd import caches_for_one_use
from singd_curvlinops.structures import DenseMatrix
from singd_curvlinops.update import precondition_input_side, precondition_output_side

CPU = torch.device("cpu")


class Relay:
    r"""The half products of one step's split layers (see the module docs).

    Receives are posted at once; `send` runs on the other side's owner after
    the layer's update, `ship` on the owner of a helped layer between its two
    sides' updates, `help` on the helper after its own updates; `receive`
    waits on the anchor's owner.

    Args:
        stepper: The shell's per-layer operations.
        plan: Per layer, its assignment.
        layers: The step's layers, in the same order on every rank.
        relayed: The layers split by sides or helped (a subset of `layers`).
        dtype: The messages' dtype (the step's gather dtype; None if there are
            no such layers).
        me: This rank.
        buffers: The strategy's message buffers, kept between steps (None:
            allocated for this step).
    """

    def __init__(
        self,
        stepper: Any,
        plan: dict[Layer, Assignment | None],
        layers: list[Layer],
        relayed: Iterable[Layer],
        dtype: torch.dtype | None,
        me: int,
        buffers: Buffers | None = None,
    ) -> None:
        self.stepper, self.plan, self.dtype, self.me = stepper, plan, dtype, me
        self.buffers = buffers
        self._tags = {layer: index for index, layer in enumerate(layers)}
        self._relayed = dict.fromkeys(relayed)  # (in order; a set would not be)
        self._incoming: dict[Layer, tuple[Tensor, Any]] = {}
        self._outgoing: list[tuple[Tensor, Any]] = []
        self._flags: dict[Layer, Tensor] = {}
        self._factors: dict[Layer, tuple[Tensor, Any]] = {}
        self._shipped: set[Layer] = set()
        # Receives are posted in the order the senders send (backends such as
        # NCCL match a pair's messages by order, not by tag): first what is
        # sent during the updates, layer by layer (half products of split
        # layers, factors for helpers), then the helpers' half products.
        for layer in self._relayed:
            assignment = plan[layer]
            if assignment.direction_owner == me and assignment.helper is None:
                self._incoming[layer] = self._receive_half(layer)
            if assignment.helper == me:
                dim = layer.dims[1 - assignment.anchor]
                factor = self._take(("factor", layer), dim * dim)
                with named_collective(self._what(layer)):
                    work = dist.irecv(
                        factor,
                        src=assignment.direction_owner,
                        tag=len(layers) + self._tags[layer],
                    )
                self._factors[layer] = (factor, work)
        for layer in self._relayed:
            assignment = plan[layer]
            if assignment.direction_owner == me and assignment.helper is not None:
                self._incoming[layer] = self._receive_half(layer)

    def _receive_half(self, layer: Layer) -> tuple[Tensor, Any]:
        """Post the receive of a layer's half product (on the anchor's owner).

        Args:
            layer: The layer.

        Returns:
            The buffer and the backend's work.
        """
        buffer = self._buffer(layer, "received")
        with named_collective(self._what(layer)):
            work = dist.irecv(
                buffer, src=self.plan[layer].sender, tag=self._tags[layer]
            )
        return buffer, work

    def _buffer(self, layer: Layer, way: str) -> Tensor:
        """Return an empty message for a layer: its half product and a flag.

        Args:
            layer: The layer.
            way: `"sent"` or `"received"` (a rank may do both for a layer).

        Returns:
            A flat tensor of `d_C * d_K + 1` numbers.
        """
        d_K, d_C = layer.dims
        return self._take((way, layer), d_C * d_K + 1)

    def _take(self, slot: tuple[str, Layer], numel: int) -> Tensor:
        """Return an empty flat message of the step's dtype for a layer.

        Args:
            slot: What it holds, and for which layer.
            numel: Its number of entries.

        Returns:
            The strategy's buffer for `slot` (a fresh tensor without buffers).
        """
        return lend(self.buffers, slot, numel, self.dtype, message_device(slot[1]))

    @staticmethod
    def _what(layer: Layer) -> str:
        """Return how a failing message is described.

        Args:
            layer: The layer.

        Returns:
            A description for `named_collective`.
        """
        return f"The half product of split layer {layer.name!r} (point-to-point)"

    def send(self, layer: Layer) -> None:
        """Apply this rank's side of a split layer to its gradient; send it.

        Does nothing unless the layer is relayed and this rank is its `sender`.

        Args:
            layer: A layer of the step, after this rank's update of it.
        """
        assignment = self.plan[layer]
        if layer not in self._relayed or assignment.sender != self.me:
            return
        if assignment.helper is not None:
            return  # (a helper applies the shipped factor: `help`)
        side = 1 - assignment.anchor
        grad = self.stepper.gradient(layer)
        if grad is not None:
            self.stepper.settle_factors()  # the kept factors (and numbers) apply
            record = self.stepper.preconditioner(layer, (side,))
            grad = record.apply_side(side, grad, overwrite=True)
        self._send(layer, grad)

    def helped_here(self, layer: Layer) -> bool:
        """Return whether this rank owns a layer that has a helper (`relay`).

        Args:
            layer: The layer.

        Returns:
            Whether the plan gives the layer a helper and this rank its factors.
        """
        assignment = self.plan[layer]
        return (
            assignment is not None
            and assignment.helper is not None
            and assignment.direction_owner == self.me
        )

    def update_helped(self, layer: Layer, statistics: FactorStatistics) -> None:
        """Update the helper's side, send it that factor, then the anchor side.

        The anchor side's update reads the other side's previous factor and
        statistics (their traces couple the sides), which the first update
        changes in place: it gets copies taken before.

        Args:
            layer: A layer this rank owns, with a helper.
            statistics: Its statistics.
        """
        anchor = self.plan[layer].anchor
        other = 1 - anchor
        record = self.stepper.preconditioner(layer, ())
        before = (record.K, record.C)[other].clone()
        previous = replace(record, **{("K", "C")[other]: before})
        kept = statistics
        if statistics.collected is not None:
            collected = list(statistics.collected)
            collected[other] = collected[other].clone()
            kept = replace(statistics, collected=tuple(collected))
        self.stepper.update(layer, statistics, (other,))
        self.ship(layer)
        self.stepper.update(layer, kept, (anchor,), record=previous)

    def ship(self, layer: Layer) -> None:
        """Send a helped layer's other factor to its helper (on the owner; once).

        Args:
            layer: A layer of the step, its other side updated (or not due).
        """
        assignment = self.plan[layer]
        if layer not in self._relayed or assignment.helper is None:
            return
        if assignment.direction_owner != self.me or layer in self._shipped:
            return
        self._shipped.add(layer)
        side = 1 - assignment.anchor
        state = self.stepper.state[layer.weight]
        factor = load_factor(state, ("K", "C")[side], "dense").to_dense()  # (a copy)
        message = factor.reshape(-1).to(message_device(layer), self.dtype)
        tag = len(self._tags) + self._tags[layer]
        with named_collective(self._what(layer)):
            work = dist.isend(message, dst=assignment.helper, tag=tag)
        self._outgoing.append((message, work))

    def help(self, layer: Layer) -> None:
        r"""Apply a shipped factor to a helped layer's gradient; send it back.

        SINGD's side \(F F^\top\) is applied as one product with \(F F^\top\)
        formed here where one use pays for it (`caches_for_one_use`: the side
        is the layer's smaller one, as the benchmark MLP's first layer's
        \(C\)), as one process applies it; else as \(F (F^\top \cdot)\). The
        helper keeps neither. Does nothing unless this rank helps.

        Args:
            layer: A layer of the step.
        """
        assignment = self.plan[layer]
        if layer not in self._relayed or assignment.helper != self.me:
            return
        factor, work = self._factors.pop(layer)
        with named_collective(self._what(layer)):
            work.wait()
        side = 1 - assignment.anchor
        dim = layer.dims[side]
        dtype = layer.factor_dtypes(self.stepper.group(layer))[side]
        device = local(layer.weight).device
        shipped = DenseMatrix(factor.view(dim, dim).to(device=device, dtype=dtype))
        grad = self.stepper.gradient(layer)
        if grad is not None:
            product = (
                shipped.outer_self()
                if caches_for_one_use(dim * dim, dim, layer.dims[1 - side])
                else None
            )
            apply = (precondition_input_side, precondition_output_side)[side]
            grad = apply(grad, shipped, product, overwrite=True)
        self._send(layer, grad)

    def _send(self, layer: Layer, half: Tensor | None) -> None:
        """Send a half product (None: no gradient) to the anchor's owner.

        Args:
            layer: The layer.
            half: `[d_C, d_K]`, or None.
        """
        assignment = self.plan[layer]
        message = self._buffer(layer, "sent")
        if half is None:
            message.zero_()
        else:
            message[:-1].view(half.shape).copy_(half)
            message[-1] = 1.0
        destination = assignment.direction_owner
        with named_collective(self._what(layer)):
            work = dist.isend(message, dst=destination, tag=self._tags[layer])
        self._outgoing.append((message, work))

    def receive(self, layer: Layer) -> Tensor:
        """Wait for a split layer's half product (on the anchor's owner).

        Args:
            layer: A split layer whose anchor this rank owns.

        Returns:
            The half product, `[d_C, d_K]` (zeros if the sender had no
            gradient; `flag` says so).
        """
        buffer, work = self._incoming.pop(layer)  # (gloo's work is waited once)
        with named_collective(self._what(layer)):
            work.wait()
        device = local(layer.weight).device
        self._flags[layer] = buffer[-1:].to(device)
        d_K, d_C = layer.dims
        return buffer[:-1].view(d_C, d_K).to(device)

    def flag(self, layer: Layer) -> Tensor | None:
        """Return the received flag of a layer (None: nothing received).

        Args:
            layer: The layer.

        Returns:
            A one-element tensor, 1 if the sender had a gradient, or None.
        """
        return self._flags.get(layer)

    def finish(self) -> None:
        """Complete the step's messages: those not received yet, and those sent."""
        pending = [work for _, work in self._incoming.values()]
        pending += [work for _, work in self._factors.values()]
        pending += [work for _, work in self._outgoing]
        with named_collective("The half products of split layers (point-to-point)"):
            for work in pending:
                work.wait()
        self._incoming.clear()
        self._factors.clear()
        self._outgoing.clear()
        self._shipped.clear()


def message_device(layer: Layer) -> torch.device:
    """Return the device of a layer's point-to-point messages.

    Args:
        layer: The layer.

    Returns:
        The device of its (local) weight, or the CPU where the process group
        sends that device's tensors with gloo (`sends_on`).
    """
    device = local(layer.weight).device
    if device.type == "cpu" or sends_on(device, str(dist.get_backend_config())):
        return device
    return CPU


def sends_on(device: torch.device, backend_config: str) -> bool:
    """Return whether a process group sends and receives tensors on `device`.

    Args:
        device: The tensors' device.
        backend_config: The group's backend per device type, as
            `torch.distributed.get_backend_config` gives it
            (`"cpu:gloo,cuda:nccl"`; one name alone serves every type).

    Returns:
        False where the backend for the device's type is gloo, whose `send`
        and `recv` take CPU tensors only; True otherwise.
    """
    if device.type == "cpu":
        return True
    backends = {}
    for entry in backend_config.split(","):
        kind, _, name = entry.strip().rpartition(":")
        backends[kind or device.type] = name.lower()
    return backends.get(device.type) != "gloo"
