import json
import re

import pytest
import torch
from torch import nn

from singd_curvlinops.bench import optimizer as bench
from singd_curvlinops.bench.configurations import reference_version
from singd_curvlinops.bench.report import COLUMNS
from singd_curvlinops.bench.workloads import build_workload
from singd_curvlinops.cli import main

VERSION = reference_version()
RECORD_KEYS = {
    "model",
    "label",
    "kind",
    "structure",
    "T",
    "ms_per_step",
    "block_ms_per_step",
    "step_peak_mib",
    "state_mib",
    "cache_mib",
    "final_loss",
    "vs_adamw",
    "vs_reference",
    "preconditioned",
}


def tiny_workload(name, seed=0):
    """The three models shrunk so that a benchmark run takes about a second."""
    workload = build_workload(name, seed)
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
        workload.model = nn.Sequential(nn.Linear(dim_in, 5), nn.ReLU(), nn.Linear(5, 3))
        shape = (4, dim_in) if name == "mlp" else (2, 3, dim_in)
        workload.inputs = torch.randn(*shape)
        workload.targets = torch.randint(3, shape[:-1])
    return workload


@pytest.fixture(autouse=True)
def _tiny_workloads(monkeypatch):
    monkeypatch.setattr(bench, "build_workload", tiny_workload)


def table_rows(out, model):
    """The rows of one model's Markdown table, as lists of cells."""
    section = out.split(f"### {model}\n\n")[1].split("\n\n")[0]
    lines = section.strip().splitlines()
    assert lines[0] == "| " + " | ".join(COLUMNS) + " |"
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


def test_benchmark_reports_all_configurations(tmp_path, capsys):
    path = tmp_path / "records.json"
    args = [
        "bench",
        "--models",
        "mlp,cnn,seq",
        "--structures",
        "diagonal,block2diagonal",
    ]
    args += ["--T", "1,2", "--rounds", "2", "--steps-per-block", "2", "--warmup", "1"]
    args += ["--json", str(path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.count("| " + " | ".join(COLUMNS) + " |") == 3
    assert "step peak MiB" in COLUMNS and "state MiB" in COLUMNS

    records = json.loads(path.read_text(encoding="utf-8"))
    assert all(set(r) == RECORD_KEYS for r in records)
    # per model: 2 structures x 2 T x (ours + reference) + KFAC per T + AdamW + SGD
    per_model = 2 * 2 * (1 + (VERSION is not None)) + 2 + 2
    assert len(records) == 3 * per_model
    assert all(
        r["ms_per_step"] > 0 and len(r["block_ms_per_step"]) == 2 for r in records
    )
    assert all(r["step_peak_mib"] > 0 and r["state_mib"] > 0 for r in records)
    assert all(r["vs_adamw"] > 0 for r in records)
    assert {r["label"] for r in records if r["kind"] == "kfac"} == {
        "KFAC T=1",
        "KFAC T=2",
    }
    # the share of the parameters in Kronecker layers (all of these tiny models')
    for r in records:
        expected = 1.0 if r["kind"] in ("ours", "kfac") else None
        assert r["preconditioned"] == expected, r["label"]
    # KFAC caches its damped inverses, SGD nothing
    assert all(r["cache_mib"] > 0 for r in records if r["kind"] == "kfac")
    assert all(r["cache_mib"] == 0 for r in records if r["label"] == "SGD")

    # the table shows the JSON's numbers, with the ratios to AdamW and the reference
    for model in ("mlp", "cnn", "seq"):
        rows = {row[0]: row for row in table_rows(out, model)}
        mine = [r for r in records if r["model"] == model]
        assert list(rows) == [r["label"] for r in mine]
        assert rows["AdamW"][2] == "1.00×"
        for r in mine:
            row = rows[r["label"]]
            assert row[2] == f"{r['vs_adamw']:.2f}×"
            ratio = r["vs_reference"]
            assert row[3] == ("—" if ratio is None else f"{ratio:.2f}×")
            assert row[4] == f"{r['step_peak_mib']:.3g}"
            assert row[5] == f"{r['state_mib']:.3g}"

    ours = [r for r in records if r["kind"] == "ours"]
    if VERSION is None:
        assert all(r["vs_reference"] is None for r in ours)
        return
    assert f"| singd {VERSION} diagonal T=1 |" in out
    assert all(r["vs_reference"] > 0 for r in ours)
    # same weights, data and hyperparameters: ours and the reference agree
    index = {(r["model"], r["kind"], r["structure"], r["T"]): r for r in records}
    for r in ours:
        ref = index[(r["model"], "reference", r["structure"], r["T"])]
        assert r["final_loss"] == pytest.approx(ref["final_loss"], rel=1e-4)
        assert r["state_mib"] == pytest.approx(ref["state_mib"])
        assert r["vs_reference"] == pytest.approx(r["ms_per_step"] / ref["ms_per_step"])


def test_benchmark_without_reference(capsys):
    args = ["bench", "--models", "mlp", "--structures", "dense", "--T", "1"]
    args += ["--rounds", "1", "--steps-per-block", "1", "--warmup", "0"]
    assert main([*args, "--no-reference", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "| SINGD dense T=1 |" in out and "| singd " not in out
    assert "| KFAC T=1 |" in out
    assert "reference: not run" in out and "torch threads: 1" in out
    assert re.search(r"\| SINGD dense T=1 \| [\d.,]+ \| [\d.]+× \| — \|", out)


@pytest.mark.parametrize("name", ["mlp", "cnn", "seq"])
def test_real_workloads_have_the_documented_shapes(name):
    workload = build_workload(name)
    batch = {"mlp": (128,), "cnn": (64,), "seq": (16, 64)}[name]
    assert tuple(workload.targets.shape) == batch
    with torch.no_grad():
        assert workload.model(workload.inputs).shape == (*batch, 10)
    layers = [m for m in workload.model if isinstance(m, nn.Linear | nn.Conv2d)]
    assert len(layers) == (4 if name == "cnn" else 3)
    assert workload.inputs.dtype == torch.float32


def test_unknown_workload_is_rejected():
    with pytest.raises(ValueError, match="choose from mlp, cnn, seq"):
        build_workload("rnn")
