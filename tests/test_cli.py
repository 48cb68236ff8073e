import configparser
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from singd_curvlinops import cli
from singd_curvlinops.cli import main
from singd_curvlinops.demo import EXTRA_MODULES
from singd_curvlinops.demo.optimizers import (
    DEFAULT_OPTIMIZERS,
    OptimizerSpec,
    parse_optimizers,
)
from singd_curvlinops.demo.report import COLUMNS

ROOT = Path(__file__).parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TINY_DEMO = ["demo", "--epochs", "1", "--train-size", "96", "--batch-size", "32"]
TINY_DEMO += ["--no-progress"]


def run_module(*args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src")])}
    return subprocess.run(
        [sys.executable, "-m", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
        check=False,
    )


def table(out):
    """The demo's Markdown table as a header and rows of cells."""
    lines = [line for line in out.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    return cells[0], cells[2:]


# ------------------------------------------------------------------------- help
@pytest.mark.parametrize(
    ("command", "expected"),
    [
        ([], ["demo", "bench"]),
        (
            ["demo"],
            ["--epochs", "--optimizers", "--plot", "--batch-size", "--train-size"]
            + ["--seed", "--threads", "--no-progress", "singd:STRUCTURE", "ikfac"]
            + ["final train loss", "test accuracy", "ms/step", "state MiB"]
            + ["singd-curvlinops[examples]"],
        ),
        (
            ["bench"],
            ["--models", "--structures", "--T", "--rounds", "--steps-per-block"]
            + ["--warmup", "--threads", "--no-reference", "--json", "ours / ref"]
            + ["step peak MiB", "torch.profiler", "state MiB", "× AdamW"],
        ),
    ],
    ids=["main", "demo", "bench"],
)
def test_help_documents_every_option(command, expected, capsys):
    with pytest.raises(SystemExit) as info:
        main([*command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: singd-curvlinops {' '.join(command)}".rstrip())
    for text in expected:
        assert text in out, text


def test_python_dash_m_runs_the_command_line():
    result = run_module("singd_curvlinops", "--help")
    assert result.returncode == 0, result.stderr
    assert "usage: singd-curvlinops" in result.stdout
    assert "demo" in result.stdout and "bench" in result.stdout
    result = run_module("singd_curvlinops", "bench", "--models", "rnn")
    assert result.returncode == 2
    assert "unknown model 'rnn'; choose from mlp, cnn, seq" in result.stderr


def test_console_script_and_extras_are_declared():
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg", encoding="utf-8")
    scripts = setup["options.entry_points"]["console_scripts"].strip().splitlines()
    assert "singd-curvlinops = singd_curvlinops.cli:main" in scripts
    extras = setup["options.extras_require"]
    examples = extras["examples"].split()
    assert sorted(EXTRA_MODULES.values()) == sorted(examples)
    assert set(examples) <= set(extras["test"].split())


# ------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "the following arguments are required: COMMAND"),
        (["train"], "invalid choice: 'train'"),
        (["demo", "--epochs", "0"], "--epochs: expected a positive integer, got 0"),
        (["demo", "--epochs", "two"], "expected a positive integer, got 'two'"),
        (["demo", "--optimizers", "adam"], "unknown optimizer 'adam'; choose from "),
        (["demo", "--optimizers", ","], "give at least one optimizer; choose from"),
        (["demo", "--optimizers", "sgd:diagonal"], "sgd takes no structure"),
        (["demo", "--optimizers", "singd:banded"], "Unknown structure 'banded'"),
        (["demo", "--plot", "loss.jpg"], "--plot: expected a .png file"),
        (["demo", "--plot", "no/such/folder/a.png"], "folder 'no/such/folder'"),
        (["demo", "--batch-size", "0"], "--batch-size: expected a positive"),
        (["demo", "--train-size", "-3"], "--train-size: expected a positive"),
        (["demo", "--train-size", "50"], "--batch-size 64 exceeds the 50 training"),
        (["demo", "--batch-size", "2000"], "exceeds the 1347 training examples"),
        (["demo", "--seed", "-1"], "--seed: expected a non-negative integer"),
        (["demo", "--threads", "0"], "--threads: expected a positive integer"),
        (["bench", "--models", "rnn"], "unknown model 'rnn'; choose from mlp, cnn"),
        (
            ["bench", "--models", ","],
            "give at least one model (mlp, cnn, seq, vit, gpt)",
        ),
        (["bench", "--structures", "nonsense"], "Valid names: dense, diagonal"),
        (["bench", "--structures", ""], "give at least one structure name"),
        (["bench", "--T", "a"], "--T: expected a positive integer, got 'a'"),
        (["bench", "--T", "1,0"], "--T: expected a positive integer, got 0"),
        (["bench", "--rounds", "0"], "--rounds: expected a positive integer"),
        (["bench", "--steps-per-block", "0"], "--steps-per-block: expected a pos"),
        (["bench", "--warmup", "-1"], "--warmup: expected a non-negative integer"),
        (["bench", "--threads", "0"], "--threads: expected a positive integer"),
        (["bench", "--json", "out.txt"], "--json: expected a .json file"),
        (["bench", "--T", "1,4", "--steps-per-block", "6"], "not a multiple of T = 4"),
    ],
)
def test_bad_arguments_exit_with_a_clear_message(args, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and message in err, err


def test_optimizer_names():
    specs = parse_optimizers(DEFAULT_OPTIMIZERS)
    labels = [spec.label for spec in specs]
    assert labels[0] == "SINGD (dense)" and "SINGD (diagonal)" in labels
    assert labels[-4:] == ["IKFAC", "KFAC", "AdamW", "SGD"]
    assert parse_optimizers("SINGD, singd:dense, ikfac:diagonal, Kfac") == [
        OptimizerSpec("singd", "dense"),
        OptimizerSpec("ikfac", "diagonal"),
        OptimizerSpec("kfac"),
    ]
    assert OptimizerSpec("ikfac", "diagonal").label == "IKFAC (diagonal)"


# ------------------------------------------------------------------------- demo
def test_tiny_demo_prints_the_table_and_writes_the_plot(tmp_path, capsys):
    plot = tmp_path / "curves.png"
    optimizers = "singd:dense,singd:diagonal,ikfac,kfac,adamw,sgd"
    threads = torch.get_num_threads()
    assert main([*TINY_DEMO, "--optimizers", optimizers, "--plot", str(plot)]) == 0
    assert torch.get_num_threads() == threads  # restored after the run
    out = capsys.readouterr().out
    header, rows = table(out)
    assert tuple(header) == COLUMNS
    assert header[1:] == ["final train loss", "test accuracy", "ms/step", "state MiB"]
    assert [row[0] for row in rows] == [
        "SINGD (dense)",
        "SINGD (diagonal)",
        "IKFAC",
        "KFAC",
        "AdamW",
        "SGD",
    ]
    for row in rows:
        assert 0 < float(row[1]) < 10
        assert 0 <= float(row[2].rstrip("%")) <= 100
        assert float(row[3]) > 0 and float(row[4]) > 0
    state = {row[0]: float(row[4]) for row in rows}
    assert state["SINGD (diagonal)"] < state["AdamW"] < state["SINGD (dense)"]
    assert f"loss curves: {plot}" in out

    assert plot.read_bytes().startswith(PNG_SIGNATURE)
    from matplotlib.image import imread

    image = imread(plot)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_demo_names_the_missing_extra(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now fails
    plot = tmp_path / "curves.png"
    assert main([*TINY_DEMO, "--optimizers", "sgd", "--plot", str(plot)]) == 1
    err = capsys.readouterr().err
    assert "singd-curvlinops demo: error: the demo needs tqdm" in err
    assert 'pip install "singd-curvlinops[examples]"' in err
    assert not plot.exists()


def test_default_plot_path_is_in_the_working_directory():
    args = cli.build_parser().parse_args(["demo"])
    assert args.plot == Path("singd-curvlinops-demo.png")
    assert args.epochs == 10 and args.batch_size == 64 and args.threads == 1
    assert [s.label for s in args.optimizers] == [
        s.label for s in parse_optimizers(DEFAULT_OPTIMIZERS)
    ]
