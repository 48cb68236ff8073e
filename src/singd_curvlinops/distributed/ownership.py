r"""Factors kept by their owners only (`Shard(factors="owned")`): drop and gather.

A rank keeps, per layer it does not own, only the shell's entries (`"step"`,
`"grad_scale"`, the momentum buffers: the parameters are replicated and every rank
applies every layer's update). `gather` brings every layer's factor entries to
every rank in one `all_gather` (for `state_dict()` and for a new assignment);
`drop` removes them again. The shapes, dtypes and types of the entries a rank does
not hold come from the rule's `init_state` on the meta device. Without the factors,
the statistics hooks collect the dense \(U_K = a^\top a\), \(U_C\)
(`dense_statistics`), which the owners project themselves.
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
from singd_curvlinops.distributed.layout import SHELL_KEYS, Item, buffer_dtype
from singd_curvlinops.layers import Layer
from singd_curvlinops.rules import FactorRule
from singd_curvlinops.structures import DenseMatrix

State = dict[Parameter, dict[str, Any]]


def holder(plan: Mapping[Layer, Assignment], layer: Layer, owned: bool) -> int | None:
    """Return the rank that keeps a layer's factors, if it is another one.

    Args:
        plan: The assignment (empty before the first step).
        layer: The layer.
        owned: Whether only owners keep factors.

    Returns:
        The owner, or None if this rank keeps the factors.
    """
    assignment = plan.get(layer)
    if not owned or assignment is None or world_size() == 1:
        return None
    owner = assignment.owners[0]
    return None if owner == rank() else owner


def drop(state: State, plan: Mapping[Layer, Assignment]) -> None:
    """Remove the factor entries of the layers this rank does not own.

    Each such layer's state becomes a new dictionary, so that a state dict
    taken before still holds the removed entries.

    Args:
        state: The optimizer's state.
        plan: The assignment.
    """
    me = rank()
    for layer, assignment in plan.items():
        if assignment.owners[0] != me:
            kept = state[layer.weight]
            state[layer.weight] = {k: v for k, v in kept.items() if k in SHELL_KEYS}


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
        group = groups[layer.group_index]
        dtypes = layer.factor_dtypes(group)
        templates[layer] = rule.init_state(group, layer.dims, dtypes, "meta")
    return templates


def gather(
    state: State,
    layers: Sequence[Layer],
    plan: Mapping[Layer, Assignment],
    groups: Sequence[dict[str, Any]],
    rule: FactorRule,
) -> None:
    """Give every rank every layer's factor entries from their owners.

    A collective: every rank must call it with the same layers and plan.

    Args:
        state: The optimizer's state (entries are added in place).
        layers: The layers, in the same order on every rank.
        plan: The assignment under which the owners hold the factors.
        groups: The parameter groups.
        rule: The factor rule.
    """
    me, templates = rank(), _templates(layers, groups, rule)
    layout: list[list[Item]] = [[] for _ in range(world_size())]
    for layer in layers:
        for key in sorted(templates[layer]):
            value = templates[layer][key]
            shape = tuple(value.shape) if isinstance(value, Tensor) else (1,)
            layout[plan[layer].owners[0]].append(Item(layer, "state", key, shape))
    dtype, device = buffer_dtype(layers, groups), layers[0].weight.device
    parts = [_as_tensor(state[item.layer.weight][item.key]) for item in layout[me]]
    sizes = [sum(item.numel for item in share) for share in layout]
    with named_collective("Gathering the factors from their owners (state_dict)"):
        buffers = all_gather_parts(parts, sizes, dtype, device)
    for sender, items in enumerate(layout):
        if sender == me:
            continue
        chunks = buffers[sender].split([item.numel for item in items])
        for item, chunk in zip(items, chunks, strict=True):
            template = templates[item.layer][item.key]
            state[item.layer.weight][item.key] = _restore(template, chunk, device)


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
    state: dict[Parameter, dict[str, Any]],
    plan: dict[Layer, Assignment],
    groups: Sequence[dict[str, Any]],
    rule: FactorRule,
) -> Iterator[None]:
    """Gather every layer's factors onto every rank; drop them again on exit.

    Args:
        state: The optimizer's state.
        plan: The assignment.
        groups: The parameter groups.
        rule: The factor rule.

    Yields:
        None.
    """
    gather(state, list(plan), plan, groups, rule)
    try:
        yield
    finally:
        drop(state, plan)


def dense_statistics(a: Tensor, g: Tensor) -> tuple[DenseMatrix, DenseMatrix]:
    r"""Return the dense \(a^\top a\), \(g^\top g\) (no factor needed).

    Args:
        a: Input rows `[rows, d_K]`.
        g: Output-gradient rows `[rows, d_C]`.

    Returns:
        The two dense matrices.
    """
    return DenseMatrix.from_mat_inner(a.T), DenseMatrix.from_mat_inner(g.T)


def dense_zeros(
    dims: tuple[int, int],
    dtypes: tuple[torch.dtype, torch.dtype],
    device: torch.device,
) -> tuple[DenseMatrix, DenseMatrix]:
    """Return dense zero statistics.

    Args:
        dims: `(d_K, d_C)`.
        dtypes: Their dtypes.
        device: Their device.

    Returns:
        Two dense zero matrices.
    """
    return tuple(
        DenseMatrix.zeros(dim, dtype=dtype, device=device)
        for dim, dtype in zip(dims, dtypes, strict=True)
    )
