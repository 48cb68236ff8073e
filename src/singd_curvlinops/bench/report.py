"""Markdown output of the step benchmark."""

from __future__ import annotations

from typing import Any

COLUMNS = (
    "optimizer",
    "ms/step",
    "× AdamW",
    "ours / ref",
    "step peak MiB",
    "state MiB",
    "final loss",
    "preconditioned",
)


def _format_ms(value: float) -> str:
    """Format milliseconds with three significant digits, without exponents.

    Args:
        value: Milliseconds.

    Returns:
        E.g. `"12.3"`, `"0.456"` or `"1,780"`.
    """
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _format_ratio(value: float | None) -> str:
    """Format a time ratio, or a dash where there is none.

    Args:
        value: The ratio, or None.

    Returns:
        E.g. `"1.25×"` or `"—"`.
    """
    return "—" if value is None else f"{value:.2f}×"


def markdown_table(records: list[dict[str, Any]], model: str) -> str:
    """Render one model's records as a Markdown table.

    Args:
        records: Output of `singd_curvlinops.bench.optimizer.measure`.
        model: The model whose rows are rendered.

    Returns:
        The table: one row per configuration, columns `COLUMNS`.
    """
    lines = [
        "| " + " | ".join(COLUMNS) + " |",
        "|---" + "|---:" * (len(COLUMNS) - 1) + "|",
    ]
    for record in records:
        if record["model"] != model:
            continue
        share = record.get("preconditioned")
        cells = [
            record["label"],
            _format_ms(record["ms_per_step"]),
            _format_ratio(record["vs_adamw"]),
            _format_ratio(record["vs_reference"]),
            f"{record['step_peak_mib']:.3g}",
            f"{record['state_mib']:.3g}",
            f"{record['final_loss']:.4g}",
            "—" if share is None else f"{share:.1%}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def preamble(
    *,
    torch_version: str,
    threads: int,
    rounds: int,
    steps_per_block: int,
    warmup: int,
    reference: str | None,
) -> str:
    """Return the paragraph that states what the tables measure.

    Args:
        torch_version: `torch.__version__`.
        threads: Number of torch threads.
        rounds: Timed blocks per configuration.
        steps_per_block: Steps per block.
        warmup: Warm-up steps per configuration.
        reference: Version of the reference `singd`, or None if it did not run.

    Returns:
        One paragraph of Markdown.
    """
    reference_text = "not run" if reference is None else f"singd {reference}"
    return (
        f"torch {torch_version}, float32, CPU, torch threads: {threads}; median of "
        f"{rounds} blocks of {steps_per_block} steps (zero_grad + forward + backward"
        f" + step), {warmup} warm-up steps, all configurations interleaved; "
        f"reference: {reference_text}. `× AdamW` and `ours / ref` are ratios of "
        "ms/step (`ours / ref` > 1: ours is slower). `preconditioned`: the share "
        "of the parameters in Kronecker layers (the rest: the AdamW fallback). "
        "`step peak MiB`: the most "
        "memory one step allocates and holds at once (torch.profiler, largest over "
        "T steps); `state MiB`: the tensors in the optimizer's state; `final loss` "
        "on the fixed batch after all steps."
    )
