"""An optimizer's life on its model (a mixin of the shell).

- `remove_hooks()`, or a `with` block, takes the optimizer's hooks off the model;
  `step` raises afterwards, as it does once a later optimizer on the same layers
  has taken the hooks over (`singd_curvlinops.attachment`).
- A `step` without gradients (no backward pass since the gradients were set to
  None) changes nothing: no parameter, factor, momentum or step counter; it warns
  and drops the statistics collected since the last step, which belong to the
  discarded gradients. So does `zero_grad`, which discards them.
"""

from __future__ import annotations

from typing import Any, TypeVar

from singd_curvlinops._warnings import warn

_Self = TypeVar("_Self", bound="Lifecycle")


class Lifecycle:
    """Hook removal and steps without gradients of `KroneckerOptimizer`."""

    def remove_hooks(self) -> None:
        """Take the optimizer's hooks off the model (idempotent).

        The optimizer collects no statistics afterwards and `step` raises a
        `RuntimeError`; `state_dict()` still works. Pending statistics are dropped.
        A dropped optimizer's hooks come off by themselves when it is
        garbage-collected, and a later optimizer on the same layers takes them
        over: call this to detach at a known point, or use the optimizer as a
        context manager (`with SINGD(model) as optimizer: ...`).
        """
        self._collector.remove_hooks(
            f"{type(self).__name__}.remove_hooks() was called (explicitly or at "
            "the end of its with block)"
        )

    def __enter__(self: _Self) -> _Self:
        """Return the optimizer, whose hooks come off at the end of the block.

        Returns:
            `self`.
        """
        return self

    def __exit__(self, *exc_info: Any) -> None:
        """Remove the hooks (`remove_hooks`); exceptions propagate.

        Args:
            *exc_info: The exception of the block, if any.
        """
        self.remove_hooks()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients (`torch.optim`), and drop the statistics collected.

        Statistics belong to the gradients of their backward passes: a pass whose
        gradients are discarded (a batch skipped after `backward()`, a curvlinops
        operator's passes after `step()`) adds nothing to the next factor update.
        Factors handed over with `set_curvature` stay.

        Args:
            set_to_none: As for `torch.optim.Optimizer.zero_grad`.
        """
        super().zero_grad(set_to_none)
        self._collector.pending.clear()

    def _has_gradients(self) -> bool:
        """Return whether any parameter of the groups has a gradient.

        Returns:
            False if no backward pass reached a parameter since the gradients
            were last set to None.
        """
        return any(p.grad is not None for g in self.param_groups for p in g["params"])

    def _step_without_gradients(self) -> None:
        """Warn that the step changes nothing; drop the collected statistics."""
        self._collector.pending.clear()
        warn(
            f"{type(self).__name__}.step() found no gradients: no backward pass "
            "reached its parameters since they were set to None (zero_grad()). "
            "Nothing changed: parameters, factors, momenta and step counters are "
            "as before; statistics collected since the last step are dropped."
        )
