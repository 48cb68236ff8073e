r"""`SINGDRule`: SINGD's and IKFAC's inverse-free Riemannian factor updates.

Per layer the state holds the structured factors \(K\), \(C\) (starting at the
identity) and their Riemannian momenta \(m_K\), \(m_C\) (starting at zero) as
`"K.<tensor>"`, `"C.<tensor>"`, `"m_K.<tensor>"`, `"m_C.<tensor>"`. The hooks
accumulate \(H_K = \Pi(K^\top U_K K)\) and \(H_C = \Pi(C^\top U_C C)\) from the rows
without forming \(U_K\), \(U_C\); the update is `singd_curvlinops.update`'s
(Lin et al., ICML 2024, Fig. 1), the preconditioner \(C C^\top \otimes K K^\top\).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from singd_curvlinops._hyperparameters import (
    check_common,
    check_lr_cov_value,
    check_number,
)
from singd_curvlinops.rules.base import FactorRule
from singd_curvlinops.rules.factors import load_factor, project_rows, store_factor
from singd_curvlinops.rules.records import FactorStatistics, Preconditioner
from singd_curvlinops.structures import StructuredMatrix, get_structure
from singd_curvlinops.update import (
    FactorHyperparameters,
    factor_step,
    momentum_increment,
)

# Riemannian momentum α₁ when a group leaves `alpha1=None`: the paper's SINGD uses
# 0.5; IKFAC (Lin et al., 2023) has none.
DEFAULT_ALPHA1 = {False: 0.5, True: 0.0}


def resolved_alpha1(group: dict[str, Any]) -> float:
    r"""Return the group's \(\alpha_1\): its value, or the default of its update.

    Args:
        group: A parameter group of `SINGD`.

    Returns:
        `alpha1`, or 0.5 for SINGD and 0 for IKFAC (`kfac_like`) if it is None.
    """
    alpha1 = group["alpha1"]
    return DEFAULT_ALPHA1[group["kfac_like"]] if alpha1 is None else alpha1


class SINGDRule(FactorRule):
    """SINGD (and IKFAC with `kfac_like=True`) on structured factors."""

    discard_hint = (
        "this layer's statistics (or damping) are too large for the factors' "
        "dtype, or lr_cov is not finite: normalise the layer's inputs or scale "
        "the loss down, keep the factors in float32 (preconditioner_dtype), check "
        "lr_cov"
    )
    checks_updates = True  # `update.factor_step` discards on the device, no copy
    factor_sides = (("K", 0), ("C", 1), ("m_K", 0), ("m_C", 1))
    splits_sides = True  # the sides couple only through scalar traces
    owner_state = ("m_K", "m_C")  # read by the factor's own update alone
    preconditioner_options = ("T",)  # whether K Kᵀ, C Cᵀ are formed (rounding)
    _IDENTITY = ("K", "C")  # the momenta start at zero

    def label(self, group: dict[str, Any]) -> str:
        """Return `"IKFAC"` for `kfac_like` groups, else `"SINGD"`."""
        return "IKFAC" if group["kfac_like"] else "SINGD"

    def check_group(self, group: dict[str, Any]) -> None:
        """Validate SINGD's options (`alpha1` may be None, `lr_cov` a callable)."""
        check_common(group)
        if group["alpha1"] is not None:
            check_number("alpha1", group["alpha1"], 0.0, 1.0)
        lr_cov = group["lr_cov"]
        if not isinstance(lr_cov, Callable):
            check_number("lr_cov", lr_cov, 0.0)
        for name in ("kfac_like", "normalize_lr_cov"):
            if not isinstance(group[name], bool):
                raise TypeError(f"{name} must be a bool, got {group[name]!r}.")

    def step_options(self, group: Mapping[str, Any], step: Any) -> dict[str, Any]:
        """Return a callable `lr_cov`'s value at `step`, checked (else nothing).

        A value that is not a finite real number >= 0 raises a `ValueError`
        (`check_lr_cov_value`).
        """
        lr_cov = group["lr_cov"]
        if not callable(lr_cov):
            return {}
        return {"lr_cov": check_lr_cov_value(lr_cov(step), step)}

    def structures(self, group: dict[str, Any]) -> tuple[str, str]:
        """Return the group's `structures`."""
        return group["structures"]

    def init_state(
        self,
        group: dict[str, Any],
        dims: tuple[int, int],
        dtypes: tuple[torch.dtype, torch.dtype],
        device: torch.device | str,
    ) -> dict[str, Any]:
        """Return identity factors `K`, `C` and zero momenta `m_K`, `m_C`."""
        state: dict[str, Any] = {}
        for prefix, side in self.factor_sides:
            cls = get_structure(group["structures"][side])
            init = cls.eye if prefix in self._IDENTITY else cls.zeros
            store_factor(
                state, prefix, init(dims[side], dtype=dtypes[side], device=device)
            )
        return state

    def project(
        self,
        preconditioner: Preconditioner,
        a: Tensor,
        g: Tensor,
        *,
        group: Mapping[str, Any],
    ) -> tuple[StructuredMatrix, StructuredMatrix]:
        r"""Return \(\Pi(K^\top a^\top a K)\) and \(\Pi(C^\top g^\top g C)\)."""
        # `a` is a buffer of ours (overwritten), `g` may be autograd's (left intact)
        return (
            project_rows(preconditioner.K, a, overwrite=True),
            project_rows(preconditioner.C, g, overwrite=False),
        )

    def project_dense(
        self,
        preconditioner: Preconditioner,
        U: Tensor,
        side: int,
        *,
        group: Mapping[str, Any],
    ) -> StructuredMatrix:
        r"""Return \(\Pi(F^\top U F)\) for the side's factor \(F\) (\(K\) or \(C\))."""
        return _projected((preconditioner.K, preconditioner.C)[side], U)

    def update(
        self,
        state: dict[str, Any],
        group: dict[str, Any],
        statistics: FactorStatistics,
        preconditioner: Preconditioner,
        *,
        sides: tuple[int, ...] = (0, 1),
        accept: Tensor | None = None,
    ) -> dict[int, Tensor]:
        r"""Apply the Riemannian updates of \(K\), \(C\) and their momenta, in place.

        A side updated alone reads the other side's \(\bar{\mathrm{tr}}(H)\) from the
        statistics and its \(\bar{\mathrm{tr}}(\Pi(C^\top C)) = \|C\|_F^2 / d_C\)
        from the factor (every structure's \(\Pi\) keeps the diagonal), which
        costs \(O(\text{entries})\) instead of the product \(\Pi(C^\top C)\).
        Each side's step is limited and checked by `update.factor_step`: a side
        whose update is not finite (or with `accept` False) keeps its factor and
        momentum.

        Returns:
            Per updated side, whether its update was kept (0-d boolean tensors).
        """
        if not sides:
            return {}
        factors = (preconditioner.K, preconditioner.C)
        H = _statistics(statistics, factors)
        FtF = [
            M.from_inner() if side in sides else None for side, M in enumerate(factors)
        ]
        traces_H = [M.average_trace() for M in H]
        traces_FtF = [
            M.frobenius_norm().square() / M.dim if MtM is None else MtM.average_trace()
            for M, MtM in zip(factors, FtF, strict=True)
        ]
        # a callable lr_cov: the optimizer hands its checked value over in `group`
        step_options = self.step_options(group, state["step"])
        hyper = FactorHyperparameters(
            damping=group["damping"],
            alpha1=resolved_alpha1(group),
            lr_cov=step_options.get("lr_cov", group["lr_cov"]),
            kfac_like=group["kfac_like"],
            normalize_lr_cov=group["normalize_lr_cov"],
        )
        names = group["structures"]
        increments = {
            side: momentum_increment(
                H[side],
                FtF[side],
                trace_H_other=traces_H[1 - side],
                trace_KtK_other=traces_FtF[1 - side],
                hyper=hyper,
            )
            for side in sides
        }
        kept = {}
        for side, increment in increments.items():
            prefix = ("K", "C")[side]  # the factors' tensors are the state's
            momentum = load_factor(state, f"m_{prefix}", names[side])
            new_momentum, kept[side] = factor_step(
                factors[side], momentum, increment, hyper, accept
            )
            store_factor(state, f"m_{prefix}", new_momentum)
        return kept

    def preconditioner(
        self,
        state: dict[str, Any],
        group: dict[str, Any],
        *,
        sides: tuple[int, ...] = (0, 1),
    ) -> Preconditioner:
        r"""Return \(C C^\top \otimes K K^\top\), caching the products that pay off.

        A dense \(K K^\top\) costs \(2d^3\) and then \(2d^2 n\) per use on
        \(n\) columns, applying \(K\) and \(K^\top\) costs \(4d^2 n\): forming
        it pays off if it serves several steps (`T > 1`) or if \(d < n\) (the
        smaller side of a layer). For sparse structures it costs less than
        applying \(K\) once.

        Args:
            state: The layer's state.
            group: The layer's parameter group.
            sides: The sides whose products may be cached.

        Returns:
            The preconditioner; `K` and `C` share the state's tensors.
        """
        names = group["structures"]
        K, C = load_factor(state, "K", names[0]), load_factor(state, "C", names[1])
        reuse = group["T"] > 1
        KKt, CCt = (
            M.outer_self()
            if side in sides and (reuse or caches_for_one_use(M.numel(), M.dim, n))
            else None
            for side, M, n in ((0, K, C.dim), (1, C, K.dim))
        )
        return Preconditioner(K, C, square_roots=True, KKt=KKt, CCt=CCt)


