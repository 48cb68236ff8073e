"""EKFAC's decompositions apart from its update, and who computes them.

Under `Shard` one rank computes each side's eigenbasis (`EKFACRule.decompose`)
and every rank's update adopts it (`FactorStatistics.decompositions`): the
state must be the one `update` leaves alone, bit for bit. The placement
(`decomposition_plan.assign_decompositions`) is a balanced, deterministic
function of the costs.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from singd_curvlinops.distributed.decomposition_plan import assign_decompositions
from singd_curvlinops.per_example import ExampleGradients
from singd_curvlinops.rules import EKFACRule, FactorStatistics, KFACRule
from singd_curvlinops.structures import DenseMatrix, get_structure

DIMS = (9, 6)  # (d_K, d_C)
GROUP = {"structures": ("dense", "dense"), "ema_decay": 0.9, "damping": 1e-3}


def _statistics(seed: int, scale: float = 1.0) -> FactorStatistics:
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(10, DIMS[0], generator=generator, dtype=torch.float64)
    g = torch.randn(10, DIMS[1], generator=generator, dtype=torch.float64)
    examples = ExampleGradients()
    examples.add(a, g, 10)
    collected = (DenseMatrix(scale * a.T @ a), DenseMatrix(g.T @ g))
    return FactorStatistics(collected=collected, examples=examples)


def _state(rule: EKFACRule, updates: int) -> dict:
    """A layer's state after `updates` updates on one process."""
    state = rule.init_state(GROUP, DIMS, (torch.float64,) * 2, "cpu")
    for seed in range(updates):
        rule.update(state, GROUP, _statistics(seed), None)
    return state


def _copy(state: dict) -> dict:
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}


@pytest.mark.parametrize("updates", [0, 2], ids=["first", "averaged"])
def test_an_update_with_handed_decompositions_leaves_the_same_state(
    updates: int,
) -> None:
    rule = EKFACRule()
    alone = _state(rule, updates)
    handed = _copy(alone)
    statistics = _statistics(7)
    bases = tuple(rule.decompose(handed, GROUP, statistics, side) for side in (0, 1))
    for key, value in alone.items():  # (decompose changes nothing)
        assert torch.equal(torch.as_tensor(value), torch.as_tensor(handed[key])), key
    rule.update(alone, GROUP, statistics, None)
    rule.update(handed, GROUP, replace(statistics, decompositions=bases), None)
    assert alone.keys() == handed.keys()
    for key, value in alone.items():
        assert torch.equal(torch.as_tensor(value), torch.as_tensor(handed[key])), key
    assert torch.equal(bases[0], alone["Q_A.mat"])
    assert not torch.equal(alone["Q_A.mat"], torch.eye(DIMS[0], dtype=torch.float64))


def test_the_averaged_factor_is_the_updated_one_bit_for_bit() -> None:
    rule, statistics = EKFACRule(), _statistics(3)
    state = _state(rule, 1)
    averaged = [rule.averaged(state, GROUP, statistics, side) for side in (0, 1)]
    KFACRule.update(rule, state, GROUP, statistics, None)
    assert torch.equal(averaged[0].mat, state["A.mat"])
    assert torch.equal(averaged[1].mat, state["G.mat"])


def test_a_factor_that_is_not_finite_keeps_its_basis() -> None:
    """`decompose` returns the basis the side keeps (the state's), and `update`
    with it keeps the basis."""
    rule = EKFACRule()
    state = _state(rule, 1)
    before = state["Q_A.mat"].clone()
    statistics = _statistics(5, scale=float("inf"))
    bases = tuple(rule.decompose(state, GROUP, statistics, side) for side in (0, 1))
    assert bases[0] is state["Q_A.mat"] and not torch.equal(bases[1], state["Q_G.mat"])
    rule.update(state, GROUP, replace(statistics, decompositions=bases), None)
    assert torch.equal(state["Q_A.mat"], before)
    assert torch.equal(state["Q_G.mat"], bases[1])


@pytest.mark.parametrize("structures", [("dense", "dense"), ("diagonal", "dense")])
def test_a_contribution_is_the_owner_s_part_of_the_examples_collective(
    structures: tuple[str, str],
) -> None:
    """Under owned factors a rank without the state adds its examples'
    squared projections in the owner's bases, as the owner's update does."""
    rule, group = EKFACRule(), {**GROUP, "structures": structures}
    state = rule.init_state(group, DIMS, (torch.float64,) * 2, "cpu")
    seen: dict[str, torch.Tensor] = {}

    def recorded(name: str) -> FactorStatistics:
        statistics = _statistics(4)
        dense = tuple(map(DenseMatrix.to_dense, statistics.collected))
        collected = tuple(
            get_structure(n).from_dense(M)
            for n, M in zip(structures, dense, strict=True)
        )
        statistics = replace(statistics, collected=collected)
        statistics.examples.reduce = lambda total: seen.setdefault(name, total)
        return statistics

    statistics = recorded("owner")
    bases = tuple(
        rule.decompose(state, group, statistics, side)
        if side in rule.decomposed_sides(group)
        else None
        for side in (0, 1)
    )
    rule.update(state, group, replace(statistics, decompositions=bases), None)
    other = replace(recorded("contribution"), decompositions=bases)
    rule.contribute(group, other, DIMS, torch.device("cpu"))
    assert torch.equal(seen["owner"], seen["contribution"])
    with pytest.raises(NotImplementedError, match="reads no other rank's numbers"):
        KFACRule().contribute(GROUP, statistics, DIMS, torch.device("cpu"))


def test_only_dense_sides_are_decomposed() -> None:
    rule = EKFACRule()
    assert rule.decomposed_sides(GROUP) == (0, 1)
    mixed = {**GROUP, "structures": ("diagonal", "dense")}
    assert rule.decomposed_sides(mixed) == (1,)
    assert KFACRule().decomposed_sides(GROUP) == ()
    with pytest.raises(NotImplementedError, match="KFACRule decomposes no factor"):
        KFACRule().decompose({}, GROUP, _statistics(0), 0)
    state = rule.init_state(mixed, DIMS, (torch.float64,) * 2, "cpu")
    assert "A.diag" in state and "Q_A.mat" not in state and "Q_G.mat" in state


def test_decompositions_go_largest_first_to_the_least_loaded_rank() -> None:
    # the benchmark MLP's dense sides (T = 1): 785 and 512, 513 and 512, 513, 10
    costs = [(785.0**3, 512.0**3), (513.0**3, 512.0**3), (513.0**3, 10.0**3)]
    assert assign_decompositions(costs, 2) == [(0, 1), (1, 1), (1, 0)]
    # three ranks: the largest alone, the four next two by two, the smallest
    # to the first of the two equally loaded ranks
    assert assign_decompositions(costs, 3) == [(0, 1), (1, 2), (2, 1)]
    # ties to the lower rank; a side without a decomposition gets rank 0
    assert assign_decompositions([(8.0, 0.0), (8.0, 8.0)], 2) == [(0, 0), (1, 0)]
    # more ranks than decompositions: the others idle
    assert assign_decompositions([(1.0, 2.0)], 4) == [(1, 0)]
    assert assign_decompositions([], 2) == []
