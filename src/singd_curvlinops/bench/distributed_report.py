"""The tables of `bench --distributed`: its records in Markdown, and what they mean."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from singd_curvlinops.bench.memory import MIB

_HEADER = (
    "model",
    "T",
    "strategy",
    "ms/step",
    "spread",
    "× replicate",
    "paired",
    "factor state/rank MiB",
    "× replicate",
    "statistics MiB/update",
    "gathered MiB update / other",
    "relay MiB/step",
    "blocks MiB/step",
    "MiB/step",
)


def markdown_table(records: list[dict[str, Any]]) -> str:
    """Render the records as one Markdown table.

    Args:
        records: Records of `measure_distributed`.

    Returns:
        The table: one row per setting.
    """
    lines = ["| " + " | ".join(_HEADER) + " |", "|---|---:|---" + "|---:" * 11 + "|"]
    for r in records:
        times = r["block_ms_per_step"]
        update, plain = r["update_bytes"], r["plain_bytes"]
        cells = [
            r["model"] if r["optimizer"] == "singd" else f"{r['model']}, EKFAC",
            str(r["T"]),
            r["strategy"],
            f"{r['ms_per_step']:.1f}",
            f"{min(times):.0f}–{max(times):.0f}",
            _ratio(r["vs_replicate"]),
            _ratio(r["vs_replicate_paired"]),
            f"{r['factor_mib']:.2f}",
            _ratio(r["factor_vs_replicate"]),
            f"{update['statistics'] / MIB:.2f}",
            f"{update['gather'] / MIB:.2f} / {plain['gather'] / MIB:.2f}",
            f"{update['relay'] / MIB:.2f}",
            f"{update['blocks'] / MIB:.2f}",
            f"{r['mib_per_step']:.2f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    """Format a ratio, or a dash where there is none.

    Args:
        value: The ratio, or None.

    Returns:
        E.g. `"0.61×"`.
    """
    return "—" if value is None else f"{value:.2f}×"


def preamble(args: Any) -> str:
    """Return the paragraph that states what the table measures.

    Args:
        args: The parsed command line.

    Returns:
        One paragraph of Markdown.
    """
    wrapper = "DistributedDataParallel"
    gradients = "DDP's gradient all-reduce"
    if args.fsdp:
        wrapper = "FSDP2 (a unit per module with parameters, and the root)"
        gradients = "FSDP2's parameter all-gathers and gradient reduce-scatters"
    if args.hsdp > 1:
        shards = dist.get_world_size() // args.hsdp
        wrapper = (
            f"HSDP ({args.hsdp} replicas of {shards} shards; a unit per module "
            "with parameters, and the root)"
        )
        gradients = (
            "FSDP2's parameter all-gathers and gradient reduce-scatters, and the "
            "replicas' gradient all-reduces"
        )
    return (
        f"torch {torch.__version__}, float32, CPU, gloo, {dist.get_world_size()} "
        f"processes with {torch.get_num_threads()} torch thread(s) each, "
        f"{wrapper}, each process on its share of the batch; median "
        f"(and fastest–slowest) of {args.rounds} blocks of {args.steps_per_block} "
        f"steps of the slowest process, {args.warmup} warm-up steps, all settings "
        "interleaved. `× replicate`: the ratio of the medians; `paired`: the "
        "median over the rounds of the ratio to replicate's block of the same "
        "round. `factor state/rank`: the rule's entries (factors, momenta) "
        "of the process that holds the most; `statistics`: the statistics "
        "exchange of an update step (an all-reduce under replicate; under shard "
        "each side's statistics sent to its owner in one all-to-all); `gathered`: the "
        "all_gather(s) of an update step and of "
        "another step (what every process receives); `relay`: the point-to-point "
        "half products (and a helper's factors) of split layers, every step, all "
        "processes' messages together; `blocks`: FSDP2's blocks of the gradients "
        "to their owners and of the directions back under owned factors, every "
        "step, all processes' messages together; `MiB/step`: all of it averaged "
        f"over T steps, without {gradients}."
    )
