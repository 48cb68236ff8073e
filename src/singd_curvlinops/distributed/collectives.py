"""The collectives of the distribution strategies, and the checks that guard them.

Every collective goes through `torch.distributed` (no other transport). Two checks
turn misuse into errors on every rank instead of a hang or a silent divergence:

- `check_same_configuration`, whenever the layers or options change: the ranks
  compare a checksum of their layers, structures, options and distribution
  strategy (mismatched collectives would otherwise crash the gloo backend);
- `check_same_step`, at every step of a sharded strategy: the ranks compare their
  step counts (a rank that skipped `step()` would pair its collectives with
  another step's).

A collective that fails (a peer that never arrives times out after the process
group's `timeout`, a crashed peer closes the connection) raises a `RuntimeError`
that names what this rank was doing and the likely cause.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor


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


def _agree(value: int, device: torch.device) -> tuple[int, int]:
    """Return the smallest and largest `value` over all ranks (one all-reduce).

    Args:
        value: A 63-bit integer.
        device: Device of the collective's tensor.

    Returns:
        `(min, max)`.
    """
    extremes = torch.tensor([value, -value], dtype=torch.int64, device=device)
    dist.all_reduce(extremes, op=dist.ReduceOp.MIN)
    low, high = extremes.tolist()
    return low, -high


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
        low, high = _agree(checksum, device)
    if low != checksum or high != checksum:
        raise RuntimeError(
            "The processes' optimizers disagree on the layers, structures or "
            f"options whose statistics they exchange (rank {rank()} has: "
            f"{description}). "
            "Build the same model and optimizer on every rank."
        )


def check_same_step(step: int, device: torch.device) -> None:
    """Raise on every process unless all processes are at the same step.

    Args:
        step: How many steps this process's optimizer has taken.
        device: Device of the collective's tensor.

    Raises:
        RuntimeError: If the step counts differ.
    """
    with named_collective("The step check of a sharded optimizer"):
        low, high = _agree(step, device)
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
    parts: Sequence[Tensor], sizes: list[int], dtype: torch.dtype, device: torch.device
) -> list[Tensor]:
    """Gather every rank's numbers: one `all_gather` of equal-size flat buffers.

    Each rank copies its parts once, into a buffer as long as the longest rank's
    share (gloo gathers equal sizes only), the tail zeroed.

    Args:
        parts: This rank's tensors, in order; `sizes[rank()]` numbers in all.
        sizes: Every rank's number of numbers, the same list on every rank.
        dtype: The buffer's dtype (holds every part exactly).
        device: The buffer's device.

    Returns:
        Per rank, its numbers (views of the gathered buffers).
    """
    buffer = torch.empty(max(sizes), dtype=dtype, device=device)
    offset = 0
    for part in parts:
        buffer[offset : offset + part.numel()].copy_(part.reshape(-1))
        offset += part.numel()
    buffer[offset:].zero_()
    received = [torch.empty_like(buffer) for _ in sizes]
    dist.all_gather(received, buffer)
    return [chunk[:size] for chunk, size in zip(received, sizes, strict=True)]
