import json

import pytest
import torch
from torch import nn

from singd_curvlinops.bench import optimizer as bench
from singd_curvlinops.bench.optimizer import main

VERSION = bench.reference_version()


@pytest.fixture(autouse=True)
def _tiny_workloads(monkeypatch):
    """Shrink the three models so that the test runs in about a second."""
    original = bench.build_workload

    def tiny(name, seed=0):
        workload = original(name, seed)
        torch.manual_seed(seed)
        if name == "cnn":
            workload.model = nn.Sequential(
                nn.Conv2d(3, 4, 3, stride=2, padding=1),
                nn.ReLU(),
                nn.Flatten(),
                nn.Linear(4 * 4 * 4, 3),
            )
            workload.inputs = torch.randn(4, 3, 8, 8)
            workload.targets = torch.randint(3, (4,))
        else:
            dim_in = 6
            workload.model = nn.Sequential(
                nn.Linear(dim_in, 5), nn.ReLU(), nn.Linear(5, 3)
            )
            shape = (4, dim_in) if name == "mlp" else (2, 3, dim_in)
            workload.inputs = torch.randn(*shape)
            workload.targets = torch.randint(3, shape[:-1])
        return workload

    monkeypatch.setattr(bench, "build_workload", tiny)


def test_benchmark_reports_all_configurations(tmp_path, capsys):
    path = tmp_path / "records.json"
    args = ["--models", "mlp,cnn,seq", "--structures", "diagonal,block2diagonal"]
    args += ["--T", "1,2", "--rounds", "2", "--steps-per-block", "2", "--warmup", "1"]
    args += ["--json", str(path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    header = "| optimizer | ms/step | × AdamW | ours / ref | state MiB | final loss |"
    assert out.count(header) == 3
    for model in ("mlp", "cnn", "seq"):
        assert f"### {model}" in out
    assert "| SINGD block2diagonal T=2 |" in out
    if VERSION is not None:
        assert f"| singd {VERSION} diagonal T=1 |" in out
    assert "| AdamW |" in out and "| SGD |" in out

    records = json.loads(path.read_text(encoding="utf-8"))
    # per model: 2 structures x 2 T x (ours + reference) + AdamW + SGD
    assert len(records) == 3 * (2 * 2 * (1 + (VERSION is not None)) + 2)
    assert all(
        r["ms_per_step"] > 0 and len(r["block_ms_per_step"]) == 2 for r in records
    )
    assert all(r["state_mib"] > 0 for r in records)
    ours = [r for r in records if r["kind"] == "ours"]
    if VERSION is None:
        return
    assert all(r["vs_reference"] > 0 and r["vs_adamw"] > 0 for r in ours)
    # same weights, data and hyperparameters: ours and the reference agree
    index = {(r["model"], r["kind"], r["structure"], r["T"]): r for r in records}
    for r in ours:
        ref = index[(r["model"], "reference", r["structure"], r["T"])]
        assert r["final_loss"] == pytest.approx(ref["final_loss"], rel=1e-4)
        assert r["state_mib"] == pytest.approx(ref["state_mib"])


def test_benchmark_without_reference(capsys):
    args = ["--models", "mlp", "--structures", "dense", "--T", "1", "--rounds", "1"]
    args += ["--steps-per-block", "1", "--warmup", "0", "--no-reference"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "| SINGD dense T=1 |" in out and "| singd " not in out


@pytest.mark.parametrize("name", ["mlp", "cnn", "seq"])
def test_real_workloads_have_the_documented_shapes(name, monkeypatch):
    monkeypatch.undo()  # the real models, not the tiny ones
    workload = bench.build_workload(name)
    batch = {"mlp": (128,), "cnn": (64,), "seq": (16, 64)}[name]
    assert tuple(workload.targets.shape) == batch
    with torch.no_grad():
        assert workload.model(workload.inputs).shape == (*batch, 10)
    layers = [m for m in workload.model if isinstance(m, nn.Linear | nn.Conv2d)]
    assert len(layers) == (4 if name == "cnn" else 3)
    assert workload.inputs.dtype == torch.float32


@pytest.mark.parametrize(
    "args",
    [
        ["--models", "rnn"],
        ["--models", ","],
        ["--structures", "nonsense"],
        ["--structures", ""],
        ["--T", "a"],
        ["--T", "0"],
        ["--rounds", "0"],
        ["--steps-per-block", "0"],
        ["--warmup", "-1"],
        ["--threads", "0"],
        ["--T", "1,10", "--steps-per-block", "5"],
    ],
)
def test_benchmark_rejects_bad_arguments(args, capsys):
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    assert "error" in capsys.readouterr().err
