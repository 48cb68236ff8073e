"""`Shard` reduces each side's statistics to its owner (`owner_statistics`).

On three ranks (rank 2 owns nothing) the owner of a side must hold exactly what
the all-reduce gives every rank; the owner of a split layer's other side its
average trace; every rank the totals; and a non-finite entry on any rank must
reach every rank's statistics of that layer (so that all ranks skip the step).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed.harness import spawn
from tests.distributed.jobs_owner_statistics import LAYERS


@pytest.fixture(scope="module")
def w3(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("owner_statistics_w3")
    return spawn("tests.distributed.jobs_owner_statistics:reduce_w3", 3, out)


def test_every_rank_learns_the_totals(w3: list[dict]) -> None:
    for result in w3:
        assert result["totals"] == result["expected_totals"] == [12, 7, 12, 0, 12]


def test_the_owner_of_a_side_holds_the_all_reduced_statistics(
    w3: list[dict],
) -> None:
    checked = 0
    for index, (_, _, owners) in enumerate(LAYERS):
        if index == 3:  # no statistics
            continue
        for side in (0, 1):
            result = w3[owners[side]]
            actual = result[f"actual/{index}/{side}"]
            expected = result[f"expected/{index}/{side}"]
            assert torch.allclose(actual, expected, rtol=1e-14, atol=1e-14)
            assert expected.abs().max() > 0
            checked += 1
    assert checked == 8


def test_the_owner_of_the_other_side_reads_the_combined_trace(
    w3: list[dict],
) -> None:
    for index, (_, _, (owner_K, owner_C)) in enumerate(LAYERS):
        if owner_K == owner_C:
            continue
        for side, reader in ((0, owner_C), (1, owner_K)):
            result = w3[reader]
            actual = result[f"actual_trace/{index}/{side}"]
            expected = result[f"expected_trace/{index}/{side}"]
            assert torch.allclose(actual, expected, rtol=1e-13, atol=0.0)


def test_a_rank_that_owns_nothing_keeps_its_own_statistics(w3: list[dict]) -> None:
    result = w3[2]
    for index in (0, 1, 2, 4):
        for side in (0, 1):
            actual = result[f"actual/{index}/{side}"]
            assert not torch.allclose(actual, result[f"expected/{index}/{side}"])


def test_a_non_finite_entry_on_one_rank_reaches_every_rank(w3: list[dict]) -> None:
    for result in w3:  # rank 2 poisoned layer 2; layer 3 has no statistics
        assert result["finite"] == [True, True, False, True, True]
        # the verdict every rank hands the step guard, the same on every rank
        assert result["poisoned_agreed"] == [True, True, False, True, True]
        assert result["agreed"] == [True] * 5
