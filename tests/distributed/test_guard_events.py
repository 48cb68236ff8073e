"""Guard events in every distribution mode, against one process (2 gloo processes).

Each mode (`replicate`, `shard`, the owned form, `share="factors"`; the owned
form also under FSDP2) meets each event once, on the test models with and
without fallback parameters and on several structures: an infinite input (the
step is skipped), `lr_cov = 50` (the trust region limits the factor steps),
inputs and a loss scaled by 1e100 (factor updates overflow; the statistics
formed from them overflow at the next step), `lr = 1e308` (the parameter steps
overflow) and, for KFAC, `damping = 0` with an input channel that is always
zero (singular damped factors); EKFAC (replicated, sharded and owned) meets the
infinite input, statistics that overflow and the overflowing step. The ranks must count,
report and take what one process on the whole batch does: the same skipped
steps, discarded updates and warnings, and parameters within 1e-10. (A sweep of
816 such configurations found the owned form stepping where one process
skipped; this is its sample in CI.)
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from tests.distributed.harness import (
    EKFAC_OPTIONS,
    KFAC_OPTIONS,
    SPARSE,
    TOLERANCE,
    Case,
    spawn,
    train_with_event,
)

pytestmark = pytest.mark.slow
MODES = ("replicate", "shard", "owned", "factors")
EVENTS = ("inf", "trust", "huge", "lrblow")
STRUCTURES = (
    ("dense", "dense"),
    ("dense", "diagonal"),
    ("block3diagonal", "triltoeplitz"),
    ("hierarchical3_2", "dense"),
)
MODELS = ("norm", "three", "two")


def _cases() -> dict[str, tuple[Case, str]]:
    """Every mode with every event; structures, models and `T` rotate."""
    cases = {}
    for index, (mode, event) in enumerate(itertools.product(MODES, EVENTS)):
        # `huge` at T = 1 with fallback parameters: the statistics of the step
        # after it overflow where the owners form them (the sweep's finding)
        T = 1 if event == "huge" else 1 + index % 2
        options = {**SPARSE, "T": T, "structures": STRUCTURES[index % 4]}
        if event == "trust":
            options["lr_cov"] = 50.0
        model = "norm" if event == "huge" else MODELS[index % 3]
        cases[f"{mode}-{event}"] = (Case(options, "ddp", mode, model=model), event)
    for mode in MODES:  # KFAC (no trust region; huge factors make it singular)
        kfac = Case(
            {**KFAC_OPTIONS, "T": 1}, "ddp", mode, optimizer="kfac", model="norm"
        )
        cases[f"{mode}-inf-kfac"] = (kfac, "inf")
        # diagonal factors above 8 dimensions: without damping, dense ones of
        # these few examples would be nearly singular, their steps huge but finite
        diagonal = replace(kfac, options={**kfac.options, "max_dense_dim": 8})
        cases[f"{mode}-singular-kfac"] = (diagonal, "singular")
    for name, (case, event) in list(cases.items()):  # owned factors under FSDP2
        if name.startswith("owned-"):
            cases[f"fsdp_{name}"] = (replace(case, wrap="fsdp"), event)
    for mode in ("replicate", "shard", "owned"):  # EKFAC (updates on every rank,
        # or on the owner with every rank's part; its float64 factors of inputs
        # scaled by 1e100 stay finite: no "huge"; those of 1e160 overflow, and
        # every rank skips the step before decomposing)
        ekfac = Case(
            {**EKFAC_OPTIONS, "T": 1}, "ddp", mode, optimizer="ekfac", model="norm"
        )
        for event in ("inf", "lrblow", "overflow"):
            cases[f"{mode}-{event}-ekfac"] = (ekfac, event)
    return cases


CASES = _cases()


def events(results: dict[str, Any], out: Path) -> None:
    """The job of every rank."""
    world, rank = dist.get_world_size(), dist.get_rank()
    for name, (case, event) in CASES.items():
        results[name] = train_with_event(case, event, world, rank)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    job = "tests.distributed.test_guard_events:events"
    return spawn(job, 2, tmp_path_factory.mktemp("guard_events"), timeout=60.0)


@pytest.mark.parametrize("name", sorted(CASES))
def test_ranks_take_the_guarded_steps_of_one_process(
    ranks: list[dict[str, Any]], name: str
) -> None:
    case, event = CASES[name]
    single = train_with_event(case, event, 1, 0)
    if event != "trust":  # (the trust region limits steps without a warning)
        assert single["messages"]  # the event made the guard act
    if event == "singular":  # the convolution's layer skips, naming the cause
        assert any(
            "'0'" in m and "damped factor singular" in m for m in single["messages"]
        )
    for result in ranks:
        assert result[name]["skipped"] == single["skipped"]
        assert result[name]["discarded"] == single["discarded"]
        assert result[name]["messages"] == single["messages"]
        for mine, reference in zip(
            result[name]["params"], single["params"], strict=True
        ):
            scale = reference.abs().max().clamp(min=1e-300)
            assert ((mine - reference).abs().max() / scale).item() < TOLERANCE
