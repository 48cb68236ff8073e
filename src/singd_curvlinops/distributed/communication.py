r"""The bytes an optimizer's collectives move per step, computed without running one.

- **statistics**: the all-reduce of every update step: the stored entries of each
  layer's \(H_K\), \(H_C\) and an example count (`bytes_per_update`); dense
  \(U_K\), \(U_C\) under `Shard(factors="owned")`; under `Shard` with
  replicated factors the entries are reduced to their owners instead, in one
  all-to-all (`owner_statistics`), the counts in a small all-reduce. EKFAC
  adds its eigenvalue sums (all-reduced, or under owned factors reduced to
  each layer's owner, whose statistics then also travel to it alone).
- **gather**: the `all_gather` of a sharded step (see `engine`): every rank
  receives every rank's share, padded to the largest, so the gathered buffer
  holds `world_size` times the largest share. Layers whose \(K\) is split by
  column blocks (`columns`) add, on update steps, the gather of the blocks and
  two partial traces each, and the step guard's `POWER_ITERATIONS + 1` small
  gathers (`column_bounds`: \(d_K\) numbers per layer and iteration, two
  peaks and a squared norm).
  Factors travel on update steps (`factors="replicated"`), preconditioned
  gradients (or FSDP2's rows, or column blocks' terms) on every step. EKFAC's
  update steps add the gather of its eigenbases (`decompositions`: \(d^2 + 1\)
  numbers per dense side, each rank's padded to the largest). FSDP2 shards
  split by column blocks add, every step, the gather of their blocks of
  \(\Gamma\) (`column_shards`: each rank's padded block and a flag).
  Under HSDP the gathers of the shards' half products and of a column-split
  layer's blocks run within a replica, among the mesh's \(P\) shards.
- **relay**: the point-to-point messages of split layers (`relay`):
  \(d_C d_K + 1\) numbers per split layer and step, and under owned factors
  the helped side's dense factor, \(d^2\) numbers; each sent by one rank to
  one other (all ranks' messages together).
- **blocks**: under `Shard(factors="owned")`, FSDP2 shards go to their owner
  and come back (`owner_blocks`): per such layer and step every rank sends its
  padded block of \(\Gamma\) and a flag to the owner, and the owner sends
  every rank its block of \(\Delta\) and a flag, in two `all_to_all`s; all
  ranks' messages together (those a rank sends itself included).
  Under HSDP only the owner's replica sends its blocks of \(\Gamma\) (\(P\)
  blocks, of \(P\) shards each, and \(W\) blocks of \(\Delta\) back).
- **checks**: the configuration check (once), not counted; the step check of
  `Shard` (`collectives.StepCheck`: \(3P\) float64 numbers per step, the
  ranks' configuration checksums, step counts and options' fingerprints), at
  the head of the statistics summary where an update step reduces the
  statistics to their owners, else in an all-reduce of its own padded to the
  summary's length (\(6 + 2P\) numbers per layer and transposed twin); on
  update steps also the agreement on the statistics that owners formed
  (`formed_statistics`: a 32-bit integer per layer reduced to its owners, or one
  under owned factors). The step guard's verdicts on the inputs and the factor
  updates ride in the gather (one number each, `StepGuard.shared_verdicts`);
  under FSDP2 (shards) they travel in an all-reduce of their own instead,
  a 32-bit integer for the step's inputs, for each side of each updated layer,
  each layer and each fallback parameter (see `singd_curvlinops.guard`); and
  for each grafted FSDP2 shard the sum of its two squared norms over the
  ranks (`LayerStepper.apply`: two numbers of the weight's dtype per layer,
  an all-reduce each). Under `Replicate` the options' fingerprints travel in
  the statistics all-reduce: one number per rank.

Under `Replicate` with FSDP2's shards every rank preconditions its shards, and
the step has a gather too (`Replicate.step`): the rows of \(\Gamma P_K\) or
columns of \(P_C \Gamma\) of every layer whose shards need another rank's (not
those with a diagonal input side: `fsdp.independent_columns`), and the step
guard's agreements on the inputs and on the shards' steps (32-bit integers: one,
then one per sharded layer and sharded fallback parameter).

DDP's own all-reduce of the gradients (the parameters' size, every step) comes
on top under every strategy.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from singd_curvlinops.bounds import POWER_ITERATIONS
from singd_curvlinops.distributed import (
    collectives,
    decompositions,
    step_layout,
)
from singd_curvlinops.distributed.assignment import column_blocks, stored_entries
from singd_curvlinops.distributed.collectives import StepCheck
from singd_curvlinops.distributed.engine import GatheredStep
from singd_curvlinops.distributed.fsdp import (
    ShardPosition,
    any_shards,
    is_sharded,
    local,
    shard_position,
    shards_across,
)
from singd_curvlinops.distributed.gram_rows import applies
from singd_curvlinops.distributed.layout import buffer_dtype
from singd_curvlinops.distributed.owner_statistics import owner_ranks
from singd_curvlinops.distributed.raw_gram import kept_structures
from singd_curvlinops.distributed.shard import Shard
from singd_curvlinops.distributed.shards import block_numel
from singd_curvlinops.distributed.summary import summary_length


def bytes_per_update(
    optimizer: Any,
    *,
    rows: int | Mapping[str, int] | None = None,
    world_size: int | None = None,
) -> int:
    r"""Return the bytes each process sends per factor update (statistics only).

    Args:
        optimizer: A `SINGD`, `KFAC` or `EKFAC` optimizer.
        rows: Under `Shard`: the rows of statistics each process's hooks
            produce per update, per layer name or one number for all (the local
            batch of a linear layer on flat inputs; times the positions of a
            convolution, or of a sequence with `kfac_approx="expand"`). None:
            every side counted as its stored entries (an upper bound).
        world_size: Processes to count for (default: the process group's).

    Returns:
        Size of the all-reduced buffer: every layer's (and every transposed
        twin's: tied weights) stored entries of `H_K` and `H_C` (under
        `Shard(factors="owned")` dense, or in a side's (block-)diagonal
        structure: `raw_gram.kept_structures`) plus one example count, in
        the factors' dtype; for EKFAC also the second collective's
        \(d_C \times d_K\) sums, in at least float32 (under owned factors
        a reduce to the layer's owner, with the same buffer). Where `Shard`
        reduces each side to its owner (`owner_statistics`; with owned factors
        unless a layer is split by column blocks, and for EKFAC only with
        owned factors) the same entries travel in one
        all-to-all (each process's buffer, its own part included), or the
        side's rows (`gram_rows`: `rows` times \(d\) numbers) where all
        processes together have fewer rows than \(d\); and a summary
        all-reduce of \(6 + 2P\) float64 numbers per layer. Under `Replicate`
        the all-reduce also carries the ranks' option fingerprints, \(P\)
        numbers in its dtype (`exchange.all_reduce_statistics`).
    """
    strategy, total, layers = optimizer.distribution, 0, list(optimizer.layers)
    world = world_size or collectives.world_size()
    owned = isinstance(strategy, Shard) and strategy.factors == "owned"
    dense = owned and not optimizer.rule.per_example  # (EKFAC: rule's structures)
    to_owners = _to_owners(optimizer, world)
    wide = False  # whether the all-reduce travels in float64 (`wire_dtype`)
    # (a transposed twin's statistics travel as its own)
    for layer in _with_twins(layers):
        group = layer.options(optimizer.param_groups[layer.group_index])
        structures = group["structures"]
        if dense:  # raw statistics: rows, or in a side's kept structure
            held = kept_structures(layer, optimizer.rule, group)
            structures = tuple(name or "dense" for name in held)
        dtype = torch.promote_types(*layer.factor_dtypes(group))
        wide = wide or dtype == torch.float64
        local = rows.get(layer.name) if isinstance(rows, Mapping) else rows
        # owned factors: the raw rows of any layer; else rows B of dense sides
        eligible = dense or applies(layer, optimizer.rule, group)
        kept = to_owners and local is not None and eligible
        for name, dim in zip(structures, layer.dims, strict=True):
            as_rows = kept and name == "dense" and 0 < local * world < dim
            total += (local * dim if as_rows else stored_entries(name, dim)) * (
                dtype.itemsize
            )
        total += (6 + 2 * world) * 8 if to_owners else dtype.itemsize
        if optimizer.rule.per_example:  # EKFAC's second collective (exchange)
            sums = torch.promote_types(dtype, torch.float32)
            total += layer.dims[0] * layer.dims[1] * sums.itemsize
    if world > 1 and not isinstance(strategy, Shard):  # options' fingerprints
        total += world * (8 if wide else 4)
    return total


def _with_twins(layers: list) -> list:
    """Return the layers and their transposed twins (tied weights), as stepped.

    Args:
        layers: The optimizer's layers.

    Returns:
        Each layer, followed by its twin if it has one: the keys whose
        statistics travel (`KroneckerOptimizer.step`).
    """
    return [k for layer in layers for k in (layer, layer.twin) if k is not None]


def _to_owners(optimizer: Any, world: int, plan: dict | None = None) -> bool:
    """Return whether an update step reduces the statistics to their owners.

    Args:
        optimizer: The optimizer.
        world: The number of ranks.
        plan: The strategy's assignments for `world` ranks, if the caller has
            them (else computed here).

    Returns:
        Under `Shard`, where `owner_statistics.owner_ranks` names the owners
        (as the exchange decides: not for per-example rows unless only
        owners keep factors, nor with a layer split by column blocks).
    """
    strategy = optimizer.distribution
    if not isinstance(strategy, Shard):
        return False
    layers, rule = list(optimizer.layers), optimizer.rule
    if plan is None:
        plan = strategy.assignments(layers, optimizer.param_groups, rule, world)
    owned = strategy.factors == "owned"
    return owner_ranks(plan, _with_twins(layers), rule, owned=owned) is not None


def bytes_per_step(
    optimizer: Any,
    *,
    update: bool,
    world_size: int | None = None,
    rows: int | Mapping[str, int] | None = None,
) -> dict[str, int]:
    """Return the bytes of one step's collectives, by kind (see the module docs).

    Args:
        optimizer: A `SINGD` or `KFAC` optimizer.
        update: Whether the step updates every layer's factors (else none).
        world_size: Ranks to count for (default: the process group's size).
        rows: The statistics rows per process (see `bytes_per_update`).

    Returns:
        `{"statistics": ..., "gather": ..., "relay": ..., "blocks": ...,
        "checks": ...}` in bytes; the gathered buffer as every rank receives
        it, the relay's and the blocks' messages of all ranks together.
    """
    strategy = optimizer.distribution
    world = world_size or collectives.world_size()
    statistics = (
        bytes_per_update(optimizer, rows=rows, world_size=world)
        if update and world > 1
        else 0
    )
    sharded = any_shards(optimizer.layers, optimizer.fallback_params)
    if world == 1 or not (isinstance(strategy, Shard) or sharded):
        nothing = {"gather": 0, "relay": 0, "blocks": 0, "checks": 0}
        return {"statistics": statistics, **nothing}
    if not isinstance(strategy, Shard):
        return {"statistics": statistics, **_replicated_shards(optimizer, world)}
    layers = list(optimizer.layers)
    groups = optimizer.param_groups
    rule = optimizer.rule
    plan = strategy.assignments(layers, groups, rule, world)
    stepper = SimpleNamespace(state=optimizer.state, rule=rule)
    fallback = optimizer.fallback_params
    # the guard's verdicts ride in the gather (`StepGuard.shareable`)
    shared = not any_shards(layers, fallback)
    options = strategy.step_options(rule)  # (as the step builds it)
    shards = _shard_count(layers, world)  # (HSDP: a replica's)
    step = GatheredStep(
        stepper,
        plan,
        **options,
        share_verdicts=shared,
        world=world,
        shards=ShardPosition(0, shards),
    )
    first, layout = step_layout.layouts(step, layers, [update] * len(layers))
    itemsize = buffer_dtype(layers, groups).itemsize
    gathered = 0
    among = step.among(layers).count  # (the step's gather)
    for ranks, items in ([(world, first)] if first else []) + [(among, layout)]:
        shares = [sum(item.numel for item in share) for share in items]
        gathered += ranks * max(shares) * itemsize
    if update and options["replicated_updates"]:  # (EKFAC's eigenbases)
        gathered += decompositions.gathered_bytes(layers, plan, rule, groups, world)
    split = [layer for layer in layers if plan[layer].columns]
    if update and split:
        gathered += _column_bytes(split, groups, world)
    split_shards = [layer for layer in split if is_sharded(layer)]
    if split_shards:  # (their Γ, gathered whole every step: `column_shards`)
        numel = sum(block_numel(layer, shards) for layer in split_shards)
        gathered += shards * numel * itemsize
    relay = 0
    for layer in filter(step.relayed, layers):
        relay += (layer.dims[0] * layer.dims[1] + 1) * itemsize
        if plan[layer].helper is not None:  # the factor shipped to the helper
            relay += layer.dims[1 - plan[layer].anchor] ** 2 * itemsize
    keys = _with_twins(layers)
    # the step guard's all-reduce (FSDP2 only): inputs, sides, layers, fallback
    verdicts = 0 if shared else 1 + (2 * update + 1) * len(layers) + len(fallback)
    to_owners = _to_owners(optimizer, world, plan)
    if update:  # the agreement on what the owners formed (`formed_statistics`)
        if options["dense_statistics"]:  # (owned factors, not EKFAC's)
            verdicts += len(split) < len(layers)
        elif to_owners:
            verdicts += len(keys)  # per due layer and transposed twin (tied weights)
    check = StepCheck.size(world)  # (`StepCheck`: alone, padded to the summary's)
    if not (update and to_owners):
        check += summary_length(len(keys), world)
    # (a replica's blocks to the owner, and the owner's to every rank)
    at_owners = filter(step.at_owner, layers)
    blocks = sum((shards + world) * block_numel(layer, shards) for layer in at_owners)
    return {
        "statistics": statistics,
        "gather": gathered,
        "relay": relay,
        "blocks": blocks * itemsize,
        "checks": 8 * check + 4 * verdicts + _graft_norm_bytes(optimizer),
    }


def _shard_count(layers: list, world: int) -> int:
    """Return the ranks of the gather of FSDP2's shards: `world`, HSDP's shards.

    Args:
        layers: The optimizer's layers.
        world: The number of ranks counted for.

    Returns:
        Under HSDP the mesh's number of shards (`fsdp.shards_across`), else
        `world`.
    """
    position = shards_across(layers)
    return world if position.group is None else position.count


def _graft_norm_bytes(optimizer: Any) -> int:
    """Return the bytes of the grafted FSDP2 shards' norm sums of one step.

    Args:
        optimizer: The optimizer.

    Returns:
        Two numbers of the weight's dtype per grafted sharded layer.
    """
    groups = optimizer.param_groups
    return sum(
        2 * local(layer.weight).dtype.itemsize
        for layer in optimizer.layers
        if is_sharded(layer)
        and shard_position(layer.weight).count > 1
        and groups[layer.group_index]["graft"] is not None
    )


def _replicated_shards(optimizer: Any, world: int) -> dict[str, int]:
    """Return the gather and the checks of `Replicate` under FSDP2 (module docs).

    Args:
        optimizer: The optimizer, its strategy `Replicate`.
        world: The number of ranks.

    Returns:
        `{"gather": ..., "relay": 0, "blocks": 0, "checks": ...}` in bytes.
    """
    layers, fallback = list(optimizer.layers), optimizer.fallback_params
    stepper = SimpleNamespace(state=optimizer.state, rule=optimizer.rule)
    plan = dict.fromkeys(layers)
    shards = _shard_count(layers, world)  # (HSDP: within a replica)
    step = GatheredStep(
        stepper,
        plan,
        share_state=False,
        dense_statistics=False,
        world=world,
        shards=ShardPosition(0, shards),
    )
    _, layout = step_layout.layouts(step, layers, [False] * len(layers))
    largest = max(sum(item.numel for item in share) for share in layout)
    largest *= shards > 1  # (one shard per replica: nothing gathered)
    itemsize = buffer_dtype(layers, optimizer.param_groups).itemsize
    # the inputs' verdict (`verdicts.inputs_verdict`), then the shards' steps
    verdicts = 1 + sum(map(is_sharded, layers))
    verdicts += sum(isinstance(param, DTensor) for param in fallback)
    checks = 4 * verdicts + _graft_norm_bytes(optimizer)
    gather = shards * largest * itemsize
    return {"gather": gather, "relay": 0, "blocks": 0, "checks": checks}


def _column_bytes(layers: list, groups: list, world: int) -> int:
    """Return the bytes of the update gathers of layers split by column blocks.

    Args:
        layers: The split layers.
        groups: The parameter groups.
        world: The number of ranks.

    Returns:
        The blocks with two partial traces each, and the step limits' gathers.
    """
    itemsize = buffer_dtype(layers, groups).itemsize
    shares = [
        sum(
            layer.dims[0] * (stop - start) + 2
            for layer, (start, stop) in (
                (layer, column_blocks(layer.dims[0], world)[r]) for layer in layers
            )
        )
        for r in range(world)
    ]
    dims = sum(layer.dims[0] for layer in layers)
    limits = POWER_ITERATIONS * dims + 3 * len(layers)  # (`column_bounds`)
    return world * (max(shares) + limits) * itemsize
