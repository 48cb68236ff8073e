"""Dense solves for the dense blocks of structured matrices."""

from __future__ import annotations

import torch
from torch import Tensor


def solve_dense(A: Tensor, V: Tensor, transpose: bool = False) -> Tensor:
    r"""Return \(A^{-1} V\) (or \(A^{-\top} V\)) by an LU solve, without an inverse.

    The solve runs in at least float32, because PyTorch has no half-precision LU
    kernels; the result is cast back to `V`'s dtype.

    Args:
        A: Square matrix `[k, k]`, or a batch of them `[N, k, k]`.
        V: Right-hand sides `[k, n]`, or `[N, k, n]` for a batch.
        transpose: Solve with \(A^\top\) instead of \(A\).

    Returns:
        Tensor with the shape and dtype of `V`.
    """
    dtype = torch.promote_types(V.dtype, torch.float32)
    A = A.to(dtype)
    return torch.linalg.solve(A.mT if transpose else A, V.to(dtype)).to(V.dtype)
