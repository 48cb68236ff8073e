"""The step guard on 2 gloo processes: every rank applies and counts the same verdicts.

- `Shard` (factors replicated or owned): a factor update that overflows is checked
  by its owner alone; every rank counts and reports it, and the parameters stay
  identical on the ranks and equal to one process on the whole batch (which
  discards the same updates). A parameter step that overflows is skipped alike.
- `Shard`: statistics whose rows are finite on every rank overflow only where
  their owner forms them (rows of about 1e20 in float32). Every rank then skips
  the step as a whole, as one process does (its hooks form the same
  statistics). Before, the owner alone skipped it and the parameters diverged;
  later, every rank discarded the owner's factor update and took the step.
- FSDP2: only rank 0's rows of a layer overflow (rank 1's rows have no gradient,
  only weight decay); the ranks agree, so rank 1 does not step its rows either.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.functional import mse_loss
from torch.nn.parallel import DistributedDataParallel

from singd_curvlinops import SINGD
from singd_curvlinops.distributed import Shard
from tests.distributed.harness import params, spawn, step_recording_warnings

pytestmark = pytest.mark.slow
BATCH, STEPS, BAD_FACTORS, BAD_LR = 8, 5, 4, 2  # steps with events (0-based)
STRATEGIES = {"replicate": "replicate", "shard": "shard", "owned": "owned"}
OWNED = Shard(factors="owned")


def _model() -> nn.Sequential:
    """Two linear layers, no activation: huge inputs overflow both factor updates."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))


