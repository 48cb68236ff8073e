r"""`Shard` (`"shard"`): each layer's factor work is done by its owner rank.

Each layer's factor work has an owner (or two, one per side; see `assignment`),
each side's statistics (or their rows) reach its owner (`owner_statistics`), and
one `all_gather` per step shares the results (`engine`). With
`factors="replicated"` (the default) the owners also send their updated factors,
so every rank keeps every factor (the statistics hooks need them); the momenta
stay with their owner. `state_dict()` gathers what only owners keep, on every
rank — a collective: call it on every rank. With `factors="owned"` only the
owner keeps a layer's factors (and projects the raw rows: `raw_gram`); layers
are not split by sides, but a SINGD layer whose dense \(K\) dominates the
factor state is split by column blocks, and one that dominates the work gets a
helper (`relay`). Under FSDP2 an owner gathers its layers' shards of
\(\Gamma\), preconditions them and sends each rank its block of \(\Delta\)
(`owner_blocks`); such layers are placed whole. EKFAC, whose updates read
every rank's examples, runs them on every rank (with owned factors: on the
owner, the others contributing), and each eigendecomposition on one rank
(`decompositions`); it has no `share="factors"`. At every step the step's first
all-reduce checks that the ranks are at the same step, with the same options
and configuration (`collectives.StepCheck`): on update steps it is the
statistics summary (`owner_statistics`).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

from singd_curvlinops.distributed import ownership, raw_gram
from singd_curvlinops.distributed.assignment import Assignment, assign_layers
from singd_curvlinops.distributed.collectives import (
    StepCheck,
    check_same_configuration,
    world_size,
)
from singd_curvlinops.distributed.engine import GatheredStep
from singd_curvlinops.distributed.fsdp import is_hybrid, is_sharded, shards_across
from singd_curvlinops.distributed.owner_statistics import owner_ranks
from singd_curvlinops.distributed.strategy import (
    DistributionStrategy,
    Projection,
    State,
)
from singd_curvlinops.distributed.summary import summary_length
from singd_curvlinops.layers import Layer
from singd_curvlinops.rules import FactorRule

_FACTORS = ("replicated", "owned")
_SHARE = ("directions", "factors")


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

    checks_steps = True  # (`_check`: at every step, in its first all-reduce)

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
        self._check_length: int | None = None  # (`_check`: agreed at each change)

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

    @property
    def owners_decide(self) -> bool:
        """Whether owners check factor updates alone: on several ranks."""
        return world_size() > 1

    def projection(
        self, layer: Layer, rule: FactorRule, group: dict[str, Any]
    ) -> Projection | None:
        """Return the raw rows' statistics if only owners keep factors (else None).

        Args:
            layer: The layer.
            rule: The factor rule.
            group: The layer's options.

        Returns:
            `(a, g) -> (aᵀa, gᵀg)` kept as the rows, or in a side's
            (block-)diagonal structure (`raw_gram.raw_statistics`), for several
            processes and
            `factors="owned"`; else None.
        """
        if not self.projects_raw_rows(rule):
            return None
        kept = raw_gram.kept_structures(layer, rule, group)
        return raw_gram.raw_statistics(kept)

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
        state: State,
        rule: FactorRule,
    ) -> None:
        """Assign the layers' work; move owner-kept state to its new owners.

        Args:
            layers: The layers.
            groups: The parameter groups.
            state: The state.
            rule: The factor rule.

        Raises:
            ValueError: Under HSDP, if a layer is not sharded (its direction
                would travel to every rank, not within a replica).
        """
        # A transposed twin (tied weights) shares its layer's factors, owner and
        # work: its statistics go to the layer's owners, sides swapped
        # (`owner_ranks`), and are merged into them (`pending.kronecker_sum`).
        layers = [layer for layer in layers if not layer.swapped]
        hybrid = [layer for layer in layers if is_hybrid(layer.weight)]
        whole = [layer.name for layer in layers if not is_sharded(layer)]
        if hybrid and whole:  # (its direction would travel to every rank)
            raise ValueError(
                f"Layer {whole[0]!r} is not sharded, but layer {hybrid[0].name!r} "
                f"is an HSDP shard: under HSDP, {self!r} needs every layer in an "
                "FSDP2 unit (fully_shard the root too), or use "
                "distribute='replicate'."
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
            replicated_updates=rule.per_example,
        )

    def statistics_owners(
        self, due: Sequence[Layer], rule: FactorRule
    ) -> list[tuple[int, int]] | None:
        """Return per due layer the owners of its K and C (`owner_statistics`)."""
        return owner_ranks(self.plan, due, rule, owned=self._owned)

    def _check(
        self,
        layers: Sequence[Layer],
        state: State,
        description: str,
        options: str,
    ) -> StepCheck | None:
        """Check the ranks' step counts, options and configuration at every step.

        At the first step every strategy's configuration check comes first.
        The numbers then ride in this step's first all-reduce (`StepCheck`),
        unless this rank's configuration changed since the ranks last agreed
        on it: then they are checked at once, in an all-reduce of the length
        agreed before, which meets the other ranks' first all-reduce whether or
        not their configuration changed alike.

        Args:
            layers: The layers.
            state: The state.
            description: This rank's configuration.
            options: This rank's options (`exchange.describe_options`).

        Returns:
            The check for the step's first collective (`StatisticsExchange`), or
            None where it was made here.
        """
        device, world = layers[0].weight.device, world_size()
        agreed = self._check_length  # (None before the first step)
        length = StepCheck.size(world) + summary_length(len(layers), world)
        if agreed is None:  # the optimizer's first step
            check_same_configuration(description, device)
        step = state[layers[0].weight]["step"]
        check = StepCheck(step, options, description, agreed or length, device)
        if agreed is not None and description != self._verified:
            check.alone()
            check = None
        self._check_length = length  # (once the ranks agreed on `description`)
        return check

    def step(self, stepper: Any, layers: Sequence[Layer]) -> None:
        """Update owned factors, precondition owned layers, share, apply.

        Args:
            stepper: The shell's `LayerStepper`.
            layers: The layers of this step, in the same order on every rank.
        """
        if world_size() == 1:
            super().step(stepper, layers)
            return
        options = self.step_options(stepper.rule)
        GatheredStep(
            stepper,
            self.plan,
            **options,
            share_verdicts=stepper.guard.shareable,
            buffers=self.buffers,
            shards=shards_across(layers),  # (HSDP: the directions within a replica)
        )(layers)

    def step_options(self, rule: FactorRule) -> dict[str, bool]:
        """Return how a `GatheredStep` of this strategy treats factors and directions.

        Args:
            rule: The factor rule: one with per-example gradients (EKFAC)
                runs every update's collectives on every rank (each update
                reads every rank's examples): its factors are updated on every
                rank, or with owned factors by the owner while the others
                contribute; its preconditioning and its sides' decompositions
                are sharded (`decompositions`).

        Returns:
            `share_state`, `dense_statistics`, `local_directions`,
            `replicated_updates` and `kept_by_owners` (`GatheredStep`'s
            arguments).
        """
        replicated = rule.per_example
        return {
            "share_state": not self._owned and not replicated,
            "dense_statistics": self._owned and not replicated,
            "local_directions": self.share == "factors",
            "replicated_updates": replicated,
            "kept_by_owners": self._owned,
        }

    def full_state(
        self,
        state: State,
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

    def loaded(self, state: State, rule: FactorRule) -> None:
        """Keep only what this rank keeps of a loaded, complete state.

        Args:
            state: The optimizer's state.
            rule: Its factor rule.
        """
        if self.plan and world_size() > 1:
            ownership.drop(state, self.plan, rule, owned=self._owned)
