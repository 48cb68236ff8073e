"""The demo's summary table and loss-curve plot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from singd_curvlinops.demo.training import RunResult

COLUMNS = ("optimizer", "final train loss", "test accuracy", "ms/step", "state MiB")


def results_table(results: Sequence[RunResult]) -> str:
    """Render the runs as a Markdown table, one row per optimizer.

    Args:
        results: The runs, in row order.

    Returns:
        The table with the columns `COLUMNS`.
    """
    lines = [
        "| " + " | ".join(COLUMNS) + " |",
        "|---" + "|---:" * (len(COLUMNS) - 1) + "|",
    ]
    for result in results:
        cells = [
            result.label,
            f"{result.final_train_loss:.4f}",
            f"{100 * result.test_accuracy:.1f}%",
            f"{result.ms_per_step:.2f}",
            f"{result.state_mib:.4f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _moving_average(values: Sequence[float], window: int) -> list[float]:
    """Return the means of `window` consecutive values (fewer at the start).

    Args:
        values: The series.
        window: Window length, at least 1.

    Returns:
        A series as long as `values`; entry `i` averages `values[i-window+1 : i+1]`.
    """
    averages, total = [], 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        averages.append(total / min(index + 1, window))
    return averages


def plot_losses(results: Sequence[RunResult], path: str | Path) -> Path:
    """Plot training loss per step and test accuracy per epoch into a PNG file.

    The loss curves are moving averages over 10 steps on a log scale.

    Args:
        results: The runs.
        path: Where to write the PNG; parent folders must exist.

    Returns:
        The path written.
    """
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 4.5), layout="constrained")
    ax_loss, ax_accuracy = figure.subplots(1, 2)
    for result in results:
        style = "-" if result.label.startswith(("SINGD", "IKFAC")) else "--"
        ax_loss.plot(_moving_average(result.losses, 10), style, label=result.label)
        epochs = range(len(result.accuracies))
        ax_accuracy.plot(epochs, result.accuracies, style + "o", ms=3)
    ax_loss.set_yscale("log")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("training loss (moving average of 10 steps)")
    ax_accuracy.set_xlabel("epoch")
    ax_accuracy.set_ylabel("test accuracy")
    figure.legend(loc="outside right center", fontsize=8)
    figure.suptitle("singd-curvlinops demo: a small CNN on scikit-learn's digits")
    path = Path(path)
    figure.savefig(path, format="png", dpi=100)
    return path
