"""The Optuna engine: budgets, resume after a kill, stale trials, storages."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from singd_curvlinops.cli import main
from singd_curvlinops.compare import cells, study
from singd_curvlinops.compare.optimizers import parse_optimizer
from singd_curvlinops.compare.search import points
from tests.compare.conftest import short

optuna = pytest.importorskip("optuna")  # the `compare` extra (part of `test`)
ROOT = Path(__file__).parents[2]
TINY = ["compare", "--workloads", "teacher-mlp", "--optimizers", "sgd,adamw"]
TINY += ["--trials", "2", "--no-progress"]


@pytest.fixture
def storage(tmp_path):
    return study.open_storage(f"sqlite:///{tmp_path / 'studies.db'}")


def cell(steps=30):
    return cells.Cell(short("teacher-mlp", steps=steps), parse_optimizer("sgd"))


def keys(trials):
    return sorted((t.user_attrs["index"], t.user_attrs["seed"]) for t in trials)


def claims(storage, budget):
    """Claim and finish runs until the budget is done; return their runs."""
    loaded, keys = study.prepare(storage, cell(), "t"), []
    while (trial := study.claim(loaded, cell(), budget)) is not None:
        keys.append((trial.user_attrs["index"], trial.user_attrs["seed"]))
        assert (
            trial.params == points(parse_optimizer("sgd").family.space, 3)[keys[-1][0]]
        )
        loaded.tell(trial, 1.0)
    return keys


def test_claims_follow_the_budget_and_a_larger_budget_extends_it(storage):
    assert claims(storage, cells.Budget("custom", 2, 2)) == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    assert claims(storage, cells.Budget("custom", 2, 2)) == []
    assert claims(storage, cells.Budget("custom", 3, 2)) == [(2, 0), (2, 1)]
    assert claims(storage, cells.Budget("custom", 1, 3)) == [(0, 2)]


def test_a_run_claimed_twice_stays_with_the_lower_trial_number(storage):
    loaded, budget = study.prepare(storage, cell(), "t"), cells.Budget("custom", 2, 1)
    first = study.claim(loaded, cell(), budget)
    first.set_user_attr("worker", {"host": "elsewhere.invalid", "pid": 1})
    # a second worker picked run (0, 0) at the same time: its trial is waiting
    loaded.enqueue_trial(first.params, user_attrs={"index": 0, "seed": 0})
    second = study.claim(loaded, cell(), budget)
    assert (second.user_attrs["index"], second.user_attrs["seed"]) == (1, 0)
    states = [(t.user_attrs["index"], t.state.name) for t in loaded.trials]
    assert states[:3] == [(0, "RUNNING"), (0, "FAIL"), (1, "RUNNING")]
    assert study.claim(loaded, cell(), budget) is None


def test_a_study_recorded_with_other_settings_is_refused(storage):
    study.prepare(storage, cell(steps=30), "t")
    with pytest.raises(ValueError, match="'t/teacher-mlp/sgd/float32' was recorded "):
        study.prepare(storage, cell(steps=40), "t")


def test_runs_run_once_and_a_rerun_skips_them(storage):
    budget, finished = cells.Budget("custom", 2, 1), []
    assert study.run_cells(storage, [cell()], "t", budget, finished.append) == 2
    assert finished == [cell(), cell()]
    assert study.run_cells(storage, [cell()], "t", budget) == 0
    runs = study.load_runs(storage, [cell()], "t", budget)
    assert [(r.index, r.seed) for r in runs] == [(0, 0), (1, 0)]
    assert runs[0].params == points(parse_optimizer("sgd").family.space, 1)[0]
    assert runs[0].worker["pid"] == os.getpid()
    assert len(study.load_runs(storage, [cell()], "t", cells.Budget("x", 1, 1))) == 1


def running(storage, attributes):
    """A running trial of run (0, 0) with the given user attributes."""
    loaded = study.prepare(storage, cell(), "t")
    trial = study.claim(loaded, cell(), cells.Budget("custom", 1, 1))
    for key, value in attributes.items():
        trial.set_user_attr(key, value)
    return loaded, trial


@pytest.mark.parametrize(
    ("worker", "lost"),
    [
        ({"worker": {"host": "this", "pid": "dead"}}, True),
        (
            {"worker": {"host": "other", "pid": 1}, "heartbeat": -study.GRACE_SECONDS},
            True,
        ),
        ({"worker": {"host": "other", "pid": 1}, "heartbeat": 0}, False),
        ({"worker": {"host": "this", "pid": "alive"}}, False),
    ],
    ids=["dead-process", "old-heartbeat", "fresh-heartbeat", "live-process"],
)
def test_a_trial_whose_worker_is_gone_is_run_again(storage, worker, lost):
    import socket

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = {"this": socket.gethostname(), "other": "elsewhere.invalid"}
    pid = {"dead": dead.pid, "alive": os.getpid(), 1: 1}
    worker = dict(worker)
    worker["worker"] = {
        "host": host[worker["worker"]["host"]],
        "pid": pid[worker["worker"]["pid"]],
    }
    if "heartbeat" in worker:
        worker["heartbeat"] += time.time() - 1
    loaded, trial = running(storage, worker)
    again = study.claim(loaded, cell(), cells.Budget("custom", 1, 1))
    states = {t.number: t.state.name for t in loaded.trials}
    if lost:  # run (0, 0) is claimed again
        assert (again.user_attrs["index"], again.user_attrs["seed"]) == (0, 0)
        assert states == {trial.number: "FAIL", again.number: "RUNNING"}
    else:
        assert again is None and states == {trial.number: "RUNNING"}


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("sqlite:////no/such/folder/studies.db", "unable to open database file"),
        ("not a url", "Could not parse"),
        ("postgresql://user@127.0.0.1:1/db", ""),  # no driver, or no server
    ],
)
def test_an_unreachable_storage_is_a_value_error_and_exit_code_2(url, reason, capsys):
    with pytest.raises(
        ValueError, match=f"cannot open the storage '{url}': .*{reason}"
    ):
        study.open_storage(url)
    with pytest.raises(SystemExit) as info:
        main([*TINY, "--storage", url])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"singd-curvlinops compare: error: cannot open the storage '{url}'" in err


def states(database: Path) -> list[str]:
    try:
        with sqlite3.connect(database) as connection:
            return [row[0] for row in connection.execute("SELECT state FROM trials")]
    except sqlite3.OperationalError:  # Optuna has not created its tables yet
        return []


def running_with_worker(database: Path) -> bool:
    """Whether a running trial has recorded its worker (right after it started)."""
    query = (
        "SELECT COUNT(*) FROM trials JOIN trial_user_attributes USING (trial_id) "
        "WHERE state = 'RUNNING' AND key = 'worker'"
    )
    with sqlite3.connect(database) as connection:
        return connection.execute(query).fetchone()[0] > 0


def deterministic(results: Path) -> list[tuple]:
    """What a rerun must reproduce: everything but times and memory."""
    runs = json.loads(results.read_text(encoding="utf-8"))["runs"]
    return [
        (r["optimizer"], r["index"], r["seed"], r["params"], r["final_metric"])
        + tuple((step, metric) for step, _, metric in r["curve"])
        for r in runs
    ]


def test_a_killed_study_resumes_to_the_same_results(tmp_path, capsys):
    killed, reference = tmp_path / "killed", tmp_path / "reference"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    process = subprocess.Popen(
        [sys.executable, "-m", "singd_curvlinops", *TINY, "--output", str(killed)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    database, deadline = killed / "studies.db", time.time() + 120
    while time.time() < deadline:  # kill it during its second run
        found = states(database) if database.exists() else []
        if found.count("COMPLETE") == 1 and running_with_worker(database):
            break
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert sorted(states(database)) == ["COMPLETE", "RUNNING"]

    assert main([*TINY, "--output", str(killed)]) == 0  # resume in this process
    resumed = capsys.readouterr().out
    assert sorted(states(database)) == ["COMPLETE"] * 4 + ["FAIL"]
    assert main([*TINY, "--output", str(killed)]) == 0  # finished: nothing to run
    assert capsys.readouterr().out == resumed
    assert len(states(database)) == 5

    assert main([*TINY, "--output", str(reference)]) == 0  # never interrupted
    assert deterministic(killed / "results.json") == deterministic(
        reference / "results.json"
    )
