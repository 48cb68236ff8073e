"""The cost model and the balanced assignment (pure functions, no processes)."""

from __future__ import annotations

import random

import pytest

from singd_curvlinops.distributed.assignment import (
    Assignment,
    LayerCost,
    assign,
    layer_cost,
)

MLP = [(785, 512), (513, 512), (513, 10)]  # the benchmark's MLP: (d_K, d_C)


def _loads(costs: list[LayerCost], plan: list[Assignment], world: int) -> list[float]:
    """Each rank's work under `plan`, computed from the costs (independently)."""
    loads = [0.0] * world
    for cost, assignment in zip(costs, plan, strict=True):
        if assignment.anchor is None:
            loads[assignment.owners[0]] += cost.whole
            continue
        for side in (0, 1):  # each side's owner applies its own side (the relay)
            work = cost.update[side] + cost.build[side] + cost.apply[side]
            loads[assignment.owners[side]] += work
    return loads


def _mlp(T: int, splittable: bool = True) -> list[LayerCost]:
    return [layer_cost(("dense", "dense"), dims, T, splittable) for dims in MLP]


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_assignments_are_deterministic_and_within_the_world(world: int) -> None:
    rng = random.Random(world)
    costs = [
        layer_cost(
            ("dense", rng.choice(["diagonal", "dense", "block4diagonal"])),
            (rng.randint(1, 80), rng.randint(1, 80)),
            rng.choice([1, 10]),
            rng.random() < 0.5,
        )
        for _ in range(7)
    ]
    plan = assign(costs, world)
    assert plan == assign(list(costs), world)
    for cost, assignment in zip(costs, plan, strict=True):
        assert all(0 <= owner < world for owner in assignment.owners)
        if assignment.anchor is None:
            assert assignment.owners[0] == assignment.owners[1]
        else:
            assert cost.splittable and assignment.owners[0] != assignment.owners[1]


def test_one_rank_does_all_the_work() -> None:
    assert assign(_mlp(1), 1) == [Assignment((0, 0))] * 3


def test_more_ranks_than_layers_leave_ranks_idle() -> None:
    plan = assign(_mlp(10, splittable=False), 5)
    owners = [assignment.owners for assignment in plan]
    assert sorted(owners) == [(0, 0), (1, 1), (2, 2)]


def test_a_dominant_layer_is_split_and_lowers_the_largest_load() -> None:
    costs = _mlp(1)
    assert costs[0].whole > sum(cost.whole for cost in costs) / 2  # it dominates
    plan = assign(costs, 2)
    assert plan[0].anchor == 0 and set(plan[0].owners) == {0, 1}
    whole = assign(_mlp(1, splittable=False), 2)
    assert max(_loads(costs, plan, 2)) < 0.9 * max(_loads(costs, whole, 2))


def _helped_loads(costs: list[LayerCost], plan: list[Assignment], world: int) -> list:
    """Each rank's work with helpers: the owner all but the helped side's use."""
    loads = [0.0] * world
    for cost, assignment in zip(costs, plan, strict=True):
        owner, b = assignment.owners[0], 1 - cost.anchor
        assert assignment.owners == (owner, owner)  # both factors on one rank
        if assignment.helper is None:
            loads[owner] += cost.whole
            continue
        loads[owner] += cost.whole - cost.build[b] - cost.apply[b]
        loads[assignment.helper] += cost.helped[b]
    return loads


def _most_state(plan: list[Assignment], world: int) -> int:
    """The largest number of the MLP's factor entries that one rank keeps."""
    kept = [0] * world
    for (d_K, d_C), assignment in zip(MLP, plan, strict=True):
        kept[assignment.owners[0]] += d_K**2
        kept[assignment.owners[1]] += d_C**2
    return max(kept)


def test_a_helper_forms_the_product_of_the_smaller_side_once() -> None:
    d_K, d_C = MLP[0]  # 785 > 512: C is the smaller side
    for T in (1, 10):
        cost = layer_cost(("dense", "dense"), (d_K, d_C), T, True)
        assert cost.helped == (2 * d_K * d_K * d_C, d_C**3 + d_C * d_C * d_K)
        assert cost.helped[1] < 2 * d_C * d_C * d_K  # less than two products
    diagonal = layer_cost(("diagonal", "dense"), (d_K, d_C), 1, True)
    assert diagonal.helped[0] == d_K + d_K * d_C  # sparse: formed at any size


@pytest.mark.parametrize("world", [2, 3])
def test_a_helper_that_would_pile_up_factor_state_is_passed_over(world: int) -> None:
    costs = _mlp(10)
    entries = [(d_K**2, d_C**2) for d_K, d_C in MLP]
    unguarded = assign(costs, world, helpers=True)
    guarded = assign(costs, world, entries, helpers=True)
    if world == 2:  # by time alone, two helped layers share one owner
        assert sum(a.helper is not None for a in unguarded) == 2
        assert _most_state(unguarded, world) > _most_state(guarded, world)
    whole = assign(_mlp(10, splittable=False), world)
    assert _most_state(guarded, world) <= _most_state(whole, world)
    assert max(_helped_loads(costs, guarded, world)) <= max(_loads(costs, whole, world))


@pytest.mark.parametrize("world", [2, 3])
def test_owned_factors_get_a_helper_instead_of_split_sides(world: int) -> None:
    costs = _mlp(1)
    plan = assign(costs, world, helpers=True)
    assert plan[0].anchor == 0 and plan[0].helper not in (None, plan[0].owners[0])
    assert plan[0].sender == plan[0].helper
    whole = assign(_mlp(1, splittable=False), world)
    assert all(a.helper is None for a in whole)
    helped, unhelped = _helped_loads(costs, plan, world), _loads(costs, whole, world)
    assert max(helped) < max(unhelped)


def test_the_sender_of_a_split_layer_owns_the_other_side() -> None:
    plan = assign(_mlp(1), 2)
    assert plan[0].sender == plan[0].owners[1] != plan[0].owners[0]
    assert plan[1].sender is None and plan[1].helper is None


def test_layers_that_cannot_split_stay_whole() -> None:
    for world in (2, 3, 4):
        assert all(a.anchor is None for a in assign(_mlp(1, splittable=False), world))


@pytest.mark.parametrize(("dims", "anchor"), [((49, 12), 0), ((13, 50), 1)])
def test_the_anchor_is_the_side_costlier_to_apply(dims: tuple, anchor: int) -> None:
    assert layer_cost(("dense", "dense"), dims, 1, True).anchor == anchor


def test_the_cost_model_follows_the_structures() -> None:
    dense = layer_cost(("dense", "dense"), (8, 4), 2, True)
    assert dense.update == (2 * 8**3 / 2, 2 * 4**3 / 2)
    assert dense.build == (8**3 / 2, 4**3 / 2)
    assert dense.apply == (8**2 * 4, 4**2 * 8)
    diagonal = layer_cost(("diagonal", "diagonal"), (8, 4), 1, True)
    assert diagonal.update == (2 * 8, 2 * 4) and diagonal.apply == (8 * 4, 4 * 8)
    blocks = layer_cost(("block2diagonal", "dense"), (8, 4), 1, True)
    assert blocks.build[0] == 8 * 2**2  # d/B blocks of B³


@pytest.mark.parametrize("world", [0, -1, 1.5, True])
def test_a_bad_world_size_raises(world: object) -> None:
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        assign(_mlp(1), world)
