"""What a comparison consists of: cells (workload × optimizer × precision), budgets.

A *cell* is one Optuna study of `compare.study`; a *budget* says how many points
of each optimizer's search space run, with how many seeds each. `settings` is what
a run of a cell depends on besides its point and seed: it is stored with the
study, and a study recorded with other settings is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from singd_curvlinops.compare.optimizers import OptimizerSpec
from singd_curvlinops.compare.trial import Precision
from singd_curvlinops.compare.workloads import Workload

REVISION = 1  # raise when a workload, the schedule or the stored format changes


@dataclass(frozen=True)
class Budget:
    """How many quasi-random points per optimizer, and seeds per point.

    Attributes:
        name: `"reduced"`, `"full"` or `"custom"`.
        trials: Points of the search space per cell.
        seeds: Seeds per point (`0, ..., seeds - 1`).
    """

    name: str
    trials: int
    seeds: int

    def describe(self) -> str:
        """Return the budget in words, e.g. `"reduced: 4 trials × 1 seed"`.

        Returns:
            The description.
        """
        seeds = "seed" if self.seeds == 1 else "seeds"
        return f"{self.name}: {self.trials} trials × {self.seeds} {seeds}"


REDUCED = Budget("reduced", trials=4, seeds=1)
# The recorded study. Planned as 16 trials × 3 seeds; its first 40 minutes on the
# shared two-core machine (load average 6) finished 289 runs, 11 s each, which put
# 16 × 3 at about 7.5 hours for two workers; 12 × 2 takes about 2.5.
FULL = Budget("full", trials=12, seeds=2)


@dataclass(frozen=True)
class Cell:
    """One study: a workload, an optimizer and a precision.

    Attributes:
        workload: The workload.
        optimizer: The optimizer.
        precision: The precision.
    """

    workload: Workload
    optimizer: OptimizerSpec
    precision: Precision = Precision.FLOAT32

    def study_name(self, prefix: str) -> str:
        """Return the Optuna study name.

        Args:
            prefix: The study prefix (`--study-name`).

        Returns:
            `PREFIX/WORKLOAD/OPTIMIZER/PRECISION`.
        """
        parts = (prefix, self.workload.name, self.optimizer.name, self.precision.value)
        return "/".join(parts)

    def settings(self) -> dict[str, Any]:
        """Return what a run of this cell depends on besides point and seed.

        Returns:
            A JSON-serialisable dictionary (stored with the study).
        """
        return {
            "revision": REVISION,
            "steps": self.workload.steps,
            "eval_every": self.workload.eval_every,
            "space": [dim.describe() for dim in self.optimizer.family.space],
            "fixed": {k: repr(v) for k, v in sorted(self.optimizer.fixed.items())},
            "precision": self.precision.value,
        }


def cells_of(
    workloads: list[Workload], optimizers: list[OptimizerSpec], bf16: bool
) -> list[Cell]:
    """List the cells of a comparison: float32, and the bfloat16 ones if asked.

    Args:
        workloads: The workloads.
        optimizers: The optimizers.
        bf16: Add each optimizer's `bf16_precisions` (families with factors).

    Returns:
        The cells, workload by workload.
    """
    cells = []
    for workload in workloads:
        for optimizer in optimizers:
            cells.append(Cell(workload, optimizer))
            if bf16:
                for precision in optimizer.family.bf16_precisions:
                    cells.append(Cell(workload, optimizer, Precision(precision)))
    return cells
