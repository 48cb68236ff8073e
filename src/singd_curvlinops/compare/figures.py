r"""The comparison's figures (matplotlib, written as PNG files).

- `plot_curves`: one panel per workload, the validation metric against training
  seconds of each optimizer's chosen trial (one line per seed), with the target as a
  dashed line. Metrics that fall by more than a factor of 10 (relative MSE) are on
  a log scale; the axis ends at twice the largest starting value, so that a
  diverging run does not flatten the others.
- `plot_profiles`: the performance profiles \(\rho(\tau)\) for \(1 \le \tau \le
  4\), with each optimizer's score in the legend.
"""

from __future__ import annotations

import math
from pathlib import Path

from singd_curvlinops.compare.summary import TAU_MAX, Profile, Row

_FIRST_ORDER = ("AdamW", "SGD", "SOAP")  # dashed lines; the K-FAC family is solid


def _style(label: str) -> str:
    """Return the line style of an optimizer: solid for the K-FAC family.

    Args:
        label: The optimizer's label.

    Returns:
        A matplotlib line style.
    """
    return "--" if label.startswith(_FIRST_ORDER) else "-"


def _colors(labels: list[str]) -> dict[str, str]:
    """Assign each optimizer a colour of the default cycle, in order.

    Args:
        labels: The optimizers' labels.

    Returns:
        `{label: colour}`.
    """
    palette = [f"C{i}" for i in range(10)]
    unique = list(dict.fromkeys(labels))
    return {label: palette[i % 10] for i, label in enumerate(unique)}


def plot_curves(rows: list[Row], path: Path) -> Path:
    """Plot the chosen trials' validation curves, one panel per workload.

    Args:
        rows: The summary rows (`summary.rows_of`).
        path: The PNG file to write.

    Returns:
        `path`.
    """
    from matplotlib.figure import Figure

    workloads = list(dict.fromkeys(row.workload for row in rows))
    columns = min(3, max(1, len(workloads)))
    lines = math.ceil(len(workloads) / columns) if workloads else 1
    figure = Figure(figsize=(5 * columns + 2, 3.6 * lines), layout="constrained")
    axes = figure.subplots(lines, columns, squeeze=False).ravel()
    colors = _colors([row.label for row in rows])
    for ax, workload in zip(axes, workloads, strict=False):
        values, starts = [], []
        for row in (r for r in rows if r.workload is workload and r.chosen):
            for seed, run in enumerate(row.chosen.runs):
                _, seconds, metric = zip(*run.result.curve, strict=True)
                values += metric
                starts.append(metric[0])
                ax.plot(
                    seconds,
                    metric,
                    _style(row.label),
                    color=colors[row.label],
                    label=row.label if seed == 0 else None,
                    lw=1.2,
                    alpha=0.85,
                )
        ax.axhline(workload.target, color="black", ls=":", lw=1, label="target")
        finite = [v for v in values if math.isfinite(v) and v > 0]
        if not workload.higher_is_better and finite:
            if max(finite) > 10 * min(finite):
                ax.set_yscale("log")
            ax.set_ylim(top=2 * max(starts + [workload.target]))
        ax.set_title(workload.name)
        ax.set_xlabel("training seconds (evaluation excluded)")
        ax.set_ylabel(workload.metric)
    for ax in axes[len(workloads) :]:
        ax.set_visible(False)
    handles = {}
    for ax in axes[: len(workloads)]:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    figure.legend(handles.values(), handles.keys(), loc="outside right center")
    figure.savefig(path, format="png", dpi=100)
    return path


def plot_profiles(profiles: list[Profile], path: Path) -> Path:
    """Plot the performance profiles as step functions.

    Args:
        profiles: The profiles (`summary.performance_profiles`).
        path: The PNG file to write.

    Returns:
        `path`.
    """
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.5), layout="constrained")
    ax = figure.subplots()
    colors = _colors([profile.label for profile in profiles])
    for profile in sorted(profiles, key=lambda p: -p.score):
        taus = sorted(
            {1.0, TAU_MAX} | {r for r in profile.ratios.values() if r <= TAU_MAX}
        )
        ax.step(
            taus,
            [profile.fraction(tau) for tau in taus],
            _style(profile.label),
            where="post",
            color=colors[profile.label],
            label=f"{profile.label} (B = {profile.score:.2f})",
        )
    ax.set_xlim(1.0, TAU_MAX)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("τ: time to target within τ × the fastest")
    ax.set_ylabel("fraction of workloads")
    ax.set_title("performance profile")
    ax.legend(loc="lower right", fontsize=8)
    figure.savefig(path, format="png", dpi=100)
    return path
