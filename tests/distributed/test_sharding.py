"""`Shard` and FSDP2 on 2 and 3 gloo processes equal one process on the whole batch.

Three spawns (module-scoped fixtures): `train_w2` runs every W = 2 scenario
(DDP, manual all-reduce, accumulation with `no_sync`, FSDP2; SINGD dense and
sparse, IKFAC, KFAC; factors replicated and owned; checkpoints; bytes),
`train_w3` the W = 3 ones (more ranks than layers, idle ranks), `misuse` the
misconfigurations (last: a rank that never steps, which breaks the group).
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import Tensor

from singd_curvlinops.bench.distributed import EKFAC_STRATEGIES, STRATEGIES
from singd_curvlinops.bench.distributed_report import markdown_table
from tests.distributed.harness import (
    CLASSES,
    DENSE,
    KFAC_OPTIONS,
    TOLERANCE,
    Case,
    reference,
    spawn,
    train_heads,
    train_routed,
)
from tests.distributed.jobs import (
    CASES_W2,
    CASES_W3,
    GRAFT_LATER,
    ROUTED,
    train_graft_later,
    train_mixed_precision,
)

# `StepCheck` on two ranks: each rank's configuration checksum, step count and
# options' fingerprint, in float64
STEP_CHECK = 3 * 2 * 8

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def w2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn("tests.distributed.jobs:train_w2", 2, tmp_path_factory.mktemp("w2"))


@pytest.fixture(scope="module")
def w3(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn("tests.distributed.jobs:train_w3", 3, tmp_path_factory.mktemp("w3"))


@pytest.fixture(scope="module")
def misuse(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("misuse")
    return spawn("tests.distributed.jobs:misuse", 2, out, timeout=4.0)


def _assert_close(actual: list[Tensor], expected: list[Tensor]) -> None:
    assert len(actual) == len(expected)
    for a, b in zip(actual, expected, strict=True):
        assert a.dtype == b.dtype == torch.float64
        error = ((a - b).abs().max() / b.abs().max()).item()
        assert error < TOLERANCE, error


def _assert_identical(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, Tensor):
        assert isinstance(b, Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            _assert_identical(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_identical(x, y, f"{where}[{index}]")
    else:
        assert a == b, where


# ------------------------------------------------------------------ equivalence
@pytest.mark.parametrize("name", sorted(CASES_W2))
def test_two_ranks_equal_one_process(w2: list[dict[str, Any]], name: str) -> None:
    expected = reference(CASES_W2[name])
    for result in w2:
        _assert_close(result[f"params/{name}"], expected)


def test_owners_hand_dense_statistics_to_other_rules(w2: list[dict]) -> None:
    """A rule other than SINGD's and KFAC's gets dense `U` under owned factors (as
    one process), and a weight tied to a transposed use raises a clear error on
    every rank (its owners could not combine the two orientations)."""
    expected = reference(Case(KFAC_OPTIONS, optimizer="kfac"))
    for result in w2:
        assert result["other_rule/three"] == "no error"
        _assert_close(result["params/other_rule/three"], expected)
        message = result["other_rule/tied"]
        assert message.startswith("ValueError: Layer '0' is tied to a layer used")
        assert "distribute=Shard(factors='owned')" in message


@pytest.mark.parametrize("name", sorted(CASES_W3))
def test_three_ranks_equal_one_process(w3: list[dict[str, Any]], name: str) -> None:
    expected = reference(CASES_W3[name])
    for result in w3:
        _assert_close(result[f"params/{name}"], expected)


@pytest.mark.parametrize("distribute", ["replicate", "shard", "owned", "factors"])
def test_layers_without_gradients_sit_out_alike(w2: list[dict], distribute) -> None:
    """Heads used in turn (T = 2): every rank leaves the resting head out alike,
    under DDP and under FSDP2 (a unit per head)."""
    expected = train_heads("replicate")
    for result in w2:
        _assert_close(result[f"heads/{distribute}"], expected)
        _assert_close(result[f"heads/fsdp/{distribute}"], expected)


@pytest.mark.parametrize("kfac", [False, True], ids=["singd", "kfac"])
@pytest.mark.parametrize("distribute", ROUTED)
def test_a_layer_that_a_rank_does_not_reach_is_reduced_alike(
    w2: list[dict], w3: list[dict], distribute: str, kfac: bool
) -> None:
    """A routed head gets statistics from some ranks only: the others take part
    in the exchange with zeros and no examples (a mixture of experts' layout)."""
    expected = train_routed("replicate", kfac=kfac)
    initial = train_routed("replicate", kfac=kfac, steps=0)
    key = f"routed/{distribute}" + ("/kfac" if kfac else "")
    for result in w2 + w3:
        _assert_close(result[key], expected)
    moved = [(q - p).abs().max() for p, q in zip(initial, expected, strict=True)]
    assert min(moved) > 1e-3  # both heads and the body train


@pytest.mark.parametrize("distribute", ["shard", "owned"])
@pytest.mark.parametrize("model", ["three", "embed", "conv1d"])
def test_fsdp2_computing_in_bfloat16_follows_float32(
    w2: list[dict], model: str, distribute: str
):
    """Under `MixedPrecisionPolicy(param_dtype=bfloat16)` the hooks see bfloat16
    copies of the float32 shards: every layer still gets its statistics (no
    warning), and after four steps each parameter's distance from the float32
    run of one process is a small fraction of how far that run moved it."""
    expected = train_mixed_precision(model)
    initial = train_mixed_precision(model, steps=0)["params"]
    for result in w2:
        actual = result[f"fsdp_bfloat16/{model}/{distribute}"]
        assert actual["messages"] == []
        for p, q, start in zip(
            actual["params"], expected["params"], initial, strict=True
        ):
            assert p.dtype == torch.float32
            assert (p - q).abs().max() < 0.5 * (q - start).abs().max()


def test_shard_equals_replicate_and_moves_the_parameters(w2: list[dict]) -> None:
    for result in w2:
        _assert_close(result["params/dense"], result["params/dense_replicate"])
    initial = reference(CASES_W2["dense"], steps=0)
    moved = max(
        (p - q).abs().max().item()
        for p, q in zip(w2[0]["params/dense"], initial, strict=True)
    )
    assert moved > 1e-3


@pytest.mark.parametrize("distribute", ["replicate", "shard", "owned"])
def test_bfloat16_ranks_agree_bitwise_and_track_one_process(
    w2: list[dict], distribute: str
) -> None:
    # the gathers carry bfloat16 directions and float32 factors in one buffer
    case = Case(DENSE, distribute=distribute, dtype=torch.bfloat16)
    first, second = (result[f"bfloat16/{distribute}"] for result in w2)
    _assert_identical(first, second, distribute)
    expected, initial = reference(case), reference(case, steps=0)
    for actual, wanted, start in zip(first, expected, initial, strict=True):
        assert actual.dtype == torch.bfloat16
        scale = wanted.double().abs().max()
        error = (actual.double() - wanted.double()).abs().max() / scale
        moved = (wanted.double() - start.double()).abs().max() / scale
        assert error < 0.02 < moved, (error, moved)


@pytest.mark.parametrize(
    "name", [n for n in sorted(CASES_W2) if not n.startswith("fsdp")]
)
def test_every_rank_ends_with_the_same_complete_state(
    w2: list[dict], name: str
) -> None:
    _assert_identical(w2[0][f"params/{name}"], w2[1][f"params/{name}"], name)
    _assert_identical(w2[0][f"state/{name}"], w2[1][f"state/{name}"], name)
    state = w2[0][f"state/{name}"]["state"].values()
    layers = [e for e in state if "grad_scale" in e]  # not the fallback params
    assert len(layers) == (2 if CASES_W2[name].model == "tied" else 3)
    for entry in layers:  # every layer's factors, also where only owners keep them
        assert any(key.startswith(("K.", "A.")) for key in entry)
        assert any(key.startswith(("C.", "G.")) for key in entry)


@pytest.mark.parametrize("name", sorted(CASES_W3))
def test_three_ranks_end_with_the_same_parameters(w3: list[dict], name: str) -> None:
    for result in w3[1:]:
        _assert_identical(result[f"params/{name}"], w3[0][f"params/{name}"], name)


def test_the_plans_cover_split_layers_both_anchors_and_idle_ranks(
    w2: list[dict], w3: list[dict]
) -> None:
    plans = {f"w2/{n}": w2[0][f"plan/{n}"] for n in CASES_W2}
    plans |= {f"w3/{n}": w3[0][f"plan/{n}"] for n in CASES_W3}
    anchors = {anchor for plan in plans.values() for _, anchor, _ in plan}
    assert anchors == {None, 0, 1}  # whole layers, and splits anchored on K and on C
    for name in ("w3/two_kfac", "w3/two_owned"):  # 2 whole layers on 3 ranks
        owners = {owners for owners, _, _ in plans[name]}
        assert len(owners) == 2 and all(a == b for a, b in owners)
    for name in ("w2/owned_dense", "w3/owned_dense"):  # sides never split when owned
        assert all(a == b for (a, b), _, _ in plans[name])
        helped = [(o, h) for (o, _), anchor, h in plans[name] if anchor is not None]
        assert helped and all(h is not None and h != o for o, h in helped)
    unowned = [plan for name, plan in plans.items() if "owned" not in name]
    assert all(helper is None for plan in unowned for *_, helper in plan)
    # the tied layer (first) gets one assignment, split by sides on three ranks
    assert [len(plans[f"w{w}/tied_dense"]) for w in (2, 3)] == [2, 2]
    assert plans["w3/tied_dense"][0][1] is not None


@pytest.mark.parametrize(
    "name",
    [
        "owned_dense",
        "owned_sparse",
        "owned_kfac",
        "embed_owned",
        "tied_owned",
        "fsdp_owned_dense",
        "fsdp_owned_conv1d",
        "fsdp_owned_tied",
        "ekfac_owned",
        "ekfac_owned_tied",
        "fsdp_ekfac_owned",
    ],
)
def test_owned_factors_live_on_exactly_one_rank(w2: list[dict], name: str) -> None:
    """(A layer split by column blocks keeps its columns of K on every rank.)"""
    held = [result[f"held/{name}"] for result in w2]
    split = w2[0][f"split/{name}"]
    counts = [sum(column) for column in zip(*held, strict=True)]
    assert counts == [2 if columns else 1 for columns in split]
    assert all(any(ranks) for ranks in held)  # both ranks own something


@pytest.mark.parametrize("name", ["dense", "ikfac"])
def test_momenta_live_on_the_rank_that_updates_their_side(
    w2: list[dict], name: str
) -> None:
    """Every rank keeps every factor; each momentum lives on one rank only."""
    assert all(all(result[f"held/{name}"]) for result in w2)
    momenta = [result[f"momenta/{name}"] for result in w2]
    plan = w2[0][f"plan/{name}"]
    for index, (owners, *_) in enumerate(plan):
        for side in (0, 1):
            holders = [rank for rank in range(2) if momenta[rank][index][side]]
            assert holders == [owners[side]]


# ------------------------------------------------------------------ checkpoints
@pytest.mark.parametrize(
    "tag",
    [
        "shard",
        "owned",
        "owned-graft",
        "fsdp",
        "fsdp-embed",
        "fsdp-conv1d",
        "fsdp-ekfac",
        "fsdp-graft-three",
        "fsdp-graft-embed",
        "fsdp-graft-conv1d",
        "ekfac-shard",
        "ekfac-owned",
        "fsdp-ekfac-owned",
        "fsdp-owned-three",
        "fsdp-owned-conv1d",
        "shard-relay",
        "owned-helper",
        "shard-tied",
        "owned-tied",
    ],
)
def test_a_resumed_sharded_run_continues_bit_identically(
    w2: list[dict], tag: str
) -> None:
    routes = ["dcp"] if tag.startswith("fsdp") else ["file", "dcp"]
    for result in w2:
        expected = result[f"resume/{tag}/uninterrupted"]
        for route in routes:
            _assert_identical(result[f"resume/{tag}/{route}"], expected, route)


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [
        ("replicate", "shard"),
        ("replicate", "owned"),
        ("shard", "replicate"),
        ("owned", "replicate"),
        ("ekfac/replicate", "shard"),
        ("ekfac/shard", "replicate"),
        ("ekfac/replicate", "owned"),
        ("ekfac/owned", "shard"),
    ],
)
def test_checkpoints_load_across_strategies(
    w2: list[dict], saved: str, loaded: str
) -> None:
    for result in w2:
        _assert_close(result[f"cross/{saved}->{loaded}"], result[f"cross/{saved}"])


