"""The study engine: Optuna studies that hold every run, resumable and shared.

One Optuna study per *cell* (workload × optimizer × precision), named
`PREFIX/WORKLOAD/OPTIMIZER/PRECISION`, in one storage: an SQLite file by default,
or any database URL that Optuna accepts (PostgreSQL, MySQL) for several machines.
Each Optuna trial is one run: a point of the optimizer's search space (user
attribute `index`, the point's position in the quasi-random sequence of
`compare.search`) and a seed (`seed`). Its result (`compare.trial.RunResult`) is
the user attribute `result`; its value is the run's seconds to the target.

A worker claims one run at a time, cell after cell (round robin):

1. **Recover**: a running trial whose worker is gone becomes `FAIL`: on the same
   host when its process no longer exists, on any host when its heartbeat (the
   user attribute `heartbeat`, renewed every `HEARTBEAT_SECONDS` while it runs;
   its start time before the first one) is older than `GRACE_SECONDS`. A worker
   records itself (user attribute `worker`) right after it claims a trial; a
   trial whose worker died before that is recovered by the heartbeat rule.
2. **Pick** the first run of the budget (by point, then seed) that has no running
   or complete trial; none left: the cell is done.
3. **Claim** it: enqueue it (`study.enqueue_trial`) and take it (`study.ask`,
   which pops the oldest waiting trial and hands each to exactly one worker). If
   two workers picked the same run at once, the trial with the lower number keeps
   it and the other becomes `FAIL` (the loser picks again).
4. **Run** it and `tell` the result. An exception marks the trial `FAIL` and
   stops the worker (Ctrl-C included), so the next start reruns it.

Runs are enqueued one at a time, just before they are taken, so no queue of
waiting runs outlives its worker and a worker runs only its own budget. A rerun
therefore skips every finished run; a larger budget adds its extra runs; several
workers (processes or machines) pointed at the same storage share the work. A
cell's settings (steps, evaluation period, search space, fixed options, and
`compare.cells.REVISION`) are stored with its study; a study recorded with other
settings is refused instead of mixed.
"""

from __future__ import annotations

import contextlib
import os
import platform
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from singd_curvlinops.compare.cells import Budget, Cell
from singd_curvlinops.compare.search import points
from singd_curvlinops.compare.trial import RunResult, run_trial, seconds_to_target

if TYPE_CHECKING:  # the `compare` extra; imported where it is used
    from optuna import Study, Trial
    from optuna.storages import RDBStorage
    from optuna.trial import FrozenTrial

HEARTBEAT_SECONDS = 10
GRACE_SECONDS = 120
DEFAULT_PREFIX = "singd-curvlinops-compare"


def open_storage(url: str) -> RDBStorage:
    """Open (and create where needed) an Optuna storage.

    Args:
        url: A database URL, e.g. `sqlite:///studies.db` or
            `postgresql://user:password@host/database`.

    Returns:
        The `optuna.storages.RDBStorage`.

    Raises:
        ValueError: If the URL is malformed, its database driver is missing, or
            the database cannot be reached or created; the message says which.
    """
    import optuna

    try:
        return optuna.storages.RDBStorage(url)
    except ImportError as error:
        reason = f"its database driver is not installed ({error})"
    except Exception as error:  # SQLAlchemy's errors: malformed URL, no server, ...
        reason = str(error).splitlines()[0]
    raise ValueError(f"cannot open the storage {url!r}: {reason}")


def _worker() -> dict[str, Any]:
    """Describe this process (stored with every trial it runs).

    Returns:
        Host, process id and versions.
    """
    from singd_curvlinops import __version__

    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "singd_curvlinops": __version__,
        "threads": torch.get_num_threads(),
    }


