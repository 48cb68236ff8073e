r"""One step in which owners compute and a single `all_gather` shares the results.

Given an `Assignment` per layer (None: every rank does the layer's work), a step

1. **updates factors** where they are owned (every rank takes the all-reduced
   statistics; the owner of a side, or of the layer, applies the rule; a rule
   with per-example gradients, EKFAC, on every rank: `replicated_updates`,
   each eigendecomposition computed by one rank and shared: `decompositions`;
   under owned factors only its owner updates, and the other ranks contribute
   to the update's collective: `kept_by_owners`);
2. **preconditions** where it is owned: the owner of a whole layer computes
   \(\Delta = P_C \Gamma P_K\); a layer split by sides is preconditioned in a
   relay (`relay`): the owner of the other side applies it to \(\Gamma\) right
   after its update and sends the half product point-to-point to the anchor's
   owner, which applies the anchor side; a layer sharded by FSDP2 has every
   rank precondition its rows of \(\Gamma P_K\) (its columns of
   \(P_C \Gamma\), for column shards: see `fsdp` and `shards`), or, where
   only its owner holds its factors, has its shards of \(\Gamma\) gathered
   on the owner, which computes \(\Delta\) (`owner_blocks`); a layer whose
   \(K\) is split by column blocks has every rank compute its term of
   \(\Gamma K K^\top = \sum_r (\Gamma K_r) K_r^\top\) (its factors were
   updated before, together, in a collective of their own: see `columns`;
   FSDP2's blocks of its \(\Gamma\) are first gathered on every rank:
   `column_shards`);
3. **shares** in one `all_gather`: each rank's preconditioned gradients (its
   rows, or its terms), one flag each (0: the layer has no gradient), the step
   guard's verdicts (`StepGuard.shared_verdicts`), and the updated factors of its
   sides if they are replicated (not momenta: `FactorRule.owner_state`);
4. **applies**: received state entries replace the local ones; the owners of
   gathered FSDP2 shards send every rank its block of \(\Delta\) in an
   `all_to_all`; every rank applies the remaining side of the other
   FSDP2-sharded layers, adds up the terms of column-split layers (keeping its
   block of an FSDP2 shard's \(\Delta\)), and then
   applies weight decay, momentum and the learning rate to every layer's
   \(\Delta\).

Every rank applies the same gathered numbers, so the replicated parameters (and
factors) stay bit-identical across ranks. The layout of every rank's share is
computed on every rank from the assignment and the due layers alone
(`step_layout`). Where every rank preconditions with factors that owners just
updated — FSDP2's rows, or `Shard(share="factors")` — the factors travel
first, in an `all_gather` of their own (with `share="factors"` the only one: no
directions travel). Under HSDP (`fsdp`) what combines shards (the gather of
their half products, a column-split layer's blocks of \(\Gamma\)) runs
within a replica (`among`), and owners gather \(\Gamma\) from their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from singd_curvlinops.distributed import (
    column_shards,
    columns,
    decompositions,
    formed_statistics,
    owner_blocks,
    shards,
    step_layout,
)
from singd_curvlinops.distributed.buffers import Buffers
from singd_curvlinops.distributed.collectives import (
    rank,
    world_size,
)
from singd_curvlinops.distributed.fsdp import (
    ShardPosition,
    independent_columns,
    is_sharded,
    local,
)
from singd_curvlinops.distributed.layout import (
    Plan,
    buffer_dtype,
    owned_sides,
)
from singd_curvlinops.distributed.relay import Relay
from singd_curvlinops.layers import Layer


class GatheredStep:
    r"""Run one step of a sharded strategy (see the module docs).

    Args:
        stepper: The shell's per-layer operations.
        plan: Per layer, its assignment (None: every rank does its work).
        share_state: Whether owners send their updated state entries (the
            state stays replicated) or keep them (only owners hold factors).
        dense_statistics: Whether the collected statistics are dense
            \(U_K\), \(U_C\) (for owners that project them themselves).
        local_directions: Whether every rank preconditions every layer itself
            (only the factors are shared; `Shard(share="factors")`).
        share_verdicts: Whether the step guard's verdicts on the inputs and the
            factor updates ride in the last gather (first, if there are two),
            instead of an all-reduce of their own (`StepGuard.adopt`).
        replicated_updates: Whether every rank updates every due layer's
            factors, as `Replicate` does (rules with per-example gradients,
            whose updates read every rank's examples in a collective of their
            own); then the preconditioning is owned, and so is each side's
            decomposition, shared before the updates (`decompositions`).
        kept_by_owners: Whether only a layer's owner keeps its state
            (`Shard(factors="owned")`); with `replicated_updates` the other
            ranks contribute to the update's collectives instead
            (`FactorRule.contribute`).
        world: The number of ranks (default: the process group's), e.g. to
            count the bytes of a step without one.
        buffers: The strategy's message buffers, kept between steps (None:
            allocated for this step).
        shards: Where this rank's FSDP2 shards lie (`fsdp.shards_across`;
            under HSDP within its replica: `among`). None: at the rank among
            all ranks (a 1-d mesh).
    """

    def __init__(
        self,
        stepper: Any,
        plan: Plan,
        *,
        share_state: bool,
        dense_statistics: bool,
        local_directions: bool = False,
        share_verdicts: bool = False,
        replicated_updates: bool = False,
        kept_by_owners: bool = False,
        world: int | None = None,
        buffers: Buffers | None = None,
        shards: ShardPosition | None = None,
    ) -> None:
        self.stepper = stepper
        self.plan = plan
        self.share_state = share_state
        self.dense_statistics = dense_statistics
        self.local_directions = local_directions
        self.share_verdicts = share_verdicts
        self.replicated_updates = replicated_updates
        self.kept_by_owners = kept_by_owners
        self.me, self.world = rank(), world or world_size()
        self.shards = shards or ShardPosition(self.me, self.world)
        self.buffers = buffers
        self.relay: Relay | None = None  # (one per step, in `__call__`)
        self._whole: dict[Layer, Tensor | None] = {}  # (`column_shards`)

    def __call__(self, layers: Sequence[Layer]) -> None:
        """Update, precondition, share and apply (see the module docs).

        Args:
            layers: The layers of this step, in the same order on every rank.
        """
        due = [self.stepper.due(layer) for layer in layers]
        is_due = dict(zip(layers, due, strict=True))
        split = [layer for layer in layers if self.split_by_columns(layer)]
        taken = formed_statistics.take(
            self.stepper,
            [layer for layer in layers if is_due[layer] and layer not in split],
            lambda layer: bool(owned_sides(self.plan[layer], self.me)),
            form=self.dense_statistics,
        )
        if self.replicated_updates:  # (each decomposition on one rank, shared)
            # (owned factors: no rank keeps other ranks' bases between steps)
            buffers = None if self.kept_by_owners else self.buffers
            taken = decompositions.share(
                self.stepper, self.plan, taken, self.me, self.world, buffers
            )
        columns.step(self.stepper, [(layer, is_due[layer]) for layer in split])
        relayed = [layer for layer in layers if self.relayed(layer)]
        at_owners = [layer for layer in layers if self.at_owner(layer)]
        exchanged = relayed or at_owners
        dtype = buffer_dtype(layers, self.stepper.groups) if exchanged else None
        self.relay = Relay(
            self.stepper, self.plan, layers, relayed, dtype, self.me, self.buffers
        )
        for layer in layers:
            if layer not in split:
                self._update(layer, is_due[layer], taken.get(layer))
                self.relay.send(layer)
        for layer in relayed:  # a helper's work, after its own updates
            self.relay.help(layer)
        self.stepper.settle_factors()  # (the guard's host numbers, before sharing)
        sharded = {layer for layer in layers if is_sharded(layer)}
        first, layout = step_layout.layouts(self, layers, due)
        if first:  # the factors first, then the preconditioning
            everyone = ShardPosition(self.me, self.world)
            step_layout.share(self, layers, first, {}, everyone, "factors")
        deltas, blocks = {}, {}  # FSDP2 shards under owned factors: at owners
        if at_owners:
            device = local(at_owners[0].weight).device
            exchange = owner_blocks.OwnerBlocks(
                self._owner,
                self.me,
                self.world,
                dtype,
                device,
                self.buffers,
                shards=self.shards.count,  # (HSDP: a replica's)
            )
            deltas = exchange.precondition(self.stepper, at_owners)
        split_shards = [layer for layer in split if layer in sharded]
        self._whole = {}  # (FSDP2 shards split by column blocks: Γ on every rank,
        if split_shards:  # in a message not kept: a whole Γ would undo the sharding)
            groups = self.stepper.groups
            self._whole = column_shards.whole_gradients(
                self.stepper, split_shards, self.shards, buffer_dtype(layers, groups)
            )
        # the relayed layers last: their half products arrive meanwhile
        ordered = sorted(layers, key=self.relayed)
        values = {
            layer: self._direction(layer, layer in sharded)
            for layer in ordered
            if layer not in at_owners
        }
        among = self.among(layers)
        received = step_layout.share(self, layers, layout, values, among)
        self.relay.finish()
        if at_owners:  # every rank its block of Δ
            blocks = exchange.from_owners(at_owners, deltas)
        for layer in layers:
            if layer in received:
                self._apply(layer, received[layer], layer in sharded)
            elif blocks.get(layer) is not None:
                self.stepper.apply(layer, blocks[layer].to(local(layer.weight).dtype))

    # ---------------------------------------------------------------- factors
    def _update(self, layer: Layer, due: bool, statistics: Any) -> None:
        """Update the sides of a due layer that this rank owns.

        Args:
            layer: The layer.
            due: Whether its factors update in this step.
            statistics: Its statistics (`formed_statistics.take`), or None.
        """
        if due:
            sides = owned_sides(self.plan[layer], self.me)
            if self.replicated_updates and self.kept_by_owners and not sides:
                self.stepper.contribute(layer, statistics)  # (the owner updates)
            elif self.replicated_updates:  # (every rank, in the same order)
                self.stepper.update(layer, statistics)
            elif self.relay.helped_here(layer) and statistics is not None:
                self.relay.update_helped(layer, statistics)
            elif self.stepper.rule.splits_sides and (sides or self.share_state):
                self.stepper.update(layer, statistics, sides)  # () advances counters
            elif sides:
                self.stepper.update(layer, statistics)
        self.stepper.finish(layer, due=due)
        self.relay.ship(layer)  # (a helped layer's factor, also between updates)

    def relayed(self, layer: Layer) -> bool:
        """Return whether two ranks precondition a layer in turn (`relay`).

        Args:
            layer: The layer.

        Returns:
            Whether it is split by sides or has a helper, and its owners (not
            every rank, not its FSDP2 shards) precondition it.
        """
        assignment = self.plan[layer]
        return (
            assignment is not None
            and assignment.anchor is not None
            and not assignment.columns
            and not self.local_work(layer)
            and not is_sharded(layer)
        )

    def at_owner(self, layer: Layer) -> bool:
        r"""Return whether the layer's owner preconditions its gathered shards.

        Args:
            layer: The layer.

        Returns:
            Whether it is sharded by FSDP2 and only its owner holds its factors
            (`Shard(factors="owned")`): \(\Gamma\) goes to the owner and
            \(\Delta\)'s blocks come back (`owner_blocks`).
        """
        return (
            is_sharded(layer)
            and self.plan[layer] is not None
            and not self.plan[layer].columns  # (its terms: `column_shards`)
            and not self.share_state
            and not self.local_directions
        )

    def _owner(self, layer: Layer) -> int:
        """Return the rank that preconditions a layer.

        Args:
            layer: A layer with an assignment.

        Returns:
            Its assignment's `direction_owner`.
        """
        return self.plan[layer].direction_owner

    def among(self, layers: Sequence[Layer]) -> ShardPosition:
        r"""Return this rank's position among the ranks of the step's gather.

        Args:
            layers: The layers of the step.

        Returns:
            `shards` where the gather carries FSDP2 shards' half products (rows
            of \(\Gamma P_K\), columns of \(P_C \Gamma\)), which under HSDP
            travel within a replica; else the rank among all ranks (owners'
            directions, column blocks' terms). Under HSDP a step carries one
            kind or the other (`Shard` shards every layer).
        """
        rows = any(
            is_sharded(layer)
            and not self.at_owner(layer)
            and not self.split_by_columns(layer)
            for layer in layers
        )
        return self.shards if rows else ShardPosition(self.me, self.world)

    def split_by_columns(self, layer: Layer) -> bool:
        r"""Return whether the layer's \(K\) is split by column blocks (`columns`).

        Args:
            layer: The layer.

        Returns:
            Whether its assignment says so.
        """
        assignment = self.plan[layer]
        return assignment is not None and assignment.columns

    # ------------------------------------------------------------- directions
    def _direction(self, layer: Layer, sharded: bool) -> Tensor | None:
        """Compute this rank's (half-)preconditioned gradient of a layer.

        A replicated layer (no assignment, not sharded) is stepped right here.

        Args:
            layer: The layer.
            sharded: Whether its gradient is sharded by FSDP2.

        Returns:
            What this rank sends for the layer (None: nothing or no gradient).
        """
        if self.split_by_columns(layer):  # (FSDP2: Γ gathered in `__call__`)
            grad = self._whole[layer] if sharded else self.stepper.gradient(layer)
            if grad is None:
                return None
            return columns.partial_direction(self.stepper, layer, grad)
        assignment, local_work = self.plan[layer], self.local_work(layer)
        mine = sharded or local_work or assignment.direction_owner == self.me
        grad = self.stepper.gradient(layer) if mine else None
        if grad is None:
            return None
        if self.relayed(layer):  # the anchor side on the other side's half product
            half = self.relay.receive(layer)
            record = self.stepper.preconditioner(layer, (assignment.anchor,))
            return record.apply_side(assignment.anchor, half, overwrite=True)
        record = self.stepper.preconditioner(layer, (0, 1))
        if sharded and independent_columns(layer):  # finished here
            here, count = self.shards.index, self.shards.count
            direction = shards.scaled_columns(layer, record, grad, here, count)
            self.stepper.apply(layer, direction)
            return None
        if sharded:  # its rows of Γ P_K, or its columns of P_C Γ
            return shards.half_product(layer, record, grad)
        if local_work:  # replicated work on this rank alone
            self.stepper.apply(layer, record.apply(grad, overwrite=True))
            return None
        return record.apply(grad, overwrite=True)

    def local_work(self, layer: Layer) -> bool:
        """Return whether every rank preconditions the layer itself.

        Args:
            layer: The layer.

        Returns:
            True for replicated work or shared factors (not for FSDP2 shards).
        """
        return (self.plan[layer] is None or self.local_directions) and not is_sharded(
            layer
        )

    # ---------------------------------------------------------------- apply
    def _apply(
        self, layer: Layer, parts: dict[int, tuple[Tensor, bool]], sharded: bool
    ) -> None:
        """Finish a layer's direction from the gathered parts and apply it.

        Args:
            layer: The layer.
            parts: Per sending rank, `(direction, flag)`.
            sharded: Whether the layer is sharded by FSDP2.
        """
        weight = local(layer.weight)
        if self.split_by_columns(layer):
            terms = [parts[r][0] for r in range(self.world) if parts[r][1]]
            if terms:
                direction = columns.finish_direction(self.stepper, layer, terms)
                if sharded:  # (its block: rows, or columns and the bias column)
                    here, count = self.shards.index, self.shards.count
                    rows = shards.held(layer, here, count)
                    direction = shards.own_block(layer, direction, here, count, rows)
                self.stepper.apply(layer, direction.to(weight.dtype))
            return
        if sharded:
            if not any(flag for _, flag in parts.values()):
                return
            record = self.stepper.preconditioner(layer, (0, 1))
            received = [parts[r][0] for r in range(self.shards.count)]
            here = self.shards.index
            direction = shards.finish(layer, record, received, here, weight.shape[0])
        else:
            assignment = self.plan[layer]
            direction, flag = parts[assignment.direction_owner]
            if not flag:
                return
        self.stepper.apply(layer, direction.to(weight.dtype))
