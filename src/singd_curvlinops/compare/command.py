"""The `compare` subcommand: its options, and the run from arguments to report.

`add_parser` registers the subcommand with the main parser of `singd_curvlinops.cli`;
`run` checks the extra and the storage (bad input exits with code 2 through the
parser), runs the missing runs with a progress bar, and writes the report.
Nothing here imports Optuna or another package of the extra at import time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from singd_curvlinops import _arguments as arguments
from singd_curvlinops.compare import require_compare, study
from singd_curvlinops.compare.cells import FULL, REDUCED, Budget, Cell, cells_of
from singd_curvlinops.compare.optimizers import (
    DEFAULT_OPTIMIZERS,
    OptimizerSpec,
    parse_optimizer,
)
from singd_curvlinops.compare.workloads import WORKLOADS, Workload

if TYPE_CHECKING:  # the `compare` extra; imported where it is used
    from optuna.storages import RDBStorage

DEFAULT_OUTPUT = "singd-curvlinops-compare"

_DESCRIPTION = """\
Compare optimizers as AlgoPerf does: every optimizer gets the same number of
quasi-random points of its search space on every workload, each point runs with
several seeds, and the result is the training time (evaluation excluded) to a
validation target. The runs live in Optuna studies (an SQLite file by default): an
interrupted study resumes where it stopped, a rerun skips finished runs, and several
processes or machines pointed at one --storage share the work. Writes results.md,
results.json, curves.png and profile.png to --output. Needs the compare extra:
pip install "singd-curvlinops[compare]".
"""

_EPILOG = f"""\
workloads (--workloads, comma-separated):
{chr(10).join(f"  {w.name:<13} {w.description}" for w in WORKLOADS.values())}

optimizers (--optimizers, comma-separated):
  singd:STRUCTURE   SINGD, both factors in STRUCTURE (dense, diagonal, triltoeplitz,
                    block30diagonal, hierarchical15_15, ...)
  ikfac[:STRUCTURE] IKFAC (SINGD with kfac_like=True; default dense)
  kfac, ekfac       the KFAC and EKFAC (eigenvalue-corrected KFAC) baselines
  adamw, sgd        torch.optim.AdamW and SGD with momentum
  soap              SOAP (Shampoo family) from pytorch-optimizer
  every optimizer runs under linear warm-up (5% of the steps) and cosine decay

budget:
  default           {REDUCED.trials} trials x {REDUCED.seeds} seed per \
workload and optimizer (a reduced budget)
  --full            {FULL.trials} trials x {FULL.seeds} seeds \
(the recorded study)

example:
  singd-curvlinops compare --workloads digits-cnn,teacher-mlp --optimizers \
singd:diagonal,kfac,adamw
"""


def workloads(text: str) -> list[Workload]:
    """Parse `--workloads` (an argparse `type`).

    Args:
        text: E.g. `"digits-cnn,sbm-gcn"`.

    Returns:
        The workloads.

    Raises:
        ArgumentTypeError: If a name is unknown.
    """
    names = arguments.comma_list(text, f"workload ({', '.join(WORKLOADS)})")
    unknown = [name for name in names if name not in WORKLOADS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown workload {', '.join(map(repr, unknown))}; choose from "
            f"{', '.join(WORKLOADS)}"
        )
    return [WORKLOADS[name] for name in names]


def optimizers(text: str) -> list[OptimizerSpec]:
    """Parse `--optimizers` (an argparse `type`).

    Args:
        text: E.g. `"singd:diagonal,kfac,soap"`.

    Returns:
        The optimizers, without duplicates.

    Raises:
        ArgumentTypeError: If a name is invalid; the message lists the valid ones.
    """
    try:
        specs = [
            parse_optimizer(name) for name in arguments.comma_list(text, "optimizer")
        ]
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return list({spec.name: spec for spec in specs}.values())


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Add the `compare` subcommand and its options.

    Args:
        commands: The subcommands of the main parser.
    """
    parser = commands.add_parser(
        "compare",
        help="tuned optimizer comparison on several workloads (time to target)",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=arguments.Formatter,
    )
    parser.set_defaults(compare_parser=parser)  # reports a bad storage (exit code 2)
    add = parser.add_argument
    add(
        "--workloads",
        type=workloads,
        default=",".join(WORKLOADS),
        metavar="LIST",
        help="comma-separated workloads (default: all)",
    )
    add(
        "--optimizers",
        type=optimizers,
        default=",".join(DEFAULT_OPTIMIZERS),
        metavar="LIST",
        help="comma-separated optimizers (default: %(default)s)",
    )
    add("--full", action="store_true", help="the recorded study's budget")
    add(
        "--trials",
        type=arguments.positive_int,
        default=None,
        metavar="N",
        help="points of each search space (overrides the budget's)",
    )
    add(
        "--seeds",
        type=arguments.positive_int,
        default=None,
        metavar="N",
        help="seeds per point (overrides the budget's)",
    )
    add(
        "--bf16",
        action="store_true",
        help="also train SINGD, IKFAC and KFAC with bfloat16 autocast and factors "
        "(KFAC also with float32 factors) and compare with float32",
    )
    add(
        "--storage",
        default=None,
        metavar="URL",
        help="Optuna storage URL, e.g. postgresql://user:pw@host/db "
        "(default: an SQLite file in --output)",
    )
    add(
        "--study-name",
        default=study.DEFAULT_PREFIX,
        metavar="NAME",
        help="prefix of the Optuna study names (default: %(default)s)",
    )
    add(
        "--output",
        type=Path,
        default=Path(DEFAULT_OUTPUT),
        metavar="DIR",
        help="folder for the report and the default storage (default: %(default)s)",
    )
    add(
        "--report-only",
        action="store_true",
        help="run nothing; report what the storage holds",
    )
    add(
        "--threads",
        type=arguments.threads,
        default=1,
        metavar="N",
        help="torch threads (default: %(default)s)",
    )
    add("--no-progress", action="store_true", help="hide the progress bar")