@pytest.mark.parametrize(
    ("saved", "loaded"), [("shard", "owned"), ("owned", "replicate")]
)
def test_fsdp2_checkpoints_load_across_strategies(
    w2: list[dict], saved: str, loaded: str
) -> None:
    """DCP's sharded save under one strategy resumes under another."""
    for result in w2:
        expected = result[f"cross/fsdp/{saved}"]
        _assert_close(result[f"cross/fsdp/{saved}->{loaded}"], expected)


# ------------------------------------------------------------------------ bytes
def test_fsdp2_column_shards_gather_their_columns(w2: list[dict]) -> None:
    """Per rank the step's gather holds each layer's padded share (rows of
    `Γ P_K`, or columns of `C Cᵀ Γ` and the bias column beside them) and a flag,
    in float64; the embedding's diagonal input side lets each rank finish its
    columns alone, so its share is missing. `bytes_per_step` says so under
    `"replicate"` too (before 2026-12-04 it reported no gather there)."""
    numbers = {
        # Embedding 31→8: nothing; Linear 8→8 with a bias: 4 rows of 9; the head
        # Linear 8→31: 16 rows of 8
        "embed": (4 * 9 + 1) + (16 * 8 + 1),
        # Conv1D 128→25: 64 columns of 25 and the bias column; Conv1D 25→60:
        # 13 columns of 60 and the bias column
        "conv1d": (25 * (64 + 1) + 1) + (60 * (13 + 1) + 1),
    }
    for result in w2:
        for model, count in numbers.items():
            recorded = result[f"bytes/fsdp_{model}"]
            reported = result[f"bytes/fsdp_{model}/reported"]
            assert recorded["all_gather"] == [2 * count * 8]
            assert reported["gather"] == 2 * count * 8
            assert sum(recorded["all_reduce"]) == reported["statistics"] > 0
            # the configuration check (first step), then the step guard's
            # agreements on the inputs and on the sharded layers' steps: 32-bit
            # integers, one and one per layer
            layers = {"embed": 3, "conv1d": 2}[model]
            assert recorded["checks"][1:] == [4, layers * 4]
            assert reported["checks"] == 4 + layers * 4


