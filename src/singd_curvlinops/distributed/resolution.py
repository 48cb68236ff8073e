"""`resolve`: the distribution strategy that an optimizer's `distribute=` names."""

from __future__ import annotations

import copy

from singd_curvlinops.distributed.shard import Shard
from singd_curvlinops.distributed.strategy import DistributionStrategy, Replicate


def resolve(
    distribute: str | DistributionStrategy, options: tuple[str, ...] = ()
) -> DistributionStrategy:
    """Return the strategy that `distribute` names, as a fresh object.

    Args:
        distribute: `"replicate"`, `"shard"` or a strategy object (copied).
        options: The optimizer's option names (its `defaults`), whose values the
            ranks compare at their steps (`exchange.describe_options`).

    Returns:
        The strategy.

    Raises:
        ValueError: If `distribute` is another string.
        TypeError: If it is neither a string nor a strategy.
    """
    strategies = {"replicate": Replicate, "shard": Shard}
    if isinstance(distribute, DistributionStrategy):
        strategy = copy.deepcopy(distribute)
    elif not isinstance(distribute, str):
        raise TypeError(
            "distribute must be 'replicate', 'shard' or a DistributionStrategy "
            f"(Replicate(), Shard(factors=...)), got {type(distribute).__name__}."
        )
    elif distribute not in strategies:
        raise ValueError(
            f"distribute must be 'replicate' or 'shard' (or Shard(factors='owned') "
            f"for only owners keeping factors), got {distribute!r}."
        )
    else:
        strategy = strategies[distribute]()
    strategy.options = options
    return strategy
