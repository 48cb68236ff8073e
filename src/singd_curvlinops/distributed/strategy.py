r"""Distribution strategies: which rank does which factor work, and what travels.

An optimizer holds one strategy (`distribute=` of `SINGD` and `KFAC`). Per step
the shell calls `exchange` (before its finiteness check) and `step`; everything
that depends on how the ranks share work lives in the strategies, not in the
shell. `DistributionStrategy` does all work on every rank and defines the hooks;

- `Replicate` (`"replicate"`, the default) is it, named: every rank updates
  every factor and preconditions every layer; the only collective is the
  statistics all-reduce on update steps;
- `Shard` (`"shard"`, module `shard`) gives each layer's factor work an owner.

Under FSDP2 (`fully_shard`) every strategy preconditions the shards (rows or
columns) of the gradient as `fsdp` describes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

from torch import Tensor
from torch.nn import Parameter

from singd_curvlinops.collector import PendingStatistics
from singd_curvlinops.distributed import collectives, raw_gram
from singd_curvlinops.distributed.buffers import Buffers
from singd_curvlinops.distributed.collectives import (
    StepCheck,
    check_same_configuration,
    world_size,
)
from singd_curvlinops.distributed.engine import GatheredStep
from singd_curvlinops.distributed.exchange import (
    StatisticsExchange,
    describe_layers,
    describe_options,
)
from singd_curvlinops.distributed.fsdp import is_sharded, shards_across
from singd_curvlinops.layers import Layer
from singd_curvlinops.rules import FactorRule
from singd_curvlinops.structures import StructuredMatrix

Projection = Callable[[Tensor, Tensor], tuple[StructuredMatrix, StructuredMatrix]]
State = dict[Parameter, dict[str, Any]]  # an optimizer's state


class DistributionStrategy:
    """How the ranks of a `torch.distributed` job share an optimizer's work.

    The base class does all work on every rank (`Replicate`); subclasses
    override the hooks they change: `projection` (what the statistics hooks
    compute), `check_holds`, `_configure` (on new layers or options), `_check`,
    `step`, `full_state` and `loaded` (checkpoints). One process without a process
    group always works alone, whatever the strategy. A strategy object belongs to
    one optimizer (`resolve` copies it).
    """

    rows: str | None = None  # statistics kept as rows (`gram_rows`): see `Shard`
    options: tuple[str, ...] = ()  # the optimizer's option names (`resolve`)
    checks_steps = False  # whether `_check` checks the options at every step

    def __init__(self) -> None:
        self._verified = ""
        self.buffers = Buffers()  # (the messages' buffers, kept between steps)

    def __repr__(self) -> str:
        """Return the strategy as users write it.

        Returns:
            E.g. `"Replicate()"`.
        """
        return f"{type(self).__name__}()"

    def projection(
        self, layer: Layer, rule: FactorRule, group: dict[str, Any]
    ) -> Projection | None:
        """Return how the hooks turn a layer's rows into statistics.

        Args:
            layer: The layer.
            rule: The factor rule.
            group: The layer's options.

        Returns:
            None: the rule's `project` with the layer's factors.
        """
        return None

    def projects_raw_rows(self, rule: FactorRule) -> bool:
        """Return whether owners project the hooks' raw rows (`raw_gram`).

        Args:
            rule: The factor rule.

        Returns:
            Where the hooks keep raw rows (`rows == "raw"`, owned factors), for
            a rule without per-example gradients; EKFAC's owners form its
            statistics from rows instead (`keeps_rows`).
        """
        return self.rows == "raw" and not rule.per_example

    def keeps_rows(self, rule: FactorRule) -> bool:
        r"""Return whether the hooks keep dense statistics as rows (`gram_rows`).

        The rows travel to the side's owner, which forms their Gram matrix.

        Args:
            rule: The factor rule.

        Returns:
            Where the hooks keep projected rows (`rows == "projected"`:
            factors replicated, \(B = a K\) for SINGD, \(a\) for KFAC), for a
            rule without per-example gradients (EKFAC's every rank updates
            there, from all-reduced statistics); where they keep raw rows
            (owned factors), for EKFAC (\(B = a\): its owner forms \(A\) to
            decompose it; the other rules' owners project the raw rows,
            `projects_raw_rows`). False without rows (`Replicate`, one process).
        """
        return self.rows == ("raw" if rule.per_example else "projected")

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
        state: State,
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
        described = describe_options(groups, self.options)
        check = self._check(layers, state, description, described)
        if description != self._verified:
            self._configure(layers, groups, state, rule)
            self.buffers.clear()  # (kept per layer: none for layers now gone)
            self._verified = description

        def zeros(layer: Layer) -> tuple[StructuredMatrix, StructuredMatrix]:
            group = layer.options(groups[layer.group_index])
            dtypes, device = layer.factor_dtypes(group), layer.weight.device
            if self.projection(layer, rule, group) is not None:
                kept = raw_gram.kept_structures(layer, rule, group)
                return raw_gram.raw_zeros(layer.dims, dtypes, device, kept)
            return rule.zero_statistics(group, layer.dims, dtypes, device)

        StatisticsExchange(
            zeros,
            lambda layer: state[layer.weight]["grad_scale"],
            per_example=rule.per_example,
            owners=lambda due: self.statistics_owners(due, rule),
            keep_rows=self.projects_raw_rows(rule),
            options=None if self.checks_steps else described,
            check=check,
            buffers=self.buffers,
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
        state: State,
        rule: FactorRule,
    ) -> None:
        """React to new layers or options (after the ranks agreed on them).

        Args:
            layers: The layers.
            groups: The parameter groups.
            state: The state.
            rule: The factor rule.
        """

    def _check(
        self,
        layers: Sequence[Layer],
        state: State,
        description: str,
        options: str,
    ) -> StepCheck | None:
        """Check the ranks' configuration where it changed (`collectives`).

        Args:
            layers: The layers.
            state: The state.
            description: This rank's configuration (layers, structures,
                options, strategy).
            options: This rank's options (`exchange.describe_options`).

        Returns:
            The check that rides in this step's first collective (None here:
            the statistics all-reduce of the factor updates compares the
            options; `Shard` checks its steps).
        """
        if description != self._verified:
            check_same_configuration(description, layers[0].weight.device)
        return None

    def step(self, stepper: Any, layers: Sequence[Layer]) -> None:
        """Update factors and parameters of every layer.

        Args:
            stepper: The shell's `LayerStepper`.
            layers: The layers of this step, in the same order on every rank.
        """
        shards = shards_across(layers)  # (HSDP: this process's replica)
        if shards.count > 1 and any(is_sharded(layer) for layer in layers):
            plan = dict.fromkeys(layers)
            GatheredStep(
                stepper,
                plan,
                share_state=False,
                dense_statistics=False,
                buffers=self.buffers,
                shards=shards,
            )(layers)
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
        return collectives.agree(flags) if self.owners_decide else flags

    @property
    def owners_decide(self) -> bool:
        """Whether owners check factor updates alone (`Shard` on several ranks)."""
        return False

    def full_state(
        self,
        state: State,
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

    def loaded(self, state: State, rule: FactorRule) -> None:
        """Drop what this rank does not keep from a freshly loaded, complete state.

        Args:
            state: The optimizer's state.
            rule: Its factor rule.
        """


class Replicate(DistributionStrategy):
    """Every rank does all factor work: the base class's behaviour, named."""
