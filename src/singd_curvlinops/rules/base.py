r"""The protocol of a factor rule and the records it exchanges with the optimizer.

A *factor rule* owns the Kronecker factors of one layer as plain tensors in the
layer's state: it creates them (`init_state`), turns a micro-batch's rows
\(a\), \(\tilde g\) into the statistics it accumulates (`project`), updates the
factors from the accumulated statistics (`update`) and states the preconditioner
they define (`preconditioner`). A rule that also needs each example's gradient
(EKFAC) says so with `per_example`: the collector then keeps the pass's rows in a
`per_example.ExampleGradients` record, which `update` receives. Rules see tensors,
structures and the options of a parameter group; never modules, hooks or the
optimizer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from singd_curvlinops.per_example import ExampleGradients
from singd_curvlinops.structures import StructuredMatrix, get_structure
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
    """

    collected: tuple[StructuredMatrix, StructuredMatrix] | None = None
    handed_over: tuple[Tensor, Tensor] | None = None
    examples: ExampleGradients | None = None


class FactorRule(ABC):
    r"""How one kind of optimizer keeps and updates a layer's Kronecker factors.

    Attributes:
        factor_sides: `(state prefix, side)` of every factor the rule keeps, side
            0 for the input (dimension `d_K`) and 1 for the output (`d_C`).
        splits_sides: Whether the two sides may be updated on different ranks
            (`singd_curvlinops.distributed.Shard`): `update(..., sides=...)`
            then changes only the state entries of `sides` (those whose prefix
            `factor_sides` maps to them), reading no more of the other side
            than its statistics and factors, and `preconditioner(..., sides=...)`
            caches products only for `sides` (the record stays correct for both).
            Entries of no side are advanced by every call, also with `sides=()`.
        owner_state: Prefixes of the entries that only the rank updating their
            side reads (SINGD's momenta \(m_K\), \(m_C\)): under `Shard` they
            stay on that rank, and `state_dict()` gathers them.
        reads_preconditioner: Whether `project` and `update` read the
            preconditioner they are given (SINGD: its factors); if not, the
            optimizer passes None and builds none for them (KFAC: no inverse
            before the update).
        per_example: Whether `update` needs the per-example gradients of the pass
            (`FactorStatistics.examples`); `project` must then leave `a` intact.
        discard_hint: The likely cause of a factor update that is not finite,
            and its remedy, for the optimizer's warning (`guard`).
        skip_hint: The likely cause of a layer's parameter update that is not
            finite (the guard skips it), and its remedy, for the same warnings.
        preconditioner_options: The group options that `preconditioner` reads
            besides the factors (KFAC's `damping`): a cached record built with
            other values is rebuilt, so that an edited option takes effect at
            the next step, as after a checkpoint's load.
        checks_updates: Whether `update` checks its own result (SINGD): it then
            takes a keyword `accept` (a 0-d boolean that must also hold), keeps
            the previous entries of a side whose update is not finite, and
            returns per updated side whether it kept the update. Otherwise the
            optimizer's guard copies the entries before the update to do so.
    """

    discard_hint = (
        "this layer's statistics are too large for the factors' dtype: keep the "
        "factors in float32 (preconditioner_dtype), normalise the layer's inputs "
        "or scale the loss down"
    )
    skip_hint = (
        "lr too large for the layer's preconditioned gradient, or factors too "
        "large (damping too small): lower lr or raise damping"
    )
    checks_updates: bool = False
    factor_sides: tuple[tuple[str, int], ...] = ()
    splits_sides: bool = False
    owner_state: tuple[str, ...] = ()
    reads_preconditioner: bool = True
    per_example: bool = False
    preconditioner_options: tuple[str, ...] = ()

    @property
    def side_names(self) -> tuple[str, str]:
        """The factor of each side, as messages name it (its first prefix).

        Returns:
            E.g. `("K", "C")` for SINGD, `("A", "G")` for KFAC.
        """
        first: dict[int, str] = {}
        for prefix, side in self.factor_sides:
            first.setdefault(side, prefix)
        return first.get(0, "K"), first.get(1, "C")

    def label(self, group: dict[str, Any]) -> str:
        """Return the name of the update a group gets, for summaries.

        Args:
            group: A parameter group.

        Returns:
            E.g. `"SINGD"`.
        """
        return type(self).__name__.removesuffix("Rule")

    @abstractmethod
    def check_group(self, group: dict[str, Any]) -> None:
        """Validate the rule's options of a parameter group, normalising them in place.

        Args:
            group: The group's options.
        """

    def step_options(self, group: Mapping[str, Any], step: Any) -> dict[str, Any]:
        """Return the options that depend on the step, evaluated and checked.

        The optimizer calls it for every layer whose factors are due, before the
        step changes anything, and `update` then reads these values in place of
        the group's (SINGD: the value of a callable `lr_cov`). The default has
        none.

        Args:
            group: The layer's options.
            step: The layer's step counter.

        Returns:
            Option name to value (empty: none).
        """
        return {}

    @abstractmethod
    def structures(self, group: dict[str, Any]) -> tuple[str, str]:
        """Return the structure names of the input- and output-side factors.

        Args:
            group: The layer's parameter group.

        Returns:
            `(K structure, C structure)`.
        """

    @abstractmethod
    def init_state(
        self,
        group: dict[str, Any],
        dims: tuple[int, int],
        dtypes: tuple[torch.dtype, torch.dtype],
        device: torch.device | str,
    ) -> dict[str, Any]:
        """Return a layer's initial factor state (plain tensors and numbers).

        Args:
            group: The layer's parameter group.
            dims: `(d_K, d_C)`.
            dtypes: The factors' dtypes `(K side, C side)`.
            device: Their device.

        Returns:
            The entries to put into the layer's state.
        """

    @abstractmethod
    def project(
        self,
        preconditioner: Preconditioner | None,
        a: Tensor,
        g: Tensor,
        *,
        group: Mapping[str, Any],
    ) -> tuple[StructuredMatrix, StructuredMatrix]:
        r"""Return one micro-batch's statistics from the rows \(a\), \(\tilde g\).

        Args:
            preconditioner: The layer's current preconditioner (None unless
                `reads_preconditioner`).
            a: Input rows `[rows, d_K]` (a buffer the rule may overwrite, unless
                it sets `per_example`).
            g: Output-gradient rows `[rows, d_C]` (leave intact).
            group: The layer's options (`Layer.options`: its own structures).

        Returns:
            The two matrices that accumulate over micro-batches.
        """

    def project_dense(
        self,
        preconditioner: Preconditioner | None,
        U: Tensor,
        side: int,
        *,
        group: Mapping[str, Any],
    ) -> StructuredMatrix:
        r"""Return one side's statistics from its dense \(U\) (`project`'s form).

        What `project` forms from rows \(B\) with \(B^\top B = U\), for a side
        whose rows were summed into \(U\) (the owners of `Shard(factors="owned")`
        get one side as rows and the other as \(U\)).

        Args:
            preconditioner: As for `project`.
            U: The side's dense statistics, `[d, d]`.
            side: 0 for the input side, 1 for the output side.
            group: The layer's options.

        Returns:
            The side's statistics.

        Raises:
            NotImplementedError: For rules without this form (the default).
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not project one side's dense statistics."
        )

    def zero_statistics(
        self,
        group: dict[str, Any],
        dims: tuple[int, int],
        dtypes: tuple[torch.dtype, torch.dtype],
        device: torch.device,
    ) -> tuple[StructuredMatrix, StructuredMatrix]:
        """Return zeros shaped like `project`'s result (a process without data).

        The default holds for rules whose statistics are in the factors'
        structures (SINGD, KFAC).

        Args:
            group: The layer's parameter group.
            dims: `(d_K, d_C)`.
            dtypes: The factors' dtypes.
            device: Their device.

        Returns:
            Two zero matrices.
        """
        return tuple(
            get_structure(name).zeros(dim, dtype=dtype, device=device)
            for name, dim, dtype in zip(group["structures"], dims, dtypes, strict=True)
        )

    @abstractmethod
    def update(
        self,
        state: dict[str, Any],
        group: dict[str, Any],
        statistics: FactorStatistics,
        preconditioner: Preconditioner | None,
        *,
        sides: tuple[int, ...] = (0, 1),
    ) -> None:
        """Update the layer's factors in `state` from the statistics.

        Args:
            state: The layer's state; its tensors may be updated in place.
            group: The layer's parameter group.
            statistics: The statistics of this update.
            preconditioner: The preconditioner before the update (None unless
                `reads_preconditioner`).
            sides: The sides to update (only passed if `splits_sides`).
        """

    @abstractmethod
    def preconditioner(
        self,
        state: dict[str, Any],
        group: dict[str, Any],
        *,
        sides: tuple[int, ...] = (0, 1),
    ) -> Preconditioner:
        """Return the preconditioner that the layer's state defines.

        Args:
            state: The layer's state.
            group: The layer's parameter group.
            sides: The sides this process applies (only passed if
                `splits_sides`): products may be cached for these alone.

        Returns:
            The preconditioner; its matrices may share the state's tensors.
        """