def _budget(args: argparse.Namespace) -> Budget:
    """Return the budget of the arguments.

    Args:
        args: The parsed arguments.

    Returns:
        `FULL` or `REDUCED`, or a `custom` budget with `--trials`/`--seeds`.
    """
    base = FULL if args.full else REDUCED
    trials, seeds = args.trials or base.trials, args.seeds or base.seeds
    if (trials, seeds) == (base.trials, base.seeds):
        return base
    return Budget("custom", trials, seeds)


def _command(args: argparse.Namespace) -> str:
    """Return the command line that reproduces the runs (paths left out).

    Args:
        args: The parsed arguments.

    Returns:
        E.g. `singd-curvlinops compare --workloads digits-cnn --optimizers sgd`.
    """
    words = ["singd-curvlinops", "compare"]
    words += ["--workloads", ",".join(w.name for w in args.workloads)]
    words += ["--optimizers", ",".join(o.name for o in args.optimizers)]
    words += ["--full"] * args.full + ["--bf16"] * args.bf16
    for option in ("trials", "seeds"):
        if getattr(args, option) is not None:
            words += [f"--{option}", str(getattr(args, option))]
    return " ".join(words)


def _run_missing(
    storage: RDBStorage, cells: list[Cell], args: argparse.Namespace, budget: Budget
) -> int:
    """Run the budget's missing runs with a progress bar.

    Args:
        storage: The Optuna storage.
        cells: The cells.
        args: The parsed arguments.
        budget: The budget.

    Returns:
        The number of runs finished by this process.
    """
    from tqdm import tqdm

    done = len(study.load_runs(storage, cells, args.study_name, budget))
    total = len(cells) * budget.trials * budget.seeds
    with tqdm(total=total, initial=done, unit="run", disable=args.no_progress) as bar:

        def advance(cell: Cell) -> None:
            """Count one finished run."""
            bar.update()
            bar.set_postfix_str(f"{cell.workload.name} {cell.optimizer.name}")

        return study.run_cells(storage, cells, args.study_name, budget, advance)


def run(args: argparse.Namespace) -> int:
    """Run `singd-curvlinops compare`.

    A storage that cannot be opened, or a study recorded with other settings, exits
    through the subcommand's parser with code 2.

    Args:
        args: The parsed arguments.

    Returns:
        0 on success, 130 if interrupted (rerun to resume).
    """
    modules = [m for w in args.workloads for m in w.requires]
    modules += [m for o in args.optimizers for m in o.family.requires]
    require_compare(modules)
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        args.output.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # a file in the way, a read-only folder
        args.compare_parser.error(f"argument --output: cannot create {error}")
    url = args.storage or f"sqlite:///{(args.output / 'studies.db').resolve()}"
    budget = _budget(args)
    cells = cells_of(args.workloads, args.optimizers, args.bf16)
    print(f"budget {budget.describe()} per workload and optimizer", file=sys.stderr)
    try:
        storage = study.open_storage(url)
        if not args.report_only:
            _run_missing(storage, cells, args, budget)
    except ValueError as error:  # unreachable storage, study with other settings
        args.compare_parser.error(str(error))
    except KeyboardInterrupt:
        print("\ninterrupted: rerun the same command to resume", file=sys.stderr)
        return 130
    return _report(storage, cells, args, budget)


def _report(
    storage: RDBStorage, cells: list[Cell], args: argparse.Namespace, budget: Budget
) -> int:
    """Write the report and print its Markdown.

    Args:
        storage: The Optuna storage.
        cells: The cells.
        args: The parsed arguments.
        budget: The budget.

    Returns:
        Exit code 0.
    """
    from singd_curvlinops.compare.report import Report, markdown, write

    runs = study.load_runs(storage, cells, args.study_name, budget)
    expected = len(cells) * budget.trials * budget.seeds
    report = Report(_command(args), budget, args.workloads, args.optimizers, runs)
    paths = write(report, args.output)
    print(markdown(report))
    if len(runs) < expected:
        print(
            f"{expected - len(runs)} of {expected} runs are not finished (running "
            "elsewhere, or interrupted: rerun to complete)",
            file=sys.stderr,
        )
    print("written: " + ", ".join(map(str, paths)), file=sys.stderr)
    return 0
