r"""`EKFACRule`: KFAC's factors, their eigenbases, and corrected eigenvalues.

EKFAC (George et al., NeurIPS 2018) keeps KFAC's eigenbasis but replaces its
eigenvalues. With KFAC's averaged factors \(A = Q_A \Lambda_A Q_A^\top\) (input
side, `"A.mat"`) and \(G = Q_G \Lambda_G Q_G^\top\) (output side, `"G.mat"`),
KFAC's curvature \(G \otimes A\) has the eigenvalues \(\lambda^G_i \lambda^A_j\);
EKFAC uses instead the second moments of the per-example gradients \(\nabla_n\)
in that basis, the diagonal that fits the (empirical) Fisher best in it:

\[
E_{ij} = \nu \sum_n \bigl(Q_G^\top \nabla_n Q_A\bigr)_{ij}^2,
\]

with \(\nu\) the loss average's factor of \(U_C\) (`statistics.gradient_scale`:
\(N\) for a mean over the batch, so that \(E\) is the mean over the examples of
the squared gradients of the per-example loss, 1 for a sum). The curvature is
\((Q_G \otimes Q_A) \operatorname{diag}(E) (Q_G \otimes Q_A)^\top\), and the
preconditioned gradient

\[
\Delta = Q_G \left[\bigl(Q_G^\top \Gamma Q_A\bigr) \oslash (E + \lambda)\right]
Q_A^\top
\]

is the exactly damped inverse, as curvlinops' `KFACInverseLinearOperator` of an
`EKFACLinearOperator` with `use_exact_damping=True` applies it.

Every `T` steps, from the pass's statistics: \(A\) and \(G\) are averaged as in
`KFACRule`; their eigenbases \(Q_A\), \(Q_G\) (`"Q_A.mat"`, `"Q_G.mat"`) are
recomputed (`torch.linalg.eigh`, in at least float32); the pass's per-example
gradients give \(E\) in the new basis, averaged into `"eigenvalues"` with the same
`ema_decay` (the first update takes it as it is, so the first step is curvlinops'
EKFAC of the first batch). The averaged eigenvalues mix bases of successive
updates, an approximation that vanishes as the factors settle; an exact average
would need every past pass's per-example gradients. George et al. refresh the
eigenvalues more often than the basis; here both follow `T`, so `T=1` refreshes
both at every step.

Per-example gradients sum over the weight-sharing positions, so \(E\) does not
depend on `kfac_approx`, which only chooses how \(A\) and \(G\) treat them (as in
curvlinops).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from singd_curvlinops.rules.base import FactorStatistics, Preconditioner
from singd_curvlinops.rules.kfac import KFACRule
from singd_curvlinops.structures import DenseMatrix


class EKFACRule(KFACRule):
    """EKFAC: KFAC's averaged factors, their eigenbases, corrected eigenvalues."""

    per_example = True

    def init_state(
        self,
        group: dict[str, Any],
        dims: tuple[int, int],
        dtypes: tuple[torch.dtype, torch.dtype],
        device: torch.device | str,
    ) -> dict[str, Any]:
        """Return KFAC's state, identity eigenbases and zero eigenvalues."""
        state = super().init_state(group, dims, dtypes, device)
        for prefix, side in self.factor_sides:
            state[f"Q_{prefix}.mat"] = torch.eye(
                dims[side], dtype=dtypes[side], device=device
            )
        state["eigenvalues"] = torch.zeros(
            dims[1], dims[0], dtype=torch.promote_types(*dtypes), device=device
        )
        return state

    def update(
        self,
        state: dict[str, Any],
        group: dict[str, Any],
        statistics: FactorStatistics,
        preconditioner: Preconditioner,
    ) -> None:
        r"""Average \(A\), \(G\); new eigenbases; average the corrected eigenvalues.

        Raises:
            ValueError: If the statistics carry no per-example gradients (factors
                handed over by `set_curvature`), or an eigendecomposition fails.
        """
        if statistics.examples is None:
            raise ValueError(
                "EKFAC's eigenvalue correction needs the per-example gradients of "
                "the training pass; handed-over factors carry none."
            )
        beta = group["ema_decay"] if state["updates"] else 0.0
        super().update(state, group, statistics, preconditioner)
        for prefix, _ in self.factor_sides:
            basis = state[f"Q_{prefix}.mat"]
            basis.copy_(_eigenbasis(state[f"{prefix}.mat"]))
        fresh = statistics.examples.squared_projections(
            state["Q_A.mat"], state["Q_G.mat"]
        )
        eigenvalues = state["eigenvalues"]
        eigenvalues.mul_(beta).add_(fresh.to(eigenvalues.dtype), alpha=1.0 - beta)

    def preconditioner(
        self, state: dict[str, Any], group: dict[str, Any]
    ) -> Preconditioner:
        r"""Return the eigenbases and \(1 / (E + \lambda)\) (before any update: I)."""
        if state["updates"] == 0:
            return super().preconditioner(state, group)
        eigenvalues = state["eigenvalues"]
        damped = eigenvalues.to(torch.promote_types(eigenvalues.dtype, torch.float32))
        return EigenbasisPreconditioner(
            DenseMatrix(state["Q_A.mat"]),
            DenseMatrix(state["Q_G.mat"]),
            square_roots=False,
            inverse_eigenvalues=(damped + group["damping"]).reciprocal_(),
        )