def _process_exists(pid: int) -> bool:
    """Return whether a process with this id runs on this host.

    Args:
        pid: A process id.

    Returns:
        False only if the operating system says there is no such process.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


def _is_stale(trial: FrozenTrial, now: float) -> bool:
    """Return whether a running trial has lost its worker.

    Args:
        trial: A running `optuna.trial.FrozenTrial`.
        now: The current time (`time.time()`).

    Returns:
        Whether its process is gone (same host) or its heartbeat is too old.
    """
    worker = trial.user_attrs.get("worker", {})
    if worker.get("host") == socket.gethostname() and not _process_exists(
        worker.get("pid", -1)
    ):
        return True
    beat = trial.user_attrs.get("heartbeat")
    if beat is None and trial.datetime_start is not None:
        beat = trial.datetime_start.timestamp()
    return beat is not None and now - beat > GRACE_SECONDS


def prepare(storage: RDBStorage, cell: Cell, prefix: str) -> Study:
    """Load or create a cell's study and check its settings.

    Args:
        storage: The Optuna storage.
        cell: The cell.
        prefix: The study prefix.

    Returns:
        The `optuna.Study`.

    Raises:
        ValueError: If the study exists with other settings.
    """
    import optuna

    name = cell.study_name(prefix)
    study = optuna.create_study(
        study_name=name, storage=storage, direction="minimize", load_if_exists=True
    )
    settings = cell.settings()
    stored = study.user_attrs.get("settings")
    if stored is None:
        study.set_user_attr("settings", settings)
    elif stored != settings:
        raise ValueError(
            f"study {name!r} was recorded with other settings ({stored}); this run "
            f"has {settings}. Choose another --study-name or --storage."
        )
    return study


def _recover(study: Study) -> None:
    """Mark the running trials whose worker is gone as failed (`_is_stale`).

    Args:
        study: An `optuna.Study`.
    """
    from optuna.trial import TrialState

    now = time.time()
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if _is_stale(trial, now):
            study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)


def _key(trial: Trial | FrozenTrial) -> tuple[int | None, int | None]:
    """Return a trial's run: `(index, seed)`, None for a trial without one.

    Args:
        trial: An Optuna trial.

    Returns:
        The run's point index and seed.
    """
    return trial.user_attrs.get("index"), trial.user_attrs.get("seed")


def _taken(study: Study) -> dict[tuple, int]:
    """Return the runs that have a running or complete trial.

    Args:
        study: An `optuna.Study`.

    Returns:
        `{(index, seed): lowest trial number}`.
    """
    from optuna.trial import TrialState

    taken: dict[tuple, int] = {}
    states = (TrialState.RUNNING, TrialState.COMPLETE)
    for trial in study.get_trials(deepcopy=False, states=states):
        taken.setdefault(_key(trial), trial.number)
    return taken


def claim(study: Study, cell: Cell, budget: Budget) -> Trial | None:
    """Claim the first run of the budget that nobody runs or has run.

    Args:
        study: The cell's `optuna.Study`.
        cell: The cell.
        budget: The budget.

    Returns:
        The running `optuna.Trial` (user attributes `index`, `seed`), or None
        when every run of the budget is running or complete.
    """
    from optuna.trial import TrialState

    _recover(study)
    space = points(cell.optimizer.family.space, budget.trials)
    while True:
        taken = _taken(study)
        missing = [
            (index, seed)
            for index in range(budget.trials)
            for seed in range(budget.seeds)
            if (index, seed) not in taken
        ]
        if not missing:
            return None
        index, seed = missing[0]
        study.enqueue_trial(space[index], user_attrs={"index": index, "seed": seed})
        trial = study.ask(_distributions(cell))
        if _taken(study).get(_key(trial)) == trial.number and None not in _key(trial):
            return trial
        study.tell(trial, state=TrialState.FAIL)  # another worker holds this run


def _distributions(cell: Cell) -> dict[str, Any]:
    """Return the Optuna distributions of the cell's search space.

    Args:
        cell: The cell.

    Returns:
        `{name: FloatDistribution(low, high, log=True)}`.
    """
    from optuna.distributions import FloatDistribution

    return {
        dim.name: FloatDistribution(dim.low, dim.high, log=True)
        for dim in cell.optimizer.family.space
    }


@contextlib.contextmanager
def _heartbeat(trial: Trial) -> Iterator[None]:
    """Renew the trial's `heartbeat` user attribute in a thread while it runs.

    Args:
        trial: The running `optuna.Trial`.

    Yields:
        None; the thread stops on exit.
    """
    done = threading.Event()

    def beat() -> None:
        """Write the time every `HEARTBEAT_SECONDS` until `done` is set."""
        while not done.wait(HEARTBEAT_SECONDS):
            trial.set_user_attr("heartbeat", time.time())

    trial.set_user_attr("heartbeat", time.time())
    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def run_one(study: Study, cell: Cell, budget: Budget) -> bool:
    """Claim a run of a cell (`claim`), train it and store its result.

    Args:
        study: The cell's `optuna.Study`.
        cell: The cell.
        budget: The budget.

    Returns:
        False if every run of the budget is running or complete.
    """
    from optuna.trial import TrialState

    trial = claim(study, cell, budget)
    if trial is None:
        return False
    trial.set_user_attr("worker", _worker())
    try:
        with _heartbeat(trial):
            result = run_trial(
                cell.workload,
                cell.optimizer,
                trial.params,
                trial.user_attrs["seed"],
                cell.precision,
            )
    except BaseException:
        study.tell(trial, state=TrialState.FAIL)
        raise
    trial.set_user_attr("result", result.to_dict())
    study.tell(trial, seconds_to_target(cell.workload, result)[1])
    return True


def run_cells(
    storage: RDBStorage,
    cells: list[Cell],
    prefix: str,
    budget: Budget,
    on_run: Callable[[Cell], None] | None = None,
) -> int:
    """Run every missing run of the cells, round robin over the cells.

    Args:
        storage: The Optuna storage.
        cells: The cells.
        prefix: The study prefix.
        budget: The budget.
        on_run: Called with the cell after each finished run (progress).

    Returns:
        The number of runs this worker finished.
    """
    studies = [(cell, prepare(storage, cell, prefix)) for cell in cells]
    finished = 0
    while studies:
        for item in list(studies):
            cell, study = item
            if not run_one(study, cell, budget):
                studies.remove(item)
                continue
            finished += 1
            if on_run is not None:
                on_run(cell)
    return finished


@dataclass(frozen=True)
class Run:
    """A finished run, as read back from the storage.

    Attributes:
        cell: Its cell.
        index: Its point's position in the quasi-random sequence.
        seed: Its seed.
        params: The searched hyperparameters.
        result: What it recorded.
        worker: The process that ran it (`host`, `pid`, versions).
    """

    cell: Cell
    index: int
    seed: int
    params: dict[str, float]
    result: RunResult
    worker: dict[str, Any]


def load_runs(
    storage: RDBStorage, cells: list[Cell], prefix: str, budget: Budget
) -> list[Run]:
    """Read the finished runs of the budget (the first trial of each index and seed).

    Args:
        storage: The Optuna storage.
        cells: The cells.
        prefix: The study prefix.
        budget: The budget (runs outside it are ignored).

    Returns:
        The runs, cell by cell, ordered by index and seed.
    """
    import optuna
    from optuna.trial import TrialState

    names = set(optuna.get_all_study_names(storage))
    runs = []
    for cell in cells:
        if cell.study_name(prefix) not in names:
            continue
        study = optuna.load_study(study_name=cell.study_name(prefix), storage=storage)
        found: dict[tuple[int, int], Run] = {}
        for trial in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            attrs = trial.user_attrs
            key = (attrs["index"], attrs["seed"])
            if key[0] < budget.trials and key[1] < budget.seeds and key not in found:
                result = RunResult.from_dict(attrs["result"])
                found[key] = Run(cell, *key, trial.params, result, attrs["worker"])
        runs += [found[key] for key in sorted(found)]
    return runs