def test_grafted_fsdp2_shards_sum_two_norms_per_layer(w2: list[dict]) -> None:
    """Grafting adds an all-reduce of two float64 numbers per sharded layer."""
    for result in w2:
        recorded = result["bytes/fsdp_graft"]
        reported = result["bytes/fsdp_graft/reported"]
        norms = recorded["all_reduce"][-3:]  # the three layers', after statistics
        assert norms == [2 * 8] * 3
        assert sum(recorded["all_reduce"][:-3]) == reported["statistics"] > 0
        assert reported["checks"] == 4 + 3 * 4 + sum(norms)


@pytest.mark.parametrize("distribute", ["replicate", "shard", "owned"])
def test_recorded_bytes_of_tied_weights(w2: list[dict], distribute: str) -> None:
    """The transposed twin's statistics travel next to its layer's: all-reduced
    under `"replicate"`, to the layer's owners (sides swapped) under `Shard`."""
    for result in w2:
        recorded = result[f"bytes/tied/{distribute}"]
        reported = result[f"bytes/tied/{distribute}/reported"]
        exchanged = recorded["all_reduce"] + recorded["all_to_all"]
        # Shard's step check rides at the head of the statistics summary
        head = 0 if distribute == "replicate" else STEP_CHECK
        assert sum(exchanged) == reported["statistics"] + head > 0
        assert bool(recorded["all_to_all"]) == (distribute != "replicate")
        assert sum(recorded["checks"][1:]) + head == reported["checks"]
        gathered = [reported["gather"]] if reported["gather"] else []
        assert recorded["all_gather"] == gathered
        assert (reported["gather"] > 0) == (distribute != "replicate")


