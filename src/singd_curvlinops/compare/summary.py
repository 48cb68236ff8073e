r"""From runs to results: the chosen trial per cell, performance profiles, bf16.

**Choosing a trial.** A point of the search space is finished when all seeds of
the budget have run. Its time to the target is the *upper median* over its seeds
(the larger middle value for an even count, so a point that misses the target in
half of its seeds counts as missing it); so are its steps to the target, its final
metric (in order of quality) and its memory. Per workload and optimizer, the
chosen trial is the finished point with the smallest median time, ties broken by
steps and then by final metric — the point a practitioner who ran this search
would pick. Targets are applied to the stored validation curves when the results
are read, so a changed target needs no new runs.

**Performance profile** (Dolan & Moré, 2002; as in AlgoPerf). With \(t_{w,o}\)
the chosen trial's time on workload \(w\) for optimizer \(o\) and
\(r_{w,o} = t_{w,o} / \min_{o'} t_{w,o'}\), the profile
\(\rho_o(\tau)\) is the fraction of workloads with \(r_{w,o} \le \tau\). The score
is its normalised integral
\[ B_o = \frac{1}{\tau_{\max} - 1} \int_1^{\tau_{\max}} \rho_o(\tau)\,d\tau
       = \frac{1}{|W|} \sum_{w:\, r_{w,o} \le \tau_{\max}}
         \frac{\tau_{\max} - r_{w,o}}{\tau_{\max} - 1}, \qquad \tau_{\max} = 4, \]
between 0 (never within 4× of the fastest) and 1 (the fastest everywhere). A
workload that no optimizer solves counts as unsolved for all.

**bfloat16.** Each bfloat16 run is paired with the float32 run of the same cell
point and seed. It has *diverged* if it diverged and its float32 partner did not,
*degraded* if its final metric is worse than its partner's by more than the
workload's `bf16_tolerance`, and is *ok* otherwise; pairs whose float32 run
diverged are counted apart.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from singd_curvlinops.compare.study import Run
from singd_curvlinops.compare.trial import Precision, seconds_to_target
from singd_curvlinops.compare.workloads import Workload

TAU_MAX = 4.0


def upper_median(
    values: Sequence[float], key: Callable[[float], float] = float
) -> float:
    """Return the upper middle value in the order of `key`.

    Args:
        values: At least one value.
        key: Sort key; smaller is better.

    Returns:
        The element at position `len(values) // 2` after sorting.
    """
    return sorted(values, key=key)[len(values) // 2]


def badness(workload: Workload) -> Callable[[float], float]:
    """Return a sort key for a workload's metric: smaller is better, NaN worst.

    Args:
        workload: The workload.

    Returns:
        The key function.
    """

    def key(value: float) -> float:
        """Return the key of one metric value."""
        if math.isnan(value):
            return math.inf
        return -value if workload.higher_is_better else value

    return key


@dataclass(frozen=True)
class Point:
    """A finished point of a cell: its seeds' runs and their medians.

    Attributes:
        index: The point's position in the quasi-random sequence.
        runs: Its runs, one per seed.
        steps: Upper median of the steps to the target.
        seconds: Upper median of the training seconds to the target.
        final_metric: Upper median (in quality order) of the final metric.
    """

    index: int
    runs: tuple[Run, ...]
    steps: float
    seconds: float
    final_metric: float

    @classmethod
    def of(cls, runs: Sequence[Run]) -> Point:
        """Summarise the runs of one point.

        Args:
            runs: The point's runs (at least one).

        Returns:
            The point.
        """
        workload = runs[0].cell.workload
        times = [seconds_to_target(workload, run.result) for run in runs]
        finals = [run.result.final_metric for run in runs]
        return cls(
            runs[0].index,
            tuple(runs),
            upper_median([t[0] for t in times]),
            upper_median([t[1] for t in times]),
            upper_median(finals, badness(workload)),
        )

    def sort_key(self) -> tuple[float, float, float]:
        """Return the key that orders points from best to worst.

        Returns:
            `(seconds, steps, final metric badness)`.
        """
        return (
            self.seconds,
            self.steps,
            badness(self.runs[0].cell.workload)(self.final_metric),
        )


@dataclass
class Row:
    """The result of one optimizer on one workload (one float32 cell).

    Attributes:
        workload: The workload.
        label: The optimizer's label.
        chosen: The chosen point (None if no point is finished).
        points: The finished points.
        best_final: The best final metric over the finished points (medians).
        step_peak_mib: The chosen point's median step memory.
        state_mib: The chosen point's median optimizer state.
    """

    workload: Workload
    label: str
    chosen: Point | None
    points: list[Point] = field(default_factory=list)
    best_final: float = math.nan
    step_peak_mib: float = math.nan
    state_mib: float = math.nan

    @property
    def seconds(self) -> float:
        """The chosen point's time to the target (infinite if missed).

        Returns:
            Training seconds.
        """
        return self.chosen.seconds if self.chosen else math.inf

    @property
    def solved(self) -> int:
        """How many finished points reach the target (upper median).

        Returns:
            The count.
        """
        return sum(math.isfinite(point.seconds) for point in self.points)


def _points(runs: list[Run], seeds: int) -> list[Point]:
    """Group a cell's runs by point and keep the points with all seeds.

    Args:
        runs: The cell's runs.
        seeds: Seeds per point in the budget.

    Returns:
        The finished points, by index.
    """
    by_index: dict[int, list[Run]] = defaultdict(list)
    for run in runs:
        by_index[run.index].append(run)
    return [
        Point.of(group)
        for index, group in sorted(by_index.items())
        if len(group) == seeds
    ]


def rows_of(runs: list[Run], seeds: int) -> list[Row]:
    """Summarise the float32 cells, in the order in which their runs appear.

    Args:
        runs: Runs of any cells.
        seeds: Seeds per point in the budget.

    Returns:
        One row per float32 cell with runs.
    """
    by_cell: dict = defaultdict(list)
    for run in runs:
        if run.cell.precision is Precision.FLOAT32:
            by_cell[run.cell].append(run)
    rows = []
    for cell, cell_runs in by_cell.items():
        points = _points(cell_runs, seeds)
        row = Row(cell.workload, cell.optimizer.label, None, points)
        if points:
            row.chosen = min(points, key=Point.sort_key)
            key = badness(cell.workload)
            row.best_final = min((p.final_metric for p in points), key=key)
            chosen = row.chosen.runs
            row.step_peak_mib = statistics.median(
                r.result.step_peak_mib for r in chosen
            )
            row.state_mib = statistics.median(r.result.state_mib for r in chosen)
        rows.append(row)
    return rows


@dataclass(frozen=True)
class Profile:
    r"""The performance profile of one optimizer.

    Attributes:
        label: The optimizer's label.
        ratios: `{workload name: r}` (infinite where the target was missed).
        score: The normalised integral \(B\) (see the module).
    """

    label: str
    ratios: dict[str, float]
    score: float

    def fraction(self, tau: float) -> float:
        r"""Return \(\rho(\tau)\), the fraction of workloads solved within `tau`.

        Args:
            tau: The ratio \(\tau \ge 1\).

        Returns:
            A fraction in `[0, 1]`.
        """
        return sum(r <= tau for r in self.ratios.values()) / len(self.ratios)


def performance_profiles(rows: list[Row], tau_max: float = TAU_MAX) -> list[Profile]:
    """Return each optimizer's performance profile over the workloads.

    Only optimizers with a row on every workload of `rows` are profiled.

    Args:
        rows: The rows (`rows_of`).
        tau_max: Upper end of the integral.

    Returns:
        The profiles, in the order of the optimizers' first rows.
    """
    workloads = list(dict.fromkeys(row.workload.name for row in rows))
    seconds: dict[str, dict[str, float]] = defaultdict(dict)
    for row in rows:
        seconds[row.label][row.workload.name] = row.seconds
    best = {w: min(t.get(w, math.inf) for t in seconds.values()) for w in workloads}
    profiles = []
    for label, times in seconds.items():
        if set(times) != set(workloads):
            continue
        ratios = {
            w: times[w] / best[w] if math.isfinite(times[w]) else math.inf
            for w in workloads
        }
        area = sum(
            (tau_max - max(r, 1.0)) / (tau_max - 1.0)
            for r in ratios.values()
            if r <= tau_max
        )
        profiles.append(Profile(label, ratios, area / len(workloads)))
    return profiles


@dataclass
class Bf16Row:
    """A bfloat16 cell against its float32 counterpart.

    Attributes:
        workload: The workload.
        label: The optimizer's label.
        precision: The bfloat16 precision.
        pairs: Runs with a float32 partner.
        diverged: bfloat16 diverged, float32 did not.
        degraded: Worse than float32 by more than the workload's tolerance.
        ok: Neither.
        float32_diverged: The float32 partner diverged (not judged).
        skipped_steps: Steps that `SINGD` skipped in the bfloat16 runs
            (non-finite statistics), summed.
        median_change: Upper median of how much worse bfloat16 ended, in the
            metric's units (positive: worse), over the judged pairs.
    """

    workload: Workload
    label: str
    precision: Precision
    pairs: int = 0
    diverged: int = 0
    degraded: int = 0
    ok: int = 0
    float32_diverged: int = 0
    skipped_steps: int = 0
    median_change: float = math.nan


def _judge(row: Bf16Row, low: Run, reference: Run) -> float | None:
    """Count one pair into a `Bf16Row`.

    Args:
        row: The row, updated in place.
        low: The bfloat16 run.
        reference: The float32 run of the same point and seed.

    Returns:
        How much worse the bfloat16 run ended (None if not judged).
    """
    row.pairs += 1
    row.skipped_steps += low.result.skipped_steps
    if reference.result.diverged:
        row.float32_diverged += 1
        return None
    change = row.workload.worse_by(
        low.result.final_metric, reference.result.final_metric
    )
    if low.result.diverged:
        row.diverged += 1
    elif change > row.workload.bf16_tolerance:
        row.degraded += 1
    else:
        row.ok += 1
    return change


def bf16_rows(runs: list[Run]) -> list[Bf16Row]:
    """Pair every bfloat16 run with its float32 run and count the outcomes.

    Args:
        runs: Runs of any cells.

    Returns:
        One row per bfloat16 cell with runs, in the order of their runs.
    """
    reference = {
        (run.cell.workload.name, run.cell.optimizer.name, run.index, run.seed): run
        for run in runs
        if run.cell.precision is Precision.FLOAT32
    }
    rows: dict = {}
    changes: dict = defaultdict(list)
    for run in runs:
        cell = run.cell
        if cell.precision is Precision.FLOAT32:
            continue
        partner = reference.get(
            (cell.workload.name, cell.optimizer.name, run.index, run.seed)
        )
        if partner is None:
            continue
        row = rows.setdefault(
            cell, Bf16Row(cell.workload, cell.optimizer.label, cell.precision)
        )
        change = _judge(row, run, partner)
        if change is not None:
            changes[cell].append(change)
    for cell, row in rows.items():
        if changes[cell]:
            row.median_change = upper_median(changes[cell])
    return list(rows.values())
