"""Output files of the command-line tools: checked before the work, written after."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path


def output_file(suffix: str) -> Callable[[str], Path]:
    """Return an argparse `type` for a file to write with the given suffix.

    Args:
        suffix: Required file name ending, e.g. `".png"`.

    Returns:
        A function that checks the suffix and that the file can be written.
    """

    def parse(text: str) -> Path:
        """Check an output path before any work starts.

        Args:
            text: The path.

        Returns:
            The path.

        Raises:
            ArgumentTypeError: If the suffix is wrong or the file cannot be written.
        """
        path = Path(text)
        if path.suffix.lower() != suffix:
            raise argparse.ArgumentTypeError(f"expected a {suffix} file, got {text!r}")
        problem = _write_problem(text, path)
        if problem is not None:
            raise argparse.ArgumentTypeError(f"cannot write {text!r}: {problem}")
        return path

    return parse


def _write_problem(text: str, path: Path) -> str | None:
    """Say why a file could not be created or overwritten at `path`, if it could not.

    Uses `os.access`, which asks the operating system without creating anything
    (and knows that root may write anywhere except on read-only file systems).

    Args:
        text: The path as given (a trailing separator names a folder).
        path: The path.

    Returns:
        The reason, or None if the file can be written.
    """
    folder = path.parent
    if path.is_dir() or text.endswith(("/", os.sep)):
        return "that is a folder"
    if not folder.exists():
        return f"folder {str(folder)!r} not found"
    if not folder.is_dir():
        return f"{str(folder)!r} is not a folder"
    if path.exists():
        if not os.access(path, os.W_OK):
            return "the file is not writable"
    elif not os.access(folder, os.W_OK | os.X_OK):
        return f"folder {str(folder)!r} is not writable"
    return None


def write_output(write: Callable[[], object]) -> OSError | None:
    """Write an output file after the run; the path was checked at parsing.

    Args:
        write: Writes the file.

    Returns:
        None, or the error if the file could not be written after all (a full
        disk, a folder removed during the run).
    """
    try:
        write()
    except OSError as error:
        return error
    return None


def report_write_failure(command: str, path: os.PathLike, error: OSError) -> int:
    """Report an output file that could not be written after all, in one line.

    Args:
        command: The subcommand, for the message.
        path: The file.
        error: What the operating system said.

    Returns:
        Exit code 1.
    """
    reason = error.strerror or str(error)
    print(
        f"singd-curvlinops {command}: error: cannot write {str(path)!r}: {reason}",
        file=sys.stderr,
    )
    return 1
