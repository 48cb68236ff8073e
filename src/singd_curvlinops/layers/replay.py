"""Replaying a forward call's random numbers when an adapter recomputes its output.

An adapter that recomputes a module's output with its linear maps exposed
(`MultiheadAttentionAdapter`, `ShiftedWindowAttentionAdapter`,
`FunctionalQKVAdapter`) must draw the same dropout masks as the original call
and leave the generator where the original call left it, so that a collecting
pass draws the same numbers as any other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor

Result = TypeVar("Result")


def random_state(device: torch.device) -> tuple[Tensor, Any]:
    """Return the CPU random state and that of `device` if it is a CUDA device.

    Args:
        device: The inputs' device.

    Returns:
        `(cpu state, (cuda state or None, device))`.
    """
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), (cuda, device)


def set_random_state(state: tuple[Tensor, Any]) -> None:
    """Restore a state from `random_state`.

    Args:
        state: The state.
    """
    cpu, (cuda, device) = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def replayed(
    before: tuple[Tensor, Any] | None,
    device: torch.device,
    compute: Callable[[], Result],
) -> Result:
    """Run `compute` from the random state `before`, then restore the current one.

    Args:
        before: The state before the original call (`random_state`), or None if
            the call drew no random numbers (`compute` then runs as it is).
        device: The inputs' device.
        compute: The recomputation.

    Returns:
        What `compute` returns.
    """
    if before is None:
        return compute()
    after = random_state(device)
    set_random_state(before)
    try:
        return compute()
    finally:
        set_random_state(after)
