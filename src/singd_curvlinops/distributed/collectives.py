"""The collectives of the distribution strategies, and the checks that guard them.

Every collective goes through `torch.distributed` (no other transport). Two checks
turn misuse into errors on every rank instead of a hang or a silent divergence:

- `check_same_configuration`, at the optimizer's first step (every strategy): the
  ranks compare a checksum of their layers, structures, options and
  distribution strategy (mismatched collectives would otherwise crash the gloo
  backend); under `Replicate` again whenever they change;
- `StepCheck`, at every step of a sharded strategy: the ranks compare their
  step counts (a rank that skipped `step()` would pair its collectives with
  another step's), a `fingerprint` of their options (`lr`, `damping`, ...:
  one rank's scheduler or setting would make the parameters diverge silently)
  and a checksum of their configuration (a change on some ranks only), in the
  step's first all-reduce; under `Replicate` the fingerprints travel in the
  statistics all-reduce of every factor update instead (`check_same_options`).

A collective that fails (a peer that never arrives times out after the process
group's `timeout`, a crashed peer closes the connection) raises a `RuntimeError`
that names what this rank was doing and the likely cause.
"""

from __future__ import annotations

import zlib
from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from singd_curvlinops.distributed.buffers import Buffers, lend


def initialized() -> bool:
    """Return whether a default `torch.distributed` process group exists.

    Returns:
        False where `torch.distributed` is unavailable.
    """
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    """Return the number of processes of the default group (1 without one).

    Returns:
        The world size.
    """
    return dist.get_world_size() if initialized() else 1


def rank() -> int:
    """Return this process's rank in the default group (0 without one).

    Returns:
        The rank.
    """
    return dist.get_rank() if initialized() else 0


@contextmanager
def named_collective(what: str) -> Iterator[None]:
    """Re-raise a failing collective's error with what this rank was doing.

    Args:
        what: E.g. `"SINGD's step"`.

    Yields:
        None.

    Raises:
        RuntimeError: If the backend raises one; the message says that another
            rank did not take part (skipped `step()`, called `state_dict()` on
            some ranks only, crashed, or is still busy past the timeout).
    """
    try:
        yield
    except RuntimeError as error:
        raise RuntimeError(
            f"{what} failed on rank {rank()}: another rank did not take part in "
            "the same collective (it skipped optimizer.step(), called "
            "state_dict()/load_state_dict() on some ranks only, crashed, or is "
            f"still busy after the process group's timeout). Backend: {error}"
        ) from error


def fingerprint(text: str) -> int:
    """Return a 24-bit checksum of `text` (exact in float32, see `option_slots`).

    Args:
        text: E.g. `exchange.describe_options` of the optimizer's groups.

    Returns:
        An integer in `[0, 2**24)`.
    """
    return zlib.crc32(text.encode()) & 0xFFFFFF


def _agree(first: int, second: int, device: torch.device) -> list[int]:
    """Return the extremes of two integers over all ranks (one all-reduce).

    `check_same_configuration` sends four numbers, the same on every rank and
    strategy at the optimizer's first step.

    Args:
        first: A 63-bit integer.
        second: Another one.
        device: Device of the collective's tensor.

    Returns:
        `[min first, max first, min second, max second]`.
    """
    values = [first, -first, second, -second]
    extremes = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(extremes, op=dist.ReduceOp.MIN)
    low, high, second_low, second_high = extremes.tolist()
    return [low, -high, second_low, -second_high]


def options_disagree(options: str) -> str:
    """Return the message of ranks whose optimizers have different options.

    Args:
        options: This rank's options (`exchange.describe_options`).

    Returns:
        The message, with the likely causes.
    """
    return (
        "The processes' optimizers disagree on their options (rank "
        f"{rank()} has: {options}). A learning-rate scheduler stepped on some "
        "ranks only, or an option set on one rank, would make the replicated "
        "parameters diverge. Set the same options on every rank."
    )


