"""What a sharded step's `all_gather` holds: items, their owners, their dtype.

Every rank computes every rank's share of a gather from the assignment and the
due layers alone (see `engine`): a list of `Item`s — state entries of the sides a
rank updated, (half-)preconditioned gradients, a flag per gradient — in one dtype
that holds each of them exactly (`buffer_dtype`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from singd_curvlinops.distributed.assignment import Assignment
from singd_curvlinops.layers import Layer
from singd_curvlinops.rules import FactorRule

# state entries of a layer that the shell keeps (not the rule's factors)
SHELL_KEYS = frozenset(
    {
        "step",
        "grad_scale",
        "momentum_buffer",
        "skipped_steps",  # the step guard's counters (`singd_curvlinops.guard`)
        "discarded_factor_updates",
    }
)
# prefix of grafting's entries in a layer's state (the shell's, not the rule's:
# every rank grafts every step it applies, from the same gradient)
GRAFT = "graft_"
Plan = Mapping[Layer, Assignment | None]


@dataclass(frozen=True)
class Item:
    """One tensor (or number) in a rank's share of the step's `all_gather`.

    Attributes:
        layer: The layer it belongs to (None for `"verdicts"`).
        kind: `"state"`, `"direction"`, `"flag"` or `"verdicts"` (the step
            guard's, `StepGuard.shared_verdicts`).
        key: The state entry (kind `"state"`), else `""`.
        shape: Its shape (`(1,)` for a number).
    """

    layer: Layer | None
    kind: str
    key: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        """How many numbers it takes."""
        return math.prod(self.shape)


def verdicts_item(due: Sequence[bool]) -> Item:
    """Return the step guard's verdicts in a rank's share (the same on every rank).

    Args:
        due: Per layer of the step, whether its factors update.

    Returns:
        One flag for the inputs and one per side of each updated layer.
    """
    return Item(None, "verdicts", "", (1 + 2 * sum(due),))


def owned_sides(assignment: Assignment | None, me: int) -> tuple[int, ...]:
    """Return the sides whose factors rank `me` updates.

    Args:
        assignment: The layer's assignment (None: replicated).
        me: The rank.

    Returns:
        A subset of `(0, 1)`.
    """
    if assignment is None:
        return (0, 1)
    return tuple(side for side in (0, 1) if assignment.owners[side] == me)


def side_of(key: str, rule: FactorRule) -> int | None:
    """Return the side a state entry belongs to (by its `factor_sides` prefix).

    Args:
        key: The entry's key, e.g. `"m_K.mat"`.
        rule: The factor rule.

    Returns:
        0, 1, or None for an entry of no side (e.g. a counter).
    """
    return dict(rule.factor_sides).get(key.split(".", 1)[0])


def rule_keys(
    state: dict[str, Any], rule: FactorRule, sides: tuple[int, ...] | None
) -> list[str]:
    """Return a layer's state entries that belong to the rule, sorted.

    Args:
        state: The layer's state.
        rule: The factor rule.
        sides: Only the entries of these sides; None: every entry of the rule,
            also those of no side.

    Returns:
        The keys.
    """
    keys = sorted(
        key for key in state if key not in SHELL_KEYS and not key.startswith(GRAFT)
    )
    if sides is None:
        return keys
    return [key for key in keys if side_of(key, rule) in sides]


def source(key: str, assignment: Assignment, rule: FactorRule) -> int:
    """Return the rank that updates a state entry.

    Args:
        key: The entry's key.
        assignment: Its layer's assignment.
        rule: The factor rule.

    Returns:
        The owner of the entry's side (of the layer, for a rule that does not
        split or an entry of no side).
    """
    side = side_of(key, rule)
    return assignment.owners[0 if side is None or not rule.splits_sides else side]


def kept_everywhere(key: str, rule: FactorRule, owned: bool) -> bool:
    """Return whether every rank keeps a state entry (else only its source).

    Args:
        key: The entry's key.
        rule: The factor rule.
        owned: Whether only owners keep factors (`Shard(factors="owned")`).

    Returns:
        False under owned factors and for the rule's `owner_state`, True
        otherwise.
    """
    return not owned and key.split(".", 1)[0] not in rule.owner_state


def buffer_dtype(layers: Sequence[Layer], groups: Sequence[dict]) -> torch.dtype:
    """Return the dtype that holds every shared number exactly.

    Args:
        layers: The layers of the step.
        groups: The parameter groups.

    Returns:
        float64 if any parameter or factor is float64, else float32.
    """
    for layer in layers:
        dtypes = (layer.weight.dtype, *layer.factor_dtypes(groups[layer.group_index]))
        if torch.float64 in dtypes:
            return torch.float64
    return torch.float32


def shape_of(value: Any) -> tuple[int, ...]:
    """Return the shape of a state entry (`(1,)` for a number).

    Args:
        value: A tensor or a number.

    Returns:
        Its shape.
    """
    return tuple(value.shape) if isinstance(value, Tensor) else (1,)


def write_received(stepper: Any, item: Item, chunk: Tensor) -> None:
    """Write a received state entry into this rank's state (copied out).

    Args:
        stepper: The shell's per-layer operations.
        item: The entry.
        chunk: Its value (a view of the gathered buffer).
    """
    state = stepper.state[item.layer.weight]
    old = state[item.key]
    if isinstance(old, Tensor):
        old.copy_(chunk)
    else:  # a number of the rule's (e.g. a counter): one host read
        value = chunk.item()
        state[item.key] = round(value) if isinstance(old, int) else value
    side = side_of(item.key, stepper.rule)
    stepper.forget(item.layer, (0, 1) if side is None else (side,))
