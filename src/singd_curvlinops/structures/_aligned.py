r"""Dense products written into rows that start on cache-line boundaries.

A linear layer's input-side factor has the dimension \(d_{\text{in}} + 1\) (the
bias column), e.g. 513, 785 or 1025: a contiguous \(d \times d\) float32 result
then starts each row 4 bytes past a 64-byte cache line. The CPU BLAS that
PyTorch ships (MKL) writes such a result slower than the same result whose rows
are padded to a multiple of 64 bytes; the operands' layout does not matter.
Measured on one thread of an AMD EPYC machine, \(K^\top K\) and \(K M\) together,
padded against contiguous (median of eight interleaved rounds): 0.96 for
\(d\) from 257 to 449, 0.95 at 513 and 577, 0.91 at 641, 0.75–0.78 from 769 to
1281 (785: 29.4 against 22.5 ms). Below 512 the gain is a few hundredths of a
millisecond, which the strided elementwise work on the result (scaling it,
reading its extremes) can cost again, so narrower results stay contiguous. The
padded product is bit-identical in float32 (checked for \(d \in \{97, 300, 513,
785, 1025\}\), one and two threads); in float64 it is neither faster nor
bit-identical, so only float32 products on the CPU take this route.
"""

from __future__ import annotations

import torch
from torch import Tensor

CACHE_LINE_BYTES = 64
SMALLEST_PADDED_WIDTH = 512  # (narrower: the strided elementwise work eats the gain)


def matmul_into_aligned_rows(A: Tensor, B: Tensor) -> Tensor:
    r"""Return \(A B\); in float32 on the CPU, with rows padded to 64 bytes.

    The result is a view `[m, n]` of a `[m, n']` buffer, \(n'\) the smallest
    multiple of 16 entries not below \(n\), where that pays off (float32, CPU,
    \(n \ge 512\) not already a multiple of 16, no autograd); otherwise the
    plain, contiguous `A @ B`. Its entries are the same either way. Meant for
    temporaries: a padded result kept in an optimizer's state would make
    `state_dict()` save its padding.

    Args:
        A: Left operand `[m, k]`.
        B: Right operand `[k, n]`.

    Returns:
        The product `[m, n]`.
    """
    width = B.shape[-1]
    per_line = CACHE_LINE_BYTES // A.element_size()
    if (
        A.dim() != 2
        or B.dim() != 2
        or A.dtype != torch.float32
        or B.dtype != torch.float32
        or A.device.type != "cpu"
        or B.device.type != "cpu"
        or width < SMALLEST_PADDED_WIDTH
        or width % per_line == 0
        or (torch.is_grad_enabled() and (A.requires_grad or B.requires_grad))
    ):
        return A @ B
    padded = -(-width // per_line) * per_line
    out = A.new_empty(A.shape[0], padded)[:, :width]
    return torch.mm(A, B, out=out)