def option_slots(checksum: int, processes: int) -> list[float]:
    """Return this rank's slots for the ranks' option checksums in a sum.

    Args:
        checksum: This rank's `fingerprint` of its options.
        processes: The number of ranks.

    Returns:
        One number per rank: `checksum` in this rank's slot, 0 elsewhere. After
        an all-reduce (sum) every slot holds its rank's checksum exactly (24
        bits fit float32).
    """
    slots = [0.0] * processes
    slots[rank()] = float(checksum)
    return slots


def check_same_options(slots: list[float], options: str) -> None:
    """Raise on every rank unless all ranks' summed `option_slots` agree.

    Args:
        slots: The slots after the all-reduce (the same on every rank).
        options: This rank's options, for the message.

    Raises:
        RuntimeError: If the checksums differ.
    """
    if len(set(slots)) > 1:
        raise RuntimeError(options_disagree(options))


def configuration_disagrees(description: str) -> str:
    """Return the message of ranks whose optimizers exchange different statistics.

    Args:
        description: This rank's layers, structures, options and strategy.

    Returns:
        The message.
    """
    return (
        "The processes' optimizers disagree on the layers, structures or "
        f"options whose statistics they exchange (rank {rank()} has: "
        f"{description}). "
        "Build the same model and optimizer on every rank."
    )


def check_same_configuration(description: str, device: torch.device) -> None:
    """Raise on every process unless all processes pass the same `description`.

    Args:
        description: A text that names the layers, structures and options whose
            statistics will be exchanged, and the distribution strategy.
        device: Device of the collective's tensor (the backend's device).

    Raises:
        RuntimeError: If the processes' descriptions differ.
    """
    checksum = zlib.crc32(description.encode())
    with named_collective("The configuration check of the optimizer's first step"):
        low, high, *_ = _agree(checksum, 0, device)
    if low != checksum or high != checksum:
        raise RuntimeError(configuration_disagrees(description))


@dataclass(frozen=True)
class StepCheck:
    r"""This rank's step count, options and configuration, checked at every step.

    `Shard` checks them at every step of several ranks: a rank that skipped
    `step()` would pair its collectives with another step's, and one rank's
    options (a scheduler stepped there only) would make the parameters diverge
    silently. Each rank writes its three numbers into its own slots of
    \(3P\) float64 numbers, zeros elsewhere (`slots`); after a sum every rank
    holds every rank's numbers exactly (a step count below \(2^{53}\),
    32-bit checksums) and `verify` raises alike on every rank.

    The slots ride at the head of the step's first all-reduce: on an update
    step the statistics summary (`owner_statistics`), else an all-reduce of
    their own (`alone`). Both are `length` numbers long, the same on every rank
    whose configuration agreed when it was last checked: ranks at different
    steps (one due for a factor update, one not) or with different
    configurations still meet in a collective of one size and raise, where
    collectives of different sizes would abort the gloo backend.

    Attributes:
        step: How many steps this rank's optimizer has taken.
        options: Its options (`exchange.describe_options`).
        configuration: Its layers, structures, options and strategy
            (`exchange.describe_layers` and the strategy).
        length: The numbers of the all-reduce that carries the slots.
        device: The device of the collective's tensor.
    """

    step: int
    options: str
    configuration: str
    length: int
    device: torch.device

    @staticmethod
    def size(processes: int) -> int:
        r"""Return the number of slots: three per rank.

        Args:
            processes: The number of ranks.

        Returns:
            \(3P\).
        """
        return 3 * processes

    def slots(self) -> Tensor:
        """Return this rank's slots: its numbers in its place, zeros elsewhere.

        Returns:
            The configuration's checksum, the step count and the options'
            `fingerprint`, each in slot `rank()` of a block of `world_size()`
            float64 numbers.
        """
        processes, me = world_size(), rank()
        values = torch.zeros(self.size(processes), dtype=torch.float64)
        values[me] = zlib.crc32(self.configuration.encode())
        values[processes + me] = self.step
        values[2 * processes + me] = fingerprint(self.options)
        return values.to(self.device)

    def message(self, *parts: Tensor) -> Tensor:
        """Return an all-reduce's buffer: the slots, `parts`, zeros to `length`.

        Args:
            parts: Flat float64 tensors that ride behind the slots (none: the
                check alone).

        Returns:
            A float64 tensor of `length` numbers.
        """
        head = self.slots()
        carried = sum(part.numel() for part in parts)
        tail = head.new_zeros(self.length - len(head) - carried)
        return torch.cat([head, *parts, tail])

    def verify(self, summed: Sequence[float]) -> None:
        """Raise on every rank unless all ranks' numbers agree.

        Args:
            summed: The slots summed over the ranks (the same on every rank).

        Raises:
            RuntimeError: If the configurations differ; else if the step counts
                do; else if the options do.
        """
        processes = world_size()
        checksums, steps, options = (
            summed[block * processes : (block + 1) * processes] for block in range(3)
        )
        if len(set(checksums)) > 1:
            raise RuntimeError(configuration_disagrees(self.configuration))
        if len(set(steps)) > 1:
            raise RuntimeError(
                "The ranks disagree on the optimizer's step count (rank "
                f"{rank()}: {self.step}; the ranks range from {round(min(steps))} "
                f"to {round(max(steps))}): a rank skipped optimizer.step() or "
                "called it more often. Every rank must call step() once per "
                "iteration."
            )
        if len(set(options)) > 1:
            raise RuntimeError(options_disagree(self.options))

    def alone(self) -> None:
        """Check in an all-reduce of its own (the slots, then zeros to `length`).

        `verify` raises where the ranks disagree.
        """
        buffer = self.message()
        with named_collective("The step check of a sharded optimizer"):
            dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
        self.verify(buffer[: self.size(world_size())].tolist())


