"""Which optimizer's hooks sit on a model: removal, take-over, dropped optimizers.

Each optimizer's collector puts its forward (pre-)hooks on the modules of its
layers through a `HookSet`. The hooks come off in three ways:

- **explicitly**, with `remove_hooks()` or at the end of a `with` block
  (`HookSet.remove`);
- **by take-over**: a module carries the hooks of one optimizer. An optimizer
  built later with a layer on a module that a live optimizer hooks removes the
  older optimizer's hooks from the whole model (a re-run notebook cell,
  Lightning's `Tuner.lr_find` followed by `fit`), so that only the newest
  optimizer collects and hooks do not pile up; the older one's `step` raises.
  Optimizers on disjoint modules of one model keep theirs. (Two optimizers on
  the slots of one module could not both collect: an adapter that computes the
  module's products itself, as the attention adapter does under its capture,
  would hide one's uses from the other.)
- **when the optimizer is garbage-collected**: the hooks hold the collector
  weakly, and a finalizer of the `HookSet` removes them.

The registry of hooked modules holds modules and hook sets weakly: it keeps
neither a model nor an optimizer alive.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from torch.nn import Module
from torch.utils.hooks import RemovableHandle

# the live hook sets on each module (weak on both sides)
_HOOKED: weakref.WeakKeyDictionary[Module, weakref.WeakSet[HookSet]] = (
    weakref.WeakKeyDictionary()
)


def _remove_handles(handles: dict[Module, list[RemovableHandle]]) -> None:
    """Remove every hook in `handles` (idempotent).

    Args:
        handles: Hook handles by module.
    """
    for module_handles in handles.values():
        for handle in module_handles:
            handle.remove()
    handles.clear()


class HookSet:
    """The hooks that one optimizer's collector has put on a model's modules.

    Args:
        owner: The optimizer's class name, for messages.

    Attributes:
        owner: The optimizer's class name.
        removed: Why the hooks were removed (None while they are on the model).
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.removed: str | None = None
        self._handles: dict[Module, list[RemovableHandle]] = {}
        finalizer = weakref.finalize(self, _remove_handles, self._handles)
        finalizer.atexit = False

    @property
    def handles(self) -> dict[Module, list[RemovableHandle]]:
        """The handles of the hooks on the model, by module (empty after removal)."""
        return self._handles

    def hook(
        self, module: Module, name: str, *register: Callable[[], RemovableHandle]
    ) -> None:
        """Register hooks on a module, taking it over from other optimizers.

        Every other live hook set on `module` is removed from the whole model
        (see the module docs). Nothing happens once this set is removed.

        Args:
            module: The module.
            name: The layer it applies, for the older optimizer's message.
            *register: Functions that register one hook each and return its handle.
        """
        if self.removed is not None:
            return
        others = _HOOKED.setdefault(module, weakref.WeakSet())
        for other in list(others):
            if other is not self:
                other.remove(
                    f"a {self.owner} optimizer built later on the same model took "
                    f"over layer {name!r}"
                )
        others.add(self)
        handles = self._handles.setdefault(module, [])
        handles.extend(add() for add in register)

    def remove(self, reason: str) -> None:
        """Remove every hook of the set from the model (idempotent).

        Args:
            reason: Why, for the message of a later `step` (the first reason is
                kept).
        """
        if self.removed is None:
            self.removed = reason
        for module in self._handles:
            others = _HOOKED.get(module)
            if others is not None:
                others.discard(self)
        _remove_handles(self._handles)

    def check(self) -> None:
        """Raise if the hooks were removed.

        Raises:
            RuntimeError: After `remove`: the optimizer collects no statistics.
        """
        if self.removed is not None:
            raise RuntimeError(
                f"This {self.owner} optimizer's hooks were removed from the model: "
                f"{self.removed}. It collects no statistics any more, so it does "
                f"not step; use the optimizer that holds the hooks, or build a new "
                f"{self.owner} (load this one's state_dict() into it to continue)."
            )
