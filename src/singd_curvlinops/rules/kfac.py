r"""`KFACRule`: exponentially averaged dense factors and their damped inverses.

Per layer the state holds dense factors \(A\) (input side, `"A.mat"`) and \(G\)
(output side, `"G.mat"`), exponential moving averages of the statistics
\(U_K = a^\top a\), \(U_C\) (the first update takes the statistics as they are),

\[
A \gets \beta A + (1 - \beta) U_K, \qquad G \gets \beta G + (1 - \beta) U_C,
\]

and the number of updates so far (`"updates"`). The preconditioner is
\((G + \lambda I)^{-1} \otimes (A + \lambda I)^{-1}\), the identity before the first
update.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from singd_curvlinops._hyperparameters import check_common, check_number
from singd_curvlinops.rules.base import FactorRule, FactorStatistics, Preconditioner
from singd_curvlinops.structures import DenseMatrix, StructuredMatrix
from singd_curvlinops.structures._linalg import solve_dense

# options of SINGD that KFAC does not have; a group that names them has them removed
_SINGD_ONLY = ("alpha1", "lr_cov", "kfac_like", "normalize_lr_cov")


class KFACRule(FactorRule):
    """KFAC's factors: dense exponential averages, inverted every `T` steps.

    The sides are not split across ranks (`splits_sides` is False): the costly
    part is the inverse in `preconditioner`, which every rank that applies a side
    would have to compute; `Shard` assigns whole layers.
    """

    factor_sides = (("A", 0), ("G", 1))
    reads_preconditioner = False  # statistics a^T a, g^T g; EMA of the factors

    def check_group(self, group: dict[str, Any]) -> None:
        """Validate KFAC's options; SINGD-only options are removed."""
        for key in _SINGD_ONLY:
            group.pop(key, None)
        group["structures"] = ("dense", "dense")  # KFAC's factors are dense
        check_common(group)
        check_number("ema_decay", group["ema_decay"], 0.0, 1.0)

    def structures(self, group: dict[str, Any]) -> tuple[str, str]:
        """Return `("dense", "dense")`: KFAC's factors are dense."""
        return ("dense", "dense")

    def init_state(
        self,
        group: dict[str, Any],
        dims: tuple[int, int],
        dtypes: tuple[torch.dtype, torch.dtype],
        device: torch.device | str,
    ) -> dict[str, Any]:
        """Return zero factors `A`, `G` and no updates."""
        state: dict[str, Any] = {
            f"{prefix}.mat": torch.zeros(
                dims[side], dims[side], dtype=dtypes[side], device=device
            )
            for prefix, side in self.factor_sides
        }
        state["updates"] = 0
        return state

    def project(
        self, preconditioner: Preconditioner | None, a: Tensor, g: Tensor
    ) -> tuple[StructuredMatrix, StructuredMatrix]:
        r"""Return the dense \(a^\top a\) and \(g^\top g\)."""
        return DenseMatrix.from_mat_inner(a.T), DenseMatrix.from_mat_inner(g.T)

    def zero_statistics(
        self,
        group: dict[str, Any],
        dims: tuple[int, int],
        dtypes: tuple[torch.dtype, torch.dtype],
        device: torch.device,
    ) -> tuple[StructuredMatrix, StructuredMatrix]:
        """Return dense zeros."""
        return tuple(
            DenseMatrix.zeros(dim, dtype=dtype, device=device)
            for dim, dtype in zip(dims, dtypes, strict=True)
        )

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
        if statistics.handed_over is not None:
            U = statistics.handed_over
        else:
            U = tuple(M.mat for M in statistics.collected)
        beta = group["ema_decay"] if state["updates"] else 0.0
        for prefix, side in self.factor_sides:
            if side in sides:
                factor = state[f"{prefix}.mat"]
                factor.mul_(beta).add_(U[side].to(factor.dtype), alpha=1.0 - beta)
        state["updates"] += 1

    def preconditioner(
        self,
        state: dict[str, Any],
        group: dict[str, Any],
        *,
        sides: tuple[int, ...] = (0, 1),
    ) -> Preconditioner:
        r"""Return \((A + \lambda I)^{-1}\), \((G + \lambda I)^{-1}\) (first: I)."""
        inverses = []
        for prefix, _ in self.factor_sides:
            factor = state[f"{prefix}.mat"]
            if state["updates"] == 0:
                inverse = torch.eye(
                    factor.shape[0], dtype=factor.dtype, device=factor.device
                )
            else:
                inverse = _damped_inverse(factor, group["damping"])
            inverses.append(DenseMatrix(inverse))
        return Preconditioner(*inverses, square_roots=False)


def _damped_inverse(factor: Tensor, damping: float) -> Tensor:
    r"""Return \((F + \lambda I)^{-1}\) by a linear solve (in at least float32).

    Args:
        factor: Symmetric positive semi-definite matrix \(F\).
        damping: \(\lambda\).

    Returns:
        The inverse, in `factor`'s dtype.

    Raises:
        ValueError: If \(F + \lambda I\) is singular (increase `damping`).
    """
    damped = factor.clone()
    damped.diagonal().add_(damping)
    eye = torch.eye(factor.shape[0], dtype=factor.dtype, device=factor.device)
    try:
        return solve_dense(damped, eye)
    except RuntimeError as error:
        raise ValueError(
            f"KFAC's damped factor is singular (damping={damping}); increase damping."
        ) from error
