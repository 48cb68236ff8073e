"""The one module that reads curvlinops' internals, behind a version check.

curvlinops has no public API for two things this package needs: the Kronecker
factors of a computed `KFACLinearOperator` per layer (`set_curvature`), and the
base class of its PyTorch linear operators (`SINGDLinearOperator`). Both are read
here, and only for the curvlinops versions this package is tested with
(`SUPPORTED_VERSIONS`, the range `setup.cfg` pins): another version raises an
error that names the supported ones instead of failing somewhere inside.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from curvlinops.kfac import KFACLinearOperator
from torch import Tensor
from torch.nn import Parameter

__all__ = ["PyTorchLinearOperator", "check_version", "kfac_factors"]

DISTRIBUTION = "curvlinops-for-pytorch"
SUPPORTED_VERSIONS = ">=3.0.1,<4"
_LOWEST, _BELOW = (3, 0, 1), (4,)


def _release(version: str) -> tuple[int, ...]:
    """Return the numeric release of a version string, e.g. `(3, 0, 1)`.

    Args:
        version: E.g. `"3.0.1"` or `"3.1.0.dev2"`.

    Returns:
        The leading numeric components.
    """
    numbers = []
    for part in version.split("."):
        digits = "".join(c for c in part if c.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        numbers.append(int(digits))
    return tuple(numbers)


def installed_version() -> str:
    """Return the installed curvlinops version.

    Returns:
        E.g. `"3.0.1"`.
    """
    return importlib.metadata.version(DISTRIBUTION)


def _unsupported(found: str) -> str:
    """Return the message for an unsupported curvlinops.

    Args:
        found: The installed version.

    Returns:
        A sentence naming the supported and the installed versions.
    """
    return (
        f"singd_curvlinops reads internals of {DISTRIBUTION} and supports versions "
        f"{SUPPORTED_VERSIONS}; version {found} is installed. Install a supported "
        f"version (pip install '{DISTRIBUTION}{SUPPORTED_VERSIONS}')."
    )


def check_version() -> None:
    """Raise unless the installed curvlinops is a supported version.

    Raises:
        RuntimeError: If it is not; the message names the supported versions.
    """
    found = installed_version()
    if not _LOWEST <= _release(found) < _BELOW:
        raise RuntimeError(_unsupported(found))


try:
    from curvlinops._torch_base import PyTorchLinearOperator
except ImportError as error:  # pragma: no cover - only with another curvlinops
    raise ImportError(_unsupported(installed_version())) from error


def kfac_factors(kfac: Any) -> dict[Parameter, tuple[Tensor, Tensor]]:
    r"""Read the Kronecker factors \((U_K, U_C)\) of a `KFACLinearOperator` per layer.

    The operator must be built with `separate_weight_and_bias=False`, so that its
    input factor carries the bias column, as SINGD's \(K\) does. Factors are
    computed first if the operator has not done so yet.

    Args:
        kfac: A `curvlinops.KFACLinearOperator`.

    Returns:
        Map from each layer's weight (a bias-only layer's bias) to (input
        covariance `[d_K, d_K]`, `[[1]]` for a bias-only layer; gradient
        covariance `[d_C, d_C]`).

    Raises:
        TypeError: If `kfac` is not a `KFACLinearOperator`.
        ValueError: If it separates weight and bias, or two of its modules share
            a parameter.
    """
    if not isinstance(kfac, KFACLinearOperator):
        raise TypeError(
            f"Expected a curvlinops.KFACLinearOperator, got {type(kfac).__name__}."
        )
    check_version()
    if kfac._separate_weight_and_bias:
        raise ValueError(
            "The KFACLinearOperator must be built with separate_weight_and_bias=False "
            "(the optimizers' input factor includes the bias column)."
        )
    if not kfac._input_covariances or not kfac._gradient_covariances:
        kfac.compute_kronecker_factors()
    factors, modules = {}, {}
    for name, positions in kfac._mapping.items():
        U_C = kfac._gradient_covariances[name]
        if "weight" in positions:
            key, U_K = kfac._params[positions["weight"]], kfac._input_covariances[name]
        else:  # a bias-only layer (frozen weight): its input rows are ones
            key, U_K = kfac._params[positions["bias"]], U_C.new_ones(1, 1)
        if key in factors:
            raise ValueError(
                f"The modules {modules[key]!r} and {name!r} share a parameter: "
                "curvlinops gives each use of a tied weight its own factors, which "
                "the optimizer cannot combine into the statistics of its layer (all "
                "uses' rows together): set_curvature does not take tied weights."
            )
        factors[key], modules[key] = (U_K, U_C), name
    return factors
