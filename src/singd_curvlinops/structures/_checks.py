"""Argument checks shared by the structured matrices.

Each check raises `TypeError` for an argument of the wrong kind and `ValueError`
for one of the right kind with a wrong value, naming the argument and what is
allowed. The structures call them on their slow paths only: where a check would
sit on the optimizer's hot path, the caller first tests the valid case in one
cheap expression and calls the check only to explain a failure.
"""

from __future__ import annotations

from numbers import Integral, Real

import torch
from torch import Tensor

#: Data types of stored tensors and dense operands (the ones torch computes in).
FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
_DTYPE_NAMES = "torch.float16, torch.bfloat16, torch.float32 or torch.float64"
#: Data types of 0-d tensors that may scale a matrix or be added to its diagonal.
REAL_DTYPES = FLOAT_DTYPES | {
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
}

#: Largest dimension, and largest size in a structure's name (block size, corners):
#: the largest int32, so that the entries of a dense block of that size can be
#: counted in int64. Anything larger is an error, not an overflow inside torch.
MAX_SIZE = 2**31 - 1

_INT64_RANGE = (-(2**63), 2**63 - 1)


def check_size(size: int, name: str, low: int) -> int:
    """Check a size parameter of a structure family (block size, corner size).

    Args:
        size: Candidate size.
        name: Argument name used in the error message.
        low: Smallest allowed value (0 or 1).

    Returns:
        `size`.

    Raises:
        TypeError: If `size` is not an integer.
        ValueError: If `size` is not in `[low, MAX_SIZE]`.
    """
    if isinstance(size, bool) or not isinstance(size, int):
        raise TypeError(f"{name} must be an int, got {type(size).__name__}.")
    if not low <= size <= MAX_SIZE:
        raise ValueError(f"{name} must be in [{low}, {MAX_SIZE}], got {size}.")
    return size


def check_dtype(dtype: torch.dtype | None) -> torch.dtype | None:
    """Check a `dtype` argument of `eye`/`zeros`.

    Args:
        dtype: Candidate data type; None stands for `torch.get_default_dtype()`.

    Returns:
        `dtype`.

    Raises:
        TypeError: If `dtype` is not None or a supported floating-point dtype.
    """
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be {_DTYPE_NAMES} (or None), got {dtype!r}.")
    return dtype


def check_device(device: torch.device | str | int | None) -> None:
    """Check that `device` names a device (whether it is available is torch's job).

    Args:
        device: Candidate device; None stands for the CPU.

    Raises:
        ValueError: If `device` is no device specification.
    """
    if device is None or isinstance(device, torch.device):
        return
    try:
        torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(
            "device must be a torch.device, a string such as 'cpu' or 'cuda:0', "
            f"or None, got {device!r}."
        ) from None


def check_float_tensor(tensor: object, name: str) -> Tensor:
    """Check that `tensor` is a tensor of a supported floating-point dtype.

    Args:
        tensor: Candidate tensor.
        name: Argument name used in the error message.

    Returns:
        `tensor`.

    Raises:
        TypeError: If it is not a tensor, or not of a supported dtype.
    """
    if not isinstance(tensor, Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor, got {type(tensor).__name__}: "
            f"{tensor!r:.60}."
        )
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must have a floating-point dtype ({_DTYPE_NAMES}), got "
            f"{tensor.dtype}; integer and complex tensors are not cast "
            "automatically: call .to(torch.float32) or similar first."
        )
    return tensor


def check_square(mat: Tensor, name: str) -> Tensor:
    """Check that `mat` is a non-empty square floating-point matrix.

    Args:
        mat: Candidate matrix.
        name: Argument name used in the error message.

    Returns:
        `mat`.

    Raises:
        ValueError: If `mat` is not of shape `[d, d]` with `d >= 1`.
    """
    check_float_tensor(mat, name)
    if mat.ndim != 2 or mat.shape[0] != mat.shape[1] or mat.shape[0] == 0:
        raise ValueError(
            f"{name} must be a square matrix [d, d] with d >= 1, got "
            f"{tuple(mat.shape)}."
        )
    return mat