@dataclass(frozen=True, kw_only=True)
class EigenbasisPreconditioner(Preconditioner):
    r"""\(P = (Q_C \otimes Q_K) \operatorname{diag}(D) (Q_C \otimes Q_K)^\top\).

    `K` and `C` hold the orthogonal bases \(Q_K\), \(Q_C\) (dense); unlike the
    Kronecker preconditioners, \(P\) scales every pair of basis vectors by its own
    entry of \(D\).

    Attributes:
        inverse_eigenvalues: \(D\), `[d_C, d_K]` (EKFAC: \(1 / (E + \lambda)\)),
            in at least float32.
    """

    inverse_eigenvalues: Tensor

    def apply(self, grad: Tensor, *, overwrite: bool = False) -> Tensor:
        r"""Return \(Q_C [(Q_C^\top \Gamma Q_K) \odot D] Q_K^\top\).

        Each side is multiplied in its basis's dtype, as `Preconditioner.apply` does.

        Args:
            grad: The gradient matrix \(\Gamma\), `[d_C, d_K]`.
            overwrite: Unused (the products allocate their results anyway).

        Returns:
            A new tensor with the shape and dtype of `grad`.
        """
        Q_K, Q_C = self.K.mat, self.C.mat
        rotated = Q_C.T @ (grad.to(Q_K.dtype) @ Q_K).to(Q_C.dtype)
        rotated.mul_(self.inverse_eigenvalues.to(rotated.dtype))
        return ((Q_C @ rotated).to(Q_K.dtype) @ Q_K.T).to(grad.dtype)


def _eigenbasis(factor: Tensor) -> Tensor:
    """Return the eigenvectors of a symmetric factor (as columns), in its dtype.

    Computed in at least float32 (PyTorch has no half-precision `eigh`), and again
    in float64 where LAPACK's float32 solver fails: on factors with many (nearly)
    repeated eigenvalues, such as the rank-deficient input factor of a wide layer
    fed by ReLUs, it may not converge or even return NaNs without an error.

    Args:
        factor: Symmetric matrix.

    Returns:
        Orthogonal matrix of the factor's shape and dtype.

    Raises:
        ValueError: If the eigendecomposition fails in float64, too (non-finite
            entries).
    """
    reason = ""
    for dtype in dict.fromkeys(
        (torch.promote_types(factor.dtype, torch.float32), torch.float64)
    ):
        try:
            basis = torch.linalg.eigh(factor.to(dtype)).eigenvectors
        except torch.linalg.LinAlgError as error:
            reason = str(error)
            continue
        if basis.isfinite().all():
            return basis.to(factor.dtype)
        reason = "non-finite eigenvectors"
    raise ValueError(
        f"EKFAC's eigendecomposition of a {tuple(factor.shape)} factor failed "
        f"({reason}); check the statistics for infinities and NaNs."
    )
