"""A dense `K` split by column blocks under `Shard(factors="owned")` (2 and 3 ranks).

The `"two"` model's 49-dimensional `K` (49 not divisible by 2 or 3) is split;
every case must equal one process on the concatenated batch to 1e-10 in
float64, keep only the rank's columns of `K` and `m_K`, return a complete state
dict, and load across modes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from singd_curvlinops.bounds import POWER_ITERATIONS
from singd_curvlinops.distributed.assignment import column_blocks, column_layers
from tests.distributed.harness import TOLERANCE, reference, spawn
from tests.distributed.jobs_columns import CASES, REPLICATE

pytestmark = pytest.mark.slow
W3_CASES = ("dense", "T3", "ikfac")


@pytest.fixture(scope="module")
def w2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("columns_w2")
    return spawn("tests.distributed.jobs_columns:train_w2", 2, out, timeout=60.0)


@pytest.fixture(scope="module")
def w3(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("columns_w3")
    return spawn("tests.distributed.jobs_columns:train_w3", 3, out, timeout=60.0)


def _error(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    assert len(actual) == len(expected)
    return max(
        ((a - b).abs().max() / b.abs().max()).item()
        for a, b in zip(actual, expected, strict=True)
    )


def test_column_blocks_cover_the_columns_once() -> None:
    assert column_blocks(49, 2) == [(0, 25), (25, 49)]
    assert column_blocks(49, 3) == [(0, 17), (17, 33), (33, 49)]
    assert column_blocks(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_only_a_layer_above_its_fair_share_is_split() -> None:
    entries = [(361, 9), (2401, 4)]  # the "two" model, dense
    assert column_layers(entries, [True, True], 2) == {1}
    assert column_layers(entries, [True, False], 2) == set()
    assert column_layers(entries, [True, True], 1) == set()
    assert column_layers([(100, 100), (100, 100)], [True, True], 2) == set()


@pytest.mark.parametrize("name", sorted(CASES))
def test_two_ranks_equal_one_process(w2: list[dict], name: str) -> None:
    expected = reference(CASES[name])
    for result in w2:
        assert result[f"plan/{name}"] == [False, True]
        assert _error(result[f"params/{name}"], expected) < TOLERANCE


@pytest.mark.parametrize("name", W3_CASES)
def test_three_ranks_equal_one_process(w3: list[dict], name: str) -> None:
    expected = reference(CASES[name])
    for result in w3:
        assert result[f"plan/{name}"] == [False, True]
        assert _error(result[f"params/{name}"], expected) < TOLERANCE


def test_split_equals_replicate(w2: list[dict]) -> None:
    for result in w2:
        assert _error(result["params/dense"], result["params/replicate"]) < TOLERANCE


@pytest.mark.parametrize(("world", "name"), [(2, "dense"), (2, "ikfac"), (3, "T3")])
def test_each_rank_keeps_its_columns_of_K_and_all_of_C(
    w2: list[dict], w3: list[dict], world: int, name: str
) -> None:
    results = {2: w2, 3: w3}[world]
    for rank, result in enumerate(results):
        shapes = result[f"shapes/{name}"][-1]  # the split Linear 48→2
        start, stop = column_blocks(49, world)[rank]
        assert shapes["K.mat"] == shapes["m_K.mat"] == (49, stop - start)
        assert all(
            shape[0] == 2 for key, shape in shapes.items() if key.startswith("C.")
        )
    conv = [result[f"shapes/{name}"][0] for result in results]
    assert sum("K.mat" in shapes for shapes in conv) == 1  # a whole layer: one owner


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_state_dict_is_complete_and_equal_on_every_rank(
    w2: list[dict], name: str
) -> None:
    states = [result[f"state/{name}"]["state"] for result in w2]
    replicate = w2[0]["state/replicate"]["state"]
    for index, entry in states[0].items():
        assert entry.keys() == states[1][index].keys()
        for key, value in entry.items():
            assert torch.equal(
                torch.as_tensor(value), torch.as_tensor(states[1][index][key])
            )
    split = states[0][2]  # the Linear's weight (conv weight, bias are 0, 1)
    assert split["K.mat"].shape == split["m_K.mat"].shape == (49, 49)
    if name == "dense":  # the same numbers as replicate's, to round-off
        for key in ("K.mat", "m_K.mat", "C.mat", "m_C.mat"):
            reference_value = replicate[2][key]
            error = (split[key] - reference_value).abs().max().item()
            assert error < TOLERANCE * max(1.0, reference_value.abs().max().item())


def test_no_rank_answers_for_a_split_layers_preconditioner(w2: list[dict]) -> None:
    for result in w2:
        assert "split by column blocks over all ranks" in result["error/dense"]


@pytest.mark.parametrize(
    "tag", ["owned->replicate", "replicate->owned", "owned->owned", "owned->shard"]
)
def test_checkpoints_load_across_modes(w2: list[dict], tag: str) -> None:
    for result in w2:
        resumed, uninterrupted = result[f"resume/{tag}"]
        assert _error(resumed, uninterrupted) < TOLERANCE


def test_recorded_bytes_match_bytes_per_step(w2: list[dict]) -> None:
    for result in w2:
        for step in (0, 1):
            recorded = result[f"bytes/{step}"]["all_gather"]
            reported = result[f"bytes/{step}/reported"]["gather"]
            assert sum(recorded) == reported > 0
        # an update step: blocks, the step limits (column_bounds), directions
        assert len(result["bytes/0"]["all_gather"]) == 1 + POWER_ITERATIONS + 1 + 1
        assert len(result["bytes/1"]["all_gather"]) == 1


def test_the_replicate_reference_is_not_split(w2: list[dict]) -> None:
    assert w2[0]["plan/replicate"] == []
    assert REPLICATE.distribute == "replicate"
