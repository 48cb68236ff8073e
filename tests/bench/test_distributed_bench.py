"""`bench --distributed`: the command line and what it reports (one process)."""

import statistics

import pytest
import torch
from torch import nn

from singd_curvlinops import SINGD
from singd_curvlinops.bench.distributed import _add_ratios, factor_bytes
from singd_curvlinops.bench.distributed_report import markdown_table
from singd_curvlinops.cli import main


def test_help_explains_the_distributed_benchmark(capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for text in ("--distributed", "torchrun --nproc_per_node 2", "ratio to replicate"):
        assert text in out, text


def test_distributed_benchmark_without_torchrun_exits_with_a_hint(monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as info:
        main(["bench", "--distributed"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "start it with torchrun --nproc_per_node 2 -m singd_curvlinops" in err


@pytest.mark.parametrize("flag", [["--fsdp"], ["--hsdp", "2"]])
def test_fsdp_without_distributed_exits_with_a_hint(flag, capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", *flag])
    assert info.value.code == 2
    assert f"{flag[0]} shards the model of --distributed" in capsys.readouterr().err


@pytest.mark.parametrize("replicas", ["3", "0"])
def test_hsdp_replicas_that_do_not_divide_the_processes_exit(
    replicas, monkeypatch, capsys
):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(SystemExit) as info:
        main(["bench", "--distributed", "--hsdp", replicas])
    assert info.value.code == 2
    err = capsys.readouterr().err
    expected = "do not divide the 4 processes" if replicas == "3" else "--hsdp"
    assert expected in err, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--optimizer", "ekfac"], "--optimizer chooses for --distributed"),
        (
            ["--distributed", "--optimizer", "ekfac", "--structures", "dense"],
            "EKFAC's structures are 'auto'",
        ),
    ],
)
def test_ekfac_options_that_do_not_apply_exit_with_a_hint(
    argv, message, monkeypatch, capsys
):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as info:
        main(["bench", *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_factor_bytes_count_the_factors_and_momenta_only():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    optimizer = SINGD(model, structures=("dense", "diagonal"), momentum=0.9)
    entries = (4 * 4 + 4) + (5 * 5 + 2)  # K dense, C diagonal, per layer
    assert factor_bytes(optimizer) == 2 * entries * 4  # and their momenta, float32


def _record(strategy: str, blocks: list[float], optimizer: str = "singd") -> dict:
    """A record of `measure_distributed` as the ratios and the table read it."""
    return {
        "model": "mlp",
        "optimizer": optimizer,
        "structure": "dense",
        "T": 1,
        "strategy": strategy,
        "ms_per_step": statistics.median(blocks),
        "block_ms_per_step": blocks,
        "factor_mib": 2.0 if strategy == "replicate" else 1.0,
        "update_bytes": {"statistics": 0, "gather": 0, "relay": 0, "blocks": 0},
        "plain_bytes": {"gather": 0},
        "mib_per_step": 0.0,
    }


def test_paired_ratio_is_robust_to_drift_between_rounds():
    """A machine that slows down between rounds moves the medians, not the pairs."""
    replicate = _record("replicate", [100.0, 200.0, 300.0])
    shard = _record("shard", [60.0, 130.0, 180.0])  # 0.6, 0.65, 0.6 per round
    other = _record("replicate", [10.0])
    other["model"] = "cnn"
    records = [replicate, shard, other]
    _add_ratios(records)
    assert shard["vs_replicate"] == pytest.approx(130.0 / 200.0)
    assert shard["vs_replicate_paired"] == pytest.approx(0.6)
    assert shard["factor_vs_replicate"] == 0.5
    assert replicate["vs_replicate"] == replicate["vs_replicate_paired"] == 1.0
    assert other["vs_replicate_paired"] == 1.0  # its own workload's reference
    rows = [
        line
        for line in markdown_table(records).splitlines()
        if line.startswith("| mlp | 1 | shard |")
    ]
    assert len(rows) == 1 and "| 0.65× | 0.60× |" in rows[0]


def test_ekfac_rows_have_their_own_reference_and_label():
    """EKFAC's shard is compared with EKFAC's replicate, not SINGD's."""
    singd = _record("replicate", [100.0])
    replicate = _record("replicate", [200.0], optimizer="ekfac")
    shard = _record("shard", [150.0], optimizer="ekfac")
    records = [singd, replicate, shard]
    _add_ratios(records)
    assert shard["vs_replicate"] == pytest.approx(0.75)
    table = markdown_table(records)
    assert "| mlp, EKFAC | 1 | shard | 150.0 |" in table
    assert "| mlp | 1 | replicate | 100.0 |" in table
