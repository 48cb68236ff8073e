r"""`KFACRule`: exponentially averaged dense factors and their damped inverses.

Per layer the state holds factors \(A\) (input side, `"A.mat"`) and \(G\)
(output side, `"G.mat"`), dense, or diagonal (`"A.diag"`) where the structure
policy's memory budget or an exactly diagonal factor (an embedding's input side)
asks for it, exponential moving averages of the statistics
\(U_K = a^\top a\), \(U_C\) (the first update takes the statistics as they are),

\[
A \gets \beta A + (1 - \beta) U_K, \qquad G \gets \beta G + (1 - \beta) U_C,
\]

and the number of updates so far (`"updates"`). The preconditioner is
\((G + \lambda I)^{-1} \otimes (A + \lambda I)^{-1}\), the identity before the first
update.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from singd_curvlinops._hyperparameters import check_common, check_number
from singd_curvlinops.rules.base import FactorRule
from singd_curvlinops.rules.factors import gram, load_factor, store_factor
from singd_curvlinops.rules.records import FactorStatistics, Preconditioner
from singd_curvlinops.structures import (
    DenseMatrix,
    DiagonalMatrix,
    StructuredMatrix,
    get_structure,
)

# checkpoints written before the optimizer shell (issue 12) name KFAC's then only
# structures, which "auto" gives within the budget
_LEGACY_STRUCTURES = (("dense", "dense"), ["dense", "dense"])
# options of SINGD that KFAC does not have (a group that names them raises)
_SINGD_ONLY = ("alpha1", "lr_cov", "kfac_like", "normalize_lr_cov")


class KFACRule(FactorRule):
    """KFAC's factors: exponential averages, inverted every `T` steps.

    Factors are dense or diagonal: the group's structure policy is always `"auto"`
    (dense within the memory budget `max_dense_dim`, diagonal above). The sides are
    not split across ranks (`splits_sides` is False): the costly part is the
    inverse in `preconditioner`, which every rank that applies a side would have to
    compute; `Shard` assigns whole layers.
    """

    factor_sides = (("A", 0), ("G", 1))
    reads_preconditioner = False  # statistics a^T a, g^T g; EMA of the factors
    skip_hint = (
        "lr too large for the layer's preconditioned gradient, or a damped factor "
        "singular or nearly so (damping too small for it; with damping=0, a "
        "factor of fewer examples than dimensions, or of an input that is always "
        "zero, is singular): lower lr or raise damping"
    )
    preconditioner_options = ("damping",)  # the inverses are of F + damping I

    def check_group(self, group: dict[str, Any]) -> None:
        """Validate KFAC's options.

        Raises:
            ValueError: For an option of SINGD's (`lr_cov`, `alpha1`, `kfac_like`,
                `normalize_lr_cov`), which KFAC does not have, or structures other
                than `"auto"` (dense within `max_dense_dim`, else diagonal); a
                group that named them had them dropped before 2026-12-02.
        """
        given = [key for key in _SINGD_ONLY if key in group]
        if given:
            raise ValueError(
                f"{', '.join(given)}: options of SINGD's that KFAC does not have; "
                "remove them from the group."
            )
        if group.get("structures", "auto") not in ("auto", *_LEGACY_STRUCTURES):
            raise ValueError(
                f"structures must be 'auto' for KFAC (dense factors within "
                f"max_dense_dim, else diagonal), got {group['structures']!r}."
            )
        group["structures"] = "auto"
        check_common(group)
        check_number("ema_decay", group["ema_decay"], 0.0, 1.0)

    def structures(self, group: dict[str, Any]) -> tuple[str, str]:
        """Return the layer's structures (`"dense"` or `"diagonal"`)."""
        return tuple(group["structures"])

    def init_state(
        self,
        group: dict[str, Any],
        dims: tuple[int, int],
        dtypes: tuple[torch.dtype, torch.dtype],
        device: torch.device | str,
    ) -> dict[str, Any]:
        """Return zero factors `A`, `G` and no updates."""
        state: dict[str, Any] = {}
        for prefix, side in self.factor_sides:
            cls = get_structure(group["structures"][side])
            store_factor(
                state, prefix, cls.zeros(dims[side], dtype=dtypes[side], device=device)
            )
        state["updates"] = 0
        return state

    def project(
        self,
        preconditioner: Preconditioner | None,
        a: Tensor,
        g: Tensor,
        *,
        group: Mapping[str, Any],
    ) -> tuple[StructuredMatrix, StructuredMatrix]:
        r"""Return \(\Pi(a^\top a)\), \(\Pi(g^\top g)\) in the factors' structures."""
        K_structure, C_structure = (get_structure(n) for n in group["structures"])
        return gram(K_structure, a), gram(C_structure, g)

    def project_dense(
        self,
        preconditioner: Preconditioner | None,
        U: Tensor,
        side: int,
        *,
        group: Mapping[str, Any],
    ) -> StructuredMatrix:
        r"""Return \(\Pi(U)\) in the side's structure."""
        return get_structure(group["structures"][side]).from_dense(U)

    def update(
        self,
        state: dict[str, Any],
        group: dict[str, Any],
        statistics: FactorStatistics,
        preconditioner: Preconditioner | None,
        *,
        sides: tuple[int, ...] = (0, 1),
    ) -> None:
        r"""Average the statistics into \(A\), \(G\) (the first update: as they are)."""
        factors = self.factors(state, group)
        U = self._new_statistics(factors, group, statistics, preconditioner)
        beta = self._decay(state, group)
        for side, factor in enumerate(factors):
            if side in sides:  # the factors' tensors are the state's: in place
                factor.mul_(beta).add_(U[side].to(factor.dtype), alpha=1.0 - beta)
        state["updates"] += 1

    def factors(
        self, state: dict[str, Any], group: Mapping[str, Any]
    ) -> list[StructuredMatrix]:
        r"""Return \(A\) and \(G\) (their tensors are the state's).

        Args:
            state: The layer's state.
            group: The layer's options.

        Returns:
            The factors of sides 0 and 1.
        """
        names = group["structures"]
        return [load_factor(state, p, names[side]) for p, side in self.factor_sides]

    def averaged(
        self,
        state: dict[str, Any],
        group: Mapping[str, Any],
        statistics: FactorStatistics,
        side: int,
    ) -> StructuredMatrix:
        r"""Return a side's factor as `update` leaves it, without changing the state.

        Args:
            state: The layer's state before the update.
            group: The layer's options.
            statistics: The statistics of the update.
            side: The side.

        Returns:
            A new matrix, bit for bit the factor after `update`.
        """
        factors = self.factors(state, group)
        U = self._new_statistics(factors, group, statistics, None)[side]
        beta = self._decay(state, group)
        factor = factors[side].clone()
        return factor.mul_(beta).add_(U.to(factor.dtype), alpha=1.0 - beta)

    @staticmethod
    def _decay(state: dict[str, Any], group: Mapping[str, Any]) -> float:
        """Return the weight of the previous factors (0 in the first update)."""
        return group["ema_decay"] if state["updates"] else 0.0

    def _new_statistics(
        self,
        factors: list[StructuredMatrix],
        group: Mapping[str, Any],
        statistics: FactorStatistics,
        preconditioner: Preconditioner | None,
    ) -> tuple[StructuredMatrix, StructuredMatrix]:
        r"""Return the update's \(U_K\), \(U_C\) in the factors' structures.

        Args:
            factors: The factors (their dtypes).
            group: The layer's options.
            statistics: The statistics of the update.
            preconditioner: Passed to `project_dense` (KFAC reads none).

        Returns:
            The collected statistics, or the handed-over ones projected.
        """
        if statistics.handed_over is None:
            return statistics.collected
        return tuple(
            self.project_dense(preconditioner, U.to(F.dtype), side, group=group)
            for side, (F, U) in enumerate(
                zip(factors, statistics.handed_over, strict=True)
            )
        )

    def preconditioner(
        self,
        state: dict[str, Any],
        group: dict[str, Any],
        *,
        sides: tuple[int, ...] = (0, 1),
    ) -> Preconditioner:
        r"""Return \((A + \lambda I)^{-1}\), \((G + \lambda I)^{-1}\) (first: I).

        The inverse of a singular damped factor is not finite (`_damped_inverse`):
        the step guard then skips the layer's parameter update, and
        `KroneckerOptimizer.preconditioner` raises.
        """
        names = group["structures"]
        inverses = []
        for prefix, side in self.factor_sides:
            factor = load_factor(state, prefix, names[side])
            if state["updates"] == 0:
                inverse = type(factor).eye(
                    factor.dim, dtype=factor.dtype, device=factor.device
                )
            else:
                inverse = _damped_inverse(factor, group["damping"])
            inverses.append(inverse)
        return Preconditioner(*inverses, square_roots=False)


