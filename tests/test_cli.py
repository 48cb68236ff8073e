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
TINY_BENCH = ["bench", "--models", "mlp", "--structures", "diagonal", "--T", "1"]
TINY_BENCH += ["--rounds", "1", "--steps-per-block", "1", "--warmup", "0"]
TINY_BENCH += ["--no-reference"]


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
        (
            ["demo", "--plot", "no/such/folder/a.png"],
            "--plot: cannot write 'no/such/folder/a.png': folder 'no/such/folder' not",
        ),
        (["demo", "--batch-size", "0"], "--batch-size: expected a positive"),
        (["demo", "--train-size", "-3"], "--train-size: expected a positive"),
        (["demo", "--train-size", "50"], "--batch-size 64 exceeds the 50 training"),
        (["demo", "--batch-size", "2000"], "exceeds the 1347 training examples"),
        (["demo", "--seed", "-1"], "--seed: expected an integer in [0, 1844674407"),
        (
            ["demo", "--seed", str(2**64)],  # torch.manual_seed's limit + 1
            "--seed: expected an integer in [0, 18446744073709551615] (2**64 - 1), "
            "got 18446744073709551616",
        ),
        (["demo", "--seed", "1e3"], "--seed: expected an integer in [0, 184"),
        (["demo", "--threads", "0"], "--threads: expected an integer in [1, 21474"),
        (["demo", "--threads", str(2**31)], "--threads: expected an integer in [1, "),
        (["bench", "--models", "rnn"], "unknown model 'rnn'; choose from mlp, cnn"),
        (["bench", "--models", ","], "give at least one model (mlp, cnn, seq)"),
        (["bench", "--structures", "nonsense"], "Valid names: dense, diagonal"),
        (["bench", "--structures", ""], "give at least one structure name"),
        (["bench", "--T", "a"], "--T: expected a positive integer, got 'a'"),
        (["bench", "--T", "1,0"], "--T: expected a positive integer, got 0"),
        (["bench", "--rounds", "0"], "--rounds: expected a positive integer"),
        (["bench", "--steps-per-block", "0"], "--steps-per-block: expected a pos"),
        (["bench", "--warmup", "-1"], "--warmup: expected a non-negative integer"),
        (["bench", "--threads", "0"], "--threads: expected an integer in [1, "),
        (["bench", "--threads", str(2**40)], "--threads: expected an integer in [1"),
        (["bench", "--json", "out.txt"], "--json: expected a .json file"),
        (["bench", "--json", "no/such/dir/a.json"], "folder 'no/such/dir' not found"),
        (["bench", "--T", "1,4", "--steps-per-block", "6"], "not a multiple of T = 4"),
    ],
)
def test_bad_arguments_exit_with_a_clear_message(args, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and message in err, err


# ---------------------------------------------------------------- output files
def unwritable_folder(tmp_path: Path) -> Path:
    """A folder in which no file can be created, by root either."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    if os.access(folder, os.W_OK):  # root ignores permission bits
        folder = Path("/proc/self")  # nobody creates files here (Linux)
    assert folder.is_dir() and not os.access(folder, os.W_OK)
    return folder


@pytest.mark.parametrize(
    ("command", "option", "name"),
    [("demo", "--plot", "curves.png"), ("bench", "--json", "records.json")],
)
def test_unwritable_output_files_stop_before_any_work(
    command, option, name, tmp_path, monkeypatch, capsys
):
    started = []
    monkeypatch.setattr(cli, "run_demo", lambda *args, **kwargs: started.append(1))
    monkeypatch.setattr(cli, "measure", lambda *args, **kwargs: started.append(1))
    (tmp_path / name).mkdir()  # a folder with the file's name
    (tmp_path / "notes.txt").write_text("a file, not a folder")
    read_only, missing = unwritable_folder(tmp_path), tmp_path / "missing"
    cases = [
        (missing / name, f"folder {str(missing)!r} not found"),
        (tmp_path / name, "that is a folder"),
        (f"{tmp_path / 'new'}{os.sep}{name}{os.sep}", "that is a folder"),
        (tmp_path / "notes.txt" / name, f"{str(tmp_path / 'notes.txt')!r} is not a"),
        (read_only / name, f"folder {str(read_only)!r} is not writable"),
    ]
    for path, reason in cases:
        with pytest.raises(SystemExit) as info:
            main([command, option, str(path)])
        assert info.value.code == 2
        last_line = capsys.readouterr().err.strip().splitlines()[-1]
        expected = f"singd-curvlinops {command}: error: argument {option}: "
        assert last_line.startswith(f"{expected}cannot write {str(path)!r}: ")
        assert reason in last_line, last_line
    assert not started, "the run started despite a bad output file"
    existing = tmp_path / f"old{Path(name).suffix}"
    existing.write_text("overwritten by the run")
    assert cli.build_parser().parse_args([command, option, str(existing)])


@pytest.mark.parametrize(
    ("args", "runner", "name"),
    [
        ([*TINY_DEMO, "--optimizers", "sgd", "--plot"], "run_demo", "c.png"),
        ([*TINY_BENCH, "--json"], "measure", "records.json"),
    ],
    ids=["demo", "bench"],
)
def test_output_folder_removed_during_the_run(
    args, runner, name, tmp_path, monkeypatch, capsys
):
    """The results are still printed, then one line says what was not written."""
    folder = tmp_path / "out"
    folder.mkdir()
    run = getattr(cli, runner)

    def run_and_remove_the_folder(*args, **kwargs):
        results = run(*args, **kwargs)
        folder.rmdir()
        return results

    monkeypatch.setattr(cli, runner, run_and_remove_the_folder)
    assert main([*args, str(folder / name)]) == 1
    captured = capsys.readouterr()
    assert table(captured.out)[1], "no results printed"
    assert "loss curves" not in captured.out
    assert captured.err.strip().splitlines()[-1] == (
        f"singd-curvlinops {args[0]}: error: cannot write {str(folder / name)!r}: "
        "No such file or directory"
    )


def test_largest_seed_torch_accepts_runs(tmp_path, capsys):
    plot = tmp_path / "curves.png"
    args = ["--optimizers", "sgd", "--plot", str(plot), "--seed", str(2**64 - 1)]
    assert main([*TINY_DEMO, *args]) == 0
    assert plot.exists() and "SGD" in capsys.readouterr().out


# --------------------------------------------------------------- closed pipes
def start(*args):
    """Start `python -m singd_curvlinops ARGS` with piped output."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.Popen(
        [sys.executable, "-m", "singd_curvlinops", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=ROOT,
    )


def assert_quiet(stderr: bytes) -> None:
    """No traceback, no 'Exception ignored ... BrokenPipeError' at exit."""
    text = stderr.decode()
    for sign in ("Traceback", "BrokenPipeError", "Exception ignored", "Errno 32"):
        assert sign not in text, text


@pytest.mark.parametrize(
    ("args", "output"),
    [
        ([*TINY_DEMO, "--optimizers", "sgd", "--plot"], "curves.png"),
        ([*TINY_BENCH, "--json"], "records.json"),
    ],
    ids=["demo", "bench"],
)
def test_output_into_a_pipe_closed_early_ends_quietly(args, output, tmp_path):
    """The reader is gone before the first line: exit 141, as after SIGPIPE."""
    process = start(*args, str(tmp_path / output))
    process.stdout.close()
    stderr = process.stderr.read()
    assert process.wait(timeout=120) == cli.EXIT_CLOSED_PIPE == 141
    assert_quiet(stderr)
    assert (tmp_path / output).stat().st_size > 0, "written before the output"


def test_demo_into_head_ends_quietly(tmp_path):
    """`singd-curvlinops demo | head -1`: head's line, then 0 or 141, no traceback."""
    demo = start(*TINY_DEMO, "--optimizers", "sgd", "--plot", str(tmp_path / "c.png"))
    head = subprocess.Popen(["head", "-1"], stdin=demo.stdout, stdout=subprocess.PIPE)
    demo.stdout.close()  # head holds the only reading end
    first_line, _ = head.communicate(timeout=120)
    stderr = demo.stderr.read()
    assert demo.wait(timeout=120) in (0, cli.EXIT_CLOSED_PIPE)
    assert first_line == b"\n"  # the demo's output starts with an empty line
    assert_quiet(stderr)


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