def check_operand(
    mat: Tensor,
    dim: int | None,
    dtype: torch.dtype | None,
    device: torch.device | None,
    name: str,
    matrix_only: bool = False,
) -> Tensor:
    """Check a dense operand of a structured matrix.

    Args:
        mat: Candidate tensor.
        dim: Required number of rows; `None` accepts any number `>= 1`.
        dtype: Required data type; `None` accepts any supported float type.
        device: Required device; `None` accepts any.
        name: Argument name used in the error message.
        matrix_only: Reject vectors (`[d]`) and accept only matrices (`[d, n]`).
            Any number of columns `n >= 0` is allowed.

    Returns:
        `mat`.

    Raises:
        ValueError: If shape, data type or device do not match.
    """
    check_float_tensor(mat, name)
    allowed_ndims = (2,) if matrix_only else (1, 2)
    rows = mat.shape[0] if mat.ndim else None
    if mat.ndim not in allowed_ndims or rows != (rows if dim is None else dim):
        expected = "[d, n]" if matrix_only else "[d] or [d, n]"
        required = "d >= 1" if dim is None else f"d = {dim}"
        raise ValueError(
            f"{name} must have shape {expected} with {required}, got "
            f"{tuple(mat.shape)}."
        )
    if rows == 0:
        raise ValueError(f"{name} must have at least one row, got {tuple(mat.shape)}.")
    if dtype is not None and mat.dtype != dtype:
        raise ValueError(
            f"{name} must have the matrix's dtype {dtype}, got {mat.dtype}. "
            "Cast one of them first."
        )
    if device is not None and mat.device != device:
        raise ValueError(
            f"{name} must be on the matrix's device {device}, got {mat.device}. "
            "Move one of them first."
        )
    return mat


def check_scalar(value: object, name: str, device: torch.device) -> None:
    """Check a scalar factor or summand of a structured matrix.

    Allowed are the real numbers torch takes as scalars, `int` (in the int64 range)
    and `float` and NumPy's real scalars (not `bool`), and 0-d tensors of a dtype in
    `REAL_DTYPES` (floating or integer, not `bool` or complex) on the CPU or on
    `device`. A 0-d tensor keeps the value on its device, which avoids a host
    synchronisation.

    Args:
        value: Candidate scalar.
        name: Argument name used in the error message.
        device: The matrix's device.

    Raises:
        TypeError: If `value` is no real scalar (e.g. a vector, a bool, a complex
            number, a `Fraction`).
        ValueError: If an int is too large, or a tensor is on another device.
    """
    if type(value) is float:  # the common case: no further checks
        return
    allowed = f"{name} must be a real number (int, float) or a 0-d real tensor"
    if isinstance(value, Tensor):
        if value.ndim != 0 or value.dtype not in REAL_DTYPES:
            raise TypeError(
                f"{allowed}, got a tensor of shape {tuple(value.shape)} and dtype "
                f"{value.dtype}."
            )
        if value.device.type != "cpu" and value.device != device:
            raise ValueError(
                f"{allowed} on the CPU or on the matrix's device {device}, got a "
                f"tensor on {value.device}."
            )
        return
    # NumPy's real scalars (float32, int64, ...) have a dtype; Fraction, also a
    # numbers.Real, has none, and torch rejects it
    number = isinstance(value, (int, float)) or hasattr(value, "dtype")
    if isinstance(value, bool) or not (isinstance(value, Real) and number):
        raise TypeError(f"{allowed}, got {type(value).__name__}: {value!r:.60}.")
    if isinstance(value, Integral) and not _INT64_RANGE[0] <= value <= _INT64_RANGE[1]:
        raise ValueError(
            f"{allowed}; the int {value} does not fit into int64: pass it as a float."
        )
