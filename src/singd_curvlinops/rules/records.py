r"""The records a factor rule exchanges with the optimizer.

`Preconditioner`: what a rule's factors define, and how it applies to a
layer's gradient (whole, by side, or to a block of rows or columns of a
sharded gradient). `FactorStatistics`: what one factor update reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from singd_curvlinops.per_example import ExampleGradients
from singd_curvlinops.structures import StructuredMatrix
from singd_curvlinops.update import (
    precondition,
    precondition_input_side,
    precondition_output_side,
)


@dataclass(frozen=True)
class Preconditioner:
    r"""A layer's preconditioner \(P = P_C \otimes P_K\), applied as \(P_C \Gamma P_K\).

    With `square_roots` (SINGD, IKFAC) the sides are \(P_K = K K^\top\) and
    \(P_C = C C^\top\), cached in `KKt`, `CCt` where that pays off (None: applied
    as \(K (K^\top \cdot)\)). Without (KFAC), `K` and `C` are the sides themselves.
    The matrices are the optimizer's: read them, copy before changing them.

    Attributes:
        K: Input-side factor, dimension `d_K`.
        C: Output-side factor, dimension `d_C`.
        square_roots: Whether the sides are \(K K^\top\), \(C C^\top\).
        KKt: Cached \(K K^\top\), or None.
        CCt: Cached \(C C^\top\), or None.
    """

    K: StructuredMatrix
    C: StructuredMatrix
    square_roots: bool = True
    KKt: StructuredMatrix | None = None
    CCt: StructuredMatrix | None = None

    def transposed(self) -> Preconditioner:
        """Return the preconditioner of the transposed layer (sides swapped).

        Returns:
            A record with `K` and `C` (and their caches) exchanged.
        """
        return Preconditioner(self.C, self.K, self.square_roots, self.CCt, self.KKt)

    def apply(self, grad: Tensor, *, overwrite: bool = False) -> Tensor:
        r"""Return \(P_C \Gamma P_K\) for a gradient matrix \(\Gamma\), `[d_C, d_K]`.

        Args:
            grad: The gradient matrix.
            overwrite: Whether `grad` may be overwritten (the caller owns it).

        Returns:
            Tensor with the shape and dtype of `grad` (possibly `grad` itself).
        """
        return precondition(grad, self.K, self.C, *self._sides, overwrite=overwrite)

    def tensors(self) -> list[Tensor]:
        """Return the tensors of the sides as applied (`K` and `C`).

        Returns:
            Their tensors, without the cached products (which derive from them).
        """
        return [*self.K.tensors(), *self.C.tensors()]

    def apply_side(self, side: int, mat: Tensor, *, overwrite: bool = False) -> Tensor:
        r"""Apply one side: \(M P_K\) (side 0) or \(P_C M\) (side 1).

        `apply` is `apply_side(1, apply_side(0, grad))`, up to the final cast;
        either order gives \(P_C \Gamma P_K\).

        Args:
            side: 0 for the input side, 1 for the output side.
            mat: `[rows, d_K]` for side 0, `[d_C, columns]` for side 1.
            overwrite: Whether `mat` may be overwritten.

        Returns:
            The product, in the side's dtype (possibly `mat` itself).
        """
        if side == 0:
            return precondition_input_side(
                mat, self.K, self._sides[0], overwrite=overwrite
            )
        return precondition_output_side(
            mat, self.C, self._sides[1], overwrite=overwrite
        )

    # ------------------------------------------------ a gradient split by ranks
    def shard_half(self, side: int, block: Tensor) -> Tensor:
        r"""Return what a block of \(\Gamma\)'s rows or columns gives on its own.

        For FSDP2 shards (`distributed.shards`): rows \(\Gamma_r\) (side 0) give
        \(\Gamma_r P_K\), columns \(\Gamma_c\) (side 1) give \(P_C \Gamma_c\).
        Stacked in order, the blocks' halves are the whole half product that
        `shard_finish` completes. The result is linear in `block`.

        Args:
            side: 0 for a block of rows, 1 for a block of columns.
            block: The block (may be overwritten).

        Returns:
            Its half product.
        """
        return self.apply_side(side, block, overwrite=True)

    def shard_finish(self, side: int, half: Tensor) -> Tensor:
        r"""Return \(\Delta\) from the whole half product of `shard_half`.

        Args:
            side: The side `shard_half` applied (0: rows, 1: columns).
            half: \(Y = \Gamma P_K\) (side 0) or \(Z = P_C \Gamma\) (side 1),
                `[d_C, d_K]` (may be overwritten).

        Returns:
            \(P_C Y\) or \(Z P_K\).
        """
        return self.apply_side(1 - side, half, overwrite=True)

    def shard_columns(self, block: Tensor, columns: slice) -> Tensor:
        r"""Return \(\Delta\)'s columns from the same columns of \(\Gamma\) alone.

        Needs a diagonal input side: then \(\Delta_c = (P_C \Gamma_c) P_K[c, c]\),
        and no other column takes part (an embedding's shard,
        `distributed.fsdp.independent_columns`).

        Args:
            block: \(\Gamma_c\), `[d_C, c]` (may be overwritten).
            columns: Where the block's columns lie among \(\Gamma\)'s `d_K`.

        Returns:
            \(\Delta_c\), in the output side's dtype.
        """
        d_K = self.K.dim
        ones = torch.ones(1, d_K, dtype=block.dtype, device=block.device)
        diagonal = self.apply_side(0, ones, overwrite=True)[0]  # 1ᵀ P_K
        return self.apply_side(1, block, overwrite=True) * diagonal[columns]

    @property
    def _sides(self) -> tuple[StructuredMatrix | None, StructuredMatrix | None]:
        r"""The matrices applied as one product (None: as \(K (K^\top \cdot)\))."""
        if self.square_roots:
            return self.KKt, self.CCt
        return self.K, self.C


@dataclass(frozen=True)
class FactorStatistics:
    r"""The statistics of one factor update of one layer, in one of two forms.

    Attributes:
        collected: \((H_K, H_C)\) as the rule's `project` formed them from the
            training pass, accumulated over micro-batches (and processes) and
            scaled to the conventions of \(U_K\), \(U_C\); or None.
        handed_over: Dense \((U_K, U_C)\) from `set_curvature`, or None.
        examples: With `collected`, for a rule with `per_example`: the pass's
            per-example gradients, scaled to the convention of \(U_C\).
        decompositions: For a rule with `decomposed_sides`: per side, the
            decomposition that `decompose` returned on the rank that computed
            it, which `update` adopts instead of computing it (None for a side
            that keeps its own); None: `update` computes them itself.
    """

    collected: tuple[StructuredMatrix, StructuredMatrix] | None = None
    handed_over: tuple[Tensor, Tensor] | None = None
    examples: ExampleGradients | None = None
    decompositions: tuple[Tensor | None, Tensor | None] | None = None
