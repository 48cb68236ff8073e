"""Argument types of the `singd-curvlinops` command line.

Each function parses one argument's text for `argparse` (`type=`) and raises
`argparse.ArgumentTypeError` with a message that names the allowed values, so
that bad input exits with code 2 before any work starts. That includes output
files: a path that cannot be written is reported at parsing, not by a traceback
after a whole run.
"""

from __future__ import annotations

import argparse

from singd_curvlinops.bench.workloads import MODELS
from singd_curvlinops.demo.optimizers import OptimizerSpec, parse_optimizers
from singd_curvlinops.demo.training import MAX_SEED
from singd_curvlinops.structures import get_structure


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Keep the line breaks of descriptions and epilogs (tables, examples)."""


#: `torch.set_num_threads` takes a C int.
MAX_THREADS = 2**31 - 1


def integer(text: str, low: int, kind: str, high: int | None = None) -> int:
    """Parse an integer in `[low, high]`.

    Args:
        text: The argument.
        low: Smallest allowed value.
        kind: Description for the error message, e.g. `"a positive integer"`.
        high: Largest allowed value; None: no limit.

    Returns:
        The integer.

    Raises:
        ArgumentTypeError: If `text` is no integer or out of range.
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
    if value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"expected {kind}, got {value}")
    return value


def positive_int(text: str) -> int:
    """Parse a positive integer (an argparse `type`).

    Args:
        text: The argument.

    Returns:
        The integer, at least 1.
    """
    return integer(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    """Parse a non-negative integer (an argparse `type`).

    Args:
        text: The argument.

    Returns:
        The integer, at least 0.
    """
    return integer(text, 0, "a non-negative integer")


def seed(text: str) -> int:
    """Parse a seed for `torch.manual_seed` (an argparse `type`).

    Args:
        text: The argument.

    Returns:
        The seed, in `[0, MAX_SEED]`.
    """
    return integer(text, 0, f"an integer in [0, {MAX_SEED}] (2**64 - 1)", MAX_SEED)


def threads(text: str) -> int:
    """Parse a number of torch threads (an argparse `type`).

    Args:
        text: The argument.

    Returns:
        The number, in `[1, MAX_THREADS]`.
    """
    return integer(text, 1, f"an integer in [1, {MAX_THREADS}]", MAX_THREADS)


def comma_list(text: str, what: str) -> list[str]:
    """Split a comma-separated argument into its non-empty, unique items.

    Args:
        text: E.g. `"mlp,cnn"`.
        what: What the items are, for the error message.

    Returns:
        The items in order of first appearance.

    Raises:
        ArgumentTypeError: If there is no item.
    """
    items = list(dict.fromkeys(item.strip() for item in text.split(",")))
    items = [item for item in items if item]
    if not items:
        raise argparse.ArgumentTypeError(f"give at least one {what}")
    return items


def models(text: str) -> list[str]:
    """Parse `--models` (an argparse `type`).

    Args:
        text: E.g. `"mlp,cnn"`.

    Returns:
        The model names.

    Raises:
        ArgumentTypeError: If a name is unknown.
    """
    models = comma_list(text, f"model ({', '.join(MODELS)})")
    unknown = [model for model in models if model not in MODELS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown model {', '.join(map(repr, unknown))}; "
            f"choose from {', '.join(MODELS)}"
        )
    return models


def structures(text: str) -> list[str]:
    """Parse `--structures` (an argparse `type`).

    Args:
        text: E.g. `"dense,block30diagonal"`.

    Returns:
        The structure names.

    Raises:
        ArgumentTypeError: If a name is unknown; the message lists the valid ones.
    """
    names = comma_list(text, "structure name")
    for name in names:
        try:
            get_structure(name)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return names


def intervals(text: str) -> list[int]:
    """Parse `--T`, comma-separated positive integers (an argparse `type`).

    Args:
        text: E.g. `"1,10"`.

    Returns:
        The intervals.
    """
    return [positive_int(item) for item in comma_list(text, "positive integer")]


def optimizers(text: str) -> list[OptimizerSpec]:
    """Parse `--optimizers` (an argparse `type`).

    Args:
        text: E.g. `"singd:dense,ikfac,adamw"`.

    Returns:
        The optimizer specifications.

    Raises:
        ArgumentTypeError: If a name is invalid; the message gives the syntax.
    """
    try:
        return parse_optimizers(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
