"""`singd-curvlinops compare`: options, errors, the extra, the report files."""

import configparser
import json
import subprocess
import sys
from pathlib import Path

import pytest

from singd_curvlinops.cli import main
from singd_curvlinops.compare import EXTRA_PACKAGES
from singd_curvlinops.compare.workloads import WORKLOADS

ROOT = Path(__file__).parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_help_documents_options_workloads_optimizers_and_budgets(capsys):
    with pytest.raises(SystemExit) as info:
        main(["compare", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for text in [
        *("--workloads", "--optimizers", "--full", "--trials", "--seeds", "--bf16"),
        *("--storage", "--study-name", "--output", "--report-only", "--threads"),
        *WORKLOADS,
        *("singd:STRUCTURE", "ikfac[:STRUCTURE]", "ekfac", "soap", "cosine decay"),
        *("4 trials x 1 seed", "12 trials x 2 seeds", "singd-curvlinops[compare]"),
    ]:
        assert text in out, text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--workloads", "mnist"],
            "unknown workload 'mnist'; choose from digits-cnn, ",
        ),
        (["--workloads", ","], "give at least one workload (digits-cnn, digits-vit"),
        (["--optimizers", "adam"], "unknown optimizer 'adam'; choose from singd[:"),
        (["--optimizers", "sgd:dense"], "sgd takes no structure"),
        (["--optimizers", "ikfac:banded"], "Unknown structure 'banded'"),
        (["--trials", "0"], "--trials: expected a positive integer, got 0"),
        (["--seeds", "x"], "--seeds: expected a positive integer, got 'x'"),
        (["--threads", "99999999999"], "--threads: expected an integer in [1, 2"),
    ],
)
def test_bad_arguments_exit_with_code_2_and_a_clear_message(args, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(["compare", *args])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "singd-curvlinops compare: error:" in err and message in err, err


@pytest.mark.parametrize(
    ("module", "optimizers", "package"),
    [("optuna", "sgd", "optuna"), ("pytorch_optimizer", "soap", "pytorch-optimizer")],
)
def test_a_missing_extra_is_named(
    module, optimizers, package, monkeypatch, tmp_path, capsys
):
    monkeypatch.setitem(sys.modules, module, None)  # importing it now fails
    args = ["compare", "--optimizers", optimizers, "--output", str(tmp_path / "out")]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert f"singd-curvlinops compare: error: compare needs {package} from " in err
    assert 'pip install "singd-curvlinops[compare]"' in err
    assert not (tmp_path / "out").exists()


def test_the_package_and_the_cli_do_not_import_the_extra():
    code = (
        "import sys, singd_curvlinops, singd_curvlinops.cli\n"
        "singd_curvlinops.cli.build_parser().parse_args(['compare'])\n"
        "extra = {'optuna', 'pytorch_optimizer', 'matplotlib'}\n"
        "print(sorted(extra & set(sys.modules)))"
    )
    env = {"PYTHONPATH": str(ROOT / "src")}
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    assert result.stdout.strip() == "[]"


def test_compare_and_test_extras_hold_the_packages():
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg", encoding="utf-8")
    extras = setup["options.extras_require"]
    compare = {line.split("=")[0].split(">")[0] for line in extras["compare"].split()}
    assert compare == set(EXTRA_PACKAGES.values())
    assert "pytorch-optimizer==4.1.0" in extras["compare"].split()
    assert set(extras["compare"].split()) <= set(extras["test"].split())


def test_bf16_study_writes_markdown_json_and_figures(tmp_path, capsys):
    out = tmp_path / "out"
    args = ["compare", "--workloads", "sbm-gcn", "--optimizers", "sgd,kfac"]
    args += ["--trials", "1", "--bf16", "--no-progress", "--output", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    page = (out / "results.md").read_text(encoding="utf-8")
    assert printed == page + "\n"
    assert page.startswith("# Comparison results\n\nRecorded on ")
    assert "singd-curvlinops compare --workloads sbm-gcn --optimizers sgd,kfac " in page
    assert "Budget **custom: 1 trials × 1 seed**" in page
    for heading in (
        "## Workloads",
        "## Search spaces",
        "### sbm-gcn",
        "## Performance",
    ):
        assert heading in page
    assert "| sbm-gcn | KFAC | bf16 | 1 |" in page
    assert "| sbm-gcn | KFAC | bf16-fp32-factors | 1 |" in page
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert [row["optimizer"] for row in results["rows"]] == ["SGD", "KFAC"]
    assert [(r["optimizer"], r["precision"]) for r in results["runs"]] == [
        ("sgd", "float32"),
        ("kfac", "float32"),
        ("kfac", "bf16"),
        ("kfac", "bf16-fp32-factors"),
    ]
    assert {p["label"] for p in results["profiles"]} <= {"SGD", "KFAC"}
    for figure in ("curves.png", "profile.png"):
        assert (out / figure).read_bytes().startswith(PNG_SIGNATURE)

    assert main([*args, "--report-only"]) == 0  # the same report, nothing run
    assert capsys.readouterr().out == printed


def test_an_output_folder_that_cannot_be_made_exits_with_code_2(tmp_path, capsys):
    """A file in the way of `--output` (before: a Python error, exit code 1)."""
    blocking = tmp_path / "afile"
    blocking.write_text("")
    for output in (blocking, blocking / "sub"):
        args = ["--workloads", "teacher-mlp", "--optimizers", "sgd", "--report-only"]
        with pytest.raises(SystemExit) as info:
            main(["compare", *args, "--output", str(output)])
        assert info.value.code == 2
        assert "argument --output: cannot create" in capsys.readouterr().err