def _batch(step: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(step)
    X = torch.randn(BATCH, 4, generator=generator)
    return X * (1e12 if step == BAD_FACTORS else 1.0), torch.randn(BATCH, 3)


def _train(distribute: Any, world: int, rank: int) -> dict[str, Any]:
    """Train STEPS steps on this rank's share; record what the guard did."""
    model = _model()
    net = DistributedDataParallel(model) if world > 1 else model
    if distribute == "owned":
        distribute = OWNED
    opt = SINGD(net, lr=1e-3, momentum=0.5, T=1, lr_cov=0.1, distribute=distribute)
    messages = []
    for step in range(STEPS):
        X, Y = _batch(step)
        share = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        # 1e38: the step overflows; 1e-30: Γ ~ 1e23 of the huge inputs stays small
        opt.param_groups[0]["lr"] = {BAD_LR: 1e38, BAD_FACTORS: 1e-30}.get(step, 1e-3)
        opt.zero_grad()
        scale = 1e3 if step == BAD_LR else 1.0  # lr * Δ ~ 1e38 * 1e2: overflows
        (mse_loss(net(X[share]), Y[share]) * scale).backward()
        messages += step_recording_warnings(opt)
    return {
        "params": params(model),
        "messages": messages,
        "counts": (opt.discarded_factor_updates, opt.skipped_steps),
        "per_layer": [
            opt.state[layer.weight].get("discarded_factor_updates", 0)
            for layer in opt.layers
        ],
    }


def _fsdp(results: dict[str, Any], name: str, distribute: Any) -> None:
    """One Linear(4, 4) on 2 ranks: rows 0-1 on rank 0, rows 2-3 on rank 1."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4, bias=False))
    fully_shard(model[0])
    fully_shard(model)
    opt = SINGD(
        model, lr=1e-3, momentum=0.0, T=1, weight_decay=0.1, distribute=distribute
    )
    X = torch.randn(BATCH, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        Y = model(X).detach()  # rows 2-3: no residual, no gradient
    Y[:, :2] += 100.0
    before = params(model)
    opt.param_groups[0]["lr"] = 1e38  # rank 0's rows overflow, rank 1's do not
    opt.zero_grad()
    mse_loss(model(X), Y).backward()
    messages = step_recording_warnings(opt)
    results[f"fsdp/{name}/unchanged"] = all(
        torch.equal(a, b) for a, b in zip(before, params(model), strict=True)
    )
    results[f"fsdp/{name}/messages"] = messages
    results[f"fsdp/{name}/skipped"] = opt.skipped_steps


def _owner_overflow(distribute: Any, world: int, rank: int) -> dict[str, Any]:
    """One step on rows of 1e20 into layer 0 (17 > 8 rows: they travel as rows)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 6), nn.Linear(6, 40), nn.Linear(40, 3))
    with torch.no_grad():
        model[0].weight.mul_(1e-20)  # its outputs, the later layers' rows, are O(1)
    net = DistributedDataParallel(model) if world > 1 else model
    opt = SINGD(net, lr=1e-3, momentum=0.5, T=1, lr_cov=0.1, distribute=distribute)
    X, Y = torch.randn(8, 16) * 1e20, torch.randn(8, 3)
    share = slice(rank * 8 // world, (rank + 1) * 8 // world)
    before = params(model)
    mse_loss(net(X[share]), Y[share]).backward()
    messages = step_recording_warnings(opt)
    after = params(model)
    changed = [not torch.equal(a, b) for a, b in zip(before, after, strict=True)]
    return {
        "params": params(model),
        "messages": messages,
        "changed": changed,
        "per_layer": [
            opt.state[layer.weight].get("discarded_factor_updates", 0)
            for layer in opt.layers
        ],
        "skipped": opt.skipped_steps,
    }


def agreement(results: dict[str, Any], out: Path) -> None:
    """The job of every rank (see the module docs)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    for name, distribute in STRATEGIES.items():
        results[name] = _train(distribute, world, rank)
    for name in ("shard", "owned"):
        distribute = OWNED if name == "owned" else name
        results[f"overflow/{name}"] = _owner_overflow(distribute, world, rank)
    # every rank its rows; the owner all rows, each rank applying its own
    for name, distribute in (("replicate", "replicate"), ("owned", OWNED)):
        _fsdp(results, name, distribute)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    job = "tests.distributed.test_guard_agreement:agreement"
    return spawn(job, 2, tmp_path_factory.mktemp("guard"))


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_rank_applies_counts_and_reports_the_same_events(
    ranks: list[dict[str, Any]], name: str
) -> None:
    single = _train("replicate", 1, 0)
    assert single["per_layer"] == [1, 1]  # both layers' updates overflow, once
    assert single["counts"] == (2, 1)  # and one parameter step
    for result in ranks:
        assert result[name]["counts"] == single["counts"]
        assert result[name]["per_layer"] == single["per_layer"]
        assert result[name]["messages"] == single["messages"]
        for mine, first in zip(
            result[name]["params"], ranks[0][name]["params"], strict=True
        ):
            assert torch.equal(mine, first)
        for mine, reference in zip(
            result[name]["params"], single["params"], strict=True
        ):
            torch.testing.assert_close(mine, reference, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["replicate", "owned"])
def test_fsdp_ranks_agree_on_a_layer_whose_rows_overflow_on_one_rank(
    ranks: list[dict[str, Any]], name: str
) -> None:
    for result in ranks:
        assert result[f"fsdp/{name}/unchanged"]
        assert result[f"fsdp/{name}/skipped"] == 1
        messages = result[f"fsdp/{name}/messages"]
        assert len(messages) == 1
        assert "skipped the update of layer '0'" in messages[0]


@pytest.mark.parametrize("name", ["shard", "owned"])
def test_statistics_that_overflow_on_their_owner_alone_skip_the_step_everywhere(
    ranks: list[dict[str, Any]], name: str
) -> None:
    single = _owner_overflow("replicate", 1, 0)
    assert not any(single["changed"])  # one process skips the step as a whole
    assert single["skipped"] == 1 and single["per_layer"] == [0, 0, 0]
    assert len(single["messages"]) == 1
    assert "skipped step 1: non-finite" in single["messages"][0]
    first, second = (result[f"overflow/{name}"] for result in ranks)
    for result in (first, second):
        for key in ("changed", "skipped", "per_layer", "messages"):
            assert result[key] == single[key]
    for mine, theirs in zip(first["params"], second["params"], strict=True):
        assert torch.equal(mine, theirs)