@pytest.mark.parametrize(
    "name", ["shard", "shard_dense", "owned", "owned_dense", "factors", "owned_embed"]
)
def test_recorded_bytes_match_bytes_per_step(w2: list[dict], name: str) -> None:
    for result in w2:
        for step in (0, 1):
            recorded = result[f"bytes/{name}/{step}"]
            reported = result[f"bytes/{name}/{step}/reported"]
            gathered = [reported["gather"]] if reported["gather"] else []
            assert recorded["all_gather"] == gathered
            # on an update step a summary all-reduce with the step check at its
            # head and an all-to-all to the owners (owned factors too: no layer
            # is split by column blocks); on a plain step the step check alone,
            # padded to the summary's length (6 + 2P numbers per layer)
            alone = STEP_CHECK + result[f"bytes/{name}/keys"] * (6 + 2 * 2) * 8
            if step == 0:
                summary, exchanged = recorded["all_reduce"], recorded["all_to_all"]
                assert len(summary) == len(exchanged) == 1
                assert summary[0] + exchanged[0] == reported["statistics"] + STEP_CHECK
                assert summary[0] == alone
            else:
                assert recorded["all_reduce"] == [alone] and not recorded["all_to_all"]
                assert reported["statistics"] == 0
            # the configuration check (the optimizer's first step), on update
            # steps the agreement on the formed statistics; the step guard's
            # verdicts ride in the gather
            checks = recorded["checks"][1:] if step == 0 else recorded["checks"]
            head = STEP_CHECK if step == 0 else alone
            assert sum(checks) + head == reported["checks"]
            assert len(checks) == (step == 0)
            if step == 0:
                assert recorded["checks"][0] == 32
    for step in (0, 1):  # the relay's messages, of both ranks together
        sent = [sum(result[f"bytes/{name}/{step}"]["isend"]) for result in w2]
        assert sum(sent) == w2[0][f"bytes/{name}/{step}/reported"]["relay"]
    update, plain = (w2[0][f"bytes/{name}/{step}/reported"] for step in (0, 1))
    dense = w2[0][f"bytes/{name}/dense"]["statistics"]
    if name in ("shard_dense", "owned", "owned_dense"):  # linear layers': rows
        assert update["statistics"] < dense / 2  # (owned: any rule's raw rows)
    elif name == "owned_embed":  # more rows than widths: formed; V numbers, not V²
        assert update["statistics"] == dense < CLASSES["embed"] ** 2 * 8
    else:  # no dense side of SINGD or KFAC under Shard: nothing travels as rows
        assert update["statistics"] == dense
    assert update["gather"] > 0 and update["statistics"] > 0
    if name in ("shard_dense", "owned_dense"):  # split, or helped: every step
        assert plain["relay"] == update["relay"] > 0
    elif name != "shard":  # sparse sides are not helped; factors: no directions
        assert update["relay"] == plain["relay"] == 0
    if name == "factors":  # between updates only the guard's inputs verdict
        assert plain["gather"] == 2 * 8  # (two ranks, one float64 each)
    else:  # the directions travel every step
        assert update["gather"] >= plain["gather"] > 0


