"""`singd-curvlinops demo`: SINGD, IKFAC, KFAC, AdamW and SGD on a small CNN.

Trains the same seeded CNN on scikit-learn's digits with every requested
optimizer (same weights, same mini-batch order), then prints a table of final
training loss, test accuracy, time per step and optimizer state, and plots the loss
curves. Needs the `examples` extra (`matplotlib`, `scikit-learn`, `tqdm`).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from singd_curvlinops.demo.optimizers import OptimizerSpec
from singd_curvlinops.demo.training import RunResult, load_digits_data, train

EXTRA_MODULES = {"matplotlib": "matplotlib", "sklearn": "scikit-learn", "tqdm": "tqdm"}


class MissingExtraError(ImportError):
    """A package of an optional extra (`examples`, `compare`) is not installed."""


def require_examples() -> None:
    """Check that the `examples` extra is installed.

    Raises:
        MissingExtraError: Naming the missing packages and the command that
            installs them.
    """
    missing = []
    for module, package in EXTRA_MODULES.items():
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(package)
    if missing:
        raise MissingExtraError(
            f"the demo needs {', '.join(missing)} from the `examples` extra; "
            'install it with: pip install "singd-curvlinops[examples]"'
        )


def run_demo(
    specs: Sequence[OptimizerSpec],
    *,
    epochs: int = 10,
    batch_size: int = 64,
    train_size: int | None = None,
    seed: int = 0,
    progress: bool = True,
) -> list[RunResult]:
    """Train one model per optimizer on the digits, one after the other.

    Args:
        specs: The optimizers.
        epochs: Epochs per run.
        batch_size: Mini-batch size.
        train_size: Use only this many training examples (None: all 1,347).
        seed: Seed of the initial weights and the data order (shared by all runs).
        progress: Show a progress bar per run.

    Returns:
        One result per optimizer, in the order of `specs`.
    """
    require_examples()
    data = load_digits_data(train_size)
    return [
        train(
            spec,
            data,
            epochs=epochs,
            batch_size=batch_size,
            seed=seed,
            progress=progress,
        )
        for spec in specs
    ]
