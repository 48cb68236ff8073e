r"""Verdicts of the step guard (`singd_curvlinops.guard`) and its counters.

A verdict is a 0-d boolean tensor on the device: `finite` (from `bounds`) and
`inputs_verdict` form them without a host read, `choose` applies one to in-place
changes (`torch.where`), a `Verdict` record keeps it with the host numbers to
restore if it fails. The counters live in the optimizer state of the parameters: each
parameter's `"skipped_steps"` (steps in which its update was skipped) and each
layer weight's `"discarded_factor_updates"`, plain ints created at 0 with the
rest of the state (`init_counters`; also after loading a checkpoint written
before them).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from singd_curvlinops.bounds import finite
from singd_curvlinops.distributed.collectives import agree, world_size
from singd_curvlinops.distributed.fsdp import local

SKIPPED = "skipped_steps"
DISCARDED = "discarded_factor_updates"
COUNTERS = (SKIPPED, DISCARDED)

# a value to write into `target`: `new` if the verdict holds, else `old`
Choice = tuple[Tensor, Tensor, Tensor]


def inputs_verdict(
    tensors: Sequence[Tensor], found_inf: Tensor | None, device: torch.device
) -> Tensor:
    """Return whether a step's gradients and statistics are finite.

    Args:
        tensors: The gradients to check (none if a `GradScaler` checked them)
            and the statistics.
        found_inf: The `GradScaler`'s count of infinities found, or None.
        device: The device of the result.

    Returns:
        A 0-d boolean tensor, the same on every rank (FSDP2's gradient shards
        are checked by each rank and agreed on in one all-reduce).
    """
    ok = finite([local(t) for t in tensors], device)
    if world_size() > 1 and any(isinstance(t, DTensor) for t in tensors):
        ok = agree(ok.reshape(1)).reshape(())
    return ok if found_inf is None else ok & (found_inf.to(device) == 0)


def choose(choices: Iterable[Choice], ok: Tensor) -> None:
    """Write `new` (if `ok`) or `old` into each target, on the device.

    Args:
        choices: `(target, new, old)` triples; `target` may be `new` or `old`.
        ok: 0-d boolean verdict (no host read).
    """
    for target, new, old in choices:
        torch.where(ok.to(target.device), new, old, out=target)


@dataclass(eq=False)
class Verdict:
    """One checked change and what to do if it fails.

    Attributes:
        flag: 0-d boolean tensor, True if the change is kept.
        state: The state the change wrote numbers to (None: no numbers).
        numbers: Those numbers before the change, restored on failure.
        settled: Whether the numbers were already settled (`settle_factors`).
    """

    flag: Tensor
    state: dict[str, Any] | None = None
    numbers: dict[str, Any] = field(default_factory=dict)
    settled: bool = False

    def restore(self) -> None:
        """Put the numbers back (the change failed)."""
        if self.state is not None:
            self.state.update(self.numbers)


def count(state: dict[str, Any], key: str) -> None:
    """Add one to a counter of a parameter's state (absent: 0).

    Args:
        state: The parameter's state.
        key: `SKIPPED` or `DISCARDED`.
    """
    state[key] = state.get(key, 0) + 1


def init_counters(
    state: Mapping[Any, dict[str, Any]], params: Iterable[Any], weights: Iterable[Any]
) -> None:
    """Give every parameter its counters (0 where they are missing).

    Created with the rest of the state, so that a `torch.distributed.checkpoint`
    template of a fresh optimizer holds them, and after loading a checkpoint that
    predates them.

    Args:
        state: The optimizer's state.
        params: Its trainable parameters (`SKIPPED`).
        weights: Its layers' weights (`DISCARDED`).
    """
    for param in params:
        state[param].setdefault(SKIPPED, 0)
    for weight in weights:
        state[weight].setdefault(DISCARDED, 0)


def total(states: Iterable[Mapping[str, Any]], key: str) -> int:
    """Return the sum of a counter over some parameters' states.

    Args:
        states: The states.
        key: The counter.

    Returns:
        The sum (absent counters count 0).
    """
    return sum(state.get(key, 0) for state in states)


def most(states: Iterable[Mapping[str, Any]], key: str) -> int:
    """Return the largest value of a counter over some parameters' states.

    Args:
        states: The states.
        key: The counter.

    Returns:
        The maximum (0 for none).
    """
    return max((state.get(key, 0) for state in states), default=0)
