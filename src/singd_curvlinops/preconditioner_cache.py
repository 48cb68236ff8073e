"""`PreconditionerCache`: an optimizer's preconditioner records, until factors change.

The shell (`KroneckerOptimizer.preconditioner`), the statistics hooks and the
per-layer operations of a step (`singd_curvlinops.stepping`) read a layer's
record from here; a factor update forgets the records whose cached products it
made stale.
"""

from __future__ import annotations

import weakref
from typing import Any

from singd_curvlinops.layers import Layer
from singd_curvlinops.rules import Preconditioner


class PreconditionerCache:
    """An optimizer's preconditioners, per layer and sides, until factors change.

    A record is also rebuilt when an option that it read changed since it was
    built (`FactorRule.preconditioner_options`).

    A record caches products only for the sides this rank applies
    (`FactorRule.splits_sides`); the statistics hooks ask for none, the step of a
    whole layer for both. Rules that cannot split build one record per layer.

    Args:
        optimizer: The optimizer shell (its rule, state, groups and strategy);
            held weakly, so that a dropped optimizer is freed without waiting for
            the cycle collector (and its hooks come off at once).
    """

    def __init__(self, optimizer: Any) -> None:
        self._optimizer = weakref.ref(optimizer)
        # per layer and sides: the options the record read, and the record
        self._records: dict[Layer, dict[tuple[int, ...], tuple[tuple, Any]]] = {}

    def __call__(self, layer: Layer, sides: tuple[int, ...]) -> Preconditioner:
        """Return a layer's record with products cached for `sides`.

        Args:
            layer: The layer.
            sides: The sides this rank applies.

        Returns:
            The rule's record (cached).
        """
        optimizer = self._optimizer()
        rule = optimizer.rule
        sides = sides if rule.splits_sides else (0, 1)
        options = layer.options(optimizer.param_groups[layer.group_index])
        read = tuple(options[name] for name in rule.preconditioner_options)
        records = self._records.setdefault(layer, {})
        if sides not in records or records[sides][0] != read:
            optimizer.distribution.check_holds(layer)
            kwargs = {"sides": sides} if rule.splits_sides else {}
            record = rule.preconditioner(
                optimizer.state[layer.weight], options, **kwargs
            )
            records[sides] = (read, record)
        return records[sides][1]

    def forget(self, layer: Layer, sides: tuple[int, ...] = (0, 1)) -> None:
        """Drop a layer's records that cache a product of a changed side.

        A record's factors are the state's tensors, updated in place; only its
        cached products (`K Kᵀ`, `C Cᵀ`, KFAC's inverses) go stale.

        Args:
            layer: The layer.
            sides: The sides whose factors changed.
        """
        records = self._records.get(layer, {})
        for cached in [c for c in records if set(c) & set(sides)]:
            del records[cached]

    def clear(self) -> None:
        """Drop every record."""
        self._records.clear()