def test_recorded_bytes_of_fsdp2_shards_split_by_column_blocks(w2: list[dict]) -> None:
    """Owned factors under FSDP2, the Conv1D 128→25 split by column blocks
    (since 2026-12-05; before, gathered on its owner): every step one gather of
    its blocks of Γ to every rank and the step's gather of the ranks' terms,
    the other layer's blocks to its owner and back, as `bytes_per_step`
    counts them."""
    assert w2[0]["split/fsdp_owned_conv1d"] == [True, False]
    for step in (0, 1):
        reported = w2[0][f"bytes/fsdp_owned_conv1d/{step}/reported"]
        for result in w2:
            gathers = result[f"bytes/fsdp_owned_conv1d/{step}"]["all_gather"]
            assert sum(gathers) == reported["gather"] > 0
        exchanges = [r[f"bytes/fsdp_owned_conv1d/{step}"]["all_to_all"] for r in w2]
        assert sum(sum(sent[-2:]) for sent in exchanges) == reported["blocks"] > 0


@pytest.mark.parametrize("name", ["fsdp_owned"])
def test_recorded_bytes_of_fsdp2_blocks_at_their_owners(
    w2: list[dict], name: str
) -> None:
    """Owned factors under FSDP2: two all-to-alls every step (Γ's blocks to the
    owners, Δ's back), all ranks' messages as `bytes_per_step` counts them, and
    no gather of directions."""
    for step in (0, 1):
        reported = w2[0][f"bytes/{name}/{step}/reported"]
        exchanges = [result[f"bytes/{name}/{step}"]["all_to_all"] for result in w2]
        # on update steps the statistics' all-to-all to the owners comes first
        assert all(len(sent) == 2 + (step == 0) for sent in exchanges)
        assert sum(sum(sent[-2:]) for sent in exchanges) == reported["blocks"] > 0
        assert reported["gather"] == 0
        assert all(not result[f"bytes/{name}/{step}"]["all_gather"] for result in w2)


