"""Benchmark: one training step on several processes, `Replicate` against `Shard`.

Start it with `torchrun --nproc_per_node 2 -m singd_curvlinops bench
--distributed` (gloo, CPU; one torch thread per process unless `--threads` says
otherwise). Every process builds the same seeded workload
(`bench.workloads`), wraps the model in `DistributedDataParallel` (with
`--fsdp`: shards it with FSDP2, `fully_shard` on every module that holds
parameters, then on the root; with `--hsdp R` the same on a 2-d mesh of `R`
replicas) and trains on its share of the fixed batch (split
evenly), so the global batch is the
single-process benchmark's. Every configuration (model, structure, `T`,
strategy) trains its own copy of the model; all are warmed up, then timed in
blocks of consecutive steps, round-robin over the configurations. Before each
block the processes meet at a barrier; a block's time is that of the slowest
process. Reported per configuration: the median over the rounds and the spread
(fastest and slowest round), the ratio to `Replicate`'s median, the factor state
of the process that holds the most (the rule's entries in `optimizer.state`:
factors and their momenta, not the parameters' momentum buffers), and the bytes
the collectives move (`distributed.communication`).
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from singd_curvlinops import EKFAC, SINGD
from singd_curvlinops.bench.configurations import (
    KFAC_HYPERPARAMETERS,
    SINGD_HYPERPARAMETERS,
)
from singd_curvlinops.bench.distributed_report import markdown_table, preamble
from singd_curvlinops.bench.memory import MIB
from singd_curvlinops.bench.workloads import build_workload, train_step
from singd_curvlinops.distributed import Shard, bytes_per_step
from singd_curvlinops.distributed.layout import SHELL_KEYS

# label: the `distribute` option
STRATEGIES: dict[str, Any] = {
    "replicate": "replicate",
    "shard": "shard",
    "shard, share factors": Shard(share="factors"),
    "shard, owned factors": Shard(factors="owned"),
}
# EKFAC's updates read every rank's examples, so no rank sends its factors:
# it has no shared-factors form; its structures are "auto"
EKFAC_STRATEGIES = ("replicate", "shard", "shard, owned factors")


@dataclass(frozen=True)
class Setting:
    """One configuration to time.

    Attributes:
        model: Workload name.
        structure: Structure of both factors.
        T: Factor update interval.
        strategy: A label of `STRATEGIES`.
        fsdp: Whether FSDP2 shards the model (else DDP wraps it).
        optimizer: `"singd"`, or `"ekfac"` (`EKFAC` with the benchmark's KFAC
            hyperparameters; `structure` is then `"auto"`).
        replicas: With more than one (and `fsdp`), HSDP: the processes form
            `replicas` replicas, each sharding the model over its processes.
    """

    model: str
    structure: str
    T: int
    strategy: str
    fsdp: bool = False
    optimizer: str = "singd"
    replicas: int = 1


def _largest(value: float) -> float:
    """Return the largest `value` over all processes.

    Args:
        value: This process's value.

    Returns:
        The maximum.
    """
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def factor_bytes(optimizer: SINGD) -> int:
    """Return the bytes of the rule's state entries this process holds.

    Args:
        optimizer: The optimizer.

    Returns:
        Factors and their momenta, without the parameters' momentum buffers.
    """
    return sum(
        value.numel() * value.element_size()
        for entry in optimizer.state.values()
        for key, value in entry.items()
        if key not in SHELL_KEYS and isinstance(value, Tensor)
    )


def _build(
    setting: Setting,
) -> tuple[SINGD, Callable[[], Tensor], dict[str, int]]:
    """Build a setting's optimizer and its training step on this process's share.

    Args:
        setting: The configuration.

    Returns:
        The optimizer, a function that runs one step, and the rows of its
        statistics per layer (`statistics_rows`).
    """
    workload = build_workload(setting.model)
    rank, world = dist.get_rank(), dist.get_world_size()
    share = slice(
        rank * len(workload.inputs) // world, (rank + 1) * len(workload.inputs) // world
    )
    inputs, targets = workload.inputs[share], workload.targets[share]
    model = copy.deepcopy(workload.model)
    if setting.fsdp:
        model = sharded(model, setting.replicas)
    else:
        model = DistributedDataParallel(model)
    options = {
        "T": setting.T,
        "loss_average": workload.loss_average,
        "distribute": STRATEGIES[setting.strategy],
    }
    if setting.optimizer == "ekfac":
        optimizer = EKFAC(model, **options, **KFAC_HYPERPARAMETERS)
    else:
        structures = (setting.structure, setting.structure)
        optimizer = SINGD(
            model, structures=structures, **options, **SINGD_HYPERPARAMETERS
        )
    rows = statistics_rows(optimizer, model, inputs)
    return optimizer, lambda: train_step(model, optimizer, inputs, targets), rows


def sharded(model: nn.Module, replicas: int = 1) -> nn.Module:
    """Shard a model with FSDP2: a unit per module that holds parameters, the root.

    Args:
        model: The model.
        replicas: With more than one, HSDP: a 2-d mesh of `replicas` replicas
            of `world_size / replicas` shards.

    Returns:
        It, sharded in place.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = None  # (FSDP2's default: a 1-d mesh over every process)
    if replicas > 1:
        shape = (replicas, dist.get_world_size() // replicas)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    for module in model.modules():
        if module is not model and next(module.parameters(False), None) is not None:
            fully_shard(module, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def statistics_rows(optimizer: SINGD, model: nn.Module, inputs: Tensor) -> dict:
    """Return the rows of statistics this process's hooks produce, per layer name.

    One forward pass without gradients, counting rows as curvlinops' `"expand"`
    does: a linear layer's inputs without their last dimension, a convolution's
    output positions times the batch (layers of other types are left out:
    `bytes_per_step` counts them as stored entries).

    Args:
        optimizer: The optimizer (its layers).
        model: The model it trains.
        inputs: This process's batch.

    Returns:
        `{layer name: rows}`.
    """
    counted: dict[nn.Module, int] = {}

    def count(module: nn.Module, args: tuple, output: Tensor) -> None:
        if isinstance(module, nn.Conv2d):
            counted[module] = output.shape[0] * output.shape[-2] * output.shape[-1]
        elif isinstance(module, nn.Linear):
            counted[module] = args[0].numel() // module.in_features

    modules = {site.module for layer in optimizer.layers for site in layer.sites}
    handles = [module.register_forward_hook(count) for module in modules]
    try:
        with torch.no_grad():
            model(inputs)
    finally:
        for handle in handles:
            handle.remove()
    return {
        layer.name: counted[layer.sites[0].module]
        for layer in optimizer.layers
        if len(layer.sites) == 1 and layer.sites[0].module in counted
    }


def _time_block(step: Callable[[], Tensor], steps: int) -> float:
    """Return the slowest process's mean time of `steps` consecutive steps.

    Args:
        step: One training step.
        steps: Number of consecutive steps.

    Returns:
        Seconds per step.
    """
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return _largest((time.perf_counter() - start) / steps)


def measure_distributed(
    settings: list[Setting],
    rounds: int,
    steps_per_block: int,
    warmup: int,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Time every setting on the processes of the default group, round-robin.

    Args:
        settings: The configurations.
        rounds: Timed blocks per setting; the median is reported.
        steps_per_block: Consecutive steps per block (a multiple of every `T`).
        warmup: Untimed steps per setting before the first round.
        progress: Called with a status line after each round (rank 0), if given.

    Returns:
        Per setting: `ms_per_step` (median), `block_ms_per_step` (every round),
        `factor_mib` (largest over the processes), the bytes of its collectives
        per update step and per other step, and the ratios to `Replicate`.
    """
    runs = [(setting, *_build(setting), []) for setting in settings]
    for _, _, step, _, _ in runs:
        for _ in range(warmup):
            step()
    for index in range(rounds):
        for _, _, step, _, times in runs:
            times.append(_time_block(step, steps_per_block))
        if progress is not None and dist.get_rank() == 0:
            progress(f"round {index + 1}/{rounds} done")
    records = [
        _record(setting, optimizer, times, rows)
        for setting, optimizer, _, rows, times in runs
    ]
    _add_ratios(records)
    return records


def _record(
    setting: Setting, optimizer: SINGD, times: list[float], rows: dict[str, int]
) -> dict[str, Any]:
    """Summarise one setting's measurements.

    Args:
        setting: The configuration.
        optimizer: Its optimizer after the timing.
        times: Seconds per step of every round.
        rows: The statistics' rows per layer (`statistics_rows`).

    Returns:
        The record (see `measure_distributed`).
    """
    update = bytes_per_step(optimizer, update=True, rows=rows)
    plain = bytes_per_step(optimizer, update=False, rows=rows)
    gradients = sum(
        p.numel() * p.element_size()
        for g in optimizer.param_groups
        for p in g["params"]
    )
    per_step = (
        sum(update.values()) + (setting.T - 1) * sum(plain.values())
    ) / setting.T
    return {
        "model": setting.model,
        "optimizer": setting.optimizer,
        "structure": setting.structure,
        "T": setting.T,
        "strategy": setting.strategy,
        "ms_per_step": 1e3 * statistics.median(times),
        "block_ms_per_step": [1e3 * t for t in times],
        "factor_mib": _largest(factor_bytes(optimizer)) / MIB,
        "update_bytes": update,
        "plain_bytes": plain,
        "mib_per_step": per_step / MIB,
        "ddp_gradient_mib": gradients / MIB,
    }


def _add_ratios(records: list[dict[str, Any]]) -> None:
    """Add the ratios to `Replicate`'s record of the same workload, in place.

    `vs_replicate` divides the medians; `vs_replicate_paired` is the median over
    the rounds of the block's time divided by `Replicate`'s block of the same
    round, which the machine's drift between rounds does not move (a round times
    every setting within seconds); `factor_vs_replicate` divides the factor
    state.

    Args:
        records: Records of `measure_distributed`.
    """
    key = lambda r: (r["model"], r["optimizer"], r["structure"], r["T"])  # noqa: E731
    base = {key(r): r for r in records if r["strategy"] == "replicate"}
    for record in records:
        reference = base.get(key(record))
        record["vs_replicate"] = record["vs_replicate_paired"] = None
        record["factor_vs_replicate"] = None
        if reference is not None:
            record["vs_replicate"] = record["ms_per_step"] / reference["ms_per_step"]
            record["vs_replicate_paired"] = statistics.median(
                mine / theirs
                for mine, theirs in zip(
                    record["block_ms_per_step"],
                    reference["block_ms_per_step"],
                    strict=True,
                )
            )
            record["factor_vs_replicate"] = (
                record["factor_mib"] / reference["factor_mib"]
            )


def run_distributed_bench(args: Any) -> int:
    """Run `singd-curvlinops bench --distributed` on the processes of torchrun.

    Args:
        args: The parsed command line (`models`, `structures`, `T`, `rounds`,
            `steps_per_block`, `warmup`, `threads`, `fsdp`, `hsdp`, `json`).

    Returns:
        Exit code 0 (rank 0 prints the table and writes the JSON file).
    """
    if not dist.is_initialized():
        dist.init_process_group("gloo")  # torchrun sets rank, world size, address
    torch.set_num_threads(args.threads or 1)
    ekfac = args.optimizer == "ekfac"
    structures = ["auto"] if ekfac else args.structures or ["dense"]
    fsdp = args.fsdp or args.hsdp > 1
    settings = [
        Setting(model, structure, T, strategy, fsdp, args.optimizer, args.hsdp)
        for model in args.models
        for structure in structures
        for T in args.T
        for strategy in (EKFAC_STRATEGIES if ekfac else STRATEGIES)
    ]
    progress = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    records = measure_distributed(
        settings, args.rounds, args.steps_per_block, args.warmup, progress
    )
    if dist.get_rank() == 0:
        print(preamble(args) + "\n")
        print(markdown_table(records))
        if args.json is not None:
            with open(args.json, "w", encoding="utf-8") as file:
                json.dump(records, file, indent=2)
    dist.destroy_process_group()
    return 0
