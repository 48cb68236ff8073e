r"""Who does which factor work: a per-structure cost model and a balanced assignment.

**Cost model.** Per layer and side (\(K\) of dimension \(d_K\), \(C\) of
dimension \(d_C\)) the work is estimated in multiply-adds per step from the number
\(n\) of entries the side's structure stores at its dimension \(d\) (dense
\(d^2\), diagonal \(d\), `block{B}diagonal` about \(dB\), ...). One product of two
factors of that structure costs about \(p = n^2 / d\) (dense \(d^3\), diagonal
\(d\), block-diagonal \(d B^2\)); then

| work | multiply-adds | when |
|---|---|---|
| factor update | \(2p\) (\(\Pi(K^\top K)\), \(K m_K\)) | every `T` steps |
| cached product | \(p\) (\(K K^\top\), or KFAC's inverse) | every `T` steps |
| applying the side to \(\Gamma\) | \(n\, m\) (\(2 n\, m\) uncached) | every step |

(\(m\): the other side's dimension)

with the first two divided by `T`. A side's product is cached as SINGD caches it
(`SINGDRule.preconditioner`): if `T > 1`, the structure is sparse, or the side
is the layer's smaller one. The model ranks work; it does not predict time.

**Assignment.** Each layer is a *unit* owned by one rank (it updates both factors
and computes \(\Delta = P_C \Gamma P_K\)), or, for rules whose sides can be
updated apart (`FactorRule.splits_sides`), it may be *split*: one rank updates
\(K\), another \(C\); the owner of the other side applies it to \(\Gamma\) and
sends the half product to the owner of the *anchor* side (the one whose
application to \(\Gamma\) costs more), which applies the anchor side
(`relay`): each side's owner pays its side's update, cached product and
application, and nothing is paid twice. Units are
placed largest first on the least loaded rank (LPT; ties go to the lower rank);
then the costliest splittable layers are split, one at a time, as long as that
lowers the largest load. Everything is a pure function of the layers' dimensions,
structures and `T` and of the world size: every rank computes the same assignment
without communicating. More ranks than units leave ranks without factor work; a
layer that dominates the model is split.

**Helpers.** Under `Shard(factors="owned")` both factors of a layer stay on
its owner, so a layer is split differently: the owner updates both sides and
applies the anchor side; a *helper* rank applies the other side. The owner
updates that side first and sends the factor to the helper, which applies it to
\(\Gamma\) and sends the half product back (`relay`). The helper keeps nothing:
where one use pays for the side's product \(F F^\top\) (`caches_for_one_use`:
the side is the layer's smaller one) it forms it in every step and applies it
as one product, else it applies \(F (F^\top \cdot)\), two products. Only
SINGD's dense sides are helped (their coupling traces are read before either
side changes). Helpers are placed like split layers: the costliest helpable
layers first, as long as that lowers the largest load, but a helper that would
raise the largest factor state of a rank is passed over (the placement of the
units moves with the helpers, and this form is there to divide the state).

**Column blocks.** Under `Shard(factors="owned")` a layer whose dense \(K\) and
\(m_K\) alone hold more than a rank's fair share of all factor entries cannot be
balanced by placing whole layers: `column_layers` picks such layers, and their
\(K\) is split by column blocks over all ranks (`column_blocks`, see
`columns`); their work is the same on every rank and does not enter the LPT.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

import torch

from singd_curvlinops.distributed.decomposition_plan import (
    assign_decompositions,
    decomposition_costs,
)
from singd_curvlinops.distributed.fsdp import is_sharded
from singd_curvlinops.layers import Layer
from singd_curvlinops.rules import FactorRule, SINGDRule
from singd_curvlinops.rules.singd import caches_for_one_use
from singd_curvlinops.structures import get_structure


@dataclass(frozen=True)
class LayerCost:
    r"""Estimated multiply-adds per step of one layer's factor work, per side.

    Attributes:
        update: Factor update of side 0 (\(K\)) and side 1 (\(C\)), amortised.
        build: Building the side's cached product, amortised.
        apply: Applying the side to the gradient matrix, every step.
        splittable: Whether the sides may be assigned to different ranks.
        helped: A helper's application of the side, every step: it keeps
            nothing, so it forms the side's product at every use where one use
            pays for it (`caches_for_one_use`), else it applies two products.
    """

    update: tuple[float, float]
    build: tuple[float, float]
    apply: tuple[float, float]
    splittable: bool
    helped: tuple[float, float]

    @property
    def whole(self) -> float:
        """The layer's work on one rank."""
        return sum(self.update) + sum(self.build) + sum(self.apply)

    @property
    def anchor(self) -> int:
        """The side whose application costs more (0 on a tie)."""
        return int(self.apply[1] > self.apply[0])


