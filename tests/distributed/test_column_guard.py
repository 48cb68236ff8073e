"""The step guard on a `K` split by column blocks (`Shard(factors="owned")`, 2 ranks).

The `"two"` model's 49-dimensional `K` is split by column blocks (25 + 24
columns), whose step each rank takes alone. The ranks must take the steps of one
process on the whole batch, also where the guard acts:

- `skip`: a step whose inputs are not finite (an infinite input on rank 0) is
  skipped as a whole. Before, the blocks took the step's NaN and the layer's
  update was skipped at every later step.
- `trust`: a factor learning rate (`lr_cov = 50`) at which the trust region
  limits the factor steps. Before, the blocks took the unlimited step and the
  parameters ended 1e180 (relative) away from one process's.
- `overflow`: inputs and a loss scaled by 1e100 (float64) at one step: the
  statistics are finite, the factor updates are not (their traces couple
  1e200 with 1e200): discarded and reported as by one process (a learning
  rate of 1e-230 at that step keeps the parameter step finite).
- `formed`: inputs of 1e150 (float64): the dense statistics the ranks all-reduce
  stay finite, but from the next step on `H_K = Kᵀ U_K K`, which the ranks
  form from them, overflows, as one process's hooks' statistics do: every rank
  skips those steps as one process does. Without the check of the formed
  statistics the ranks discarded the factor updates and took the steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

import singd_curvlinops.update as update_module
from tests.distributed.harness import (
    DENSE,
    TOLERANCE,
    Case,
    spawn,
    train_with_event,
)

pytestmark = pytest.mark.slow
# per scenario: options, and the event (`harness.train_with_event`)
SCENARIOS = {
    "skip": ({}, "inf"),
    "trust": ({"lr_cov": 50.0}, "trust"),
    "overflow": ({}, "huge"),
    "formed": ({}, "wide"),
}


def _train(name: str, world: int, rank: int) -> dict[str, Any]:
    """Train a scenario on this rank's share (one process without a group)."""
    options, event = SCENARIOS[name]
    case = Case({**DENSE, **options}, model="two", distribute="owned")
    return train_with_event(case, event, world, rank)


def scenarios(results: dict[str, Any], out: Path) -> None:
    """The job of every rank."""
    world, rank = dist.get_world_size(), dist.get_rank()
    for name in SCENARIOS:
        results[name] = _train(name, world, rank)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    job = "tests.distributed.test_column_guard:scenarios"
    return spawn(job, 2, tmp_path_factory.mktemp("column_guard"), timeout=60.0)


def _error(actual: list[Tensor], expected: list[Tensor]) -> float:
    return max(
        ((a - b).abs().max() / b.abs().max()).item()
        for a, b in zip(actual, expected, strict=True)
    )


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_split_layers_take_the_guarded_steps_of_one_process(
    ranks: list[dict[str, Any]], name: str
) -> None:
    single = _train(name, 1, 0)
    for result in ranks:
        assert result[name]["split"] == [False, True]
        assert result[name]["skipped"] == single["skipped"]
        assert result[name]["discarded"] == single["discarded"]
        assert result[name]["messages"] == single["messages"]
        assert _error(result[name]["params"], single["params"]) < TOLERANCE
    for mine, theirs in zip(
        ranks[0][name]["params"], ranks[1][name]["params"], strict=True
    ):
        assert torch.equal(mine, theirs)


def test_the_scenarios_exercise_the_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    """One process: the skip, the discard of the split layer, the trust region."""
    assert _train("skip", 1, 0)["skipped"] > 0
    overflow = _train("overflow", 1, 0)
    assert overflow["discarded"] == [1, 1]  # the split layer's among them
    formed = _train("formed", 1, 0)
    assert formed["skipped"] > 0 and formed["discarded"] == [0, 0]
    scales = []

    def recorded(lr: Any, norm: Tensor) -> Tensor:
        scale = trust_region(lr, norm)
        scales.append(scale.item())
        return scale

    trust_region = update_module.trust_region
    monkeypatch.setattr(update_module, "trust_region", recorded)
    _train("trust", 1, 0)
    assert min(scales) < 0.5
