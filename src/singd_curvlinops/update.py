r"""The pure math of SINGD: factor updates and the preconditioned gradient.

Lin et al., *Structured inverse-free natural gradient descent* (ICML 2024),
Fig. 1 / Alg. 1. Per layer, with \(H_K = \Pi(K^\top U_K K)\),
\(H_C = \Pi(C^\top U_C C)\), damping \(\lambda\), Riemannian momentum \(\alpha_1\) and
factor learning rate \(\beta_1\):

\[
\hat m_K = \bar{\mathrm{tr}}(H_C) H_K + \lambda\, \bar{\mathrm{tr}}(\Pi(C^\top C))
\,\Pi(K^\top K) - I, \qquad
m_K \gets \alpha_1 m_K + s\, \hat m_K, \qquad K \gets K - \beta_1 K m_K,
\]

and symmetrically for \(C\); IKFAC (`kfac_like=True`) drops the traces. The scale is
\(s = \tfrac12 (1 - \alpha_1)\) with `normalize_lr_cov`, where also
\(\beta_1 \gets \beta_1 / \max(1, \|m\|_{\max})\), else \(s = \tfrac12\).

Every step, with learning rate \(\beta_2\), momentum \(\alpha_2\) and weight decay
\(\gamma\), `parameter_step` applies the preconditioned gradient \(\Delta\) to each
parameter \(\theta\) as SGD does:

\[
\mu \gets \alpha_2 \mu + \Delta + \gamma \theta, \qquad
\theta \gets \theta - \beta_2 \mu.
\]

These functions do not know about modules, hooks or parameter groups; like
`torch.optim`'s functional optimizers they take tensors and keyword-only
hyperparameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from singd_curvlinops.bounds import (
    below_overflow,
    lands,
    peaks,
    spectral_norm,
    trust_region,
)
from singd_curvlinops.structures import StructuredMatrix


@dataclass(frozen=True)
class FactorHyperparameters:
    r"""Hyperparameters of one factor update (one layer, one step).

    Attributes:
        damping: \(\lambda \ge 0\).
        alpha1: Riemannian momentum \(\alpha_1 \in [0, 1)\).
        lr_cov: Factor learning rate \(\beta_1\) at this step.
        kfac_like: IKFAC update (no trace coupling) instead of SINGD's.
        normalize_lr_cov: Normalise \(\beta_1\) by the largest momentum entry.
    """

    damping: float
    alpha1: float
    lr_cov: float
    kfac_like: bool
    normalize_lr_cov: bool


def momentum_increment(
    H: StructuredMatrix,
    KtK: StructuredMatrix,
    *,
    trace_H_other: Tensor,
    trace_KtK_other: Tensor,
    hyper: FactorHyperparameters,
) -> StructuredMatrix:
    r"""Return \(s \hat m_K = s(\bar{\mathrm{tr}}(H_C) H_K + \lambda \bar{\mathrm{tr}}(C^\top C) K^\top K - I)\).

    Args:
        H: \(H_K = \Pi(K^\top U_K K)\) (consumed: updated in place).
        KtK: \(\Pi(K^\top K)\) (consumed).
        trace_H_other: \(\bar{\mathrm{tr}}(H_C)\) of the other factor (0-d tensor).
        trace_KtK_other: \(\bar{\mathrm{tr}}(\Pi(C^\top C))\) of the other factor.
        hyper: The hyperparameters.

    Returns:
        The scaled increment, in the structure of `H`.
    """  # noqa: E501
    if hyper.kfac_like:
        increment = H.add_(KtK, alpha=hyper.damping)
    else:
        increment = H.mul_(trace_H_other).add_(
            KtK.mul_(trace_KtK_other * hyper.damping)
        )
    scale = 0.5 * (1.0 - hyper.alpha1) if hyper.normalize_lr_cov else 0.5
    return increment.diag_add_(-1.0).mul_(scale)


def factor_step(
    K: StructuredMatrix,
    m_K: StructuredMatrix,
    increment: StructuredMatrix,
    hyper: FactorHyperparameters,
    accept: Tensor | None = None,
) -> tuple[StructuredMatrix, Tensor]:
    r"""Update the factor in place, \(K \gets K - \beta_1 K m_K\); return the momentum.

    The step is limited by `bounds.trust_region` and kept only if it is sound:
    the new momentum is finite and \(\max|K| + \max|\beta_1 K m_K|\) is at most
    half the dtype's largest number (`bounds.lands`: the new \(K\) is finite).
    Otherwise \(K\) gets an exact zero step and the momentum its previous value:
    the update is discarded on the device, without a host read or a copy.

    Args:
        K: The factor (updated in place).
        m_K: Its momentum before the step (not modified).
        increment: \(s \hat m_K\) from `momentum_increment` (consumed).
        hyper: The hyperparameters.
        accept: A 0-d boolean that must also hold (the step's inputs were
            finite); None: true.

    Returns:
        The momentum to keep (`increment`, updated: \(\alpha_1 m_K + s \hat m_K\),
        or the previous \(m_K\)), and whether the update was kept (0-d boolean).
    """
    m_new = increment.add_(m_K, alpha=hyper.alpha1) if hyper.alpha1 else increment
    lr: float | Tensor = hyper.lr_cov
    if hyper.normalize_lr_cov:
        lr = hyper.lr_cov / m_new.infinity_vector_norm().clamp(min=1.0)
    step = K @ m_new
    peak_K, peak_step, peak_m = peaks([K.tensors(), step.tensors(), m_new.tensors()])
    ok = limited_factor_step(
        K.tensors(),
        m_K.tensors(),
        m_new.tensors(),
        step.tensors(),
        lr=lr,
        peaks=(peak_K, peak_step, peak_m),
        norm=spectral_norm(m_new, peak_m),
        accept=accept,
    )
    return m_new, ok


def limited_factor_step(
    factor: Sequence[Tensor],
    momentum: Sequence[Tensor],
    new_momentum: Sequence[Tensor],
    step: Sequence[Tensor],
    *,
    lr: float | Tensor,
    peaks: tuple[Tensor, Tensor, Tensor],
    norm: Tensor,
    accept: Tensor | None,
) -> Tensor:
    r"""Take \(K \gets K - \beta_1 s\, K m_K\) if sound: `factor_step`'s second half.

    Works on stored tensors: a factor's, or the column blocks of a dense \(K\)
    that `distributed.columns` splits over the ranks, whose numbers for the whole
    factor come from every rank's block (`distributed.column_bounds`). The step
    \(K m_K\) is scaled by the trust region's \(s\) (`bounds.trust_region`) and
    kept if \(m_K\) is finite and \(K\) `lands` (and `accept` holds); otherwise
    \(K\) gets an exact zero step and the new momentum its previous value.

    Args:
        factor: The tensors of \(K\) (updated in place).
        momentum: Those of \(m_K\) before the step (not modified).
        new_momentum: Those of the new \(m_K\) (take the old values if discarded).
        step: Those of \(K m_K\) (consumed).
        lr: \(\beta_1\) (a 0-d tensor with `normalize_lr_cov`).
        peaks: \(\max|K|\), \(\max|K m_K|\), \(\max|m_K|\) of the whole factor.
        norm: \(\|m_K\|_2\), or its estimate (`bounds.spectral_norm`).
        accept: A 0-d boolean that must also hold; None: true.

    Returns:
        Whether the update was kept (0-d boolean).
    """
    peak_K, peak_step, peak_m = peaks
    scale = trust_region(lr, norm)
    for tensor in step:
        tensor.mul_(scale)  # exactly 1 within the region
    ok = lands(peak_K, peak_step * scale, lr, factor[0].dtype) & below_overflow(peak_m)
    ok = ok if accept is None else ok & accept
    for new, old in zip(new_momentum, momentum, strict=True):
        torch.where(ok, new, old, out=new)
    discard = ~ok
    for tensor in step:  # a discarded step adds an exact 0
        tensor.masked_fill_(discard, 0.0)
    if isinstance(lr, Tensor):  # (a NaN learning rate would spoil the 0)
        alpha = -lr.masked_fill(discard, 0.0)
        torch._foreach_add_(list(factor), torch._foreach_mul(list(step), alpha))
    else:
        alpha = -lr if math.isfinite(lr) else 0.0
        torch._foreach_add_(list(factor), list(step), alpha=alpha)
    return ok


def precondition(
    grad: Tensor,
    K: StructuredMatrix,
    C: StructuredMatrix,
    KKt: StructuredMatrix | None = None,
    CCt: StructuredMatrix | None = None,
    overwrite: bool = False,
) -> Tensor:
    r"""Return \(C C^\top \Gamma K K^\top\) without forming either product densely.

    \(\Gamma K K^\top = (K (K^\top \Gamma^\top))^\top\), then \(C (C^\top \cdot)\);
    where \(K K^\top\) (\(C C^\top\)) is given, one symmetric product replaces the
    two. Each side is computed in its factor's dtype. Intermediate results are
    overwritten in place where the structure allows (`matmat_`), and so is `grad`
    if `overwrite` is set: for diagonal factors, no buffer is allocated at all.

    Args:
        grad: Matrix gradient \(\Gamma\), `[d_out, d_in (+1)]`; last column = bias.
        K: Input-side factor of dimension `d_in (+1)`.
        C: Output-side factor of dimension `d_out`.
        KKt: Optional precomputed \(K K^\top\) (`K.outer_self()`).
        CCt: Optional precomputed \(C C^\top\).
        overwrite: Whether `grad` may be overwritten (the caller owns it).

    Returns:
        Tensor with the shape and dtype of `grad` (possibly `grad` itself).
    """
    right = precondition_input_side(grad, K, KKt, overwrite=overwrite)
    # `right` is a tensor of ours (or `grad`, if we may overwrite it)
    left = precondition_output_side(right, C, CCt, overwrite=True)
    return left.to(grad.dtype)


def precondition_input_side(
    grad: Tensor,
    K: StructuredMatrix,
    KKt: StructuredMatrix | None = None,
    *,
    overwrite: bool = False,
) -> Tensor:
    r"""Return \(\Gamma K K^\top = (K (K^\top \Gamma^\top))^\top\), in `K`'s dtype.

    The input-side half of `precondition`; any number of rows of \(\Gamma\) works
    (FSDP2's row shards precondition their rows alone).

    Args:
        grad: \(\Gamma\) or some of its rows, `[rows, d_K]`.
        K: Input-side factor.
        KKt: Optional precomputed \(K K^\top\) (for KFAC: the side itself).
        overwrite: Whether `grad` may be overwritten.

    Returns:
        `[rows, d_K]`, a tensor of ours or `grad` itself (if `overwrite`).
    """
    right = grad.T.to(K.dtype)
    owned = overwrite or K.dtype != grad.dtype  # (a cast is a copy of ours)
    if KKt is None:
        right = K @ K.rmatmat(right)
    else:
        right = KKt.matmat_(right) if owned else KKt @ right
    return right.T


def precondition_output_side(
    mat: Tensor,
    C: StructuredMatrix,
    CCt: StructuredMatrix | None = None,
    *,
    overwrite: bool = False,
) -> Tensor:
    r"""Return \(C C^\top M = C (C^\top M)\), in `C`'s dtype.

    The output-side half of `precondition`; any number of columns works
    (FSDP2's column shards precondition their columns alone).

    Args:
        mat: \(M\), `[d_C, columns]`.
        C: Output-side factor.
        CCt: Optional precomputed \(C C^\top\) (for KFAC: the side itself).
        overwrite: Whether `mat` may be overwritten.

    Returns:
        `[d_C, columns]`, a tensor of ours or `mat` itself (if `overwrite`).
    """
    left = mat.to(C.dtype)
    if CCt is None:
        return C @ C.rmatmat(left)
    owned = overwrite or C.dtype != mat.dtype
    return CCt.matmat_(left) if owned else CCt @ left


def parameter_step(
    params: Sequence[Tensor],
    directions: Sequence[Tensor],
    momentum_buffers: Sequence[Tensor],
    *,
    lr: float,
    momentum: float,
    weight_decay: float,
) -> None:
    r"""Apply weight decay, momentum and the learning rate, in place.

    \(\mu \gets \alpha_2 \mu + \Delta + \gamma \theta\),
    \(\theta \gets \theta - \beta_2 \mu\) for every parameter \(\theta\) with its
    direction \(\Delta\) and momentum buffer \(\mu\) (unused if \(\alpha_2 = 0\)).

    Args:
        params: The parameters \(\theta\) (updated in place).
        directions: Their preconditioned gradients \(\Delta\) (overwritten).
        momentum_buffers: Their buffers \(\mu\) (updated in place).
        lr: Learning rate \(\beta_2\).
        momentum: Momentum \(\alpha_2\).
        weight_decay: Weight decay \(\gamma\).
    """
    for param, direction, buffer in zip(
        params, directions, momentum_buffers, strict=True
    ):
        if weight_decay:
            direction.add_(param, alpha=weight_decay)
        if momentum:
            # μ ← α₂μ + Δ as one pass: add(Δ, μ, alpha=α₂) written into μ
            direction = torch.add(direction, buffer, alpha=momentum, out=buffer)  # noqa: PLW2901
        param.add_(direction, alpha=-lr)


def checked_parameter_steps(
    params: Sequence[Tensor],
    directions: Sequence[Tensor],
    buffers: Sequence[Tensor],
    *,
    lrs: Sequence[float],
    momenta: Sequence[float],
    weight_decays: Sequence[float],
    whole: Tensor | None = None,
) -> tuple[Tensor, Callable[[Tensor], None]]:
    r"""Prepare `parameter_step` for some parameters; apply it only if it is sound.

    The same operations as `parameter_step`, bit for bit, but each new buffer
    \(\mu' = \alpha_2 \mu + \Delta + \gamma \theta\) is written into its
    direction first, and nothing into the parameters and buffers until the
    returned function is called with the verdict (on the device; a False verdict
    adds an exact 0 to every parameter and keeps the buffers). The steps are
    sound if every \(\mu'\) and \(\theta - \beta_2 \mu'\) is finite
    (`bounds.lands`, with the largest \(\beta_2\)).

    Args:
        params: The parameters \(\theta\), of one dtype and device.
        directions: Their directions \(\Delta\) (overwritten).
        buffers: Their momentum buffers \(\mu\) (unused where \(\alpha_2 = 0\)).
        lrs: Learning rates \(\beta_2\), one per parameter.
        momenta: Momenta \(\alpha_2\).
        weight_decays: Weight decays \(\gamma\).
        whole: A tensor whose entries are exactly those of the directions (their
            layer's matrix, of which they are views): its largest entry is read
            in one contiguous pass instead of one strided pass per direction.

    Returns:
        Whether all steps are sound (0-d boolean), and the function that applies
        them given the (possibly stricter) verdict.
    """
    for param, direction, buffer, momentum, weight_decay in zip(
        params, directions, buffers, momenta, weight_decays, strict=True
    ):
        if weight_decay:
            direction.add_(param, alpha=weight_decay)
        if momentum:  # (in place: `direction` may be a strided view)
            direction.add_(buffer, alpha=momentum)
    finite_lrs = all(math.isfinite(lr) for lr in lrs)
    changes = directions if whole is None else [whole]
    peak_param, peak_direction = peaks([params, changes])
    largest = max(abs(lr) for lr in lrs) if finite_lrs else 0.0
    sound = lands(peak_param, peak_direction, largest, params[0].dtype)
    if not finite_lrs:  # a non-finite learning rate never lands
        sound = torch.zeros_like(sound)

    def apply(ok: Tensor) -> None:
        discard = ~ok.to(params[0].device)
        for param, direction, buffer, lr, momentum in zip(
            params, directions, buffers, lrs, momenta, strict=True
        ):
            if momentum:
                torch.where(discard, buffer, direction, out=buffer)
            direction.masked_fill_(discard, 0.0)
            param.add_(direction, alpha=-lr if finite_lrs else 0.0)

    return sound, apply
