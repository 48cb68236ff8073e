"""Benchmark: time and memory per training step of `SINGD`, `singd`, KFAC, AdamW, SGD.

One training step is `zero_grad`, forward, backward and `optimizer.step()` on a
fixed mini-batch. Every configuration (optimizer, structure, `T`) gets its own copy
of the same seeded model, is warmed up, and is then timed in blocks of consecutive
steps, round-robin over all configurations and models so that all of them see the
same machine state; the median over the rounds is reported. A block must hold a
multiple of every `T`, so that each block contains the same number of factor
updates. After the timing, each of `T` further steps is run once under the memory
profiler (`singd_curvlinops.bench.memory`); the largest of their peaks, so that
a factor update is included, is the step peak. The reference's sparse structures
do not accept float64, so everything runs in float32 on the CPU.

Run it with `singd-curvlinops bench` or `python -m singd_curvlinops bench` (see
`singd-curvlinops bench --help`).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

from torch import Tensor

from singd_curvlinops.bench.configurations import Configuration, make_optimizer
from singd_curvlinops.bench.memory import (
    MIB,
    cache_bytes,
    peak_allocated_bytes,
    state_bytes,
)
from singd_curvlinops.bench.workloads import build_workload, evaluate_loss, train_step


def _time_block(step: Callable[[], Tensor], steps: int) -> float:
    """Return the mean time of `steps` consecutive calls of `step`.

    Args:
        step: One training step.
        steps: Number of consecutive steps.

    Returns:
        Seconds per step.
    """
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def _step_peak(step: Callable[[], Tensor], T: int) -> int:
    """Return the largest memory peak of `T` consecutive steps, one factor update.

    Args:
        step: One training step.
        T: Number of steps (the factor update interval).

    Returns:
        Bytes.
    """
    return max(peak_allocated_bytes(step) for _ in range(T))


def measure(
    models: list[str],
    configs: list[Configuration],
    rounds: int,
    steps_per_block: int,
    warmup: int,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Time every configuration on every model, interleaved round-robin.

    Args:
        models: Model names.
        configs: Configurations.
        rounds: Number of timed blocks per configuration; the median is reported.
        steps_per_block: Consecutive steps per timed block.
        warmup: Untimed steps per configuration before the first round.
        progress: Called with a status line after each round, if given.

    Returns:
        One record per model and configuration: `ms_per_step` (median),
        `block_ms_per_step` (all rounds), `step_peak_mib`, `state_mib`,
        `cache_mib` (see `singd_curvlinops.bench.memory`), `final_loss` (on the
        fixed batch after all steps) and the time ratios `vs_adamw` and
        `vs_reference` (ours only, else None).
    """
    runs = []
    for name in models:
        workload = build_workload(name)
        for config in configs:
            model = copy.deepcopy(workload.model)
            optimizer = make_optimizer(config, model, workload.loss_average)

            def step(model=model, optimizer=optimizer, workload=workload) -> Tensor:
                """Run one training step of this run.

                Args:
                    model: The run's model copy.
                    optimizer: The run's optimizer.
                    workload: The run's workload.

                Returns:
                    The loss.
                """
                return train_step(model, optimizer, workload.inputs, workload.targets)

            runs.append((workload, model, config, optimizer, step, []))
    for *_, step, _ in runs:
        for _ in range(warmup):
            step()
    for index in range(rounds):
        for *_, step, times in runs:
            times.append(_time_block(step, steps_per_block))
        if progress is not None:
            progress(f"round {index + 1}/{rounds} done")
    records = []
    for workload, model, config, optimizer, step, times in runs:
        peak = _step_peak(step, config.T or 1)
        records.append(
            {
                "model": workload.name,
                "label": config.label,
                "kind": config.kind,
                "structure": config.structure,
                "T": config.T,
                "ms_per_step": 1e3 * statistics.median(times),
                "block_ms_per_step": [1e3 * t for t in times],
                "step_peak_mib": peak / MIB,
                "state_mib": state_bytes(optimizer) / MIB,
                "cache_mib": cache_bytes(optimizer) / MIB,
                "final_loss": evaluate_loss(model, workload.inputs, workload.targets),
                "preconditioned": _preconditioned_share(optimizer),
            }
        )
    _add_ratios(records)
    return records


def _preconditioned_share(optimizer: Any) -> float | None:
    """Return the share of the parameters that a Kronecker optimizer preconditions.

    Args:
        optimizer: Any optimizer.

    Returns:
        `describe().preconditioned_share` for ours, else None.
    """
    describe = getattr(optimizer, "describe", None)
    return None if describe is None else describe().preconditioned_share


def _add_ratios(records: list[dict[str, Any]]) -> None:
    """Add `vs_adamw` and `vs_reference` (time ratios) to every record in place.

    Args:
        records: Records of `measure`, without the ratios.
    """
    index = {(r["model"], r["kind"], r["structure"], r["T"]): r for r in records}
    adamw = {r["model"]: r for r in records if r["label"] == "AdamW"}
    for record in records:
        base = adamw.get(record["model"])
        record["vs_adamw"] = (
            record["ms_per_step"] / base["ms_per_step"] if base is not None else None
        )
        reference = None
        if record["kind"] == "ours":
            key = (record["model"], "reference", record["structure"], record["T"])
            reference = index.get(key)
        record["vs_reference"] = (
            record["ms_per_step"] / reference["ms_per_step"]
            if reference is not None
            else None
        )