@dataclass(frozen=True)
class Assignment:
    r"""Who does one layer's factor work.

    Attributes:
        owners: The ranks that update side 0 (\(K\)) and side 1 (\(C\)).
        anchor: None if one rank owns the whole layer; else the side whose owner
            finishes \(\Delta\) from the other owner's half product.
        columns: Whether \(K\) is split by column blocks over all ranks (and
            \(C\) kept and updated by every rank); `owners` is then unused.
        helper: Under owned factors, the rank that applies the side that is not
            the anchor (the owner sends it that factor); None: no helper.
        decomposers: For a rule whose updates every rank repeats but whose
            sides' decompositions one rank computes (`FactorRule.decompose`),
            the rank of each side's; None: no side is decomposed.
    """

    owners: tuple[int, int]
    anchor: int | None = None
    columns: bool = False
    helper: int | None = None
    decomposers: tuple[int, int] | None = None

    @property
    def direction_owner(self) -> int:
        """The rank that computes the layer's preconditioned gradient."""
        return self.owners[0 if self.anchor is None else self.anchor]

    @property
    def sender(self) -> int | None:
        """The rank that applies the side that is not the anchor (None: whole)."""
        if self.anchor is None or self.columns:
            return None
        return self.owners[1 - self.anchor] if self.helper is None else self.helper


@lru_cache(maxsize=1024)
def stored_entries(structure: str, dim: int) -> int:
    """Return how many numbers a factor of this structure stores at `dim`.

    Args:
        structure: A structure name (see `get_structure`).
        dim: The factor's dimension.

    Returns:
        The structure's `numel()` (built on the meta device: nothing allocated).
    """
    cls = get_structure(structure)
    return cls.zeros(dim, dtype=torch.float32, device="meta").numel()


def layer_cost(
    structures: tuple[str, str], dims: tuple[int, int], T: int, splittable: bool
) -> LayerCost:
    r"""Return the cost model's estimate for one layer (see the module docs).

    Args:
        structures: Structure names of \(K\) and \(C\).
        dims: `(d_K, d_C)`.
        T: The factor update interval.
        splittable: Whether the rule may update the sides on different ranks.

    Returns:
        The layer's costs.
    """
    entries = [stored_entries(s, d) for s, d in zip(structures, dims, strict=True)]
    products = [n * n / d for n, d in zip(entries, dims, strict=True)]
    others = (dims[1], dims[0])
    once = [
        caches_for_one_use(n, d, other)
        for n, d, other in zip(entries, dims, others, strict=True)
    ]
    cached = [T > 1 or c for c in once]
    uses = [n * other for n, other in zip(entries, others, strict=True)]
    return LayerCost(
        update=(2 * products[0] / T, 2 * products[1] / T),
        build=tuple(p / T if c else 0.0 for p, c in zip(products, cached, strict=True)),
        apply=tuple(u * (1 if c else 2) for u, c in zip(uses, cached, strict=True)),
        splittable=splittable,
        helped=tuple(
            p + u if c else 2 * u for p, u, c in zip(products, uses, once, strict=True)
        ),
    )


@dataclass(frozen=True)
class _Schedule:
    """An assignment and the largest load it leads to."""

    assignments: tuple[Assignment, ...]
    makespan: float


