r"""The step limits of a dense \(K\) split by column blocks, from every rank's block.

One process limits and checks a factor step (`update.factor_step`) with numbers
of the whole new momentum \(M = m_K\) and step \(K M\): their largest entries,
and \(\|M\|_2\) as `bounds.spectral_norm` estimates it by power iteration. Under
column blocks (`columns`) rank \(r\) holds \(M_r = M_{:,J_r}\) and, for the
update, the whole old \(K\), so it forms its block \(S_r = K M_r\) of the step.
Those numbers are maxima and sums over the blocks:

\[
\max|M| = \max_r \max|M_r|, \qquad \max|K M| = \max_r \max|S_r|, \qquad
M v = \sum_r M_r v_{J_r}, \qquad (M^\top u)_{J_r} = M_r^\top u, \qquad
\|M^\top u\|^2 = \sum_r \|M_r^\top u\|^2 .
\]

Each of the `POWER_ITERATIONS` iterations is one `all_gather` of the partial
products \(M_r v_{J_r}\) (\(d_K\) numbers per layer; the first also carries the
two peaks), and one more carries the squared norms: four small collectives per
update step, for all split layers together. Every rank adds the gathered terms in
rank order, so the ranks hold the same bits and take the same verdict and step.
Between the iterations \(v\) is divided by \(\max|M|\) instead of its norm (which
would cost a gather more): \(u = M v / \|M v\|\) does not depend on the length of
\(v\), and \(\|v\| \le \|M\|_2 / \max|M| \le d_K\) keeps \(M v\) far from
overflowing. The estimate is the one process's up to the order of additions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from singd_curvlinops.bounds import POWER_ITERATIONS, peaks, start_vector
from singd_curvlinops.distributed.collectives import (
    all_gather_parts,
    named_collective,
    world_size,
)


@dataclass(frozen=True)
class StepLimits:
    r"""The numbers of a split layer's whole factor step (the same on every rank).

    Attributes:
        peak_momentum: \(\max|m_K|\).
        peak_step: \(\max|K m_K|\).
        norm: The estimate of \(\|m_K\|_2\).
    """

    peak_momentum: Tensor
    peak_step: Tensor
    norm: Tensor


def step_limits(
    momenta: Sequence[Tensor],
    steps: Sequence[Tensor],
    columns: Sequence[slice],
    dtype: torch.dtype,
) -> list[StepLimits]:
    r"""Return each split layer's `StepLimits` (a collective: every rank, same layers).

    Args:
        momenta: Per layer, this rank's block \(M_r\) of the new \(m_K\),
            `[d_K, |J_r|]`.
        steps: Per layer, this rank's block \(S_r = K M_r\) of the step.
        columns: Per layer, this rank's columns \(J_r\).
        dtype: The gathers' dtype (holds every number exactly).

    Returns:
        Per layer, the limits of its whole step.
    """
    count, dims = len(momenta), [M.shape[0] for M in momenta]
    local = peaks([[tensor] for tensor in (*momenta, *steps)])
    starts = [
        start_vector(dim, M.dtype, M.device)[cols]
        for dim, M, cols in zip(dims, momenta, columns, strict=True)
    ]
    first = _gather([torch.stack(local), *_products(momenta, starts)], 1, dtype)
    maxima = torch.stack([g[: 2 * count] for g in first]).amax(0).to(local[0].dtype)
    sums = _split_sums([g[2 * count :] for g in first], dims)
    for iteration in range(2, POWER_ITERATIONS + 1):
        vectors = _transposed_products(momenta, sums, maxima[:count])
        sums = _split_sums(_gather(_products(momenta, vectors), iteration, dtype), dims)
    vectors = _transposed_products(momenta, sums)
    squares = [torch.linalg.vector_norm(v).square().reshape(1) for v in vectors]
    norms = torch.stack(_gather(squares, 0, dtype)).sum(0).sqrt().to(maxima.dtype)
    return [
        StepLimits(peak_momentum=maxima[i], peak_step=maxima[count + i], norm=norms[i])
        for i in range(count)
    ]


def _products(momenta: Sequence[Tensor], vectors: Sequence[Tensor]) -> list[Tensor]:
    r"""Return this rank's partial products \(M_r v_{J_r}\).

    Args:
        momenta: Per layer, \(M_r\).
        vectors: Per layer, \(v_{J_r}\), `[|J_r|, 1]`.

    Returns:
        Per layer, `[d_K, 1]`.
    """
    return [M @ v for M, v in zip(momenta, vectors, strict=True)]


def _transposed_products(
    momenta: Sequence[Tensor],
    sums: Sequence[Tensor],
    peaks: Tensor | None = None,
) -> list[Tensor]:
    r"""Return \(v_{J_r} = M_r^\top u\) with \(u = M v / \|M v\|\), over \(\max|M|\).

    Args:
        momenta: Per layer, \(M_r\).
        sums: Per layer, \(M v\) (every rank's terms added).
        peaks: Per layer, \(\max|M|\) to divide by (None: the last
            iteration, whose \(\|M^\top u\|\) is the estimate).

    Returns:
        Per layer, `[|J_r|, 1]`.
    """
    vectors = []
    for index, (M, total) in enumerate(zip(momenta, sums, strict=True)):
        tiny = torch.finfo(M.dtype).tiny
        u = total.to(M.dtype)
        v = M.T @ (u / torch.linalg.vector_norm(u).clamp(min=tiny))
        if peaks is not None:
            v = v / peaks[index].to(M.dtype).clamp(min=tiny)
        vectors.append(v)
    return vectors


def _gather(parts: list[Tensor], iteration: int, dtype: torch.dtype) -> list[Tensor]:
    """Gather the parts of every rank (each rank sends as many numbers).

    Args:
        parts: This rank's tensors.
        iteration: The power iteration (0: the norms after the last).
        dtype: The buffer's dtype.

    Returns:
        Per rank, its numbers (flat).
    """
    size = sum(part.numel() for part in parts)
    device = parts[0].device
    what = f"iteration {iteration}" if iteration else "norms"
    with named_collective(f"The all_gather of the power iteration's {what}"):
        return all_gather_parts(parts, [size] * world_size(), dtype, device)


def _split_sums(gathered: list[Tensor], dims: list[int]) -> list[Tensor]:
    """Return, per layer, the sum of every rank's partial product in rank order.

    Args:
        gathered: Per rank, its partial products one after the other.
        dims: Per layer, the length of its product.

    Returns:
        Per layer, the summed product (a new tensor).
    """
    sums, offset = [], 0
    for dim in dims:
        total = gathered[0][offset : offset + dim].clone()
        for received in gathered[1:]:
            total.add_(received[offset : offset + dim])
        sums.append(total.unsqueeze(1))
        offset += dim
    return sums
