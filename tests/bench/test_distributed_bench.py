"""`bench --distributed`: the command line and what it reports (one process)."""

import pytest
import torch
from torch import nn

from singd_curvlinops import SINGD
from singd_curvlinops.bench.distributed import factor_bytes
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


def test_factor_bytes_count_the_factors_and_momenta_only():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    optimizer = SINGD(model, structures=("dense", "diagonal"), momentum=0.9)
    entries = (4 * 4 + 4) + (5 * 5 + 2)  # K dense, C diagonal, per layer
    assert factor_bytes(optimizer) == 2 * entries * 4  # and their momenta, float32
