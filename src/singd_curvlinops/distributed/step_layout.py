r"""What every rank sends in the `all_gather`(s) of a `GatheredStep` (`engine`).

`layouts` lists the items, `item_value` gives this rank's tensor for each, and
`share` gathers them and hands out what arrived.

Every rank computes every rank's layout from the step's assignment and the due
layers alone, so the gathered buffers split the same way everywhere, and
`communication.bytes_per_step` counts them without running a step:

- **state**: the entries of the factors that an owner updated, where the
  factors stay replicated (not the momenta: `FactorRule.owner_state`);
- **directions**: per layer, each sending rank's (half-)preconditioned gradient
  and a flag (0: no gradient): the owner's \(\Delta\), every rank's share of
  an FSDP2 shard (`shards.share_shape`) or every rank's term of a layer split
  by column blocks (`columns`); nothing for layers every rank preconditions
  itself, and nothing for FSDP2 shards whose owner gathers them
  (`owner_blocks`);
- **verdicts**: the step guard's, one number each, where they ride in the
  gather (`StepGuard.shared_verdicts`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from singd_curvlinops.distributed import shards
from singd_curvlinops.distributed.collectives import all_gather_parts, named_collective
from singd_curvlinops.distributed.fsdp import ShardPosition, is_sharded, local
from singd_curvlinops.distributed.layout import (
    Item,
    buffer_dtype,
    kept_everywhere,
    owned_sides,
    rule_keys,
    shape_of,
    verdicts_item,
    write_received,
)
from singd_curvlinops.layers import Layer


def layouts(
    step: Any, layers: Sequence[Layer], due: list[bool]
) -> tuple[list[list[Item]] | None, list[list[Item]]]:
    """Return what every rank sends in the step's `all_gather`(s).

    Args:
        step: The `GatheredStep`.
        layers: The layers.
        due: Per layer, whether its factors update.

    Returns:
        The layout of a first gather of factors (FSDP2 with owned updates, or
        `local_directions`; else None) and of the step's gather, each per rank.
    """
    states = [state_items(step, layers, due, r) for r in range(step.world)]
    among = range(step.among(layers).count)  # (HSDP: a replica's shards, or all)
    directions = [direction_items(step, layers, r) for r in among]
    first = None
    sharded = any(map(is_sharded, layers))
    if (sharded or step.local_directions) and any(states):
        first = states  # preconditioning needs the new factors
    elif any(states):  # (every rank's: no shards)
        directions = [s + d for s, d in zip(states, directions, strict=True)]
    if step.share_verdicts and layers:
        for share in first or directions:
            share.append(verdicts_item(due))
    return first, directions


def state_items(
    step: Any, layers: Sequence[Layer], due: list[bool], r: int
) -> list[Item]:
    """Return the state entries rank `r` sends (of the sides it updated).

    Entries that only their owner keeps (`FactorRule.owner_state`) stay.

    Args:
        step: The `GatheredStep`.
        layers: The layers.
        due: Per layer, whether it updated.
        r: The rank.

    Returns:
        Its `Item`s.
    """
    if not step.share_state:
        return []
    rule, items = step.stepper.rule, []
    for layer, is_due in zip(layers, due, strict=True):
        assignment = step.plan[layer]
        sides = owned_sides(assignment, r)
        if not is_due or assignment is None or not sides:
            continue
        state = step.stepper.state[layer.weight]
        keys = rule_keys(state, rule, sides if rule.splits_sides else None)
        shared = [key for key in keys if kept_everywhere(key, rule, owned=False)]
        items += [Item(layer, "state", key, shape_of(state[key])) for key in shared]
    return items


def direction_items(step: Any, layers: Sequence[Layer], r: int) -> list[Item]:
    """Return the (half-)preconditioned gradients rank `r` sends.

    Args:
        step: The `GatheredStep`.
        layers: The layers.
        r: The rank.

    Returns:
        Its `Item`s, each direction followed by its flag.
    """
    items = []
    for layer in layers:
        d_K, d_C = layer.dims
        if step.at_owner(layer):  # (its blocks travel in `owner_blocks`)
            continue
        if step.split_by_columns(layer):  # every rank sends its term of the sum
            shape = (d_C, d_K)
        elif is_sharded(layer):
            shape = shards.share_shape(layer, step.shards.count)
            if shape is None:  # (finished by each rank alone)
                continue
        elif step.local_work(layer) or step.plan[layer].direction_owner != r:
            continue
        else:
            shape = (d_C, d_K)
        items += [
            Item(layer, "direction", "", shape),
            Item(layer, "flag", "", (1,)),
        ]
    return items


def item_value(item: Item, values: dict, stepper: Any, relay: Any) -> Tensor:
    """Return the tensor this rank sends for one of its items.

    Args:
        item: The item.
        values: This rank's direction per layer.
        stepper: The shell's per-layer operations (`LayerStepper`).
        relay: The step's `relay.Relay` (its flags of relayed layers), or None.

    Returns:
        The tensor (zeros for a missing direction, rows padded).
    """
    if item.kind == "verdicts":
        return stepper.guard.shared_verdicts()
    weight = local(item.layer.weight)
    if item.kind == "state":
        value = stepper.state[item.layer.weight][item.key]
        return value if isinstance(value, Tensor) else torch.tensor([value])
    direction = values.get(item.layer)
    if item.kind == "flag":
        flag = torch.tensor([float(direction is not None)], device=weight.device)
        relayed = relay.flag(item.layer) if relay else None
        return flag if relayed is None else flag * relayed.to(flag.dtype)
    if direction is not None and tuple(direction.shape) == item.shape:
        return direction
    padded = torch.zeros(item.shape, dtype=weight.dtype, device=weight.device)
    if direction is None:
        return padded
    return shards.pad_share(direction, item.layer, padded)  # a short shard


def share(
    step: Any,
    layers: Sequence[Layer],
    layout: list[list[Item]],
    values: dict,
    among: ShardPosition,
    slot: str = "step",
) -> dict[Layer, dict[int, tuple[Tensor, bool]]]:
    """All-gather every rank's items; write received state; collect the rest.

    Args:
        step: The `GatheredStep`.
        layers: The layers of the step.
        layout: Per rank of the gather, its items.
        values: This rank's direction per layer (None: no gradient).
        among: This rank's position among the ranks that gather, and their
            group (the step's: `GatheredStep.among`).
        slot: The gather's buffers (`buffers`: the first gather of factors
            keeps its own, read before the step's gather).

    Returns:
        Per layer with directions, per sending rank: `(direction, flag)`.
    """
    sizes = [sum(item.numel for item in items) for items in layout]
    if not any(sizes):
        return {}
    stepper = step.stepper
    dtype = buffer_dtype(layers, stepper.groups)
    device = local(layers[0].weight).device
    parts = [
        item_value(item, values, stepper, step.relay) for item in layout[among.index]
    ]
    with named_collective("The all_gather of a sharded optimizer's step"):
        buffers = all_gather_parts(
            parts, sizes, dtype, device, step.buffers, slot, among.group
        )
    directions, flags, verdicts = {}, [], []
    for sender, (items, flat) in enumerate(zip(layout, buffers, strict=True)):
        chunks = flat.split([item.numel for item in items])
        for item, flat_chunk in zip(items, chunks, strict=True):
            chunk = flat_chunk.view(item.shape)
            if item.kind == "verdicts":
                verdicts.append(chunk)
            elif item.kind == "direction":
                directions[item.layer, sender] = chunk
            elif item.kind == "flag":
                flags.append((item.layer, sender, chunk))
            elif sender != among.index:
                write_received(stepper, item, chunk)
    if verdicts:  # kept only where every rank kept it
        stepper.guard.adopt((torch.stack(verdicts).amin(0) > 0.5).tolist())
    present = torch.cat([c for *_, c in flags]).tolist() if flags else []
    received: dict[Layer, dict[int, tuple[Tensor, bool]]] = {}
    for (layer, sender, _), flag in zip(flags, present, strict=True):
        received.setdefault(layer, {})[sender] = (directions[layer, sender], bool(flag))
    return received