def assign(
    costs: Sequence[LayerCost],
    world_size: int,
    entries: Sequence[tuple[int, int]] = (),
    columns: Sequence[bool] = (),
    *,
    helpers: bool = False,
) -> list[Assignment]:
    r"""Assign every layer's factor work to ranks (see the module docs).

    Args:
        costs: Per layer, in the same order on every rank.
        world_size: The number of ranks.
        entries: Per layer, the stored entries of \(K\) and \(C\) (needed
            with `columns`; with `helpers`, a helper is only accepted if the
            largest factor state of a rank does not grow).
        columns: Per layer, whether its \(K\) may be split by column blocks
            (`column_layers`); empty: none may.
        helpers: Whether the `splittable` layers get a helper (owned factors)
            instead of being split by sides.

    Returns:
        Per layer, its `Assignment`.

    Raises:
        ValueError: If `world_size` is not a positive int.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise ValueError(f"world_size must be a positive int, got {world_size!r}.")
    if world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}.")
    split_columns = column_layers(entries, columns, world_size) if columns else ()
    if split_columns:
        whole = [i for i in range(len(costs)) if i not in split_columns]
        placed = assign(
            [costs[i] for i in whole],
            world_size,
            [entries[i] for i in whole],
            helpers=helpers,
        )
        by_index = dict(zip(whole, placed, strict=True))
        return [
            by_index.get(i, Assignment((0, 0), columns=True)) for i in range(len(costs))
        ]
    split: frozenset[int] = frozenset()
    best = _schedule(costs, world_size, split, helpers)
    candidates = sorted(
        (i for i, cost in enumerate(costs) if cost.splittable),
        key=lambda i: (-costs[i].whole, i),
    )
    for index in candidates:
        trial = _schedule(costs, world_size, split | {index}, helpers)
        if not trial.makespan < best.makespan:
            break
        if (
            helpers
            and entries
            and _most_state(trial, entries) > _most_state(best, entries)
        ):
            continue  # (the memory-saving form keeps its factor state balanced)
        split, best = split | {index}, trial
    return list(best.assignments)


def _most_state(schedule: _Schedule, entries: Sequence[tuple[int, int]]) -> int:
    r"""Return the largest number of factor entries that one rank keeps.

    Args:
        schedule: A placement.
        entries: Per layer, the stored entries of \(K\) and \(C\).

    Returns:
        The maximum over the ranks of the entries of the sides they own.
    """
    kept: dict[int, int] = {}
    for assignment, sides in zip(schedule.assignments, entries, strict=True):
        for owner, n in zip(assignment.owners, sides, strict=True):
            kept[owner] = kept.get(owner, 0) + n
    return max(kept.values(), default=0)


def _schedule(
    costs: Sequence[LayerCost],
    world_size: int,
    split: frozenset[int],
    helpers: bool = False,
) -> _Schedule:
    """Place the units largest first on the least loaded rank.

    Args:
        costs: Per layer.
        world_size: The number of ranks.
        split: The layers whose sides (or whose helped side) are separate units.
        helpers: Whether a split layer's other unit is a helper's application
            of the side that is not the anchor (its owner does the rest).

    Returns:
        The assignment; a split layer whose units land on one rank is whole.
    """
    units = []  # (cost, layer, side or -1 for the whole layer)
    for index, cost in enumerate(costs):
        a, b = cost.anchor, 1 - cost.anchor
        if index in split and helpers:  # the helper keeps no cached product
            units.append((cost.whole - cost.build[b] - cost.apply[b], index, a))
            units.append((cost.helped[b], index, b))
        elif index in split:
            for side in (a, b):
                work = cost.update[side] + cost.build[side] + cost.apply[side]
                units.append((work, index, side))
        else:
            units.append((cost.whole, index, -1))
    units.sort(key=lambda unit: (-unit[0], unit[1], unit[2]))
    loads = [0.0] * world_size
    owner: dict[tuple[int, int], int] = {}
    for work, index, side in units:
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        loads[rank] += work
        owner[index, side] = rank
    assignments = []
    for index in range(len(costs)):
        if index not in split:
            rank = owner[index, -1]
            assignments.append(Assignment((rank, rank)))
            continue
        owners = (owner[index, 0], owner[index, 1])
        anchor = None if owners[0] == owners[1] else costs[index].anchor
        if anchor is None:  # both units on one rank: it does everything
            assignments.append(Assignment(owners[:1] * 2))
        elif helpers:  # the anchor's unit owns both factors
            kept = owners[anchor]
            assignments.append(
                Assignment((kept, kept), anchor, helper=owners[1 - anchor])
            )
        else:
            assignments.append(Assignment(owners, anchor))
    return _Schedule(tuple(assignments), max(loads))


def column_blocks(dim: int, world_size: int) -> list[tuple[int, int]]:
    """Return the balanced column blocks of a `dim`-dimensional factor.

    Args:
        dim: The factor's dimension (at least `world_size`).
        world_size: The number of ranks.

    Returns:
        Per rank, `(start, stop)`; the first `dim % world_size` blocks are one
        column wider than the others.
    """
    size, extra = divmod(dim, world_size)
    starts = [r * size + min(r, extra) for r in range(world_size + 1)]
    return list(zip(starts[:-1], starts[1:], strict=True))


def column_layers(
    entries: Sequence[tuple[int, int]], eligible: Sequence[bool], world_size: int
) -> frozenset[int]:
    r"""Return the layers whose \(K\) is split by column blocks (owned factors).

    A layer is split if it may be (`eligible`: SINGD with a dense \(K\), of
    \(n_K = d_K^2\) entries and at least `world_size` columns) and its \(K\)
    stores more than the fair share \(\frac1W \sum (n_K + n_C)\) of all layers'
    entries: no placement of whole layers could then keep every rank's factor
    state at its share.

    Args:
        entries: Per layer, the stored entries of \(K\) and \(C\).
        eligible: Per layer, whether its \(K\) may be split.
        world_size: The number of ranks.

    Returns:
        The indices of the split layers (none on one rank).
    """
    share = sum(n_K + n_C for n_K, n_C in entries) / world_size
    return frozenset(
        index
        for index, ((n_K, _), ok) in enumerate(zip(entries, eligible, strict=True))
        if ok and 1 < world_size <= math.isqrt(n_K) and n_K > share
    )


def assign_layers(
    layers: Sequence[Layer],
    groups: Sequence[dict],
    rule: FactorRule,
    world: int,
    *,
    owned: bool,
    share_factors: bool,
    replicated_updates: bool = False,
) -> dict[Layer, Assignment]:
    r"""Assign the layers' work to `world` ranks from their options (module docs).

    Args:
        layers: The layers.
        groups: The parameter groups.
        rule: The factor rule (whether sides may split).
        world: The number of ranks.
        owned: Whether only owners keep factors (`Shard(factors="owned")`): sides
            are not split, SINGD's layers may get a helper for a dense side that
            is not the anchor (not an FSDP2 shard: its owner gathers
            \(\Gamma\), `owner_blocks`), and SINGD may split a dense \(K\)
            by column blocks (an FSDP2 shard's too: `column_shards`).
        share_factors: Whether every rank preconditions (`share="factors"`):
            then only the factor updates are balanced.
        replicated_updates: Whether every rank runs every update's
            collectives (rules with per-example gradients, EKFAC): then the
            preconditioning is balanced, and apart from it the sides'
            decompositions (`decomposition_plan`); with `owned`, each layer's
            owner decomposes its sides, as part of its unit.

    Returns:
        Per layer, its assignment.
    """
    splits = rule.splits_sides and not owned
    decomposed = [decomposition_costs(layer, groups, rule) for layer in layers]
    costs, entries, columns = [], [], []
    for layer, decomposition in zip(layers, decomposed, strict=True):
        group = layer.options(groups[layer.group_index])
        structures = rule.structures(group)
        cost = layer_cost(structures, layer.dims, group["T"], splits)
        whole = is_sharded(layer)  # (no helper: FSDP2's Γ is gathered to one owner)
        if owned and type(rule) is SINGDRule:  # a helper for a dense other side
            other = structures[1 - cost.anchor] == "dense"
            cost = replace(cost, splittable=other and not share_factors and not whole)
        if share_factors:
            cost = replace(cost, build=(0.0, 0.0), apply=(0.0, 0.0))
        if replicated_updates:  # (owned factors: the owner decomposes)
            update = decomposition if owned else (0.0, 0.0)
            cost = replace(cost, update=update, build=(0.0, 0.0))
        costs.append(cost)
        entries.append(tuple(map(stored_entries, structures, layer.dims)))
        dense_K = structures[0] == "dense"  # (a tied layer's twin: not split)
        columns.append(
            owned and type(rule) is SINGDRule and dense_K and layer.twin is None
        )
    plan = assign(costs, world, entries, columns, helpers=owned)
    if replicated_updates and any(map(any, decomposed)):
        if owned:  # (the owner keeps the bases it computes)
            ranks = [a.owners for a in plan]
        else:
            ranks = assign_decompositions(decomposed, world)
        plan = [replace(a, decomposers=r) for a, r in zip(plan, ranks, strict=True)]
    return dict(zip(layers, plan, strict=True))
