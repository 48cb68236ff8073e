"""Copies of an optimizer whose hooks sit on its model (a mixin of the shell).

An optimizer cannot be pickled or copied on its own: `copy.deepcopy((model,
optimizer))` copies both and re-attaches the copy's hooks to the copied model.
"""

from __future__ import annotations

import copy
from typing import Any


class CopiesWithModel:
    """Copy support of `KroneckerOptimizer` (see the module docs)."""

    def __deepcopy__(self, memo: dict[int, Any]) -> CopiesWithModel:
        """Copy the optimizer together with its model: `deepcopy((model, opt))`.

        Args:
            memo: `copy.deepcopy`'s memo, which must hold the model's copy.

        Returns:
            An optimizer of the copied model's layers, with a copy of the state.

        Raises:
            TypeError: If the model was not copied first (the copy's hooks would
                sit on the original model).
        """
        if id(self._layers.model) not in memo:
            raise TypeError(self._copy_message())
        twin = object.__new__(type(self))
        memo[id(self)] = twin
        # "step": an LR scheduler's wrapper of `step`, bound to this optimizer (the
        # copy keeps its class's `step`, as torch's optimizers do when copied)
        skip = ("_collector", "_records", "step")
        for key, value in self.__dict__.items():
            if key not in skip:
                twin.__dict__[key] = copy.deepcopy(value, memo)
        twin._records = type(self._records)(twin)  # derived data: rebuilt
        layers = {layer: copy.deepcopy(layer, memo) for layer in self._layers}
        twin._collector = self._collector.copy_to(layers, twin._collection_plan, memo)
        return twin

    def __reduce_ex__(self, protocol: int) -> Any:
        """Refuse pickling and shallow copies: save `state_dict()` instead.

        Args:
            protocol: The pickle protocol.

        Raises:
            TypeError: Always.
        """
        raise TypeError(self._copy_message())

    def _copy_message(self) -> str:
        """Return the message for refused copies.

        Returns:
            What to do instead.
        """
        return (
            f"A {type(self).__name__} optimizer cannot be pickled or copied on its "
            "own: its hooks sit on the model. Save and load optimizer.state_dict() "
            "(with the model's), or copy both at once: "
            "copy.deepcopy((model, optimizer))."
        )
