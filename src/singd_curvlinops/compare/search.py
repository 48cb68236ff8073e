"""Search spaces and their quasi-random points.

Every optimizer has a documented search space: a few hyperparameters, each in an
interval on a log scale (`Dimension`); all its other options are fixed. Trial `i`
of every study uses the `i`-th point of a scrambled Halton sequence (scipy's
`qmc.Halton`, seed 0) mapped into the space. The sequence does not depend on the
number of trials, so a larger budget extends a smaller one: the trials of the
reduced default study are the first trials of the full one. Optimizers whose
spaces have the same number of dimensions get the same points of the unit cube.

>>> space = (Dimension("lr", 1e-3, 1e-1),)
>>> [round(point["lr"], 6) for point in points(space, 3)] == [
...     round(point["lr"], 6) for point in points(space, 5)[:3]
... ]
True
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

HALTON_SEED = 0


@dataclass(frozen=True)
class Dimension:
    """One searched hyperparameter: an interval, searched on a log scale.

    Attributes:
        name: The optimizer's argument name (or a name its factory understands).
        low: Smallest value (> 0).
        high: Largest value (> `low`).
    """

    name: str
    low: float
    high: float

    def __post_init__(self) -> None:
        """Check the interval.

        Raises:
            ValueError: If not `0 < low < high`.
        """
        if not 0 < self.low < self.high:
            raise ValueError(
                f"Dimension {self.name!r} needs 0 < low < high, got "
                f"[{self.low}, {self.high}]."
            )

    def value(self, unit: float) -> float:
        """Map a point of `[0, 1]` log-linearly onto `[low, high]`.

        Args:
            unit: A number in `[0, 1]`.

        Returns:
            `low * (high / low) ** unit`.
        """
        return math.exp(math.log(self.low) + unit * math.log(self.high / self.low))

    def describe(self) -> str:
        """Return the interval as text, e.g. `"lr ∈ [0.001, 0.1] (log)"`.

        Returns:
            The description.
        """
        return f"{self.name} ∈ [{self.low:g}, {self.high:g}] (log)"


def points(space: Sequence[Dimension], count: int) -> list[dict[str, float]]:
    """Return the first `count` quasi-random points of a search space.

    Args:
        space: The dimensions.
        count: Number of points.

    Returns:
        One `{name: value}` per point; `[{}] * count` for an empty space.
    """
    if not space:
        return [{} for _ in range(count)]
    from scipy.stats import qmc

    unit = qmc.Halton(d=len(space), scramble=True, seed=HALTON_SEED).random(count)
    return [
        {dim.name: dim.value(float(u)) for dim, u in zip(space, row, strict=True)}
        for row in unit
    ]
