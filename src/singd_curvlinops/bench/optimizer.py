"""Benchmark: time per training step of `SINGD`, the reference `singd`, AdamW, SGD.

One training step is `zero_grad`, forward, backward and `optimizer.step()` on a
fixed mini-batch. Every configuration (optimizer, structure, `T`) gets its own copy
of the same seeded model, is warmed up, and is then timed in blocks of consecutive
steps, round-robin over all configurations and models so that all of them see the
same machine state; the median over the rounds is reported. A block must hold a
multiple of every `T`, so that each block contains the same number of factor
updates. The reference's sparse structures do not accept float64, so everything
runs in float32 on the CPU.

Usage: `python -m singd_curvlinops.bench.optimizer [--models mlp,cnn,seq]
[--structures dense,diagonal,...] [--T 1,10] [--rounds 5] [--steps-per-block 10]
[--threads N] [--json PATH]`.
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from singd_curvlinops import SINGD
from singd_curvlinops.bench.structures import reference_class
from singd_curvlinops.structures import get_structure

MODELS = ("mlp", "cnn", "seq")
DEFAULT_STRUCTURES = (
    "dense",
    "diagonal",
    "block30diagonal",
    "hierarchical15_15",
    "triltoeplitz",
)
# Hyperparameters shared by both SINGD implementations (the reference's defaults).
SINGD_HYPERPARAMETERS = {
    "lr": 1e-3,
    "momentum": 0.9,
    "damping": 1e-3,
    "alpha1": 0.5,
    "weight_decay": 0.0,
    "lr_cov": 1e-2,
}


@dataclass
class Workload:
    """A model with its fixed mini-batch.

    Attributes:
        name: `"mlp"`, `"cnn"` or `"seq"`.
        model: The network (float32, seeded initial weights).
        inputs: The mini-batch's inputs.
        targets: The class labels, one per example (and token for `"seq"`).
        loss_average: SINGD's `loss_average` that matches the mean loss.
    """

    name: str
    model: nn.Module
    inputs: Tensor
    targets: Tensor
    loss_average: str


@dataclass(frozen=True)
class Configuration:
    """One optimizer setting to time.

    Attributes:
        label: Row label, e.g. `"SINGD dense T=10"`.
        kind: `"ours"`, `"reference"` or `"baseline"`.
        structure: Structure of both `K` and `C` (None for the baselines).
        T: Factor update interval (None for the baselines).
    """

    label: str
    kind: str
    structure: str | None = None
    T: int | None = None


def build_workload(name: str, seed: int = 0) -> Workload:
    """Build a model and a fixed mini-batch with seeded weights and data.

    Args:
        name: `"mlp"` (784-512-512-10, batch 128), `"cnn"` (three 3x3 convolutions
            with stride 2 on 3x32x32 images, 3-16-32-64 channels, then a linear
            layer 1024-10, batch 64) or `"seq"` (per-token MLP 256-256-256-10 on
            `[16, 64, 256]` tokens).
        seed: Seed of the weights and the data.

    Returns:
        The workload.

    Raises:
        ValueError: If `name` is unknown.
    """
    torch.manual_seed(seed)
    if name == "mlp":
        model = nn.Sequential(
            nn.Linear(784, 512),
            nn.ReLU(),
            nn.Linear(512, 512),
            nn.ReLU(),
            nn.Linear(512, 10),
        )
        inputs, targets = torch.randn(128, 784), torch.randint(10, (128,))
        return Workload(name, model, inputs, targets, "batch")
    if name == "cnn":
        # Stride 2 throughout keeps the linear layer's K at 1025 (stride 1 in the
        # first layer makes it 4097: seconds per dense factor update on a CPU).
        model = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(64 * 4 * 4, 10),
        )
        inputs, targets = torch.randn(64, 3, 32, 32), torch.randint(10, (64,))
        return Workload(name, model, inputs, targets, "batch")
    if name == "seq":
        model = nn.Sequential(
            nn.Linear(256, 256),
            nn.ReLU(),
            nn.Linear(256, 256),
            nn.ReLU(),
            nn.Linear(256, 10),
        )
        inputs, targets = torch.randn(16, 64, 256), torch.randint(10, (16, 64))
        return Workload(name, model, inputs, targets, "batch+sequence")
    raise ValueError(f"Unknown model {name!r}; choose from {', '.join(MODELS)}.")


def reference_version() -> str | None:
    """Return the installed version of the reference `singd`, or None.

    Returns:
        E.g. `"0.0.5"`, or None when `singd` cannot be imported.
    """
    try:
        importlib.import_module("singd.optim.optimizer")
    except ImportError:
        return None
    try:
        return importlib.metadata.version("singd")
    except importlib.metadata.PackageNotFoundError:
        return "?"


def reference_optimizer_class(structure: str) -> type | None:
    """Return the reference `SINGD`, extended to `structure` if it lacks it.

    Args:
        structure: Structure name as accepted by `get_structure`.

    Returns:
        The reference optimizer class, or None when `singd` is unavailable or has
        no counterpart of the structure.
    """
    try:
        from singd.optim.optimizer import SINGD as ReferenceSINGD
    except ImportError:
        return None
    if structure in ReferenceSINGD.SUPPORTED_STRUCTURES:
        return ReferenceSINGD
    cls = reference_class(structure)
    if cls is None:
        return None
    supported = {**ReferenceSINGD.SUPPORTED_STRUCTURES, structure: cls}
    return type(
        "ReferenceSINGD", (ReferenceSINGD,), {"SUPPORTED_STRUCTURES": supported}
    )


def configurations(
    structures: list[str], Ts: list[int], with_reference: bool
) -> list[Configuration]:
    """List the configurations to time, in table order.

    Args:
        structures: Structure names (the same for `K` and `C`).
        Ts: Factor update intervals.
        with_reference: Whether to add the reference's rows.

    Returns:
        Ours and the reference per structure and `T`, then AdamW and SGD.
    """
    version = reference_version()
    configs = []
    for structure in structures:
        for T in Ts:
            configs.append(
                Configuration(f"SINGD {structure} T={T}", "ours", structure, T)
            )
            if with_reference and reference_optimizer_class(structure) is not None:
                label = f"singd {version} {structure} T={T}"
                configs.append(Configuration(label, "reference", structure, T))
    configs.append(Configuration("AdamW", "baseline"))
    configs.append(Configuration("SGD", "baseline"))
    return configs


def make_optimizer(
    config: Configuration, model: nn.Module, loss_average: str
) -> torch.optim.Optimizer:
    """Construct the optimizer of a configuration for `model`.

    Args:
        config: The configuration.
        model: The model it trains (SINGD installs hooks on it).
        loss_average: SINGD's `loss_average`.

    Returns:
        The optimizer.

    Raises:
        ValueError: If the configuration is unknown or the reference is missing.
    """
    if config.kind in ("ours", "reference"):
        cls = (
            SINGD
            if config.kind == "ours"
            else reference_optimizer_class(config.structure)
        )
        if cls is None:
            raise ValueError(f"The reference has no {config.structure!r} structure.")
        return cls(
            model,
            T=config.T,
            loss_average=loss_average,
            structures=(config.structure, config.structure),
            **SINGD_HYPERPARAMETERS,
        )
    if config.label == "AdamW":
        return torch.optim.AdamW(model.parameters(), lr=1e-3)
    if config.label == "SGD":
        return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    raise ValueError(f"Unknown configuration {config!r}.")


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, inputs: Tensor, targets: Tensor
) -> Tensor:
    """Run one training step: zero_grad, forward, backward, step.

    Args:
        model: The network.
        optimizer: Its optimizer.
        inputs: The mini-batch's inputs.
        targets: Class labels; the loss is the mean cross-entropy over all of them.

    Returns:
        The loss (detached).
    """
    optimizer.zero_grad(set_to_none=True)
    logits = model(inputs)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    optimizer.step()
    return loss.detach()


def evaluate_loss(model: nn.Module, inputs: Tensor, targets: Tensor) -> float:
    """Return the mean cross-entropy on the batch without gradients (no hooks fire).

    Args:
        model: The network.
        inputs: The mini-batch's inputs.
        targets: Class labels.

    Returns:
        The loss.
    """
    with torch.no_grad():
        logits = model(inputs)
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        ).item()


def _tensors(value: Any) -> list[Tensor]:
    """Collect the tensors in nested state containers and structured matrices.

    Args:
        value: A tensor, structured matrix, mapping or sequence.

    Returns:
        The tensors found.
    """
    if isinstance(value, Tensor):
        return [value]
    if hasattr(value, "named_tensors"):
        return [tensor for _, tensor in value.named_tensors()]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


def state_mib(optimizer: torch.optim.Optimizer) -> float:
    """Return the size of the optimizer's persistent state in MiB.

    Counts `optimizer.state` and, for the reference, its factors and momenta,
    which it keeps outside `optimizer.state` (`Ks`, `Cs`, `m_Ks`, `m_Cs`).
    Tensors that share memory are counted once.

    Args:
        optimizer: The optimizer after some steps.

    Returns:
        The size in MiB.
    """
    tensors = _tensors(list(optimizer.state.values()))
    for attribute in ("Ks", "Cs", "m_Ks", "m_Cs"):
        tensors += _tensors(getattr(optimizer, attribute, {}))
    seen, total = set(), 0
    for tensor in tensors:
        key = (tensor.data_ptr(), tensor.numel(), tensor.dtype)
        if key not in seen:
            seen.add(key)
            total += tensor.numel() * tensor.element_size()
    return total / 2**20


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
        `block_ms_per_step` (all rounds), `state_mib`, `final_loss` (on the
        fixed batch after all steps) and the ratios `vs_adamw` and `vs_reference`
        (ours only, else None).
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
    for workload, model, config, optimizer, _, times in runs:
        records.append(
            {
                "model": workload.name,
                "label": config.label,
                "kind": config.kind,
                "structure": config.structure,
                "T": config.T,
                "ms_per_step": 1e3 * statistics.median(times),
                "block_ms_per_step": [1e3 * t for t in times],
                "state_mib": state_mib(optimizer),
                "final_loss": evaluate_loss(model, workload.inputs, workload.targets),
            }
        )
    _add_ratios(records)
    return records


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


def _format_ms(value: float) -> str:
    """Format milliseconds with three significant digits, without exponents.

    Args:
        value: Milliseconds.

    Returns:
        E.g. `"12.3"`, `"0.456"` or `"1,780"`.
    """
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def markdown_table(records: list[dict[str, Any]], model: str) -> str:
    """Render one model's records as a Markdown table.

    Args:
        records: Output of `measure`.
        model: The model whose rows are rendered.

    Returns:
        The table: one row per configuration.
    """
    lines = [
        "| optimizer | ms/step | × AdamW | ours / ref | state MiB | final loss |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for record in records:
        if record["model"] != model:
            continue
        vs_adamw = record["vs_adamw"]
        vs_reference = record["vs_reference"]
        cells = [
            record["label"],
            _format_ms(record["ms_per_step"]),
            "—" if vs_adamw is None else f"{vs_adamw:.2f}×",
            "—" if vs_reference is None else f"{vs_reference:.2f}×",
            f"{record['state_mib']:.3g}",
            f"{record['final_loss']:.4g}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _comma_list(text: str) -> list[str]:
    """Split a comma-separated option into its non-empty, unique items.

    Args:
        text: E.g. `"mlp,cnn"`.

    Returns:
        The items in order of first appearance.
    """
    return list(dict.fromkeys(item.strip() for item in text.split(",") if item.strip()))


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """Parse and validate the command line; exit with code 2 on bad arguments.

    Args:
        argv: Command-line arguments; default: `sys.argv[1:]`.

    Returns:
        The arguments, with `models`, `structures` and `T` as lists.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="mlp,cnn,seq")
    parser.add_argument(
        "--structures",
        default=",".join(DEFAULT_STRUCTURES),
        help="structure names of K and C, comma-separated",
    )
    parser.add_argument("--T", default="1,10", help="factor update intervals")
    parser.add_argument("--rounds", type=int, default=5, help="timed blocks per run")
    parser.add_argument(
        "--steps-per-block",
        type=int,
        default=10,
        help="consecutive steps per timed block (a multiple of every T)",
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per run")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument(
        "--no-reference", action="store_true", help="skip the reference rows"
    )
    parser.add_argument("--json", default=None, help="also write records here")
    args = parser.parse_args(argv)

    args.models = _comma_list(args.models)
    unknown = [m for m in args.models if m not in MODELS]
    if not args.models or unknown:
        parser.error(
            f"--models: unknown {', '.join(unknown) or 'empty list'}; "
            f"choose from {', '.join(MODELS)}."
        )
    args.structures = _comma_list(args.structures)
    if not args.structures:
        parser.error("--structures: give at least one structure name.")
    for name in args.structures:
        try:
            get_structure(name)
        except ValueError as error:
            parser.error(f"--structures: {error}")
    try:
        args.T = [int(t) for t in _comma_list(args.T)]
    except ValueError:
        parser.error(f"--T: expected comma-separated integers, got {args.T!r}.")
    if not args.T or any(t < 1 for t in args.T):
        parser.error("--T: give one or more positive integers.")
    for option in ("rounds", "steps_per_block"):
        if getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')} must be a positive integer.")
    if args.warmup < 0:
        parser.error("--warmup must be a non-negative integer.")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be a positive integer.")
    uneven = [t for t in args.T if args.steps_per_block % t]
    if uneven:
        parser.error(
            f"--steps-per-block {args.steps_per_block} is not a multiple of T = "
            f"{', '.join(map(str, uneven))}: every timed block must hold the same "
            "number of factor updates."
        )
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print one Markdown table per model.

    Args:
        argv: Command-line arguments; default: `sys.argv[1:]`.

    Returns:
        Exit code 0.
    """
    args = _parse(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    version = None if args.no_reference else reference_version()
    configs = configurations(args.structures, args.T, version is not None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reference warns on its dense fallbacks
        records = measure(
            args.models,
            configs,
            args.rounds,
            args.steps_per_block,
            args.warmup,
            progress=lambda line: print(line, file=sys.stderr),
        )
    reference = "not run" if version is None else f"singd {version}"
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, CPU; "
        f"median of {args.rounds} blocks of {args.steps_per_block} steps "
        f"(zero_grad + forward + backward + step), {args.warmup} warm-up steps; "
        f"reference: {reference}; `ours / ref` > 1 means ours is slower; "
        "peak memory: n/a on CPU, `state MiB` is the optimizer's state; "
        "`final loss` on the fixed batch after all steps.\n"
    )
    for model in args.models:
        print(f"### {model}\n")
        print(markdown_table(records, model))
        print()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump(records, file, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