def test_recorded_bytes_of_ekfac_under_shard(w2: list[dict]) -> None:
    """EKFAC under `"shard"`: the step check alone first; on update steps the
    statistics and each layer's eigenvalue sums all-reduced (every rank
    updates) and the eigenbases gathered from the ranks that computed them;
    the owners' directions in the gather every step; no all-to-all."""
    for result in w2:
        for step in (0, 1):
            recorded = result[f"bytes/ekfac_shard/{step}"]
            reported = result[f"bytes/ekfac_shard/{step}/reported"]
            assert not recorded["reduce"]
            assert len(recorded["all_gather"]) == (2 if step == 0 else 1)
            assert sum(recorded["all_gather"]) == reported["gather"]
            assert reported["gather"] > 0 and not recorded["all_to_all"]
            check, *exchange = recorded["all_reduce"]
            assert check == reported["checks"]
            assert sum(exchange) == reported["statistics"]
            assert len(exchange) == (1 + 3 if step == 0 else 0)  # (three layers)


def test_recorded_bytes_of_ekfac_with_owned_factors(w2: list[dict]) -> None:
    """EKFAC under owned factors (before 2026-12-05 all-reduced as under
    `"shard"`): on update steps the summary with the step check at its head,
    the statistics to each layer's owner in one all-to-all (the linear layers'
    as rows), the owners' agreement on what they formed, and each layer's
    eigenvalue sums reduced to its owner alone; the eigenbases gathered from
    the owners; the directions in the gather every step. Between updates the
    step check alone, padded to the summary's length."""
    held = [result["held/ekfac_owned"] for result in w2]
    owners = [ranks.index(True) for ranks in zip(*held, strict=True)]
    keys = w2[0]["bytes/ekfac_owned/keys"]
    alone = STEP_CHECK + keys * (6 + 2 * 2) * 8
    for result in w2:
        for step in (0, 1):
            recorded = result[f"bytes/ekfac_owned/{step}"]
            reported = result[f"bytes/ekfac_owned/{step}/reported"]
            assert len(recorded["all_gather"]) == (2 if step == 0 else 1)
            assert sum(recorded["all_gather"]) == reported["gather"] > 0
            assert recorded["all_reduce"] == [alone]
            if step == 1:
                assert not (recorded["all_to_all"] or recorded["reduce"])
                assert not recorded["checks"] and reported["statistics"] == 0
                assert reported["checks"] == alone
                continue
            assert [dst for dst, _ in recorded["reduce"]] == owners
            sums = sum(size for _, size in recorded["reduce"])
            sent = alone - STEP_CHECK + recorded["all_to_all"][0] + sums
            assert len(recorded["all_to_all"]) == 1 and sent == reported["statistics"]
            configuration, agreement = recorded["checks"]  # (the first step's)
            assert configuration == 32 and agreement + STEP_CHECK == reported["checks"]
    update = w2[0]["bytes/ekfac_owned/0/reported"]["statistics"]
    dense = w2[0]["bytes/ekfac_owned/dense"]["statistics"]
    shard = w2[0]["bytes/ekfac_shard/0/reported"]["statistics"]
    assert update < dense / 2 and update < shard / 2  # (rows, to the owner only)


def test_the_distributed_benchmark_measures_every_strategy(w2: list[dict]) -> None:
    records = w2[0]["bench"]
    assert [r["strategy"] for r in records] == list(STRATEGIES)
    replicate, shard, factors, owned = records
    assert replicate["vs_replicate"] == 1.0 and replicate["factor_vs_replicate"] == 1.0
    assert replicate["vs_replicate_paired"] == 1.0
    assert shard["vs_replicate_paired"] == pytest.approx(shard["vs_replicate"])
    assert all(
        r["ms_per_step"] > 0 and len(r["block_ms_per_step"]) == 1 for r in records
    )
    assert owned["factor_mib"] < shard["factor_mib"] < replicate["factor_mib"]
    assert factors["factor_mib"] < replicate["factor_mib"]  # momenta on their owners
    assert replicate["plain_bytes"]["gather"] == 0 < shard["plain_bytes"]["gather"]
    table = markdown_table(records)
    assert table.count("\n") == len(records) + 1 and "| cnn | 1 | shard |" in table
    # a block's time and the factor state are the busiest process's
    assert [result["bench_largest"] for result in w2] == [2.0, 2.0]


