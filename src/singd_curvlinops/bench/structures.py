"""Micro-benchmark: time per structured-matrix operation, ours against `singd`.

Every operation is timed for our structure and, when the reference release
`singd==0.0.5` is installed, for its counterpart, alternating the two in one
process so that both see the same machine state. The reference's sparse structures
do not accept float64, so the benchmark runs in float32.

Usage: `python -m singd_curvlinops.bench.structures [--dims 64,512,2048]
[--structures dense,diagonal,...] [--cols 128] [--json PATH]`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from singd_curvlinops._paths import output_file
from singd_curvlinops.structures import get_structure

DEFAULT_STRUCTURES = (
    "dense",
    "diagonal",
    "block30diagonal",
    "hierarchical15_15",
    "triltoeplitz",
    "triutoeplitz",
    "trilbottomrightdiag",
    "triutopleftdiag",
)
OPERATIONS = (
    "from_dense",
    "from_mat_inner",
    "from_inner(X)",
    "from_inner()",
    "K @ V",
    "rmatmat",
    "K @ K",
    "add_",
    "average_trace",
    "frobenius_norm",
)


def reference_class(name: str) -> type | None:
    """Return the class of `singd==0.0.5` for `name`, or None if unavailable.

    Args:
        name: Structure name as accepted by `get_structure`.

    Returns:
        The reference class, or None when `singd` is not installed.
    """
    try:
        from singd.optim.optimizer import SINGD
    except ImportError:
        return None
    if name in SINGD.SUPPORTED_STRUCTURES:
        return SINGD.SUPPORTED_STRUCTURES[name]
    if name.startswith(("tril", "triu")) and name.endswith("diag"):
        module = importlib.import_module(f"singd.structures.{name}")
        return getattr(module, get_structure(name).__name__)
    from singd.structures.blockdiagonal import BlockDiagonalMatrixTemplate
    from singd.structures.hierarchical import HierarchicalMatrixTemplate

    cls = get_structure(name)
    if hasattr(cls, "BLOCK_DIM"):
        return type("Ref", (BlockDiagonalMatrixTemplate,), {"BLOCK_DIM": cls.BLOCK_DIM})
    if hasattr(cls, "MAX_K1"):
        sizes = {"MAX_K1": cls.MAX_K1, "MAX_K2": cls.MAX_K2}
        return type("Ref", (HierarchicalMatrixTemplate,), sizes)
    return None


def operations(cls: type, dim: int, cols: int) -> dict[str, Callable[[], Any]]:
    """Build the timed closures for one structure class (ours or the reference).

    Args:
        cls: Structure class with the reference's interface.
        dim: Matrix dimension.
        cols: Number of columns of the dense operands `X` and `V`.

    Returns:
        Map from operation name to a closure without arguments.
    """
    generator = torch.Generator().manual_seed(0)
    S = torch.randn(dim, dim, generator=generator)
    S = S + S.T
    X = torch.randn(dim, cols, generator=generator) / cols**0.5
    V = torch.randn(dim, cols, generator=generator)
    K = cls.from_mat_inner(X)
    K.diag_add_(1.0)
    L = K * 0.5
    return {
        "from_dense": lambda: cls.from_dense(S),
        "from_mat_inner": lambda: cls.from_mat_inner(X),
        "from_inner(X)": lambda: K.from_inner(X),
        "from_inner()": K.from_inner,
        "K @ V": lambda: K @ V,
        "rmatmat": lambda: K.rmatmat(V),
        "K @ K": lambda: K @ L,
        "add_": lambda: L.add_(K, alpha=1e-8),
        "average_trace": K.average_trace,
        "frobenius_norm": K.frobenius_norm,
    }


def _seconds_per_call(fn: Callable[[], Any], budget: float) -> float:
    """Return the time of one call of `fn`, from a loop that runs about `budget` s.

    Args:
        fn: Closure to time.
        budget: Target duration of the timing loop in seconds.

    Returns:
        Seconds per call.
    """
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    repeats = max(1, min(10_000, int(budget / max(first, 1e-7))))
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def measure(
    name: str, dim: int, cols: int, rounds: int, budget: float
) -> list[dict[str, Any]]:
    """Time every operation for one structure and dimension, ours and reference.

    Args:
        name: Structure name.
        dim: Matrix dimension.
        cols: Number of columns of the dense operands.
        rounds: Number of alternating rounds; the median is reported.
        budget: Seconds per timing loop.

    Returns:
        One record per operation with `ours_s`, `reference_s` (or None).
    """
    ours = operations(get_structure(name), dim, cols)
    ref_cls = reference_class(name)
    reference = operations(ref_cls, dim, cols) if ref_cls is not None else {}
    records = []
    for op in OPERATIONS:
        ours_times, ref_times = [], []
        for _ in range(rounds):
            ours_times.append(_seconds_per_call(ours[op], budget))
            if op in reference:
                ref_times.append(_seconds_per_call(reference[op], budget))
        records.append(
            {
                "structure": name,
                "dim": dim,
                "operation": op,
                "ours_s": statistics.median(ours_times),
                "reference_s": statistics.median(ref_times) if ref_times else None,
            }
        )
    return records


def _format_time(seconds: float) -> str:
    """Format a duration with a unit that keeps three significant digits.

    Args:
        seconds: Duration.

    Returns:
        E.g. `"12.3 µs"`.
    """
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def markdown_table(records: list[dict[str, Any]], dims: list[int]) -> str:
    """Render records as a Markdown table: one row per structure and operation.

    Args:
        records: Output of `measure`.
        dims: Dimensions, one column each.

    Returns:
        The table; each cell reads `ours / reference (speed-up×)`.
    """
    header = "| structure | operation | " + " | ".join(f"d = {d}" for d in dims) + " |"
    lines = [header, "|---|---|" + "---|" * len(dims)]
    index = {(r["structure"], r["operation"], r["dim"]): r for r in records}
    for name in dict.fromkeys(r["structure"] for r in records):
        for op in OPERATIONS:
            cells = []
            for dim in dims:
                record = index[(name, op, dim)]
                cell = _format_time(record["ours_s"])
                if record["reference_s"] is not None:
                    speedup = record["reference_s"] / record["ours_s"]
                    cell += f" / {_format_time(record['reference_s'])} ({speedup:.2g}×)"
                cells.append(cell)
            lines.append(f"| {name} | `{op}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the Markdown table.

    Args:
        argv: Command-line arguments; default: `sys.argv[1:]`.

    Returns:
        Exit code 0.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dims", default="64,512,2048", help="comma-separated dims")
    parser.add_argument(
        "--structures", default=",".join(DEFAULT_STRUCTURES), help="structure names"
    )
    parser.add_argument("--cols", type=int, default=128, help="columns of X and V")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--budget", type=float, default=0.05, help="s per loop")
    parser.add_argument(
        "--json",
        type=output_file(".json"),
        default=None,
        help="also write records here",
    )
    args = parser.parse_args(argv)
    try:
        dims = [int(d) for d in args.dims.split(",")]
        names = args.structures.split(",")
        for name in names:
            get_structure(name)
    except ValueError as error:
        parser.error(str(error))
    if any(d < 1 for d in dims) or args.cols < 1 or args.rounds < 1:
        parser.error("--dims, --cols and --rounds must be positive.")

    torch.manual_seed(0)
    records = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reference warns on its dense fallbacks
        for name in names:
            for dim in dims:
                records.extend(measure(name, dim, args.cols, args.rounds, args.budget))
                print(f"measured {name} d={dim}", file=sys.stderr)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, "
        f"{args.cols} columns; cells: ours / singd 0.0.5 (speed-up)\n"
    )
    print(markdown_table(records, dims))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump(records, file, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
