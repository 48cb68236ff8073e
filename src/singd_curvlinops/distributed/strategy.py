r"""Distribution strategies: which rank does which factor work, and what travels.

An optimizer holds one strategy (`distribute=` of `SINGD` and `KFAC`). Per step
the shell calls `exchange` (before its finiteness check) and `step`; everything
that depends on how the ranks share work lives here, not in the shell.

- `Replicate` (`"replicate"`, the default): every rank updates every factor and
  preconditions every layer; the only collective is the statistics all-reduce
  on update steps.
- `Shard` (`"shard"`): each layer's factor work has an owner (or two, one per
  side; see `assignment`), each side's statistics (or their rows) reach its
  owner (`owner_statistics`), and one `all_gather` per step shares the results
  (`engine`). With `factors="replicated"` (the default) the owners also
  send their updated factors, so every rank keeps every factor (the statistics
  hooks need them); the momenta stay with their owner. `state_dict()` gathers
  what only owners keep, on every rank — a collective: call it on every rank.
  With `factors="owned"` only the owner keeps a layer's factors (and projects
  the raw rows: `gram_rows`); layers are not split by sides, but a SINGD layer
  whose dense \(K\) dominates the factor state is split by column blocks.

Under FSDP2 (`fully_shard`) every strategy preconditions the row shards of the
gradient as `fsdp` describes; `Shard(factors="owned")` is not available there
(the row scheme needs every factor on every rank).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

from torch import Tensor
from torch.nn import Parameter

from singd_curvlinops.collector import PendingStatistics
from singd_curvlinops.distributed import collectives, gram_rows, ownership
from singd_curvlinops.distributed.assignment import Assignment, assign_layers
from singd_curvlinops.distributed.collectives import (
    check_same_configuration,
    check_same_step,
    world_size,
)
from singd_curvlinops.distributed.engine import GatheredStep
from singd_curvlinops.distributed.exchange import StatisticsExchange, describe_layers
from singd_curvlinops.distributed.fsdp import is_sharded
from singd_curvlinops.distributed.owner_statistics import owner_ranks
from singd_curvlinops.layers import Layer
from singd_curvlinops.rules import FactorRule
from singd_curvlinops.structures import StructuredMatrix

Projection = Callable[[Tensor, Tensor], tuple[StructuredMatrix, StructuredMatrix]]
_FACTORS = ("replicated", "owned")
_SHARE = ("directions", "factors")


class DistributionStrategy:
    """How the ranks of a `torch.distributed` job share an optimizer's work.

    The base class does all work on every rank (`Replicate`); subclasses
    override the hooks they change: `projection` (what the statistics hooks
    compute), `check_holds`, `_configure` (on new layers or options), `_check_step`,
    `step`, `full_state` and `loaded` (checkpoints). One process without a process
    group always works alone, whatever the strategy. A strategy object belongs to
    one optimizer (`resolve` copies it).
    """

    rows: str | None = None  # statistics kept as rows (`gram_rows`): see `Shard`

    def __init__(self) -> None:
        self._verified = ""

    def __repr__(self) -> str:
        """Return the strategy as users write it.

        Returns:
            E.g. `"Replicate()"`.
        """
        return f"{type(self).__name__}()"

    def projection(self, layer: Layer) -> Projection | None:
        """Return how the hooks turn a layer's rows into statistics.

        Args:
            layer: The layer.

        Returns:
            None: the rule's `project` with the layer's factors.
        """
        return None

    def check_holds(self, layer: Layer) -> None:
        """Raise unless this rank keeps the layer's factors.

        Args:
            layer: The layer.
        """

    def exchange(
        self,
        pending: dict[Layer, PendingStatistics],
        layers: Sequence[Layer],
        due: Sequence[Layer],
        *,
        groups: Sequence[dict[str, Any]],
        state: dict[Parameter, dict[str, Any]],
        rule: FactorRule,
    ) -> None:
        """Check the ranks' configuration; all-reduce the due layers' statistics.

        Args:
            pending: The collector's pending statistics (updated in place).
            layers: The layers of this step, in the same order on every rank.
            due: Those whose factors update in this step.
            groups: The optimizer's parameter groups.
            state: Its state.
            rule: Its factor rule.
        """
        if world_size() == 1:
            return
        description = f"{describe_layers(layers, groups, rule)}|{self!r}"
        if description != self._verified:
            check_same_configuration(description, layers[0].weight.device)
            self._configure(layers, groups, state, rule)
            self._verified = description
        self._check_step(layers, state)

        def zeros(layer: Layer) -> tuple[StructuredMatrix, StructuredMatrix]:
            group = layer.options(groups[layer.group_index])
            dtypes, device = layer.factor_dtypes(group), layer.weight.device
            if self.projection(layer) is not None:
                return ownership.dense_zeros(layer.dims, dtypes, device)
            return rule.zero_statistics(group, layer.dims, dtypes, device)

        StatisticsExchange(
            zeros,
            lambda layer: state[layer.weight]["grad_scale"],
            per_example=rule.per_example,
            owners=lambda due: self.statistics_owners(due, rule),
            keep_rows=self.rows == "raw",
        )(pending, due)

    def statistics_owners(
        self, due: Sequence[Layer], rule: FactorRule
    ) -> list[tuple[int, int]] | None:
        """Return per due layer who reads its K, C statistics (None: all ranks)."""
        return None

    def _configure(
        self,
        layers: Sequence[Layer],
        groups: Sequence[dict[str, Any]],
        state: dict[Parameter, dict[str, Any]],
        rule: FactorRule,
    ) -> None:
        """React to new layers or options (after the ranks agreed on them).

        Args:
            layers: The layers.
            groups: The parameter groups.
            state: The state.
            rule: The factor rule.
        """

    def _check_step(
        self, layers: Sequence[Layer], state: dict[Parameter, dict[str, Any]]
    ) -> None:
        """Check that the ranks are at the same step (strategies that need it).

        Args:
            layers: The layers.
            state: The state.
        """

    def step(self, stepper: Any, layers: Sequence[Layer]) -> None:
        """Update factors and parameters of every layer.

        Args:
            stepper: The shell's `LayerStepper`.
            layers: The layers of this step, in the same order on every rank.
        """
        sharded = world_size() > 1 and any(is_sharded(layer) for layer in layers)
        if sharded:
            plan = dict.fromkeys(layers)
            GatheredStep(stepper, plan, share_state=False, dense_statistics=False)(
                layers
            )
            return
        for layer in layers:
            stepper.update_factors(layer)
        stepper.settle_factors()
        for layer in layers:
            stepper.step_parameters(layer)

    def agree(self, flags: Tensor) -> Tensor:
        """Return the step guard's verdicts as every rank applies them (`guard`).

        Args:
            flags: This rank's verdicts, True where it checked nothing.

        Returns:
            Under `Shard` on several ranks the minimum over the ranks (owners
            check their factor updates alone; one all-reduce), else `flags`
            (every rank decides alike; FSDP2's rows agree in the guard).
        """
        owners_decide = isinstance(self, Shard) and world_size() > 1
        return collectives.agree(flags) if owners_decide else flags

    def full_state(
        self,
        state: dict[Parameter, dict[str, Any]],
        layers: Sequence[Layer],
        groups: Sequence[dict[str, Any]],
        rule: FactorRule,
    ) -> Any:
        """Return a context in which `state` holds every layer's factors.

        Args:
            state: The optimizer's state.
            layers: Its layers.
            groups: Its parameter groups.
            rule: Its factor rule.

        Returns:
            A context manager (here: nothing to do).
        """
        return nullcontext()

    def loaded(self, state: dict[Parameter, dict[str, Any]], rule: FactorRule) -> None:
        """Drop what this rank does not keep from a freshly loaded, complete state.

        Args:
            state: The optimizer's state.
            rule: Its factor rule.
        """


class Replicate(DistributionStrategy):
    """Every rank does all factor work: the base class's behaviour, named."""


class Shard(DistributionStrategy):
    r"""Each layer's factor work is done by its owner rank (see the module docs).

    Args:
        factors: `"replicated"`: every rank keeps every factor (owners send their
            updates); `"owned"`: only the owner keeps a layer's factors.
        share: `"directions"`: owners precondition and send
            \(\Delta = P_C \Gamma P_K\) every step; `"factors"`: owners send
            only their updated factors and every rank preconditions every layer
            (needs `factors="replicated"`; the benchmarks compare the two).

    Raises:
        ValueError: If `factors` or `share` is not one of the allowed values, or
            `share="factors"` comes with `factors="owned"`.
    """

    def __init__(
        self, *, factors: str = "replicated", share: str = "directions"
    ) -> None:
        super().__init__()
        if factors not in _FACTORS:
            raise ValueError(f"factors must be one of {_FACTORS}, got {factors!r}.")
        if share not in _SHARE:
            raise ValueError(f"share must be one of {_SHARE}, got {share!r}.")
        if share == "factors" and factors == "owned":
            raise ValueError(
                "share='factors' sends the updated factors to every rank, so it "
                "needs factors='replicated', got factors='owned'."
            )
        self.factors, self.share = factors, share
        self.plan: dict[Layer, Assignment] = {}

    def __repr__(self) -> str:
        """Return the strategy as users write it.

        Returns:
            E.g. `"Shard(factors='owned', share='directions')"`.
        """
        return f"Shard(factors={self.factors!r}, share={self.share!r})"

    @property
    def _owned(self) -> bool:
        """Whether only owners keep factors."""
        return self.factors == "owned"

    def projection(self, layer: Layer) -> Projection | None:
        """Return the raw rows' statistics if only owners keep factors (else None).

        Args:
            layer: The layer.

        Returns:
            `(a, g) -> (aᵀa, gᵀg)` kept as the rows (`gram_rows`), for several
            processes and `factors="owned"`; else None.
        """
        if self.rows != "raw":
            return None
        return gram_rows.project_to_rows(None, ownership.dense_statistics)

    @property
    def rows(self) -> str | None:  # type: ignore[override]
        """`"projected"` (`B = a K`), `"raw"` (`a`: owned factors), or None."""
        return None if world_size() == 1 else ("raw" if self._owned else "projected")

    def check_holds(self, layer: Layer) -> None:
        """Raise a `ValueError` if only the owner keeps the layer's factors.

        Args:
            layer: The layer.

        Raises:
            ValueError: If this rank does not keep them.
        """
        owner = ownership.holder(self.plan, layer, self._owned)
        if owner == -1:
            raise ValueError(
                f"Layer {layer.name!r}: under Shard(factors='owned') its K is split "
                "by column blocks over all ranks; no rank holds its preconditioner."
            )
        if owner is not None:
            raise ValueError(
                f"Layer {layer.name!r}: under Shard(factors='owned') its factors "
                f"live on rank {owner} only; ask that rank for its preconditioner."
            )

    def _configure(
        self,
        layers: Sequence[Layer],
        groups: Sequence[dict[str, Any]],
        state: dict[Parameter, dict[str, Any]],
        rule: FactorRule,
    ) -> None:
        """Assign the layers' work; move owner-kept state to its new owners.

        Args:
            layers: The layers.
            groups: The parameter groups.
            state: The state.
            rule: The factor rule.

        Raises:
            ValueError: For `factors="owned"` with FSDP2 row-sharded layers.
        """
        if self._owned and any(is_sharded(layer) for layer in layers):
            raise ValueError(
                "Shard(factors='owned') cannot precondition FSDP2 row shards (every "
                "rank needs every factor there); use 'shard' or 'replicate'."
            )
        if self.plan:  # gather under the old owners first
            ownership.gather(state, self.plan, groups, rule, owned=self._owned)
        self.plan = self.assignments(layers, groups, rule, world_size())
        ownership.drop(state, self.plan, rule, owned=self._owned)

    def assignments(
        self,
        layers: Sequence[Layer],
        groups: Sequence[dict[str, Any]],
        rule: FactorRule,
        world: int,
    ) -> dict[Layer, Assignment]:
        """Assign the layers' work to `world` ranks (see `assignment`).

        Args:
            layers: The layers.
            groups: The parameter groups.
            rule: The factor rule (whether sides may split).
            world: The number of ranks.

        Returns:
            Per layer, its assignment.
        """
        return assign_layers(
            layers,
            groups,
            rule,
            world,
            owned=self._owned,
            share_factors=self.share == "factors",
        )

    def statistics_owners(
        self, due: Sequence[Layer], rule: FactorRule
    ) -> list[tuple[int, int]] | None:
        """Return per due layer the owners of its K and C (`owner_statistics`)."""
        return owner_ranks(self.plan, due, rule, owned=self._owned)

    def _check_step(
        self, layers: Sequence[Layer], state: dict[Parameter, dict[str, Any]]
    ) -> None:
        """Raise on every rank unless all ranks are at the same step.

        Args:
            layers: The layers.
            state: The state.
        """
        check_same_step(state[layers[0].weight]["step"], layers[0].weight.device)

    def step(self, stepper: Any, layers: Sequence[Layer]) -> None:
        """Update owned factors, precondition owned layers, share, apply.

        Args:
            stepper: The shell's `LayerStepper`.
            layers: The layers of this step, in the same order on every rank.
        """
        if world_size() == 1:
            super().step(stepper, layers)
            return
        GatheredStep(
            stepper,
            self.plan,
            share_state=not self._owned,
            dense_statistics=self._owned,
            local_directions=self.share == "factors",
        )(layers)

    def full_state(
        self,
        state: dict[Parameter, dict[str, Any]],
        layers: Sequence[Layer],
        groups: Sequence[dict[str, Any]],
        rule: FactorRule,
    ) -> Any:
        """Return a context in which `state` holds every layer's whole state.

        It gathers what only owners keep (the momenta; with `factors="owned"`
        all factors) from them — a collective: every rank must enter it — and
        drops it again on exit.

        Args:
            state: The optimizer's state.
            layers: Its layers.
            groups: Its parameter groups.
            rule: Its factor rule.

        Returns:
            A context manager.
        """
        if not (self.plan and world_size() > 1):
            return nullcontext()
        return ownership.gathered(state, self.plan, groups, rule, owned=self._owned)

    def loaded(self, state: dict[Parameter, dict[str, Any]], rule: FactorRule) -> None:
        """Keep only what this rank keeps of a loaded, complete state.

        Args:
            state: The optimizer's state.
            rule: Its factor rule.
        """
        if self.plan and world_size() > 1:
            ownership.drop(state, self.plan, rule, owned=self._owned)
