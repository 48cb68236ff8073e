"""The `singd-curvlinops` command line (also `python -m singd_curvlinops`).

- `singd-curvlinops demo`: train a small CNN on scikit-learn's digits with SINGD in
  several structures, IKFAC, KFAC, AdamW and SGD; print a table and plot the
  loss curves.
- `singd-curvlinops bench`: time and memory per training step of SINGD per
  structure, the reference `singd`, KFAC, AdamW and SGD, interleaved in one process;
  print Markdown tables.
- `singd-curvlinops compare`: a tuned comparison of SINGD, IKFAC, KFAC and
  first-order and Shampoo-family baselines on several workloads, as Optuna studies
  (`singd_curvlinops.compare`); a Markdown report, JSON and figures.

`main(argv)` parses `argv` (default: `sys.argv[1:]`) and returns the exit code;
bad arguments, unwritable output files included, exit with code 2 and a message that
names the allowed values before any work starts. Output into a pipe that its reader
has closed (`singd-curvlinops demo | head -1`) ends the program quietly with exit
code 141, as if stopped by SIGPIPE.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import torch

from singd_curvlinops import _arguments as arguments
from singd_curvlinops._cli_help import (
    BENCH_DESCRIPTION,
    BENCH_EPILOG,
    DEMO_DESCRIPTION,
    DEMO_EPILOG,
)
from singd_curvlinops._paths import output_file, report_write_failure, write_output
from singd_curvlinops.bench.configurations import configurations, reference_version
from singd_curvlinops.bench.distributed import run_distributed_bench
from singd_curvlinops.bench.optimizer import measure
from singd_curvlinops.bench.report import markdown_table, preamble
from singd_curvlinops.bench.workloads import MODELS
from singd_curvlinops.compare import command as compare_command
from singd_curvlinops.demo import MissingExtraError, run_demo
from singd_curvlinops.demo.optimizers import DEFAULT_OPTIMIZERS
from singd_curvlinops.demo.report import plot_losses, results_table
from singd_curvlinops.demo.training import TRAIN_EXAMPLES

BENCH_STRUCTURES = "dense, diagonal, block30diagonal, hierarchical15_15, triltoeplitz"
DEMO_PLOT = "singd-curvlinops-demo.png"
#: Exit status after a closed output pipe: that of a process stopped by SIGPIPE
#: (128 + 13), which is what shells report for `yes | head -1`.
EXIT_CLOSED_PIPE = 141


def build_parser() -> argparse.ArgumentParser:
    """Build the parser with the subcommands `demo`, `bench` and `compare`.

    Returns:
        The parser.
    """
    parser = argparse.ArgumentParser(
        prog="singd-curvlinops",
        description="SINGD on curvlinops: a training demo, a step benchmark and a "
        "tuned optimizer comparison.",
        epilog="Run `singd-curvlinops COMMAND --help` for a command's options.",
        formatter_class=arguments.Formatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_demo(commands)
    _add_bench(commands)
    compare_command.add_parser(commands)
    return parser


def _add_demo(commands: argparse._SubParsersAction) -> None:
    """Add the `demo` subcommand and its options.

    Args:
        commands: The subcommands of the main parser.
    """
    demo = commands.add_parser(
        "demo",
        help="train a small CNN on scikit-learn's digits with every optimizer",
        description=DEMO_DESCRIPTION,
        epilog=DEMO_EPILOG,
        formatter_class=arguments.Formatter,
    )
    add = demo.add_argument
    add(
        "--epochs",
        type=arguments.positive_int,
        default=10,
        metavar="N",
        help="epochs per optimizer (default: %(default)s)",
    )
    add(
        "--optimizers",
        type=arguments.optimizers,
        default=DEFAULT_OPTIMIZERS,
        metavar="LIST",
        help="comma-separated optimizers, syntax below (default: %(default)s)",
    )
    add(
        "--plot",
        type=output_file(".png"),
        default=DEMO_PLOT,
        metavar="PATH",
        help="PNG file for the loss curves (default: %(default)s)",
    )
    add(
        "--batch-size",
        type=arguments.positive_int,
        default=64,
        metavar="N",
        help="mini-batch size (default: %(default)s)",
    )
    add(
        "--train-size",
        type=arguments.positive_int,
        default=None,
        metavar="N",
        help=f"use only the first N of the {TRAIN_EXAMPLES} training digits "
        "(default: all)",
    )
    add(
        "--seed",
        type=arguments.seed,
        default=0,
        metavar="N",
        help="seed of the initial weights and the data order, in [0, 2**64 - 1] "
        "(default: %(default)s)",
    )
    add(
        "--threads",
        type=arguments.threads,
        default=1,
        metavar="N",
        help="torch threads (default: %(default)s; the demo's layers are too small "
        "to gain from more, and busy cores slow multithreaded kernels down)",
    )
    add("--no-progress", action="store_true", help="hide the progress bars")


def _add_bench(commands: argparse._SubParsersAction) -> None:
    """Add the `bench` subcommand and its options.

    Args:
        commands: The subcommands of the main parser.
    """
    bench = commands.add_parser(
        "bench",
        help="time and memory per training step, all optimizers interleaved",
        description=BENCH_DESCRIPTION,
        epilog=BENCH_EPILOG,
        formatter_class=arguments.Formatter,
    )
    add = bench.add_argument
    add(
        "--models",
        type=arguments.models,
        default=", ".join(MODELS),
        metavar="LIST",
        help="comma-separated models (default: %(default)s)",
    )
    add(
        "--structures",
        type=arguments.structures,
        default=None,
        metavar="LIST",
        help="comma-separated structures, each used for both K and "
        f"C (default: {BENCH_STRUCTURES}; dense with --distributed)",
    )
    add(
        "--T",
        type=arguments.intervals,
        default="1, 10",
        metavar="LIST",
        help="comma-separated factor update intervals (default: %(default)s)",
    )
    add(
        "--rounds",
        type=arguments.positive_int,
        default=5,
        metavar="N",
        help="timed blocks per configuration (default: %(default)s)",
    )
    add(
        "--steps-per-block",
        type=arguments.positive_int,
        default=10,
        metavar="N",
        help="consecutive steps per timed block, a multiple of every T "
        "(default: %(default)s)",
    )
    add(
        "--warmup",
        type=arguments.non_negative_int,
        default=3,
        metavar="N",
        help="untimed steps per configuration (default: %(default)s)",
    )
    add(
        "--threads",
        type=arguments.threads,
        default=None,
        metavar="N",
        help="torch threads (default: torch's choice)",
    )
    add("--no-reference", action="store_true", help="skip the reference singd's rows")
    add(
        "--distributed",
        action="store_true",
        help="time replicate against shard on the processes of torchrun (below)",
    )
    add("--fsdp", action="store_true", help="with --distributed: FSDP2, not DDP")
    add(
        "--hsdp",
        type=arguments.positive_int,
        default=1,
        metavar="REPLICAS",
        help="with --distributed: HSDP, REPLICAS replicas of the shards",
    )
    add(
        "--optimizer",
        choices=("singd", "ekfac"),
        default="singd",
        help="with --distributed: the optimizer timed (default: %(default)s)",
    )
    add(
        "--json",
        type=output_file(".json"),
        default=None,
        metavar="PATH",
        help="also write all records to this JSON file",
    )


def _run_demo(args: argparse.Namespace) -> int:
    """Run `singd-curvlinops demo`.

    The plot is written before the table is printed, so that it exists even if
    the reader of the output stops early (`singd-curvlinops demo | head -3`).

    Args:
        args: The parsed arguments.

    Returns:
        Exit code 0, or 1 if the plot could not be written.
    """
    results = run_demo(
        args.optimizers,
        epochs=args.epochs,
        batch_size=args.batch_size,
        train_size=args.train_size,
        seed=args.seed,
        progress=not args.no_progress,
    )
    failure = write_output(lambda: plot_losses(results, args.plot))
    print()
    print(results_table(results))
    if failure is not None:
        return report_write_failure("demo", args.plot, failure)
    print(f"\nloss curves: {args.plot}")
    return 0


def _run_bench(args: argparse.Namespace) -> int:
    """Run `singd-curvlinops bench`.

    Args:
        args: The parsed arguments.

    Returns:
        Exit code 0, or 1 if the JSON file could not be written.
    """
    if args.distributed:
        return run_distributed_bench(args)
    version = None if args.no_reference else reference_version()
    structures = args.structures or arguments.structures(BENCH_STRUCTURES)
    configs = configurations(structures, args.T, version is not None)
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
    content = json.dumps(records, indent=2)
    failure = args.json and write_output(lambda: args.json.write_text(content, "utf-8"))
    text = preamble(
        torch_version=torch.__version__,
        threads=torch.get_num_threads(),
        rounds=args.rounds,
        steps_per_block=args.steps_per_block,
        warmup=args.warmup,
        reference=version,
    )
    print(text + "\n")
    for model in args.models:
        print(f"### {model}\n")
        print(markdown_table(records, model))
        print()
    if failure is not None:
        return report_write_failure("bench", args.json, failure)
    return 0


def _closed_pipe() -> int:
    """End quietly after the reader of the output went away (`... | head -1`).

    As the Python documentation recommends for `BrokenPipeError`, the standard
    streams are pointed at the null device, so that the interpreter's final flush
    of pending output cannot fail a second time and print a traceback.

    Returns:
        `EXIT_CLOSED_PIPE`.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError):  # a stream without a file descriptor
            pass
    os.close(devnull)
    return EXIT_CLOSED_PIPE


