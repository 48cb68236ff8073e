"""The comparison's report: a Markdown page, a JSON file and two PNG figures.

`Report` collects what a study produced (`summary` derives the tables from the
runs); `write` puts `results.md`, `results.json`, `curves.png` and `profile.png`
into a folder. The Markdown is the content of a results page for the
documentation: it names the command, the date, the budget and the versions, and
links the figures by their file names. In the JSON file an infinite time (target
missed) is `null`.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import math
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from singd_curvlinops.compare import figures
from singd_curvlinops.compare.cells import Budget
from singd_curvlinops.compare.optimizers import OptimizerSpec
from singd_curvlinops.compare.study import Run
from singd_curvlinops.compare.summary import (
    Bf16Row,
    Profile,
    Row,
    bf16_rows,
    performance_profiles,
    rows_of,
)
from singd_curvlinops.compare.workloads import Workload

PACKAGES = (
    "singd-curvlinops",
    "torch",
    "curvlinops-for-pytorch",
    "optuna",
    "pytorch-optimizer",
    "torch-geometric",
    "scikit-learn",
)
BASELINES = ("AdamW", "SOAP")  # time ratios against these in the tables


def versions() -> dict[str, str | None]:
    """Return the versions of Python and the packages the comparison uses.

    Returns:
        `{name: version}`; None for a package that is not installed.
    """
    found: dict[str, str | None] = {"python": platform.python_version()}
    for package in PACKAGES:
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    return found


@dataclass
class Report:
    """Everything a report shows.

    Attributes:
        command: The command line that ran the study.
        budget: The budget.
        workloads: The workloads.
        optimizers: The optimizers.
        runs: The finished runs of the budget.
        date: When the report was made (ISO date).
        versions: `versions()` of the reporting process.
        rows: Per workload and optimizer (float32).
        profiles: Performance profiles.
        bf16: bfloat16 cells against float32.
    """

    command: str
    budget: Budget
    workloads: list[Workload]
    optimizers: list[OptimizerSpec]
    runs: list[Run]
    date: str = field(default_factory=lambda: datetime.date.today().isoformat())
    versions: dict[str, str | None] = field(default_factory=versions)
    rows: list[Row] = field(init=False)
    profiles: list[Profile] = field(init=False)
    bf16: list[Bf16Row] = field(init=False)

    def __post_init__(self) -> None:
        """Derive the tables from the runs."""
        self.rows = rows_of(self.runs, self.budget.seeds)
        self.profiles = performance_profiles(self.rows)
        self.bf16 = bf16_rows(self.runs)


def _number(value: float, digits: int = 4) -> str:
    """Format a number with `digits` significant digits; `∞` and `–` for inf, NaN.

    Args:
        value: The number.
        digits: Significant digits.

    Returns:
        The text.
    """
    if math.isnan(value):
        return "–"
    if math.isinf(value):
        return "∞"
    return f"{value:.{digits}g}"


def _params(params: dict[str, float]) -> str:
    """Format hyperparameters as `lr=0.0474, damping=0.061`.

    Args:
        params: The values.

    Returns:
        The text.
    """
    return ", ".join(f"{name}={value:.3g}" for name, value in params.items())


def _table(header: list[str], rows: list[list[str]], text: int = 1) -> str:
    """Render a Markdown table: text columns left-aligned, numbers right.

    Args:
        header: Column names.
        rows: Cells.
        text: The first `text` columns hold text, as does the last one if
            negative (`-1`: the first and the last).

    Returns:
        The table.
    """
    left = set(range(abs(text))) | ({len(header) - 1} if text < 0 else set())
    rule = ["---" if i in left else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


def _workload_table(report: Report, workload: Workload) -> str:
    """Render one workload's time-to-target table.

    Args:
        report: The report.
        workload: The workload.

    Returns:
        The Markdown table.
    """
    rows = [row for row in report.rows if row.workload is workload]
    times = {row.label: row.seconds for row in rows}
    baselines = [b for b in BASELINES if b in times]
    header = ["optimizer", "time to target [s]", *(f"× {b}" for b in baselines)]
    header += ["steps to target", "final metric", "best final metric"]
    header += [
        "points on target",
        "step peak MiB",
        "state MiB",
        "chosen hyperparameters",
    ]
    cells = []
    for row in rows:
        chosen = row.chosen
        ratios = [
            _number(row.seconds / times[b], 3) if math.isfinite(times[b]) else "–"
            for b in baselines
        ]
        cells.append(
            [row.label, _number(row.seconds, 3), *ratios]
            + [_number(chosen.steps) if chosen else "–"]
            + [_number(chosen.final_metric) if chosen else "–", _number(row.best_final)]
            + [f"{row.solved}/{len(row.points)}", _number(row.step_peak_mib, 3)]
            + [
                _number(row.state_mib, 3),
                _params(chosen.runs[0].params) if chosen else "–",
            ]
        )
    return _table(header, cells, text=-1)


def _profile_table(report: Report) -> str:
    """Render the performance-profile table.

    Args:
        report: The report.

    Returns:
        The Markdown table: score, workloads on target, ratio per workload.
    """
    names = [
        w.name for w in report.workloads if any(r.workload is w for r in report.rows)
    ]
    cells = [
        [profile.label, f"{profile.score:.3f}"]
        + [f"{sum(math.isfinite(r) for r in profile.ratios.values())}/{len(names)}"]
        + [_number(profile.ratios[name], 3) for name in names]
        for profile in sorted(report.profiles, key=lambda p: -p.score)
    ]
    header = ["optimizer", "score B", "on target", *(f"r ({name})" for name in names)]
    return _table(header, cells)


def _bf16_table(report: Report) -> str:
    """Render the bfloat16 table.

    Args:
        report: The report.

    Returns:
        The Markdown table.
    """
    header = ["workload", "optimizer", "precision", "runs", "diverged", "degraded"]
    header += ["ok", "float32 diverged", "skipped steps", "median change"]
    cells = [
        [row.workload.name, row.label, row.precision.value, str(row.pairs)]
        + [str(row.diverged), str(row.degraded), str(row.ok)]
        + [str(row.float32_diverged), str(row.skipped_steps)]
        + [_number(row.median_change, 3)]
        for row in report.bf16
    ]
    return _table(header, cells, text=3)


def _setup(report: Report) -> list[str]:
    """Render the introduction: command, budget, versions, workloads, spaces.

    Args:
        report: The report.

    Returns:
        Markdown paragraphs.
    """
    versions = ", ".join(f"{k} {v}" for k, v in report.versions.items() if v)
    threads = sorted({run.worker.get("threads") for run in report.runs} - {None})
    workloads = _table(
        ["workload", "description", "metric", "target", "steps", "eval every"],
        [
            [w.name, w.description, w.metric]
            + [("≥ " if w.higher_is_better else "≤ ") + f"{w.target:g}"]
            + [str(w.steps), str(w.eval_every)]
            for w in report.workloads
        ],
        text=3,
    )
    spaces = _table(
        ["optimizer", "searched (log scale)", "fixed"],
        [
            [spec.label, ", ".join(d.describe() for d in spec.family.space)]
            + [", ".join(f"{k}={v}" for k, v in spec.fixed.items())]
            for spec in report.optimizers
        ],
        text=3,
    )
    return [
        f"Recorded on {report.date} with\n\n```bash\n{report.command}\n```",
        f"Budget **{report.budget.describe()}** per workload and optimizer "
        f"({len(report.runs)} finished runs). Versions: {versions}; torch threads "
        f"per run: {', '.join(map(str, threads)) or '–'}.",
        "## Workloads\n\n" + workloads,
        "## Search spaces\n\n" + spaces,
    ]


def markdown(report: Report) -> str:
    """Render the report as Markdown (the content of a results page).

    Args:
        report: The report.

    Returns:
        The page, with figures linked as `curves.png` and `profile.png`.
    """
    parts = ["# Comparison results", *_setup(report), "## Time to target"]
    parts.append(
        "Per workload, each optimizer's chosen trial (smallest median time to the "
        "target over its seeds); times are training seconds, evaluation excluded; "
        "∞: target missed. *points on target*: points of the search space whose "
        "median run reached the target."
    )
    for workload in report.workloads:
        if any(row.workload is workload for row in report.rows):
            target = (
                "≥ " if workload.higher_is_better else "≤ "
            ) + f"{workload.target:g}"
            parts.append(f"### {workload.name} ({workload.metric} {target})")
            parts.append(_workload_table(report, workload))
    parts.append("## Performance profile")
    parts.append(
        "Ratio r of each optimizer's time to the fastest optimizer's on each "
        "workload, and the score B (the profile's integral over 1 ≤ τ ≤ 4, "
        "normalised: 1 = fastest everywhere, 0 = never within 4×)."
    )
    parts += [_profile_table(report), "![performance profile](profile.png)"]
    parts += ["## Validation curves", "![validation curves](curves.png)"]
    if report.bf16:
        parts.append("## bfloat16 against float32")
        parts.append(
            "Every bfloat16 run against the float32 run of the same point and seed: "
            "*diverged* (non-finite loss or an arithmetic error where float32 "
            "trained), *degraded* (final metric worse by more than the workload's "
            "tolerance), *ok*. Skipped steps: steps the optimizer skipped for "
            "non-finite statistics. Median change: how much worse bfloat16 ended, "
            "in the metric's units."
        )
        parts.append(_bf16_table(report))
    return "\n\n".join(parts) + "\n"


def _finite_or_none(value: Any) -> Any:
    """Replace infinite and NaN floats by None, recursively.

    Args:
        value: A JSON-like value.

    Returns:
        The value with non-finite floats as None.
    """
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_or_none(v) for v in value]
    return value


def to_json(report: Report) -> dict[str, Any]:
    """Return the report as a JSON-serialisable dictionary.

    Args:
        report: The report.

    Returns:
        Command, date, budget, versions, rows, profiles, bf16 rows and every run.
    """
    rows = [
        {
            "workload": row.workload.name,
            "optimizer": row.label,
            "seconds_to_target": row.seconds,
            "steps_to_target": row.chosen.steps if row.chosen else None,
            "final_metric": row.chosen.final_metric if row.chosen else None,
            "best_final_metric": row.best_final,
            "points": len(row.points),
            "points_on_target": row.solved,
            "chosen": row.chosen.runs[0].params if row.chosen else None,
            "step_peak_mib": row.step_peak_mib,
            "state_mib": row.state_mib,
        }
        for row in report.rows
    ]
    runs = [
        {
            "workload": run.cell.workload.name,
            "optimizer": run.cell.optimizer.name,
            "precision": run.cell.precision.value,
            "index": run.index,
            "seed": run.seed,
            "params": run.params,
            **run.result.to_dict(),
        }
        for run in report.runs
    ]
    bf16 = [
        {**vars(row), "workload": row.workload.name, "precision": row.precision.value}
        for row in report.bf16
    ]
    return _finite_or_none(
        {
            "command": report.command,
            "date": report.date,
            "budget": vars(report.budget),
            "versions": report.versions,
            "rows": rows,
            "profiles": [vars(profile) for profile in report.profiles],
            "bf16": bf16,
            "runs": runs,
        }
    )


def write(report: Report, folder: Path) -> list[Path]:
    """Write `results.md`, `results.json`, `curves.png` and `profile.png`.

    Args:
        report: The report.
        folder: An existing folder.

    Returns:
        The paths written.
    """
    paths = [folder / name for name in ("results.md", "results.json")]
    paths[0].write_text(markdown(report), encoding="utf-8")
    with open(paths[1], "w", encoding="utf-8") as file:
        json.dump(to_json(report), file, indent=1, allow_nan=False)
    paths.append(figures.plot_curves(report.rows, folder / "curves.png"))
    paths.append(figures.plot_profiles(report.profiles, folder / "profile.png"))
    return paths