def test_the_distributed_benchmark_times_ekfac(w2: list[dict]) -> None:
    """`bench --distributed --optimizer ekfac`: replicate, shard and owned
    factors; the update step gathers the eigenbases besides the directions."""
    records = w2[0]["bench_ekfac"]
    assert [r["strategy"] for r in records] == list(EKFAC_STRATEGIES)
    replicate, shard, owned = records
    assert {r["optimizer"] for r in records} == {"ekfac"}
    assert replicate["update_bytes"]["gather"] == 0
    for record in (shard, owned):
        assert record["update_bytes"]["gather"] > record["plain_bytes"]["gather"] > 0
    assert shard["factor_mib"] == replicate["factor_mib"]  # (replicated state)
    assert (
        owned["factor_mib"] < replicate["factor_mib"]
    )  # (the cnn: one layer holds 90%)
    assert "| cnn, EKFAC | 1 | shard |" in markdown_table(records)


def test_the_distributed_benchmark_shards_with_fsdp2(w2: list[dict]) -> None:
    """`bench --distributed --fsdp`: the owned form sends the gradients' blocks
    to their owners instead of gathering the directions (but gathers the CNN's
    linear layer, split by column blocks), and keeps its share of the
    factors."""
    records = w2[0]["bench_fsdp"]
    assert [r["strategy"] for r in records] == list(STRATEGIES)
    replicate, shard, _, owned = records
    assert owned["factor_mib"] < shard["factor_mib"] <= replicate["factor_mib"]
    # the linear layer split by column blocks (its Γ and terms gathered)
    assert owned["factor_mib"] < 0.6 * replicate["factor_mib"]
    for step in ("update_bytes", "plain_bytes"):
        assert owned[step]["blocks"] > 0 and owned[step]["gather"] > 0
        assert shard[step]["blocks"] == replicate[step]["blocks"] == 0
        assert replicate[step]["gather"] > 0  # (each rank's rows of Γ P_K)
    assert "| blocks MiB/step |" in markdown_table(records)


# ----------------------------------------------------------------------- misuse
@pytest.mark.parametrize("label", ["distribute", "factors"])
def test_ranks_with_different_strategies_raise(misuse: list[dict], label: str) -> None:
    for result in misuse:
        assert re.search("disagree", result[f"misuse/{label}"])


def test_ranks_resumed_at_different_steps_raise(misuse: list[dict]) -> None:
    for result in misuse:
        assert re.search("step count", result["misuse/resumed_apart"])


@pytest.mark.parametrize("distribute", ["replicate", "shard", "owned"])
@pytest.mark.parametrize("T", [1, 2])
def test_ranks_with_different_options_raise(
    misuse: list[dict], distribute: str, T: int
) -> None:
    # Shard checks the options with the step count at every step; Replicate in
    # the statistics all-reduce, so at the next factor update (step 2 at T = 2)
    expected = 2 if distribute == "replicate" and T == 2 else 1
    for result in misuse:
        step, message = result[f"misuse/options/{distribute}/{T}"]
        assert step == expected, message
        assert re.search("disagree on their options", message)
        assert re.search("scheduler stepped on some ranks only", message)
        assert re.search(r"\blr=0\.[12]\b", message)  # it names this rank's options


@pytest.mark.parametrize("distribute", ["shard", "owned"])
@pytest.mark.parametrize("change", ["T", "layer"])
@pytest.mark.parametrize("T", [1, 2])
def test_a_configuration_changed_on_one_rank_raises(
    misuse: list[dict], distribute: str, change: str, T: int
) -> None:
    # rank 1 checks its new configuration at once, in an all-reduce of the length
    # the ranks agreed before (with one layer fewer its own summary would be
    # shorter): it meets rank 0's statistics summary (T = 1) or rank 0's step
    # check alone (T = 2) instead of aborting gloo on a size mismatch
    for result in misuse:
        key = f"misuse/changed_apart/{distribute}/{change}/{T}"
        step, message, _ = result[key]
        assert step == 1 + T, message
        assert re.search("disagree on the layers, structures or options", message)