def _check_combinations(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> None:
    """Check the constraints between arguments; exit with code 2 if one fails.

    Args:
        parser: The parser (reports the error).
        args: The parsed arguments.
    """
    if args.command == "demo":
        n_train = min(args.train_size or TRAIN_EXAMPLES, TRAIN_EXAMPLES)
        if args.batch_size > n_train:
            parser.error(
                f"demo: --batch-size {args.batch_size} exceeds the {n_train} "
                "training examples."
            )
    elif args.command == "bench":
        if (args.fsdp or args.hsdp > 1) and not args.distributed:
            flag = "--fsdp" if args.fsdp else "--hsdp"
            parser.error(f"bench: {flag} shards the model of --distributed; add it.")
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if args.distributed and world % args.hsdp:
            parser.error(
                f"bench: --hsdp {args.hsdp} replicas do not divide the "
                f"{world} processes into replicas of equal size."
            )
        if args.optimizer != "singd" and not args.distributed:
            parser.error("bench: --optimizer chooses for --distributed; add it.")
        if args.optimizer == "ekfac" and args.structures:
            parser.error("bench: EKFAC's structures are 'auto'; drop --structures.")
        if args.distributed and "WORLD_SIZE" not in os.environ:
            parser.error(
                "bench --distributed runs on the processes of torchrun: start it "
                "with torchrun --nproc_per_node 2 -m singd_curvlinops bench "
                "--distributed"
            )
        uneven = [T for T in args.T if args.steps_per_block % T]
        if uneven:
            parser.error(
                f"bench: --steps-per-block {args.steps_per_block} is not a multiple "
                f"of T = {', '.join(map(str, uneven))}: every timed block must hold "
                "the same number of factor updates."
            )


def main(argv: list[str] | None = None) -> int:
    """Run the `singd-curvlinops` command line.

    Args:
        argv: Arguments without the program name; default: `sys.argv[1:]`.

    Returns:
        The exit code: 0 on success, 1 if an extra (`examples` for the demo,
        `compare` for compare) is missing or an output file cannot be written
        after all, 130 if compare was interrupted, 141 if the reader of the output
        closed the pipe. Bad arguments and `--help` exit through `SystemExit`
        (codes 2 and 0).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_combinations(parser, args)
    threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        runners = {"demo": _run_demo, "compare": compare_command.run}
        code = runners.get(args.command, _run_bench)(args)
        sys.stdout.flush()  # a closed pipe shows here, not in the final flush
        return code
    except MissingExtraError as error:
        print(f"singd-curvlinops {args.command}: error: {error}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return _closed_pipe()
    finally:  # main may run inside a larger program (tests, notebooks)
        torch.set_num_threads(threads)
