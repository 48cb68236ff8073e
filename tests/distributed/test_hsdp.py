"""HSDP (FSDP2 on a 2-d mesh: two replicas of two shards) on four gloo processes.

One spawn (`jobs_hsdp.train_hsdp`): under every `distribute` each case trains
equal to one process on the whole batch, every rank ends with the same
parameters, and DCP checkpoints resume bit for bit; what combines shards stays
within a replica while the statistics and the owners' work span all four
processes (the recorded collectives, against `bytes_per_step`); the benchmark
runs with `--hsdp`; a layer left out of every unit (under `Shard`) and meshes
of two shapes raise.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from singd_curvlinops.bench.distributed import STRATEGIES
from singd_curvlinops.bench.distributed_report import markdown_table
from tests.distributed.harness import TOLERANCE, reference, spawn
from tests.distributed.jobs_hsdp import CASES_HSDP, CROSS_MESH

pytestmark = pytest.mark.slow

WORLD = 4
REPLICA = 2  # the processes of one replica: the shards of a layer


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("hsdp")
    return spawn("tests.distributed.jobs_hsdp:train_hsdp", WORLD, out)


@pytest.mark.parametrize("name", sorted(CASES_HSDP))
def test_hsdp_equals_one_process(hsdp: list[dict[str, Any]], name: str) -> None:
    expected = reference(CASES_HSDP[name])
    for result in hsdp:
        actual = result[f"params/{name}"]
        assert len(actual) == len(expected)
        for a, b in zip(actual, expected, strict=True):
            assert a.dtype == b.dtype == torch.float64
            error = ((a - b).abs().max() / b.abs().max()).item()
            assert error < TOLERANCE, error


@pytest.mark.parametrize("name", sorted(CASES_HSDP))
def test_every_rank_ends_with_the_same_parameters(
    hsdp: list[dict[str, Any]], name: str
) -> None:
    first = hsdp[0][f"params/{name}"]
    for result in hsdp[1:]:
        for a, b in zip(result[f"params/{name}"], first, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize(
    "name",
    [
        "graft",
        "conv1d_graft",
        "shard_dense",
        "shard_conv1d_graft",
        "owned_dense",
        "owned_conv1d",
    ],
)
def test_a_dcp_checkpoint_resumes_bit_identically(
    hsdp: list[dict[str, Any]], name: str
) -> None:
    """Grafting's moments are DTensors on the 2-d mesh: DCP saves and loads
    them as the parameters' shards (the resumed run moved: not the start)."""
    for result in hsdp:
        run = result[f"resume/{name}"]
        for a, b in zip(run["resumed"], run["uninterrupted"], strict=True):
            assert torch.equal(a, b)
    initial = reference(CASES_HSDP[name], steps=0)
    moved = hsdp[0][f"resume/{name}"]["resumed"]
    assert any(not torch.equal(a, b) for a, b in zip(moved, initial, strict=True))


@pytest.mark.parametrize(("saved", "loaded", "distribute"), CROSS_MESH)
def test_a_dcp_checkpoint_moves_between_fsdp2_and_hsdp(
    hsdp: list[dict[str, Any]], saved: str, loaded: str, distribute: str
) -> None:
    """Saved on one mesh, resumed on the other (DCP reshards the parameters,
    momenta and grafting's moments): the run continues to `1e-10` of the
    uninterrupted one (not bit for bit: the shards' sums run over two
    processes instead of four, or back)."""
    for result in hsdp:
        run = result[f"cross/{saved}->{loaded}/{distribute}"]
        for a, b in zip(run["resumed"], run["uninterrupted"], strict=True):
            error = ((a - b).abs().max() / b.abs().max()).item()
            assert error < TOLERANCE, error


def test_the_step_gathers_within_a_replica(hsdp: list[dict[str, Any]]) -> None:
    """The statistics are all-reduced over all four processes (FSDP2's own
    all-reduces of the gradients between the replicas aside); the shards' half
    products are gathered over the two processes of a replica, as many bytes
    as `bytes_per_step` reports; the step guard agrees over all four."""
    for result in hsdp:
        recorded = result["collectives/dense"]
        reported = result["bytes/dense"]
        statistics = [
            size for kind, size, n in recorded if kind == "all_reduce" and n == WORLD
        ]
        assert sum(statistics) == reported["statistics"] > 0
        gathers = [(size, n) for kind, size, n in recorded if kind == "all_gather"]
        assert gathers == [(reported["gather"], REPLICA)]
        assert {n for kind, _, n in recorded if kind == "checks"} == {WORLD}


@pytest.mark.parametrize("name", ["graft", "conv1d_graft"])
def test_grafted_norms_sum_over_a_replica(
    hsdp: list[dict[str, Any]], name: str
) -> None:
    """Two float64 numbers per sharded layer, summed over one replica's shards
    (over all four processes each would count twice)."""
    for result in hsdp:
        recorded = result[f"collectives/{name}"]
        reported = result[f"bytes/{name}"]
        norms = [(s, n) for kind, s, n in recorded if kind == "all_reduce" and s == 16]
        layers = 3 if name == "graft" else 2
        assert norms == [(2 * 8, REPLICA)] * layers
        # the guard's verdicts (the inputs', each layer's) and the norms
        assert reported["checks"] == 4 * (1 + layers) + 2 * 8 * layers


