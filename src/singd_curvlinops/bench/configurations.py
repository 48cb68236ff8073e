"""The optimizer settings the step benchmark times, and how to build them.

Rows per structure and `T`: ours (`SINGD`) and the reference `singd` when it is
installed and has the structure; per `T` the `KFAC` baseline; then AdamW and SGD.
Both SINGD implementations get the reference's default hyperparameters; `KFAC`
gets the same learning rate and momentum, and damping 0.1 (see below).
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass

import torch
from torch import nn

from singd_curvlinops import KFAC, SINGD
from singd_curvlinops.bench.structures import reference_class

# Hyperparameters shared by both SINGD implementations (the reference's defaults).
SINGD_HYPERPARAMETERS = {
    "lr": 1e-3,
    "momentum": 0.9,
    "damping": 1e-3,
    "alpha1": 0.5,
    "weight_decay": 0.0,
    "lr_cov": 1e-2,
}
# KFAC inverts its damped factors: with SINGD's damping 1e-3 the step along the
# factors' small eigenvalues is ~1e3 times the gradient, and KFAC at T = 10
# diverges on the cnn's fixed batch; 0.1 is a common KFAC damping.
KFAC_HYPERPARAMETERS = {
    **{key: SINGD_HYPERPARAMETERS[key] for key in ("lr", "momentum", "weight_decay")},
    "damping": 0.1,
}


@dataclass(frozen=True)
class Configuration:
    """One optimizer setting to time.

    Attributes:
        label: Row label, e.g. `"SINGD dense T=10"`.
        kind: `"ours"`, `"reference"`, `"kfac"` or `"baseline"`.
        structure: Structure of both `K` and `C` (None for KFAC and the baselines).
        T: Factor update interval (None for AdamW and SGD).
    """

    label: str
    kind: str
    structure: str | None = None
    T: int | None = None


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
        Ours and the reference per structure and `T`, KFAC per `T`, then AdamW
        and SGD.
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
    configs.extend(Configuration(f"KFAC T={T}", "kfac", T=T) for T in Ts)
    configs.append(Configuration("AdamW", "baseline"))
    configs.append(Configuration("SGD", "baseline"))
    return configs


def make_optimizer(
    config: Configuration, model: nn.Module, loss_average: str
) -> torch.optim.Optimizer:
    """Construct the optimizer of a configuration for `model`.

    Args:
        config: The configuration.
        model: The model it trains (SINGD and KFAC install hooks on it).
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
    if config.kind == "kfac":
        return KFAC(
            model, T=config.T, loss_average=loss_average, **KFAC_HYPERPARAMETERS
        )
    if config.label == "AdamW":
        return torch.optim.AdamW(model.parameters(), lr=1e-3)
    if config.label == "SGD":
        return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    raise ValueError(f"Unknown configuration {config!r}.")