def agree(flags: Tensor) -> Tensor:
    """Return flags that hold on every rank: True only where all ranks' are.

    One all-reduce (a minimum) of 32-bit integers; no host synchronisation.

    Args:
        flags: This rank's boolean flags, the same number on every rank.

    Returns:
        The agreed boolean flags, on the device of `flags`.
    """
    votes = flags.to(torch.int32)
    with named_collective("The agreement on a step's verdicts (the step guard)"):
        dist.all_reduce(votes, op=dist.ReduceOp.MIN)
    return votes.bool()


def all_gather_parts(
    parts: Sequence[Tensor],
    sizes: list[int],
    dtype: torch.dtype,
    device: torch.device,
    buffers: Buffers | None = None,
    slot: Hashable = "gather",
    group: dist.ProcessGroup | None = None,
) -> list[Tensor]:
    """Gather every rank's numbers: one `all_gather` of equal-size flat buffers.

    Each rank copies its parts once, into a buffer as long as the longest rank's
    share (gloo gathers equal sizes only), the tail zeroed.

    Args:
        parts: This rank's tensors, in order; `sizes[rank()]` numbers in all.
        sizes: Every rank's number of numbers, the same list on every rank.
        dtype: The buffer's dtype (holds every part exactly).
        device: The buffer's device.
        buffers: Where the sent and received buffers are kept between steps
            (None: allocated for this call).
        slot: The name of this gather's buffers in `buffers`.
        group: The processes that gather (None: the default group); `sizes`
            and the result are indexed by the rank within it.

    Returns:
        Per rank, its numbers (views of the gathered buffers; with `buffers`,
        valid until `slot` is gathered again).
    """
    length = max(sizes)
    buffer = lend(buffers, (slot, "sent"), length, dtype, device)
    offset = 0
    for part in parts:
        buffer[offset : offset + part.numel()].copy_(part.reshape(-1))
        offset += part.numel()
    buffer[offset:].zero_()
    received = [
        lend(buffers, (slot, sender), length, dtype, device)
        for sender in range(len(sizes))
    ]
    dist.all_gather(received, buffer, group=group)
    return [chunk[:size] for chunk, size in zip(received, sizes, strict=True)]
