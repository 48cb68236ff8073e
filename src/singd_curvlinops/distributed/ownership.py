r"""State kept by its owners only: drop it elsewhere, gather it for checkpoints.

Under `Shard` a state entry of a layer is kept either by every rank (the factors
that the statistics hooks and the preconditioning read, with
`factors="replicated"`) or only by its *source*, the rank that updates it:
the rule's `owner_state` (SINGD's momenta) always, every factor entry with
`factors="owned"`. Every rank keeps the shell's entries (`"step"`,
`"grad_scale"`, the momentum buffers: the parameters are replicated and every rank
applies every layer's update). `gather` brings the entries a rank does not keep to
every rank in one `all_gather` (for `state_dict()` and for a new assignment);
`drop` removes them again. A layer whose \(K\) is split by column blocks
(`columns`) keeps \(C\), \(m_C\) on every rank and only this rank's columns of
\(K\), \(m_K\): `drop` cuts them out, `gather` puts them together. Their
shapes, dtypes and types come from the rule's `init_state` on the meta device.
Without the factors, the statistics hooks keep the raw rows \(a\), \(\tilde g\)
(`raw_gram.raw_statistics`; a (block-)diagonal side's diagonal blocks, which
are all its projection reads), which the owners project themselves (`engine`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.nn import Parameter

from singd_curvlinops.distributed.assignment import Assignment
from singd_curvlinops.distributed.collectives import (
    all_gather_parts,
    named_collective,
    rank,
    world_size,
)
from singd_curvlinops.distributed.columns import block, is_split_key
from singd_curvlinops.distributed.layout import (
    Item,
    buffer_dtype,
    kept_everywhere,
    rule_keys,
    shape_of,
    source,
)
from singd_curvlinops.layers import Layer
from singd_curvlinops.rules import FactorRule

State = dict[Parameter, dict[str, Any]]


def holder(plan: Mapping[Layer, Assignment], layer: Layer, owned: bool) -> int | None:
    r"""Return the rank that keeps a layer's factors, if it is another one.

    Args:
        plan: The assignment (empty before the first step).
        layer: The layer.
        owned: Whether only owners keep factors.

    Returns:
        The owner, None if this rank keeps the factors, or -1 if the layer's
        \(K\) is split by column blocks over all ranks (no rank keeps all of it).
    """
    assignment = plan.get(layer)
    if not owned or assignment is None or world_size() == 1:
        return None
    if assignment.columns:
        return -1
    owner = assignment.owners[0]
    return None if owner == rank() else owner


def drop(
    state: State, plan: Mapping[Layer, Assignment], rule: FactorRule, *, owned: bool
) -> None:
    """Remove the entries this rank does not keep (see the module docs).

    A layer that loses entries gets a new state dictionary, so that a state dict
    taken before still holds them.

    Args:
        state: The optimizer's state.
        plan: The assignment.
        rule: The factor rule.
        owned: Whether only owners keep factors.
    """
    me = rank()
    for layer, assignment in plan.items():
        entries = state[layer.weight]
        if assignment.columns:
            _keep_columns(state, layer, me)
            continue
        dropped = {
            key
            for key in rule_keys(entries, rule, None)
            if not kept_everywhere(key, rule, owned)
            and source(key, assignment, rule) != me
        }
        if dropped:
            state[layer.weight] = {k: v for k, v in entries.items() if k not in dropped}


def _keep_columns(state: State, layer: Layer, me: int) -> None:
    r"""Keep only this rank's columns of a split layer's \(K\), \(m_K\).

    Args:
        state: The optimizer's state (the layer gets a new dictionary).
        layer: A layer split by column blocks.
        me: This rank.
    """
    entries, d_K = state[layer.weight], layer.dims[0]
    columns = block(d_K, me, world_size())
    if columns.stop - columns.start == d_K:
        return
    state[layer.weight] = {
        key: value[:, columns].clone()
        if is_split_key(key) and value.shape[-1] == d_K
        else value
        for key, value in entries.items()
    }


def _templates(
    layers: Sequence[Layer], groups: Sequence[dict[str, Any]], rule: FactorRule
) -> dict[Layer, dict[str, Any]]:
    """Return every layer's initial factor entries, built on the meta device.

    Args:
        layers: The layers.
        groups: The parameter groups.
        rule: The factor rule.

    Returns:
        Per layer, its rule's entries (shapes, dtypes and types only).
    """
    templates = {}
    for layer in layers:
        group = layer.options(groups[layer.group_index])
        dtypes = layer.factor_dtypes(group)
        templates[layer] = rule.init_state(group, layer.dims, dtypes, "meta")
    return templates


def gather(
    state: State,
    plan: Mapping[Layer, Assignment],
    groups: Sequence[dict[str, Any]],
    rule: FactorRule,
    *,
    owned: bool,
) -> None:
    """Give every rank the entries that only their sources keep.

    A collective: every rank must call it with the same plan.

    Args:
        state: The optimizer's state (entries are added in place).
        plan: The assignment under which the sources hold the entries.
        groups: The parameter groups.
        rule: The factor rule.
        owned: Whether only owners keep factors.
    """
    layers = list(plan)
    me, templates = rank(), _templates(layers, groups, rule)
    layout: list[list[Item]] = [[] for _ in range(world_size())]
    for layer in layers:
        for key in sorted(templates[layer]):
            if plan[layer].columns:
                if is_split_key(key):
                    d_K = layer.dims[0]
                    for r, share in enumerate(layout):
                        width = _width(block(d_K, r, len(layout)))
                        share.append(Item(layer, "columns", key, (d_K, width)))
            elif not kept_everywhere(key, rule, owned):
                shape = shape_of(templates[layer][key])
                sender = source(key, plan[layer], rule)
                layout[sender].append(Item(layer, "state", key, shape))
    sizes = [sum(item.numel for item in share) for share in layout]
    if not any(sizes):
        return
    dtype, device = buffer_dtype(layers, groups), layers[0].weight.device
    parts = [_as_tensor(state[item.layer.weight][item.key]) for item in layout[me]]
    with named_collective("Gathering the state from its owners (state_dict)"):
        buffers = all_gather_parts(parts, sizes, dtype, device)
    blocks: dict[tuple[Layer, str], list[Tensor]] = {}
    for sender, items in enumerate(layout):
        chunks = buffers[sender].split([item.numel for item in items])
        for item, chunk in zip(items, chunks, strict=True):
            own = state[item.layer.weight][item.key] if sender == me else None
            if item.kind == "columns":
                blocks.setdefault((item.layer, item.key), []).append(
                    chunk.view(item.shape) if own is None else own
                )
            elif own is None:
                template = templates[item.layer][item.key]
                state[item.layer.weight][item.key] = _restore(template, chunk, device)
    for (layer, key), parts in blocks.items():
        whole = torch.cat([part.to(parts[me].dtype) for part in parts], dim=1)
        state[layer.weight][key] = _restore(templates[layer][key], whole, device)


def _width(columns: slice) -> int:
    """Return how many columns a block has.

    Args:
        columns: The block.

    Returns:
        Its width.
    """
    return columns.stop - columns.start


def _as_tensor(value: Any) -> Tensor:
    """Return a state entry as a tensor (a number as a 1-element tensor).

    Args:
        value: A tensor or a number.

    Returns:
        The tensor.
    """
    return value if isinstance(value, Tensor) else torch.tensor([value])


def _restore(template: Any, chunk: Tensor, device: torch.device) -> Any:
    """Return a received entry in its template's shape, dtype or type.

    Args:
        template: The entry from `init_state` on the meta device.
        chunk: The received numbers.
        device: The layer's device.

    Returns:
        A tensor on `device`, or a number.
    """
    if isinstance(template, Tensor):
        view = chunk.view(template.shape)  # (a copy: not a view of the buffer)
        return view.to(dtype=template.dtype, device=device, copy=True)
    value = chunk.item()
    return round(value) if isinstance(template, int) else value


@contextmanager
def gathered(
    state: State,
    plan: Mapping[Layer, Assignment],
    groups: Sequence[dict[str, Any]],
    rule: FactorRule,
    *,
    owned: bool,
) -> Iterator[None]:
    """Gather the entries kept by their sources only; drop them again on exit.

    Args:
        state: The optimizer's state.
        plan: The assignment.
        groups: The parameter groups.
        rule: The factor rule.
        owned: Whether only owners keep factors.

    Yields:
        None.
    """
    gather(state, plan, groups, rule, owned=owned)
    try:
        yield
    finally:
        drop(state, plan, rule, owned=owned)
