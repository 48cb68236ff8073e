"""EKFAC's eigendecompositions under `"shard"`: one rank each, shared (2 gloo ranks).

`distributed.decompositions`: every rank repeats EKFAC's update (it reads every
rank's examples) but takes each side's eigenbasis from the rank assigned to it.
The ranks must compute each decomposition once between them, train as
`"replicate"` does and as one process does, and report a failing
decomposition on every rank instead of leaving the others waiting.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import pytest
import torch

from tests.distributed.harness import TOLERANCE, reference, spawn
from tests.distributed.jobs_decompositions import EKFAC_SHARD

pytestmark = pytest.mark.slow
MODELS = ("three", "tied")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("decompositions")
    return spawn("tests.distributed.jobs_decompositions:decompositions", 2, out)


@pytest.mark.parametrize("model", MODELS)
def test_each_decomposition_is_computed_once_between_the_ranks(
    ranks: list[dict[str, Any]], model: str
) -> None:
    replicated = [Counter(r[f"replicate/{model}"]["shapes"]) for r in ranks]
    sharded = [Counter(r[f"shard/{model}"]["shapes"]) for r in ranks]
    assert replicated[0] == replicated[1] and sum(replicated[0].values()) > 0
    assert sharded[0] + sharded[1] == replicated[0]  # (each once, in all)
    assert all(0 < sum(c.values()) < sum(replicated[0].values()) for c in sharded)


@pytest.mark.parametrize("model", MODELS)
def test_under_owned_factors_the_owner_decomposes_its_layers(
    ranks: list[dict[str, Any]], model: str
) -> None:
    """The owner computes its layers' bases and keeps them; the other rank only
    uses them in the step (the gather's buffers are not kept)."""
    replicated = Counter(ranks[0][f"replicate/{model}"]["shapes"])
    owned = [Counter(r[f"owned/{model}"]["shapes"]) for r in ranks]
    assert owned[0] + owned[1] == replicated
    record = ranks[0][f"owned/{model}"]
    assert record["decomposers"] == record["owners"]
    assert not any(r[f"owned/{model}"]["kept_bases"] for r in ranks)
    assert all(r[f"shard/{model}"]["kept_bases"] for r in ranks)


def test_the_decompositions_are_balanced_between_the_ranks(
    ranks: list[dict[str, Any]],
) -> None:
    """The model's largest factor (49) goes to one rank, the next two to the
    other: the same placement on every rank."""
    placements = [r["shard/three"]["decomposers"] for r in ranks]
    assert placements[0] == placements[1]
    assert placements[0][1][0] != placements[0][2][1]  # K (49) and C (60) apart


@pytest.mark.parametrize("model", MODELS)
def test_sharded_decompositions_train_as_one_process(
    ranks: list[dict[str, Any]], model: str
) -> None:
    expected = reference(replace(EKFAC_SHARD, model=model))
    for result in ranks:
        for distribute in ("replicate", "shard", "owned"):
            trained = result[f"{distribute}/{model}"]["params"]
            for actual, wanted in zip(trained, expected, strict=True):
                error = ((actual - wanted).abs().max() / wanted.abs().max()).item()
                assert error < TOLERANCE, (distribute, error)
        replicate = result[f"replicate/{model}"]["params"]
        # (the same bits under "shard"; with owned factors the owner forms a
        # dense side's statistics from every rank's rows in one product, which
        # rounds otherwise than the all-reduce of each rank's product)
        trained = result[f"shard/{model}"]["params"]
        assert all(map(torch.equal, trained, replicate))
    for distribute in ("shard", "owned"):
        first, second = (r[f"{distribute}/{model}"]["params"] for r in ranks)
        assert all(map(torch.equal, first, second))


def test_a_failing_decomposition_raises_on_every_rank(
    ranks: list[dict[str, Any]],
) -> None:
    """The rank that computes it raises its error; the other names that rank
    and the layer, after the gather (no rank waits; they train on together)."""
    owner = ranks[0]["shard/three"]["decomposers"][1][0]  # (the failing side's)
    messages = [r["failure/shard"] for r in ranks]
    assert "injected" in messages[owner]
    other = messages[1 - owner]
    assert f"failed on rank {owner}" in other and "layer '3'" in other
    assert "(49, 49) factor of side 0" in other
    assert all("injected" in r["failure/replicate"] for r in ranks)
    owned = [r["failure/owned"] for r in ranks]  # (the owner decomposes)
    holder = ranks[0]["owned/three"]["decomposers"][1][0]
    assert "injected" in owned[holder]
    assert f"failed on rank {holder}" in owned[1 - holder]
    assert torch.equal(ranks[0]["after_failure"][0], ranks[1]["after_failure"][0])
