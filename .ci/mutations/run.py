"""Check that the test suite catches deliberate faults in the package (mutants).

Each mutant in `mutants.json` replaces one exact piece of a source file by a
faulty one. For each, this script copies the checkout's `src/`, `tests/` and
project files into a temporary folder, applies the mutant there, runs the tests
it names (`pytest -x`, no coverage, `src/` of the copy first on the path) and
restores the file. A mutant is *killed* if a test fails. One that survives is a
fault the suite cannot see: add a test, or, if the mutant changes no behaviour
(a design constant, the rounding of a symmetrisation), give it an `"equivalent"`
entry that says why.

Usage, from the repository root (any Python with the `test` extra installed):

    python .ci/mutations/run.py                 # every mutant (about 6 minutes)
    python .ci/mutations/run.py --only gcn-cache budget-le

The exit status is 1 if an unexpected mutant survived or a mutant no longer
matches its file (`STALE`: the code moved on; update its `old` text).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MUTANTS = Path(__file__).with_name("mutants.json")
COPIED = ("src", "tests", "pyproject.toml", "setup.cfg")


def main() -> int:
    """Run the mutants; return the exit status.

    Returns:
        0 if every mutant was killed or survived as expected, else 1.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="ID", help="mutants to run")
    args = parser.parse_args()
    mutants = json.loads(MUTANTS.read_text())
    if args.only:
        unknown = set(args.only) - {m["id"] for m in mutants}
        if unknown:
            parser.error(f"unknown mutant ids: {sorted(unknown)}")
        mutants = [m for m in mutants if m["id"] in args.only]
    failures = 0
    with tempfile.TemporaryDirectory(prefix="mutations-") as scratch:
        copy = Path(scratch)
        for name in COPIED:
            source = ROOT / name
            if source.is_dir():
                ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
                shutil.copytree(source, copy / name, ignore=ignore)
            else:
                shutil.copy2(source, copy / name)
        for mutant in mutants:
            verdict, detail = _run(copy, mutant)
            expected = mutant.get("equivalent")
            if verdict == "SURVIVED" and expected:
                detail = f"expected: {expected}"
            elif verdict != "KILLED":
                failures += 1
            print(f"{verdict:8} {mutant['id']}: {detail}", flush=True)
    print(f"{len(mutants)} mutants, {failures} unexpected")
    return int(failures > 0)


def _run(copy: Path, mutant: dict) -> tuple[str, str]:
    """Apply one mutant in the copy, run its tests, restore the file.

    Args:
        copy: The temporary copy of the checkout.
        mutant: Its entry (`id`, `file`, `old`, `new`, `tests`).

    Returns:
        The verdict (`KILLED`, `SURVIVED` or `STALE`) and a detail.
    """
    path = copy / mutant["file"]
    original = path.read_text()
    matches = original.count(mutant["old"])
    if matches != 1:
        return "STALE", f"`old` occurs {matches} times in {mutant['file']}"
    path.write_text(original.replace(mutant["old"], mutant["new"]))
    start = time.perf_counter()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-rf", "--no-cov"]
            + ["-p", "no:cacheprovider", *mutant["tests"].split()],
            check=False,  # (a failing test is the verdict, not an error)
            cwd=copy,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(copy / "src")},
        )
    finally:
        path.write_text(original)
    seconds = time.perf_counter() - start
    if result.returncode == 0:
        return "SURVIVED", f"{mutant['tests']} passed ({seconds:.0f} s)"
    failed = re.search(r"^(?:FAILED|ERROR) (\S+)", result.stdout, re.MULTILINE)
    where = failed.group(1) if failed else result.stdout.strip()[-200:]
    return "KILLED", f"{where} ({seconds:.0f} s)"


if __name__ == "__main__":
    sys.exit(main())
