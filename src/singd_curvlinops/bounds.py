r"""Bounds that keep SINGD's steps finite and faithful, computed on the device.

- `peaks`: the largest absolute entry of groups of tensors, reduced for all of
  them at once (`abs_peaks`: one `torch._foreach_norm` on CUDA, each tensor's
  extremes elsewhere).
- `finite`, `finite_each`: whether tensors hold only finite numbers, as 0-d
  boolean tensors, from the same peaks (`below_overflow`).
- `lands`: whether \(b - \eta c\) stays finite, from the peaks of \(b\) and \(c\).
- `trust_region`: the scale of a factor step, with `spectral_norm`, an estimate
  of \(\|m_K\|_2\) (the math is in `trust_region`'s docstring).

None of them reads a number on the host: the optimizer's guard
(`singd_curvlinops.guard`) reads all verdicts of a step at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache

import torch
from torch import Tensor

from singd_curvlinops.structures import DiagonalMatrix, StructuredMatrix

# `trust_region`: a factor step keeps β₁ ‖m_K‖₂ within ρ; ‖m_K‖₂ is estimated
# by this many power iterations
MAX_FACTOR_STEP = 1.5
POWER_ITERATIONS = 3


def peaks(groups: Sequence[Sequence[Tensor]]) -> list[Tensor]:
    """Return the largest absolute entry of each group of tensors.

    Args:
        groups: Groups of floating-point tensors on one device (empty tensors
            count as 0).

    Returns:
        One 0-d tensor per group, in at least float32 (NaN if the group holds a
        NaN, infinity if it holds one), from `abs_peaks` of all tensors at
        once.
    """
    tensors = [t for group in groups for t in group if t.numel()]
    wide = _wide(t for group in groups for t in group)
    if not tensors:  # (no device to put the zeros on: only empty tensors)
        return [torch.zeros((), dtype=wide) for _ in groups]
    device = tensors[0].device
    return _per_group(
        [sum(1 for t in group if t.numel()) for group in groups],
        abs_peaks(tensors, device, wide),
        Tensor.amax,  # several tensors: a layer's weight and bias, say
        lambda: torch.zeros((), dtype=wide, device=device),
    )


def _per_group(
    counts: Sequence[int],
    values: Tensor,
    reduce: Callable[[Tensor], Tensor],
    empty: Callable[[], Tensor],
) -> list[Tensor]:
    """Split values stacked for the tensors of consecutive groups, one per group.

    Args:
        counts: The number of values of each group, in order.
        values: All values, `[sum(counts)]`.
        reduce: Reduces a group's several values to one 0-d tensor.
        empty: Makes the result of a group without values (only when one is
            empty: it costs an operation).

    Returns:
        One 0-d tensor per group: its value, the reduction of its values, or
        `empty`.
    """
    each = values.unbind() if 1 in counts else ()  # (views, made once)
    result, start = [], 0
    for count in counts:
        if count == 1:
            result.append(each[start])
        else:
            result.append(reduce(values[start : start + count]) if count else empty())
        start += count
    return result


def _wide(tensors: Iterable[Tensor]) -> torch.dtype:
    """Return float64 if a tensor is float64, else float32.

    The floating-point dtype that holds the peaks of all `tensors`, without
    dispatching `torch.promote_types` per tensor.

    Args:
        tensors: Floating-point tensors.

    Returns:
        The dtype.
    """
    return (
        torch.float64
        if any(t.dtype == torch.float64 for t in tensors)
        else torch.float32
    )


def abs_peaks(
    tensors: Sequence[Tensor], device: torch.device, dtype: torch.dtype
) -> Tensor:
    r"""Return \(\max_i |t_i|\) of each non-empty tensor `t`, stacked.

    The peaks propagate NaN, carry infinities and are exact in each tensor's
    dtype. How they are reduced depends on the device (`fused_peaks`):

    - on CUDA, one `torch._foreach_norm` of order \(\infty\) for all tensors
      (a multi-tensor kernel where they share a dtype; its maximum propagates
      NaN), and one stack;
    - elsewhere, the largest and the smallest entry of each tensor
      (`_extremes`: one pass, no temporary, also for strided views), stacked
      once. The CPU's kernel for the \(\infty\)-norm takes 18 times as long as
      `aminmax` on a `[768, 3072]` float32 matrix (measured on 2026-12-04; with
      it the optimizer's step took twice as long).

    Args:
        tensors: Non-empty floating-point tensors.
        device: The device of the result.
        dtype: The dtype of the result; it must hold every peak (a float64 peak
            beyond float32's range would become infinite in float32).

    Returns:
        A tensor `[len(tensors)]`.
    """
    fused = fused_peaks(tensors)
    if fused:
        values = list(torch._foreach_norm(list(tensors), math.inf))
    else:
        values = [value for tensor in tensors for value in _extremes(tensor)]
    kind = values[0].dtype
    if any(v.dtype != kind or v.device != device for v in values):
        values = [value.to(device, dtype) for value in values]
    # (one cast after the stack where all values share a dtype: the stack is ours)
    stacked = torch.stack(values).to(dtype)
    return stacked if fused else stacked.abs_().view(-1, 2).amax(1)


def fused_peaks(tensors: Sequence[Tensor]) -> bool:
    """Return whether `abs_peaks` reduces `tensors` with one `torch._foreach_norm`.

    Args:
        tensors: The tensors.

    Returns:
        True if all of them are CUDA tensors.
    """
    return all(tensor.is_cuda for tensor in tensors)


def _extremes(tensor: Tensor) -> tuple[Tensor, Tensor]:
    """Return the largest and the smallest entry of a non-empty tensor.

    Args:
        tensor: The tensor.

    Returns:
        Two 0-d tensors, from one pass for a contiguous tensor (`aminmax`), from
        two for a strided view (which `aminmax` would copy first).
    """
    if tensor.is_contiguous():
        return tuple(torch.aminmax(tensor))
    return tensor.amax(), tensor.amin()


def finite(tensors: Iterable[Tensor], device: torch.device) -> Tensor:
    """Return a 0-d boolean tensor: do all `tensors` hold only finite values?

    Args:
        tensors: Tensors to check (empty ones and integer ones, such as a step
            counter, pass).
        device: The device of the result.

    Returns:
        True for no tensor; no host synchronisation.
    """
    return finite_each([list(tensors)], device)[0]


def finite_each(
    groups: Sequence[Sequence[Tensor]], device: torch.device
) -> list[Tensor]:
    """Return per group of tensors a 0-d boolean: does it hold only finite values?

    Args:
        groups: Groups of tensors to check (empty ones and integer ones, such as
            a step counter, pass).
        device: The device of the results.

    Returns:
        One verdict per group (True for a group without a tensor to check), from
        `abs_peaks` of all tensors at once; no host synchronisation.
    """
    checked = [
        [t for t in group if t.numel() and t.is_floating_point()] for group in groups
    ]
    tensors = [t for group in checked for t in group]

    def passed() -> Tensor:
        return torch.ones((), dtype=torch.bool, device=device)

    if not tensors:
        return [passed()] * len(groups)
    # the peaks carry NaN and ±inf, stacked in a dtype that holds each of them
    # (float64 ones would overflow float32)
    flags = below_overflow(abs_peaks(tensors, device, _wide(tensors)))
    return _per_group([len(group) for group in checked], flags, Tensor.all, passed)


def below_overflow(peak: Tensor) -> Tensor:
    """Return whether peaks (absolute values, or NaN) are finite, in one operation.

    `torch.isfinite` takes four: a NaN fails the comparison, and so does
    infinity.

    Args:
        peak: Non-negative values or NaN (from `peaks` or `abs_peaks`).

    Returns:
        A boolean tensor of `peak`'s shape.
    """
    return peak <= torch.finfo(peak.dtype).max


def lands(
    peak_base: Tensor, peak_change: Tensor, eta: float | Tensor, dtype: torch.dtype
) -> Tensor:
    r"""Return whether \(b - \eta c\) stays finite for every entry, from the peaks.

    True if \(\max|b| + |\eta| \max|c| \le\) half the largest number of `dtype`:
    then no entry of \(b - \eta c\), rounding included, overflows. False for any
    infinity or NaN in \(b\), \(c\) or \(\eta\); a result at the very top of the
    range counts as overflowing (it is a blow-up anyway).

    Args:
        peak_base: \(\max|b|\) (from `peaks`).
        peak_change: \(\max|c|\).
        eta: \(\eta\).
        dtype: The dtype of \(b - \eta c\).

    Returns:
        A 0-d boolean tensor.
    """
    limit = torch.finfo(dtype).max / 2
    if isinstance(eta, Tensor):
        return peak_base + eta.abs() * peak_change <= limit
    return torch.add(peak_base, peak_change, alpha=abs(eta)) <= limit


def trust_region(lr: float | Tensor, norm: Tensor) -> Tensor:
    r"""Return a factor step's scale \(\min(1, \rho / (\beta_1 \|m_K\|_2))\).

    The update \(K \gets K (I - \beta_1 m_K)\) is the first-order truncation of
    the Riemannian step \(K \gets K \exp(-\beta_1 m_K)\) on the factor's matrix
    group (Lin et al., ICML 2024, Sec. 3). Along an eigenvector of \(m_K\) with
    eigenvalue \(\mu > 0\) (where \(K\) is too large) the exponential shrinks
    \(K\) by \(e^{-\beta_1 \mu} \in (0, 1)\) however long the step; the
    truncation multiplies it by \(1 - \beta_1 \mu\), which also shrinks it (up
    to a sign that \(K K^\top\) does not see) while \(\beta_1 \mu < 2\), but
    *enlarges* it for \(\beta_1 \mu > 2\): \(K^\top U K\), and with it \(\mu\),
    then grows quadratically by the next update, a blow-up within a few updates
    (large `lr_cov`, tiny `damping`). So the step \(\beta_1 K m_K\) is scaled,
    keeping its direction, until \(\beta_1 \|m_K\|_2 \le \rho\) with \(\rho\) =
    `MAX_FACTOR_STEP` = 3/2: inside the range \((0, 2)\) where the truncated
    step contracts like the exponential, and away from its two degenerate
    points (\(\beta_1 \mu = 1\) collapses the direction for good, since
    \(K^\top U K\) is then 0 there and \(m_K\) cannot grow it back;
    \(\beta_1 \mu = 2\) never moves it). The direction with the largest \(\mu\)
    then shrinks by half (sign flipped), the others by less, and a growing
    direction (\(\mu < 0\)) grows at most 5/2-fold. Ordinary steps (\(\beta_1
    \|m_K\|_2\) below about 1, also in the reference trajectories with
    `lr_cov` up to 1/2) are multiplied by exactly 1: unchanged.

    Args:
        lr: \(\beta_1\) (a number, or a 0-d tensor with `normalize_lr_cov`).
        norm: \(\|m_K\|_2\) or an estimate of it (`spectral_norm`).

    Returns:
        A 0-d tensor in \([0, 1]\) (NaN if `norm` or `lr` is NaN).
    """
    return (MAX_FACTOR_STEP / norm / lr).clamp(max=1.0)


def spectral_norm(M: StructuredMatrix, peak: Tensor) -> Tensor:
    r"""Return \(\|M\|_2\), exactly for a diagonal \(M\), else estimated from below.

    The estimate alternates \(u \gets M v / \|M v\|\), \(v \gets M^\top u /
    \|M^\top u\|\) (`POWER_ITERATIONS` times, two structured products each, from
    the fixed vector \(\cos(2.4 i)\) that no structure is orthogonal to) and
    returns the last \(\|M^\top u\| \le \|M\|_2\). It converges fast exactly
    when one direction dominates, which is the blow-up that `trust_region`
    prevents; below the norm, it lets ordinary steps through unchanged.

    Args:
        M: The matrix.
        peak: \(\max_{ij} |M_{ij}|\) (from `peaks`), the norm of a diagonal.

    Returns:
        A 0-d tensor (0 for \(M = 0\); NaN if \(M\) holds one).
    """
    if isinstance(M, DiagonalMatrix):
        return peak
    tiny = torch.finfo(M.dtype).tiny
    v = start_vector(M.dim, M.dtype, M.device)
    for _ in range(POWER_ITERATIONS):
        u = M @ v
        u = u / torch.linalg.vector_norm(u).clamp(min=tiny)
        v = M.rmatmat(u)
        norm = torch.linalg.vector_norm(v)
        v = v / norm.clamp(min=tiny)
    return norm.to(peak.dtype)


@lru_cache(maxsize=64)
def start_vector(dim: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    r"""Return the power iteration's start vector \(\cos(2.4 i)\), `[dim, 1]`.

    Args:
        dim: Its length.
        dtype: Its dtype.
        device: Its device.

    Returns:
        A tensor (cached: never modified).
    """
    index = torch.arange(dim, device=device, dtype=torch.float32)
    return torch.cos(index * 2.4).to(dtype).unsqueeze(1)
