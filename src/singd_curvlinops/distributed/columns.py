r"""A dense \(K\) split by column blocks over all ranks (`Shard(factors="owned")`).

Rank \(r\) keeps the columns \(J_r\) (`assignment.column_blocks`) of a split
layer's \(K\) and \(m_K\), \(K_r = K_{:,J_r}\); every rank keeps and updates the
whole \(C\), \(m_C\) (the split layers are those whose \(K\) dominates the factor
state). SINGD's update works column by column:

\[
(K^\top U_K K)_{:,J_r} = K^\top (U_K K_r), \qquad
(K^\top K)_{:,J_r} = K^\top K_r, \qquad
(K m_K)_{:,J_r} = K\, (m_K)_{:,J_r},
\]

so rank \(r\) forms its block of \(\hat m_K\), of \(m_K\) and of the new \(K\)
from its own blocks and the whole old \(K\), which one `all_gather` of the blocks
brings to every rank for the update (transient, not kept). The traces that
couple the sides are sums over the blocks: \(\bar{\mathrm{tr}}(H_K) = \sum_r
\sum_{j \in J_r} (K_r^\top U_K K_r)_{jj} / d_K\) and \(\bar{\mathrm{tr}}(K^\top K) =
\sum_r \|K_r\|_F^2 / d_K\) travel with the blocks; \(\bar{\mathrm{tr}}(H_C)\),
\(\bar{\mathrm{tr}}(C^\top C)\) are every rank's own. With `normalize_lr_cov` the
largest entry of \(m_K\) is the largest of the blocks' (from the guard's
gathers, below). The projection's symmetrisation \((M + M^\top)/2\) is left out: it
only removes round-off.

The preconditioned gradient is a sum over the blocks,
\(\Gamma K K^\top = \sum_r (\Gamma K_r) K_r^\top\): rank \(r\) sends its term
\(Y_r\) (`partial_direction`) in the step's `all_gather`, every rank adds the
terms in rank order and applies \(C C^\top\) (`finish_direction`), so every
rank applies the same numbers.

The step guard (`singd_curvlinops.guard`) covers these layers as one process's:
every rank forms its block \(K (m_K)_{:,J_r}\) of the step, and
`column_bounds` gathers the numbers of the whole step (the peaks, and the power
iteration's estimate of \(\|m_K\|_2\) for the trust region), so that every
rank limits its block by the same factor and keeps or discards it by the same
verdict (`update.limited_factor_step`), which the guard counts and reports as
any layer's; \(C\)'s update goes through `update.factor_step`.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor

from singd_curvlinops.bounds import finite, peaks
from singd_curvlinops.distributed.assignment import column_blocks
from singd_curvlinops.distributed.collectives import (
    all_gather_parts,
    named_collective,
    rank,
    world_size,
)
from singd_curvlinops.distributed.column_bounds import StepLimits, step_limits
from singd_curvlinops.distributed.gram_rows import as_structured
from singd_curvlinops.distributed.layout import buffer_dtype
from singd_curvlinops.distributed.raw_gram import in_kept_structure
from singd_curvlinops.layers import Layer
from singd_curvlinops.rules import FactorStatistics
from singd_curvlinops.rules.factors import (
    load_factor,
    project_structured_gram,
    store_factor,
)
from singd_curvlinops.rules.singd import resolved_alpha1
from singd_curvlinops.structures import StructuredMatrix
from singd_curvlinops.update import (
    FactorHyperparameters,
    factor_step,
    limited_factor_step,
    momentum_increment,
    precondition_output_side,
)

SPLIT_PREFIXES = ("K", "m_K")  # the entries kept by column blocks


def block(dim: int, me: int, world: int) -> slice:
    """Return the columns rank `me` keeps of a `dim`-dimensional factor.

    Args:
        dim: The factor's dimension.
        me: The rank.
        world: The number of ranks.

    Returns:
        The slice of its columns.
    """
    return slice(*column_blocks(dim, world)[me])


def is_split_key(key: str) -> bool:
    r"""Return whether a state entry is kept by column blocks.

    Args:
        key: The entry's key, e.g. `"m_K.mat"`.

    Returns:
        True for \(K\)'s and \(m_K\)'s tensor.
    """
    return key.split(".", 1)[0] in SPLIT_PREFIXES


def step(stepper: Any, layers: Sequence[tuple[Layer, bool]]) -> None:
    """Update the split layers that are due (a collective: every rank, same layers).

    Args:
        stepper: The shell's `LayerStepper`.
        layers: The split layers of the step (same order on every rank), each
            with whether its factors update in this step.
    """
    pending = []
    for layer, due in layers:
        if due:
            statistics = stepper.take(layer)
            pending.append(
                (layer, None if statistics is None else _dense_K(statistics))
            )
    update(stepper, pending)
    for layer, due in layers:
        stepper.finish(layer, due=due)


def _dense_K(statistics: FactorStatistics) -> FactorStatistics:
    r"""Return a split layer's statistics as dense \(U_K\) and \(U_C\).

    A (block-)diagonal \(C\)'s raw statistics stay in its structure
    (`raw_gram.kept_structures`): that is all its projection reads.

    Args:
        statistics: Collected raw statistics, or handed-over dense ones.

    Returns:
        Handed-over `(U_K, U_C)`.
    """
    if statistics.collected is None:
        return statistics
    U_K, U_C = statistics.collected
    if not in_kept_structure(U_C):
        U_C = as_structured(U_C).to_dense()
    return FactorStatistics(handed_over=(as_structured(U_K).to_dense(), U_C))


def update(stepper: Any, due: Sequence[tuple[Layer, Any]]) -> None:
    r"""Update the split layers' factors (a collective: every rank, same layers).

    Args:
        stepper: The shell's `LayerStepper`.
        due: Per due split layer (same order on every rank), its statistics
            (dense \(U_K\), \(U_C\) or a diagonal \(C\)'s diagonal, or None).
    """
    work = [(layer, stats) for layer, stats in due if stats is not None]
    if not work:
        return
    world, layers = world_size(), [layer for layer, _ in work]
    dtype = buffer_dtype(layers, stepper.groups)
    device = layers[0].weight.device
    parts, products = [], []
    for layer, stats in work:
        K_r = stepper.state[layer.weight]["K.mat"]
        UK_r = stats.handed_over[0].to(K_r.dtype) @ K_r
        d_K = layer.dims[0]
        trace_H = ((K_r * UK_r).sum(0) / d_K).sum()
        trace_KtK = (K_r.square().sum(0) / d_K).sum()
        parts += [K_r.reshape(-1), trace_H.reshape(1), trace_KtK.reshape(1)]
        products.append(UK_r)
    sizes = [
        sum(layer.dims[0] * (stop - start) + 2 for layer, (start, stop) in blocks)
        for blocks in (_blocks(layers, r, world) for r in range(world))
    ]
    with named_collective("The all_gather of the column blocks of K"):
        buffers = all_gather_parts(parts, sizes, dtype, device)
    received = [_unpack(layers, buffers[r], r, world) for r in range(world)]
    steps = [
        _block_step(stepper, layer, stats, products[i], [b[i] for b in received])
        for i, (layer, stats) in enumerate(work)
    ]
    # the statistics one process checks before any change: H_C, and H_K by its
    # diagonal (H_K is positive semi-definite), whose blocks the traces sum
    formed = [part[1] for parts in received for part in parts]
    formed += [tensor for *_, (H_C, _) in steps for tensor in H_C.tensors()]
    stepper.guard.require(finite(formed, stepper.guard.device))
    block_steps = [K @ m_new for m_new, K, *_ in steps]
    columns = [block(layer.dims[0], rank(), world) for layer in layers]
    limits = step_limits([m for m, *_ in steps], block_steps, columns, dtype)
    for layer, (m_new, K, traces_K, side_C), step, limit in zip(
        layers, steps, block_steps, limits, strict=True
    ):
        state, group = stepper.state[layer.weight], stepper.group(layer)
        commit = partial(_commit, state, group, m_new, K, step, limit, traces_K, side_C)
        stepper.guard.factor_update(layer, state, [], commit, checks=True)
        stepper.forget(layer, (0, 1))


def _blocks(layers: Sequence[Layer], r: int, world: int) -> list[tuple[Layer, tuple]]:
    """Return each layer with rank `r`'s column block.

    Args:
        layers: The split layers.
        r: The rank.
        world: The number of ranks.

    Returns:
        `(layer, (start, stop))` per layer.
    """
    return [(layer, column_blocks(layer.dims[0], world)[r]) for layer in layers]


def _unpack(
    layers: Sequence[Layer], flat: Tensor, r: int, world: int
) -> list[tuple[Tensor, Tensor, Tensor]]:
    """Split rank `r`'s gathered share into its blocks and partial traces.

    Args:
        layers: The split layers.
        flat: The share.
        r: The sending rank.
        world: The number of ranks.

    Returns:
        Per layer, `(K_r, partial tr̄(H_K), partial tr̄(KᵀK))`.
    """
    out, offset = [], 0
    for layer, (start, stop) in _blocks(layers, r, world):
        d_K = layer.dims[0]
        numel = d_K * (stop - start)
        K_r = flat[offset : offset + numel].view(d_K, stop - start)
        out.append((K_r, flat[offset + numel], flat[offset + numel + 1]))
        offset += numel + 2
    return out


def _block_step(
    stepper: Any, layer: Layer, stats: Any, UK_r: Tensor, blocks: list
) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor], tuple[Any, Any]]:
    r"""Return this rank's new block of \(m_K\) and what the rest of the step needs.

    Args:
        stepper: The shell's `LayerStepper`.
        layer: The layer.
        stats: Its statistics.
        UK_r: \(U_K K_r\).
        blocks: Per rank, `(K_r, partial traces...)` as gathered.

    Returns:
        `(m_K block, K, (tr̄(H_K), tr̄(KᵀK)), (H_C, Π(CᵀC)))`: the block
        \(\alpha_1 (m_K)_{:,J_r} + s (\hat m_K)_{:,J_r}\), the whole old \(K\).
    """
    state, group = stepper.state[layer.weight], stepper.group(layer)
    K_r = state["K.mat"]
    K = torch.cat([b[0] for b in blocks], dim=1).to(K_r.dtype)
    traces_K = tuple(
        torch.stack([b[i] for b in blocks]).sum().to(K_r.dtype) for i in (1, 2)
    )
    C = load_factor(state, "C", group["structures"][1])
    H_C, CtC = _projected_C(C, stats.handed_over[1])
    hyper = _hyperparameters(state, group)
    H_r, G_r = K.T @ UK_r, K.T @ K_r
    if hyper.kfac_like:
        increment = H_r.add_(G_r, alpha=hyper.damping)
    else:
        increment = H_r.mul_(H_C.average_trace()).add_(
            G_r.mul_(CtC.average_trace() * hyper.damping)
        )
    start = block(layer.dims[0], rank(), world_size()).start
    columns = torch.arange(K_r.shape[1], device=K_r.device)
    increment[start + columns, columns] -= 1.0
    increment.mul_(0.5 * (1.0 - hyper.alpha1) if hyper.normalize_lr_cov else 0.5)
    if hyper.alpha1:
        increment.add_(state["m_K.mat"], alpha=hyper.alpha1)
    return increment, K, traces_K, (H_C, CtC)


def _projected_C(C: Any, U_C: Tensor | StructuredMatrix) -> tuple[Any, Any]:
    r"""Return \(H_C = \Pi(C^\top U_C C)\) and \(\Pi(C^\top C)\) (as `SINGDRule`).

    Args:
        C: The factor.
        U_C: The dense statistics, or \(\Pi(U_C)\) in the structure of a
            (block-)diagonal \(C\).

    Returns:
        Both projections.
    """
    if isinstance(U_C, StructuredMatrix):
        return project_structured_gram(C, U_C), C.from_inner()
    product = C.rmatmat(C.rmatmat(U_C.to(C.dtype)).T)
    return C.from_dense((product + product.T) / 2), C.from_inner()


def _hyperparameters(state: dict[str, Any], group: dict[str, Any]) -> Any:
    """Return the layer's factor hyperparameters at this step (as `SINGDRule`).

    Args:
        state: The layer's state.
        group: Its parameter group.

    Returns:
        `FactorHyperparameters`.
    """
    lr_cov = group["lr_cov"]
    return FactorHyperparameters(
        damping=group["damping"],
        alpha1=resolved_alpha1(group),
        lr_cov=lr_cov(state["step"]) if callable(lr_cov) else lr_cov,
        kfac_like=group["kfac_like"],
        normalize_lr_cov=group["normalize_lr_cov"],
    )


def _commit(
    state: dict[str, Any],
    group: dict[str, Any],
    m_new: Tensor,
    K: Tensor,
    step: Tensor,
    limits: StepLimits,
    traces_K: tuple[Tensor, Tensor],
    side_C: tuple[Any, Any],
    *,
    accept: Tensor,
) -> dict[int, Tensor]:
    r"""Take this rank's step of \(K\)'s block and the whole \(C\)'s, each if sound.

    \(K_r \gets K_r - \beta_1 s\, K (m_K)_{:,J_r}\) with the trust region's
    \(s\) and the verdict of the whole factor (`column_bounds`), as one process
    takes it (`update.limited_factor_step`); \(C\) by `update.factor_step`.

    Args:
        state: The layer's state.
        group: Its parameter group.
        m_new: This rank's block of the new \(m_K\) (kept, or given the old
            values if the step is discarded).
        K: The whole old \(K\).
        step: This rank's block \(K (m_K)_{:,J_r}\) (consumed).
        limits: The numbers of the whole step.
        traces_K: \(\bar{\mathrm{tr}}(H_K)\), \(\bar{\mathrm{tr}}(K^\top K)\).
        side_C: \(H_C\), \(\Pi(C^\top C)\) (consumed).
        accept: Whether the step's inputs were finite (the guard's verdict).

    Returns:
        Per side, whether its update was kept (the same on every rank).
    """
    hyper = _hyperparameters(state, group)
    lr: float | Tensor = hyper.lr_cov
    if hyper.normalize_lr_cov:
        lr = hyper.lr_cov / limits.peak_momentum.clamp(min=1.0).to(m_new.dtype)
    (peak_K,) = peaks([[K]])
    kept_K = limited_factor_step(
        [state["K.mat"]],
        [state["m_K.mat"]],
        [m_new],
        [step],
        lr=lr,
        peaks=(peak_K, limits.peak_step, limits.peak_momentum),
        norm=limits.norm,
        accept=accept,
    )
    state["m_K.mat"] = m_new
    increment = momentum_increment(
        *side_C, trace_H_other=traces_K[0], trace_KtK_other=traces_K[1], hyper=hyper
    )
    name = group["structures"][1]
    C, m_C = load_factor(state, "C", name), load_factor(state, "m_C", name)
    m_C_new, kept_C = factor_step(C, m_C, increment, hyper, accept)
    store_factor(state, "m_C", m_C_new)
    return {0: kept_K, 1: kept_C}


def partial_direction(stepper: Any, layer: Layer, grad: Tensor) -> Tensor:
    r"""Return this rank's term \(Y_r = (\Gamma K_r) K_r^\top\).

    Args:
        stepper: The shell's `LayerStepper`.
        layer: The layer.
        grad: \(\Gamma\), `[d_C, d_K]`.

    Returns:
        `[d_C, d_K]`, in \(K\)'s dtype.
    """
    K_r = stepper.state[layer.weight]["K.mat"]
    return (grad.to(K_r.dtype) @ K_r) @ K_r.T


def finish_direction(stepper: Any, layer: Layer, terms: Sequence[Tensor]) -> Tensor:
    r"""Return \(\Delta = C C^\top \sum_r Y_r\), the terms added in rank order.

    Args:
        stepper: The shell's `LayerStepper`.
        layer: The layer.
        terms: Per rank, its \(Y_r\).

    Returns:
        \(\Delta\) in the weight's dtype.
    """
    state, group = stepper.state[layer.weight], stepper.group(layer)
    C = load_factor(state, "C", group["structures"][1])
    total = terms[0].clone()
    for term in terms[1:]:
        total.add_(term)
    return precondition_output_side(total, C, overwrite=True).to(layer.weight.dtype)
