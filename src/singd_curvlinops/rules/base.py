r"""The protocol of a factor rule (its records: `rules.records`).

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
from typing import Any

import torch
from torch import Tensor

from singd_curvlinops.rules.records import FactorStatistics, Preconditioner
from singd_curvlinops.structures import StructuredMatrix, get_structure


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

    def decomposed_sides(self, group: Mapping[str, Any]) -> tuple[int, ...]:
        """Return the sides whose update decomposes the averaged factor.

        Such a decomposition (EKFAC's eigenbasis) is the costliest part of an
        update whose other parts every rank must repeat (they read every rank's
        examples): under `Shard` one rank computes it with `decompose` and
        shares it, and the others pass it to `update` in
        `FactorStatistics.decompositions`. The default: none.

        Args:
            group: The layer's options (structures resolved).

        Returns:
            The sides, each with a square decomposition of the side's dimension.
        """
        return ()

    def decompose(
        self,
        state: dict[str, Any],
        group: dict[str, Any],
        statistics: FactorStatistics,
        side: int,
    ) -> Tensor | None:
        """Return the decomposition of a side that `update` would compute.

        It reads the state and changes nothing; `update` with the result in
        `FactorStatistics.decompositions` leaves the same state, bit for bit,
        as `update` without it.

        Args:
            state: The layer's state before the update.
            group: The layer's options.
            statistics: The statistics of the update.
            side: One of `decomposed_sides(group)`.

        Returns:
            The decomposition that the side holds after `update`: a new one,
            or the previous one (where the averaged factor is not finite).

        Raises:
            NotImplementedError: For a rule without `decomposed_sides`.
        """
        raise NotImplementedError(f"{type(self).__name__} decomposes no factor.")

    def contribute(
        self,
        group: Mapping[str, Any],
        statistics: FactorStatistics,
        dims: tuple[int, int],
        device: torch.device,
    ) -> None:
        """Take part in the collectives of `update` without the layer's state.

        Under `Shard(factors="owned")` only a layer's owner keeps its state and
        runs `update`; a rule whose update reads every rank's examples in a
        collective of its own (`per_example`) has every other rank contribute
        its part here, from `statistics` (with `decompositions`, the owner's),
        in the same order of collectives.

        Args:
            group: The layer's options.
            statistics: The statistics of the update, with the decompositions.
            dims: `(d_K, d_C)`.
            device: The layer's device.

        Raises:
            NotImplementedError: For a rule whose update has no collectives.
        """
        raise NotImplementedError(
            f"{type(self).__name__}'s update reads no other rank's numbers."
        )

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
