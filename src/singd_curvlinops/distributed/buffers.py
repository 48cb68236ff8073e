r"""Message buffers that a strategy keeps from one step to the next.

A sharded step moves megabytes (on the MLP of the benchmarks at `T = 1` every
process receives 9.8 MiB in the step's gather, and one process a 1.5 MiB half
product point-to-point). Allocated afresh, such a buffer costs more than its
copy on a CPU: the allocator maps tensors this large straight from the kernel
and hands them back when they are freed, so every page is faulted in again on
the first write, every step.
`Buffers` keeps one flat tensor per *slot* (what the message is, e.g. the
step's gather or one layer's half product) and lends a prefix of it; it grows
when a larger message comes (an update step gathers more than the steps
between). Like the gradient buckets of `DistributedDataParallel`, the buffers
then stay allocated: their bytes are the largest message of each slot.

Contract: a tensor lent for a slot is valid until the same slot is lent again.
Callers read or copy out what they received within the step (the state
entries are copied into the optimizer's state, the directions are applied),
and every point-to-point message of a step is completed before the step ends
(`relay.Relay.finish`). A strategy object belongs to one optimizer, so two
optimizers never share buffers.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
from torch import Tensor


class Buffers:
    """Flat message buffers, one per slot, lent again at every step."""

    def __init__(self) -> None:
        self._held: dict[tuple[Hashable, torch.dtype, torch.device], Tensor] = {}

    def take(
        self, slot: Hashable, numel: int, dtype: torch.dtype, device: torch.device
    ) -> Tensor:
        """Lend a flat buffer of `numel` entries (contents undefined).

        Args:
            slot: What the buffer holds (one live message per slot).
            numel: Its number of entries.
            dtype: Its dtype.
            device: Its device.

        Returns:
            A one-dimensional tensor of `numel` entries, valid until `slot` is
            taken again.
        """
        key = (slot, dtype, torch.device(device))
        held = self._held.get(key)
        if held is None or held.numel() < numel:
            held = torch.empty(numel, dtype=dtype, device=device)
            self._held[key] = held
        return held[:numel]

    @property
    def nbytes(self) -> int:
        """The bytes held by all slots."""
        return sum(held.numel() * held.element_size() for held in self._held.values())

    def clear(self) -> None:
        """Release every buffer (the next step allocates them again)."""
        self._held.clear()


def lend(
    buffers: Buffers | None,
    slot: Hashable,
    numel: int,
    dtype: torch.dtype,
    device: torch.device,
) -> Tensor:
    """Return `buffers.take(slot, ...)`, or a fresh tensor where there are none.

    Args:
        buffers: The strategy's buffers, or None (a message of one call).
        slot: What the buffer holds.
        numel: Its number of entries.
        dtype: Its dtype.
        device: Its device.

    Returns:
        A one-dimensional tensor of `numel` entries (contents undefined).
    """
    if buffers is None:
        return torch.empty(numel, dtype=dtype, device=device)
    return buffers.take(slot, numel, dtype, device)