def _statistics(
    statistics: FactorStatistics, factors: tuple[StructuredMatrix, StructuredMatrix]
) -> list[StructuredMatrix]:
    r"""Return \(H_K\), \(H_C\): collected, or projected from dense \(U\).

    Args:
        statistics: The update's statistics.
        factors: \(K\), \(C\).

    Returns:
        \([\Pi(K^\top U_K K), \Pi(C^\top U_C C)]\).
    """
    if statistics.handed_over is None:
        return list(statistics.collected)
    return [  # dense U: project Kᵀ U K
        _projected(M, U) for M, U in zip(factors, statistics.handed_over, strict=True)
    ]


def _projected(M: StructuredMatrix, U: Tensor) -> StructuredMatrix:
    r"""Return \(\Pi(M^\top U M)\) from a dense \(U\).

    Args:
        M: The factor.
        U: Dense statistics, `[d, d]`.

    Returns:
        The projection, in `M`'s structure and dtype.
    """
    return M.from_dense(_symmetric(M.rmatmat(M.rmatmat(U.to(M.dtype)).T)))


def _symmetric(mat: Tensor) -> Tensor:
    """Return the symmetric part of a square matrix (removes round-off asymmetry).

    Args:
        mat: Square matrix.

    Returns:
        `(mat + mat.T) / 2`.
    """
    return (mat + mat.T) / 2


def caches_for_one_use(entries: int, dim: int, other: int) -> bool:
    r"""Return whether a side's product \(F F^\top\) pays for itself at one use.

    Forming it costs one product of two factors, and then one product with the
    gradient matrix instead of two: this pays off for a sparse structure
    (fewer than \(d^2\) entries) or the layer's smaller side (\(d < m\)).
    `SINGDRule.preconditioner` caches on this condition or if the product
    serves several steps (`T > 1`); a helper under `Shard(factors="owned")`
    (`distributed.relay`), which keeps nothing between steps, on this one alone.

    Args:
        entries: The number of entries the side's structure stores.
        dim: The side's dimension \(d\).
        other: The other side's dimension \(m\).

    Returns:
        Whether forming the product is cheaper than applying the factor twice.
    """
    return entries < dim * dim or dim < other
