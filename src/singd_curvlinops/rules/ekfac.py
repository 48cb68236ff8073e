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

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from singd_curvlinops.rules.kfac import KFACRule
from singd_curvlinops.rules.records import FactorStatistics, Preconditioner
from singd_curvlinops.structures import DenseMatrix, DiagonalMatrix


class EKFACRule(KFACRule):
    """EKFAC: KFAC's averaged factors, their eigenbases, corrected eigenvalues.

    A factor that the structure policy makes diagonal (a dimension over the
    memory budget) is its own eigendecomposition: its basis is the identity, kept
    as nothing. The rule needs the rows of every process in its update (a second
    collective), so every rank updates every factor: under `distribute="shard"`
    the preconditioning has owners, and so has each eigendecomposition, the
    update's costliest part (`decompose`; `GatheredStep.replicated_updates`).
    """

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
            if group["structures"][side] == "dense":
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
        preconditioner: Preconditioner | None,
        *,
        sides: tuple[int, ...] = (0, 1),
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
        beta = self._decay(state, group)
        super().update(state, group, statistics, preconditioner, sides=sides)
        given = statistics.decompositions  # (computed by another rank, or None)
        bases = []
        for side, (prefix, _) in enumerate(self.factor_sides):
            basis = state.get(f"Q_{prefix}.mat")  # (a diagonal factor has none)
            if basis is not None:
                fresh = _fresh(state[f"{prefix}.mat"]) if given is None else given[side]
                if fresh is not None:
                    basis.copy_(fresh)
            bases.append(basis)
        eigenvalues = state["eigenvalues"]
        fresh = statistics.examples.squared_projections(
            *bases, dims=eigenvalues.shape[::-1], device=eigenvalues.device
        )
        eigenvalues.mul_(beta).add_(fresh.to(eigenvalues.dtype), alpha=1.0 - beta)

    def decomposed_sides(self, group: Mapping[str, Any]) -> tuple[int, ...]:
        """Return the dense sides: their eigenbases are recomputed in each update."""
        return tuple(
            side
            for _, side in self.factor_sides
            if group["structures"][side] == "dense"
        )

    def decompose(
        self,
        state: dict[str, Any],
        group: dict[str, Any],
        statistics: FactorStatistics,
        side: int,
    ) -> Tensor | None:
        r"""Return the eigenbasis of a dense side's averaged factor (`update`'s).

        A failing eigendecomposition raises `update`'s `ValueError`.

        Returns:
            The eigenvectors; the state's basis itself if the averaged factor
            is not finite (the side keeps it, and the optimizer discards the
            update).
        """
        fresh = _fresh(self.averaged(state, group, statistics, side).mat)
        prefix = self.side_names[side]
        return state[f"Q_{prefix}.mat"] if fresh is None else fresh

    def contribute(
        self,
        group: Mapping[str, Any],
        statistics: FactorStatistics,
        dims: tuple[int, int],
        device: torch.device,
    ) -> None:
        r"""Add this rank's examples to the owner's \(E\): their squared projections.

        `update` sums each rank's \(\Sigma\) in the examples' collective
        (`ExampleGradients.reduce`); here it is formed in the owner's bases
        (`statistics.decompositions`, in the factors' dtypes; None for a
        diagonal side: the identity), as the owner forms its own.
        """
        # row-major as the owner's state (eigh's vectors are column-major, and
        # the products' rounding follows the layout)
        bases = [
            None if basis is None else basis.contiguous()
            for basis in statistics.decompositions or (None, None)
        ]
        statistics.examples.squared_projections(*bases, dims=dims, device=device)

    def preconditioner(
        self,
        state: dict[str, Any],
        group: dict[str, Any],
        *,
        sides: tuple[int, ...] = (0, 1),
    ) -> Preconditioner:
        r"""Return the eigenbases and \(1 / (E + \lambda)\) (before any update: I)."""
        if state["updates"] == 0:
            return super().preconditioner(state, group)
        eigenvalues = state["eigenvalues"]
        damped = eigenvalues.to(torch.promote_types(eigenvalues.dtype, torch.float32))
        bases = []
        for (prefix, _), dim in zip(
            self.factor_sides, eigenvalues.shape[::-1], strict=True
        ):
            basis = state.get(f"Q_{prefix}.mat")
            if basis is None:
                dtype = state[f"{prefix}.diag"].dtype
                bases.append(DiagonalMatrix.eye(dim, dtype=dtype, device=damped.device))
            else:
                bases.append(DenseMatrix(basis))
        return EigenbasisPreconditioner(
            *bases,
            square_roots=False,
            inverse_eigenvalues=(damped + group["damping"]).reciprocal_(),
        )


