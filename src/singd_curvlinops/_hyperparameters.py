"""Validation of the optimizers' hyperparameters (one place, clear messages).

The same checks run at construction (`add_param_group`), on the options of a
loaded state dict (`checkpoint_validation`) and on options edited between steps
(`option_guard`). Real-valued options must be finite: `inf` and NaN are rejected
with the argument's name and its allowed range.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from singd_curvlinops.rules.fallback import GRAFTS, fallback_names
from singd_curvlinops.statistics import check_kfac_approx, check_loss_average
from singd_curvlinops.structure_policy import check_max_dense_dim, check_structures


def is_finite(value: int | float) -> bool:
    """Return whether a real number is finite (also as a float: no overflow).

    Args:
        value: An int or float.

    Returns:
        False for NaN, infinities and ints beyond the float range.
    """
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def check_number(name: str, value: Any, low: float, high: float | None = None) -> None:
    """Check `low <= value` (and `value < high`) for a finite real number.

    Args:
        name: Argument name for the message.
        value: Candidate value.
        low: Inclusive lower bound.
        high: Exclusive upper bound, if any.

    Raises:
        TypeError: If `value` is not a real number.
        ValueError: If it is out of range, NaN or infinite.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}.")
    finite = is_finite(value)
    if not finite or value < low or (high is not None and value >= high):
        allowed = f"in [{low}, {high})" if high is not None else f">= {low}"
        note = "" if finite else " (it must be finite)"
        raise ValueError(f"{name} must be {allowed}, got {value!r}{note}.")


def check_positive(name: str, value: Any) -> None:
    """Check `0 < value < inf` for a real number (a gradient scale).

    Args:
        name: Argument name for the message.
        value: Candidate value.

    Raises:
        TypeError: If `value` is neither a real number nor a bool.
        ValueError: If it is a bool, not positive, NaN or infinite.
    """
    if not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number > 0, got {value!r}.")
    finite = not isinstance(value, bool) and is_finite(value)
    if not finite or value <= 0:
        note = "" if finite or isinstance(value, bool) else " (it must be finite)"
        raise ValueError(f"{name} must be > 0, got {value!r}{note}.")


def check_lr_cov_value(value: Any, step: Any) -> float:
    """Check what a callable `lr_cov` returned at a step.

    Args:
        value: The returned value.
        step: The step it was called with (the layer's step counter).

    Returns:
        The value as a float.

    Raises:
        ValueError: If it is not a finite real number >= 0 (the message names
            `lr_cov` and the step).
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not is_finite(value)
        or value < 0
    ):
        raise ValueError(
            f"lr_cov (a callable) returned {value!r} at step {step}; it must "
            "return a finite real number >= 0."
        )
    return float(value)


def check_preconditioner_dtype(value: Any) -> tuple[torch.dtype | None, ...]:
    """Check a pair `(dtype_K, dtype_C)` of floating dtypes or None, or None.

    Args:
        value: Candidate pair; None stands for `(None, None)` (both factors in
            the parameter's dtype), as each None in a pair does for its side.

    Returns:
        The pair as a tuple.

    Raises:
        ValueError: If it is neither None nor such a pair.
    """
    if value is None:
        return (None, None)
    if (
        not isinstance(value, (tuple, list))
        or len(value) != 2
        or not all(
            d is None or (isinstance(d, torch.dtype) and d.is_floating_point)
            for d in value
        )
    ):
        raise ValueError(
            "preconditioner_dtype must be a pair of floating torch dtypes or None "
            "(one per factor; None: the parameter's dtype), or None for both, got "
            f"{value!r}."
        )
    return tuple(value)


def check_common(group: dict[str, Any]) -> None:
    """Validate the options every Kronecker optimizer has, normalising them in place.

    Args:
        group: The group's options (`params` is ignored).

    Raises:
        ValueError: If a value is out of range or unknown; the message names the
            argument and the allowed values.
    """
    check_number("lr", group["lr"], 0.0)
    check_number("momentum", group["momentum"], 0.0, 1.0)
    check_number("damping", group["damping"], 0.0)
    check_number("weight_decay", group["weight_decay"], 0.0)
    T = group["T"]
    if isinstance(T, bool) or not isinstance(T, int) or T < 1:
        raise ValueError(f"T must be a positive int, got {T!r}.")
    group["loss_average"] = check_loss_average(group["loss_average"])
    group["kfac_approx"] = check_kfac_approx(group["kfac_approx"])
    group["preconditioner_dtype"] = check_preconditioner_dtype(
        group["preconditioner_dtype"]
    )
    group["structures"] = check_structures(group["structures"])
    group["max_dense_dim"] = check_max_dense_dim(group["max_dense_dim"])
    check_fallback(group)


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """Check that `value` is one of `choices` or None.

    Args:
        name: Argument name for the message.
        value: Candidate value.
        choices: The allowed strings.

    Raises:
        ValueError: If it is not.
    """
    if value is not None and value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name} must be one of {allowed} or None, got {value!r}.")


def check_fallback(group: dict[str, Any]) -> None:
    """Validate the fallback and grafting options, normalising them in place.

    Args:
        group: The group's options.

    Raises:
        ValueError: If `fallback_betas` is not a pair; other values are checked by
            `check_choice` and `check_number`.
    """
    check_choice("fallback", group["fallback"], fallback_names())
    check_choice("graft", group["graft"], GRAFTS)
    check_number("fallback_lr_ratio", group["fallback_lr_ratio"], 0.0)
    check_number("fallback_eps", group["fallback_eps"], 0.0)
    betas = group["fallback_betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(
            f"fallback_betas must be a pair (beta1, beta2), got {betas!r}."
        )
    for index, beta in enumerate(betas):
        check_number(f"fallback_betas[{index}]", beta, 0.0, 1.0)
    group["fallback_betas"] = tuple(betas)