def _damped_inverse(factor: StructuredMatrix, damping: float) -> StructuredMatrix:
    r"""Return \((F + \lambda I)^{-1}\), dense by a linear solve, diagonal entrywise.

    A singular \(F + \lambda I\) (possible with \(\lambda = 0\)) has no inverse:
    the result then holds infinities or NaN (a zero diagonal entry's reciprocal
    is infinite; a dense factor's is NaN). Deciding this on the device keeps the
    step free of host reads: the step guard skips the parameter update that the
    result would reach, and `KroneckerOptimizer.preconditioner` refuses it.

    Args:
        factor: Symmetric positive semi-definite \(F\), dense or diagonal.
        damping: \(\lambda\).

    Returns:
        The inverse (or a non-finite matrix), in the structure and dtype of
        `factor`.
    """
    if isinstance(factor, DiagonalMatrix):
        return DiagonalMatrix((factor.diag + damping).reciprocal())
    return DenseMatrix(_dense_inverse(factor.mat, damping))


def _dense_inverse(factor: Tensor, damping: float) -> Tensor:
    r"""Return \((F + \lambda I)^{-1}\) by an LU solve in at least float32, or NaN.

    Args:
        factor: Symmetric positive semi-definite matrix \(F\).
        damping: \(\lambda\).

    Returns:
        The inverse in `factor`'s dtype; NaN everywhere if the LU factorization
        met an exactly zero pivot (`info > 0`: \(F + \lambda I\) is singular).
    """
    # PyTorch has no half-precision LU kernels (as `structures._linalg.solve_dense`)
    dtype = torch.promote_types(factor.dtype, torch.float32)
    damped = factor.to(dtype, copy=True)
    damped.diagonal().add_(damping)
    eye = torch.eye(factor.shape[0], dtype=dtype, device=factor.device)
    inverse, info = torch.linalg.solve_ex(damped, eye)
    return inverse.masked_fill_(info != 0, float("nan")).to(factor.dtype)
