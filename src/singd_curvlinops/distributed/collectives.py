"""The collectives of the distribution strategies, and the checks that guard them.

Every collective goes through `torch.distributed` (no other transport). Two checks
turn misuse into errors on every rank instead of a hang or a silent divergence:

- `check_same_configuration`, whenever the layers or options change: the ranks
  compare a checksum of their layers, structures, options and distribution
  strategy (mismatched collectives would otherwise crash the gloo backend);
- `check_same_step`, at every step of a sharded strategy: the ranks compare their
  step counts (a rank that skipped `step()` would pair its collectives with
  another step's) and a `fingerprint` of their options (`lr`, `damping`, ...:
  one rank's scheduler or setting would make the parameters diverge silently);
  under `Replicate` the fingerprints travel in the statistics all-reduce of
  every factor update instead (`check_same_options`).

A collective that fails (a peer that never arrives times out after the process
group's `timeout`, a crashed peer closes the connection) raises a `RuntimeError`
that names what this rank was doing and the likely cause.
"""

from __future__ import annotations

import zlib
from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager

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

    Every check sends the same four numbers, so that two different checks that
    meet (ranks that disagree on which one is due) still pair up and raise.

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
        raise RuntimeError(
            "The processes' optimizers disagree on the layers, structures or "
            f"options whose statistics they exchange (rank {rank()} has: "
            f"{description}). "
            "Build the same model and optimizer on every rank."
        )


def check_same_step(step: int, options: str, device: torch.device) -> None:
    """Raise on every process unless all are at the same step, with the same options.

    Args:
        step: How many steps this process's optimizer has taken.
        options: Its options (`exchange.describe_options`).
        device: Device of the collective's tensor.

    Raises:
        RuntimeError: If the step counts or the options' fingerprints differ.
    """
    checksum = fingerprint(options)
    with named_collective("The step check of a sharded optimizer"):
        low, high, options_low, options_high = _agree(step, checksum, device)
    if options_low != options_high and low == high:
        raise RuntimeError(options_disagree(options))
    if low != high:
        raise RuntimeError(
            f"The ranks disagree on the optimizer's step count (rank {rank()}: "
            f"{step}; the ranks range from {low} to {high}): a rank skipped "
            "optimizer.step() or called it more often. Every rank must call "
            "step() once per iteration."
        )


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
    dist.all_gather(received, buffer)
    return [chunk[:size] for chunk, size in zip(received, sizes, strict=True)]
