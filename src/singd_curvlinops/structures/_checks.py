"""Argument checks shared by the structured matrices."""

from __future__ import annotations

import torch
from torch import Tensor


def check_dim(dim: int) -> int:
    """Check that `dim` is a positive integer.

    Args:
        dim: Candidate matrix dimension.

    Returns:
        `dim`.

    Raises:
        TypeError: If `dim` is not an integer.
        ValueError: If `dim < 1`.
    """
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}.")
    if dim < 1:
        raise ValueError(f"dim must be >= 1, got {dim}.")
    return dim


def check_square(mat: Tensor, name: str) -> Tensor:
    """Check that `mat` is a non-empty square floating-point matrix.

    Args:
        mat: Candidate matrix.
        name: Argument name used in the error message.

    Returns:
        `mat`.

    Raises:
        TypeError: If `mat` is not a floating-point tensor.
        ValueError: If `mat` is not of shape `[d, d]` with `d >= 1`.
    """
    if not isinstance(mat, Tensor) or not mat.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {mat!r:.80}.")
    if mat.ndim != 2 or mat.shape[0] != mat.shape[1] or mat.shape[0] == 0:
        raise ValueError(f"{name} must be a square matrix [d, d], got {mat.shape}.")
    return mat


def check_operand(
    mat: Tensor,
    dim: int | None,
    dtype: torch.dtype | None,
    name: str,
    matrix_only: bool = False,
) -> Tensor:
    """Check a dense operand of a structured matrix.

    Args:
        mat: Candidate tensor.
        dim: Required number of rows; `None` accepts any.
        dtype: Required data type; `None` accepts any floating-point type.
        name: Argument name used in the error message.
        matrix_only: Reject vectors (`[d]`) and accept only matrices (`[d, n]`).

    Returns:
        `mat`.

    Raises:
        TypeError: If `mat` is not a floating-point tensor.
        ValueError: If shape or data type do not match.
    """
    if not isinstance(mat, Tensor) or not mat.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {mat!r:.80}.")
    allowed_ndims = (2,) if matrix_only else (1, 2)
    if mat.ndim not in allowed_ndims or (dim is not None and mat.shape[0] != dim):
        expected = "[d, n]" if matrix_only else "[d] or [d, n]"
        raise ValueError(
            f"{name} must have shape {expected} with d = {dim}, got {tuple(mat.shape)}."
        )
    if dtype is not None and mat.dtype != dtype:
        raise ValueError(
            f"{name} must have the matrix's dtype {dtype}, got {mat.dtype}. "
            "Cast one of them first."
        )
    return mat