def test_one_shard_per_replica_combines_nothing(hsdp: list[dict[str, Any]]) -> None:
    """Four replicas of one shard: every rank steps its whole layers, so no
    gather and no grafted norms travel (`bytes_per_step` says so too)."""
    for result in hsdp:
        recorded = result["collectives/whole"]
        reported = result["bytes/whole"]
        assert not [kind for kind, *_ in recorded if kind == "all_gather"]
        assert reported["gather"] == 0
        assert {n for kind, _, n in recorded if kind == "all_reduce"} == {WORLD}
        assert reported["checks"] == 4 * (1 + 3)  # the guard's verdicts alone


def test_shard_gathers_factors_among_all_and_directions_within_a_replica(
    hsdp: list[dict[str, Any]],
) -> None:
    """Under `"shard"` the owners (any of the four ranks) send their updated
    factors to all four; the shards' half products travel within a replica."""
    for result in hsdp:
        recorded = result["collectives/shard_dense"]
        reported = result["bytes/shard_dense"]
        gathers = [(size, n) for kind, size, n in recorded if kind == "all_gather"]
        assert [n for _, n in gathers] == [WORLD, REPLICA]
        assert sum(size for size, _ in gathers) == reported["gather"] > 0
    plan = hsdp[0]["plan/shard_dense"]
    assert all(result["plan/shard_dense"] == plan for result in hsdp)
    owners = {owner for sides in plan for owner in sides}
    assert len(owners) > REPLICA, owners  # (factor work beyond one replica)


def test_owners_gather_the_gradient_from_their_replica(
    hsdp: list[dict[str, Any]],
) -> None:
    """Owned factors (sparse: no layer split by column blocks): Γ's blocks go
    from the owner's replica to the owner, Δ's blocks from the owner to all
    four ranks, in the step's last two all-to-alls (over all four), as many
    bytes, all ranks' messages together, as `bytes_per_step` counts; no
    gather of directions."""
    reported = hsdp[0]["bytes/owned_sparse"]
    sent = []
    for result in hsdp:
        recorded = result["collectives/owned_sparse"]
        exchanges = [(size, n) for kind, size, n in recorded if kind == "all_to_all"]
        assert {n for _, n in exchanges} == {WORLD} and len(exchanges) >= 2
        sent += [size for size, _ in exchanges[-2:]]
        assert "all_gather" not in [kind for kind, *_ in recorded]
    assert sum(sent) == reported["blocks"] > 0 and reported["gather"] == 0


def test_column_blocks_gather_the_gradient_within_a_replica(
    hsdp: list[dict[str, Any]],
) -> None:
    """Owned factors, the Conv1D 128→25 split by column blocks over all four
    ranks: its blocks of Γ are gathered within a replica, the ranks' terms
    among all four."""
    assert hsdp[0]["split/owned_conv1d"] == [True, False]
    reported = hsdp[0]["bytes/owned_conv1d"]
    for result in hsdp:
        gathers = [
            (size, n)
            for kind, size, n in result["collectives/owned_conv1d"]
            if kind == "all_gather"
        ]
        assert REPLICA in [n for _, n in gathers] and WORLD in [n for _, n in gathers]
        assert sum(size for size, _ in gathers) == reported["gather"] > 0


def test_shard_refuses_a_layer_left_whole_under_hsdp(
    hsdp: list[dict[str, Any]],
) -> None:
    for result in hsdp:
        message = result["misuse/unsharded"]
        assert message.startswith("ValueError: Layer '5' is not sharded"), message
        assert "layer '0' is an HSDP shard" in message, message


def test_meshes_of_two_shapes_raise(hsdp: list[dict[str, Any]]) -> None:
    for result in hsdp:
        message = result["misuse/meshes"]
        assert message.startswith("ValueError: Parameters '0.weight' and "), message
        assert "on device meshes of shapes (2, 2) and (4,)" in message, message


def test_the_distributed_benchmark_shards_with_hsdp(hsdp: list[dict[str, Any]]) -> None:
    """`bench --distributed --hsdp 2` on four processes: the statistics and
    the factor state per process as under FSDP2 on four (owners among all
    four); the half products gathered within a replica, every row of them
    from two processes instead of four (with less padding, no more bytes)."""
    flat, hybrid = hsdp[0]["bench/1"], hsdp[0]["bench/2"]
    assert [r["strategy"] for r in hybrid] == list(STRATEGIES)
    for fsdp, hsdp_record in zip(flat, hybrid, strict=True):
        assert hsdp_record["ms_per_step"] > 0
        assert hsdp_record["factor_mib"] == fsdp["factor_mib"]
        statistics = hsdp_record["update_bytes"]["statistics"]
        assert statistics == fsdp["update_bytes"]["statistics"]
    replicate = (flat[0]["plain_bytes"]["gather"], hybrid[0]["plain_bytes"]["gather"])
    assert 0 < replicate[1] <= replicate[0]
    assert "| cnn | 1 | shard |" in markdown_table(hybrid)