@pytest.mark.parametrize("distribute", ["shard", "owned"])
@pytest.mark.parametrize("change", ["T", "layer"])
def test_a_configuration_changed_on_every_rank_trains_on(
    misuse: list[dict], distribute: str, change: str
) -> None:
    key = f"misuse/changed_alike/{distribute}/{change}"
    results = [result[key] for result in misuse]
    for step, message, _ in results:
        assert step == -1, message
    assert results[0][2]  # (parameters after five steps)
    for mine, theirs in zip(results[0][2], results[1][2], strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


def test_a_rank_that_never_steps_times_out_with_the_cause(misuse: list[dict]) -> None:
    message = misuse[0]["misuse/never_steps"]
    assert re.search("another rank did not take part", message), message
    assert re.search(r"skipped optimizer\.step\(\)", message), message


def test_owned_factors_are_asked_of_their_owner(misuse: list[dict]) -> None:
    answers = [result["misuse/not_held"] for result in misuse]
    for per_layer in zip(*answers, strict=True):
        errors = [a for a in per_layer if a != "no error"]
        assert len(errors) == 1 and re.search("live on rank", errors[0])


@pytest.mark.parametrize("distribute", ["replicate", "shard", "owned"])
def test_data_parallelism_over_a_subgroup_raises(
    misuse: list[dict], distribute: str
) -> None:
    # each rank's DDP (or FSDP2 mesh) is a group of its own: without the check the
    # statistics of both independent replicas were averaged, silently
    for rank, result in enumerate(misuse):
        ddp = result[f"misuse/ddp_subgroup/{distribute}"]
        assert ddp.startswith("ValueError") and f"processes [{rank}]" in ddp
        assert "default process group" in ddp
        fsdp = result[f"misuse/fsdp_submesh/{distribute}"]
        assert fsdp.startswith("ValueError") and "device mesh" in fsdp
        assert f"processes [{rank}]" in fsdp
        # a group of every process in rank order is the default group's equal
        assert result[f"misuse/ddp_all/{distribute}"] == "no error"


@pytest.mark.parametrize("distribute", ["replicate", "shard", "owned"])
def test_fsdp_shards_that_are_not_rows_or_columns_raise(
    misuse: list[dict], distribute: str
) -> None:
    """A weight that tensor parallelism splits by columns, and a registered
    layer type whose layout the adapter owns without declaring its weight
    transposed. (HSDP's 2-d mesh raised here too before 2026-12-05: it now
    trains, `test_hsdp.py`; here a mesh of one replica takes a step.)"""
    for result in misuse:
        columns = result[f"misuse/column_parallel/{distribute}"]
        assert columns.startswith("ValueError: Layer '5'"), columns
        assert "placements (Shard(dim=1),) on a 1-d mesh" in columns, columns
        assert "and HSDP's (Replicate(), Shard(0)) on a 2-d mesh" in columns
        assert result[f"misuse/hsdp/{distribute}"] == "no error"
        own = result[f"misuse/fsdp_own_layout/{distribute}"]
        assert own.startswith("ValueError: Layer '1' (Dense"), own
        assert "neither rows nor columns of Γ" in own


@pytest.mark.parametrize("model", ["three", "conv1d"])
def test_grafting_switched_on_later_under_fsdp(w2: list[dict], model: str) -> None:
    """The moments are made at the first grafted step, sharded like Γ's blocks
    (like the parameters beside Conv1D's split bias)."""
    single = replace(GRAFT_LATER, wrap="manual", distribute="replicate", model=model)
    expected = train_graft_later(single)
    key = "graft_later" if model == "three" else f"graft_later/{model}"
    for result in w2:
        _assert_close(result[key], expected)


# --------------------------------------------------------------- buffers
@pytest.mark.parametrize(
    "distribute", ["replicate", "shard", "owned", "factors", "fsdp_owned"]
)
def test_message_buffers_are_lent_again(
    w2: list[dict[str, Any]], distribute: str
) -> None:
    """Steps reuse the strategy's message buffers; no state lives in them."""
    for result in w2:
        early, late = result[f"buffers/{distribute}"]["after"]
        assert early, "no message buffers kept"
        assert early == late  # same slots at the same addresses: not reallocated
        assert result[f"buffers/{distribute}"]["aliased"] == []
    slots = " ".join(  # every rank's
        slot for result in w2 for slot in result[f"buffers/{distribute}"]["after"][0]
    )
    expected = {
        "replicate": ["('statistics',)"],
        "shard": ["('step', 'sent')", "('step', 1)", "('received', "],  # + relay
        "owned": ["('step', 'sent')", "('factor', ", "('received', "],  # + helper
        "factors": ["('factors', 'sent')", "('factors', 1)"],
        "fsdp_owned": [  # Γ's blocks to their owners, Δ's back
            f"('{way} owners', '{end}')"
            for way in ("to", "from")
            for end in ("sent", "received")
        ],
    }[distribute]
    for name in expected:
        assert name in slots, (name, slots)