@dataclass(frozen=True, kw_only=True)
class EigenbasisPreconditioner(Preconditioner):
    r"""\(P = (Q_C \otimes Q_K) \operatorname{diag}(D) (Q_C \otimes Q_K)^\top\).

    `K` and `C` hold the orthogonal bases \(Q_K\), \(Q_C\) (dense, or the
    diagonal identity); unlike the Kronecker preconditioners, \(P\) scales every
    pair of basis vectors by its own entry of \(D\).

    Attributes:
        inverse_eigenvalues: \(D\), `[d_C, d_K]` (EKFAC: \(1 / (E + \lambda)\)),
            in at least float32.
    """

    inverse_eigenvalues: Tensor

    def tensors(self) -> list[Tensor]:
        r"""Return the tensors of the bases and the inverse eigenvalues.

        Returns:
            Those of `K` and `C`, then \(D\).
        """
        return [*super().tensors(), self.inverse_eigenvalues]

    def apply(self, grad: Tensor, *, overwrite: bool = False) -> Tensor:
        r"""Return \(Q_C [(Q_C^\top \Gamma Q_K) \odot D] Q_K^\top\).

        Each side is multiplied in its basis's dtype, as `Preconditioner.apply` does.

        Args:
            grad: The gradient matrix \(\Gamma\), `[d_C, d_K]`.
            overwrite: Unused (the products allocate their results anyway).

        Returns:
            A new tensor with the shape and dtype of `grad`.
        """
        # the whole gradient is one block of rows
        return self.shard_finish(0, self.shard_half(0, grad)).to(grad.dtype)

    def apply_side(self, side: int, mat: Tensor, *, overwrite: bool = False) -> Tensor:
        """Refuse: the eigenvalue scaling couples both sides.

        Args:
            side: Unused.
            mat: Unused.
            overwrite: Unused.

        Raises:
            ValueError: Always (EKFAC cannot split its preconditioning).
        """
        raise ValueError(
            "EKFAC's preconditioner scales each pair of basis vectors on its own: "
            "its two sides cannot be applied apart (distribute='shard' with "
            "sides split between ranks)."
        )

    # ------------------------------------------------ a gradient split by ranks
    def shard_half(self, side: int, block: Tensor) -> Tensor:
        r"""Return a block's rotation: \(\Gamma_r Q_K\), or \(Q_C^\top \Gamma_c\).

        Args:
            side: 0 for a block of rows, 1 for a block of columns.
            block: The block.

        Returns:
            The rotated block, in the basis's dtype.
        """
        if side == 0:
            Q_K = self.K
            return Q_K.rmatmat(block.T.to(Q_K.dtype)).T  # (Q_Kᵀ Γᵀ)ᵀ = Γ Q_K
        return self.C.rmatmat(block.to(self.C.dtype))

    def shard_finish(self, side: int, half: Tensor) -> Tensor:
        r"""Return \(Q_C [(Q_C^\top \Gamma Q_K) \odot D] Q_K^\top\) from one rotation.

        Args:
            side: The side `shard_half` rotated (0: \(\Gamma Q_K\), 1:
                \(Q_C^\top \Gamma\)).
            half: The whole rotation, `[d_C, d_K]`.

        Returns:
            \(\Delta\), in the input basis's dtype.
        """
        Q_K, Q_C = self.K, self.C
        if side == 0:
            rotated = Q_C.rmatmat(half.to(Q_C.dtype))  # Q_Cᵀ (Γ Q_K)
        else:
            rotated = Q_K.rmatmat(half.T.to(Q_K.dtype)).T  # (Q_Cᵀ Γ) Q_K
        rotated = rotated * self.inverse_eigenvalues.to(rotated.dtype)
        back = (Q_C @ rotated.to(Q_C.dtype)).to(Q_K.dtype)  # Q_C [...]
        return (Q_K @ back.T).T  # [...] Q_Kᵀ

    def shard_columns(self, block: Tensor, columns: slice) -> Tensor:
        r"""Return \(\Delta_c\) from \(\Gamma_c\) alone, for a diagonal basis \(Q_K\).

        Then \(\Delta_c = Q_C [(Q_C^\top \Gamma_c q_c) \odot D_c] q_c\), with
        \(q_c\) and \(D_c\) the columns' entries of \(Q_K\)'s diagonal and of
        \(D\) (`Preconditioner.shard_columns`).

        Args:
            block: \(\Gamma_c\), `[d_C, c]`.
            columns: Where the block's columns lie among \(\Gamma\)'s `d_K`.

        Returns:
            \(\Delta_c\), in the output basis's dtype.
        """
        Q_C = self.C
        q = self.K.diag[columns]  # (EKFAC: ones, the basis of a diagonal factor)
        rotated = Q_C.rmatmat(block.to(Q_C.dtype)) * q.to(Q_C.dtype)
        inverse = self.inverse_eigenvalues[:, columns]
        rotated = rotated * inverse.to(rotated.dtype)
        return (Q_C @ rotated.to(Q_C.dtype)) * q.to(Q_C.dtype)


def _fresh(factor: Tensor) -> Tensor | None:
    """Return a factor's new eigenbasis, or None if the factor is not finite.

    Args:
        factor: The averaged symmetric factor.

    Returns:
        `_eigenbasis(factor)`; None keeps the previous basis (the optimizer
        discards the update of a factor that is not finite).
    """
    return _eigenbasis(factor) if bool(factor.isfinite().all()) else None


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
