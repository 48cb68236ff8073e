"""Data parallelism: 2 gloo processes train as one process on the concatenated batch.

Two spawns of two processes each (module-scoped fixtures): `ranks` runs every
training scenario, `misuse_ranks` the misconfigurations (which crash gloo if the
configuration check regresses). Each process writes its results to a file; the tests
compare them with single-process references computed here. Tensors travel through
`torch.save` files (a tensor sent through a queue dies with the child that sent it).
"""

from __future__ import annotations

import copy
import os
import re
import socket
import subprocess
import sys
import time
import traceback
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from singd_curvlinops import EKFAC, SINGD
from singd_curvlinops.distributed import bytes_per_update

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[1]
WORLD = 2
BATCH = 8  # global batch per step, split evenly over the ranks
STEPS = 6
RESUME_AT = 3  # the checkpoint of the "ddp" case is taken before this step
JOIN_TIMEOUT = 120.0  # seconds for the whole spawn; a hang fails the tests
COLLECTIVE_TIMEOUT = timedelta(seconds=30)
TOLERANCE = 1e-10

SPARSE = {
    "lr": 0.1,
    "lr_cov": 0.1,
    "T": 2,
    "alpha1": 0.5,
    "momentum": 0.5,
    "damping": 1e-3,
    "weight_decay": 1e-3,
    "structures": ("block3diagonal", "triltoeplitz"),
}
EKFAC_OPTIONS = {
    "optimizer": "ekfac",
    "lr": 0.1,
    "T": 2,
    "momentum": 0.5,
    "damping": 1e-2,
    "weight_decay": 1e-3,
}
OPTIMIZERS = {"singd": SINGD, "ekfac": EKFAC}
# name: (optimizer options, how the processes average their gradients)
CASES: dict[str, tuple[dict[str, Any], str]] = {
    "ddp": (SPARSE, "ddp"),
    "manual": (SPARSE, "manual"),
    "hierarchical_manual": (
        {**SPARSE, "T": 3, "structures": ("hierarchical5_5", "triutoeplitz")},
        "manual",
    ),
    "ikfac": (
        {**SPARSE, "kfac_like": True, "structures": ("dense", "diagonal")},
        "ddp",
    ),
    "sum_loss": ({**SPARSE, "lr": 0.02, "loss_average": None}, "ddp"),
    "accumulate": (SPARSE, "accumulate"),
    # EKFAC: a second collective (the projected per-example gradients)
    "ekfac": (EKFAC_OPTIONS, "ddp"),
    "ekfac_accumulate": (EKFAC_OPTIONS, "accumulate"),
}


# ----------------------------------------------------------------- shared pieces
def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(48, 3),
    ).double()


def _batch(step: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(step)
    X = torch.randn(BATCH, 2, 8, 8, generator=generator, dtype=torch.float64)
    return X, torch.randint(0, 3, (BATCH,), generator=generator)


def _optimizer(net: nn.Module, opts: dict[str, Any]) -> SINGD | EKFAC:
    """Build `opts["optimizer"]` (default SINGD) with the other options."""
    opts = dict(opts)
    return OPTIMIZERS[opts.pop("optimizer", "singd")](net, **opts)


def _loss(output: Tensor, y: Tensor, opts: dict[str, Any]) -> Tensor:
    sum_loss = "loss_average" in opts and opts["loss_average"] is None
    return F.cross_entropy(output, y, reduction="sum" if sum_loss else "mean")


def _single_process(opts: dict[str, Any], steps: int = STEPS) -> list[Tensor]:
    model = _model()
    optimizer = _optimizer(model, opts)
    for step in range(steps):
        X, y = _batch(step)
        optimizer.zero_grad()
        _loss(model(X), y, opts).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


# ------------------------------------------------- a whole model (issue 13)
VOCABULARY, WIDTH, SEQUENCE = 11, 6, 4
WHOLE = {"lr": 0.05, "T": 2, "loss_average": "batch+sequence", "momentum": 0.5}


class _Whole(nn.Module):
    """Embedding tied to the output layer, attention, fallback parameters."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCABULARY, WIDTH, padding_idx=0)
        self.position = nn.Parameter(0.1 * torch.randn(SEQUENCE, WIDTH))
        self.attention = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCABULARY, bias=False)
        self.head.weight = self.embed.weight
        self.double()

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens) + self.position
        h = self.norm(h + self.attention(h, h, h, need_weights=False)[0])
        return self.head(h)


def _tokens(step: int) -> Tensor:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCABULARY, (BATCH, SEQUENCE), generator=generator)


def _token_loss(model: nn.Module, tokens: Tensor) -> Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1), tokens.roll(1, 1).flatten())


def _whole_single_process() -> list[Tensor]:
    model = _Whole()
    optimizer = SINGD(model, **WHOLE)
    for step in range(STEPS):
        optimizer.zero_grad()
        _token_loss(model, _tokens(step)).backward()
        optimizer.step()
    return _params(model)


def _run_whole_model(results: dict[str, Any]) -> None:
    model = _Whole()
    net = DistributedDataParallel(model)
    optimizer = SINGD(net, **WHOLE)
    rank = dist.get_rank()
    for step in range(STEPS):
        local = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
        optimizer.zero_grad()
        _token_loss(net, _tokens(step)[local]).backward()
        optimizer.step()
    results["params/whole"] = _params(model)
    results["whole/fallback"] = len(optimizer.fallback_params)
    results["whole/twins"] = sum(layer.twin is not None for layer in optimizer.layers)


# ------------------------------------------------------------------ the workers
def _local_batch(step: int, rank: int) -> tuple[Tensor, Tensor]:
    X, y = _batch(step)
    local = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    return X[local], y[local]


def _setup(
    opts: dict[str, Any], mode: str, model_state: dict | None = None
) -> tuple[nn.Module, nn.Module, SINGD]:
    model = _model()
    if model_state is not None:
        model.load_state_dict(model_state)
    net = model if mode == "manual" else DistributedDataParallel(model)
    return model, net, _optimizer(net, opts)


def _train_step(
    net: nn.Module,
    optimizer: SINGD,
    step: int,
    mode: str,
    opts: dict[str, Any],
) -> None:
    rank = dist.get_rank()
    X, y = _local_batch(step, rank)
    optimizer.zero_grad()
    if mode == "accumulate":  # two micro-batches, synchronised on the last only
        micro = list(zip(X.chunk(2), y.chunk(2), strict=True))
        for index, (X_micro, y_micro) in enumerate(micro):
            last = index == len(micro) - 1
            with nullcontext() if last else net.no_sync():
                (_loss(net(X_micro), y_micro, opts) / len(micro)).backward()
    else:
        sum_loss = "loss_average" in opts and opts["loss_average"] is None
        scale = WORLD if sum_loss else 1  # DDP's convention for sum losses
        (_loss(net(X), y, opts) * scale).backward()
        if mode == "manual":  # what DistributedDataParallel does
            for param in net.parameters():
                dist.all_reduce(param.grad)
                param.grad /= WORLD
    optimizer.step()


def _params(model: nn.Module) -> list[Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _run_cases(out_dir: Path, results: dict[str, Any]) -> None:
    for name, (opts, mode) in CASES.items():
        model, net, optimizer = _setup(opts, mode)
        for step in range(STEPS):
            if name == "ddp" and step == RESUME_AT:
                checkpoint = _checkpoint(model, net, optimizer, out_dir)
            _train_step(net, optimizer, step, mode, opts)
        results[f"params/{name}"] = _params(model)
        results[f"state/{name}"] = optimizer.state_dict()
    _resume(checkpoint, results)


def _checkpoint(
    model: nn.Module, net: nn.Module, optimizer: SINGD, out_dir: Path
) -> tuple[Path, dict, dict]:
    path = out_dir / "checkpoint.pt"
    if dist.get_rank() == 0:
        torch.save(
            {"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path
        )
    dist.barrier()
    # SINGD updates its factors in place: copy what the checkpoint APIs return
    dcp_state = copy.deepcopy(get_optimizer_state_dict(net, optimizer))
    return path, copy.deepcopy(model.state_dict()), dcp_state


def _resume(checkpoint: tuple[Path, dict, dict], results: dict[str, Any]) -> None:
    path, model_state, dcp_state = checkpoint
    opts, mode = CASES["ddp"]
    saved = torch.load(path, weights_only=True)
    model, net, optimizer = _setup(opts, mode, saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    for step in range(RESUME_AT, STEPS):
        _train_step(net, optimizer, step, mode, opts)
    results["params/resumed"] = _params(model)
    results["state/resumed"] = optimizer.state_dict()

    results["dcp/keys"] = {k: sorted(v) for k, v in dcp_state["state"].items()}
    model, net, optimizer = _setup(opts, mode, model_state)
    set_optimizer_state_dict(net, optimizer, optim_state_dict=dcp_state)
    for step in range(RESUME_AT, STEPS):
        _train_step(net, optimizer, step, mode, opts)
    results["params/dcp"] = _params(model)
    results["state/dcp"] = optimizer.state_dict()


BYTES_OPTIONS = {  # the all-reduces of two steps are recorded
    "diagonal": {"structures": ("diagonal", "diagonal"), "T": 1},
    "ekfac": {"optimizer": "ekfac", "T": 1},
}


def _measure_bytes(results: dict[str, Any], name: str) -> None:
    """Record the sizes of the floating-point all-reduces of two steps."""
    opts = BYTES_OPTIONS[name]
    model, net, optimizer = _setup(opts, "ddp")
    recorded = []
    original = dist.all_reduce

    def recording(tensor: Tensor, *args: Any, **kwargs: Any) -> Any:
        if tensor.is_floating_point():
            recorded.append(tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = recording
    try:
        for step in range(2):
            _train_step(net, optimizer, step, "ddp", opts)
    finally:
        dist.all_reduce = original
    results[f"bytes/{name}/recorded"] = recorded
    results[f"bytes/{name}/reported"] = bytes_per_update(optimizer)


def _misuse(results: dict[str, Any]) -> None:
    """Ranks that disagree on structures or layers: both must raise, none hang."""
    rank = dist.get_rank()
    setups = {
        "structures": (("diagonal", "diagonal"), ("dense", "dense"))[rank],
        "layers": SPARSE["structures"],
    }
    for label, structures in setups.items():
        model = _model()
        conv_only = label == "layers" and rank == 1
        params = list(model[0].parameters()) if conv_only else None
        optimizer = SINGD(model, params=params, structures=structures, T=1)
        X, y = _local_batch(0, rank)
        F.cross_entropy(model(X), y).backward()
        try:
            optimizer.step()
            results[f"misuse/{label}"] = "no error"
        except RuntimeError as error:
            results[f"misuse/{label}"] = str(error)
    dist.barrier()  # the group still works afterwards


def _misuse_and_no_group(results: dict[str, Any]) -> None:
    _misuse(results)
    wrapped = DistributedDataParallel(_model())
    dist.destroy_process_group()
    try:
        SINGD(wrapped)
        results["no_group"] = "no error"
    except ValueError as error:
        results["no_group"] = str(error)


def _train(results: dict[str, Any], out_dir: Path) -> None:
    _run_cases(out_dir, results)
    for name in BYTES_OPTIONS:
        _measure_bytes(results, name)
    _run_whole_model(results)
    dist.destroy_process_group()


def _worker(rank: int, out_dir: str, job: str) -> None:
    torch.set_num_threads(1)
    out = Path(out_dir)
    results: dict[str, Any] = {"error": None}
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{out / 'store'}",
            rank=rank,
            world_size=WORLD,
            timeout=COLLECTIVE_TIMEOUT,
        )
        if job == "train":
            _train(results, out)
        else:
            _misuse_and_no_group(results)
    except Exception:  # reported by the parent
        results["error"] = traceback.format_exc()
    torch.save(results, out / f"rank{rank}.pt")


def _spawn(out_dir: Path, job: str) -> list[dict[str, Any]]:
    """Run `job` on `WORLD` fresh processes; fail on a hang, crash or exception."""
    context = mp.get_context("spawn")
    processes = [
        context.Process(target=_worker, args=(rank, str(out_dir), job))
        for rank in range(WORLD)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + JOIN_TIMEOUT
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    hung = [process for process in processes if process.is_alive()]
    for process in hung:
        process.kill()
        process.join()
    assert not hung, f"{len(hung)} process(es) hung for {JOIN_TIMEOUT} s"
    assert [process.exitcode for process in processes] == [0] * WORLD
    results = [
        torch.load(out_dir / f"rank{rank}.pt", weights_only=True)
        for rank in range(WORLD)
    ]
    for rank, result in enumerate(results):
        assert result["error"] is None, f"rank {rank}:\n{result['error']}"
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _spawn(tmp_path_factory.mktemp("train"), "train")


@pytest.fixture(scope="module")
def misuse_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """A separate spawn: a regression that crashes gloo spares the other tests."""
    return _spawn(tmp_path_factory.mktemp("misuse"), "misuse")


# -------------------------------------------------------------------- the tests
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
        assert type(a) is type(b) and len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_identical(x, y, f"{where}[{index}]")
    else:
        assert a == b, where


@pytest.mark.parametrize(
    "name", ["ddp", "manual", "hierarchical_manual", "ikfac", "sum_loss", "ekfac"]
)
def test_processes_equal_one_process_on_concatenated_batch(
    ranks: list[dict[str, Any]], name: str
) -> None:
    opts, _ = CASES[name]
    expected = _single_process(opts)
    initial = _params(_model())
    moved = max(
        (p - q).abs().max().item() for p, q in zip(expected, initial, strict=True)
    )
    assert moved > 1e-3  # training did something
    for result in ranks:
        _assert_close(result[f"params/{name}"], expected)


def test_whole_model_equals_one_process(ranks: list[dict[str, Any]]) -> None:
    """Fallback parameters, a tied embedding and attention under DDP."""
    expected = _whole_single_process()
    initial = _params(_Whole())
    moved = max(
        (p - q).abs().max().item() for p, q in zip(expected, initial, strict=True)
    )
    assert moved > 1e-3
    for result in ranks:
        assert result["whole/fallback"] == 3  # position, norm weight and bias
        assert result["whole/twins"] == 1  # the embedding tied to the head
        _assert_close(result["params/whole"], expected)


@pytest.mark.parametrize("name", ["accumulate", "ekfac_accumulate"])
def test_gradient_accumulation_with_no_sync(
    ranks: list[dict[str, Any]], name: str
) -> None:
    expected = _single_process(CASES[name][0])
    for result in ranks:
        _assert_close(result[f"params/{name}"], expected)


@pytest.mark.parametrize("name", [*CASES, "resumed", "dcp"])
def test_every_rank_ends_with_the_same_optimizer_state(
    ranks: list[dict[str, Any]], name: str
) -> None:
    states = [result[f"state/{name}"] for result in ranks]
    factor = "eigenvalues" if name.startswith("ekfac") else "K."
    assert any(key.startswith(factor) for key in states[0]["state"][0])
    _assert_identical(states[0], states[1], name)
    _assert_identical(ranks[0][f"params/{name}"], ranks[1][f"params/{name}"])


@pytest.mark.parametrize("restored", ["resumed", "dcp"])
def test_restored_training_continues_identically(
    ranks: list[dict[str, Any]], restored: str
) -> None:
    for result in ranks:
        _assert_identical(result[f"params/{restored}"], result["params/ddp"])
        _assert_identical(result[f"state/{restored}"], result["state/ddp"])


def test_dcp_state_dict_holds_the_factors(ranks: list[dict[str, Any]]) -> None:
    keys = ranks[0]["dcp/keys"]
    assert set(keys) == {"0.weight", "0.bias", "3.weight", "3.bias"}
    for weight in ("0.weight", "3.weight"):
        assert "step" in keys[weight]
        for prefix in ("K.", "C.", "m_K.", "m_C."):
            assert any(key.startswith(prefix) for key in keys[weight])
    assert "momentum_buffer" in keys["0.bias"]


@pytest.mark.parametrize("label", ["structures", "layers"])
def test_ranks_that_disagree_raise_on_every_rank(
    misuse_ranks: list[dict[str, Any]], label: str
) -> None:
    for result in misuse_ranks:
        assert re.search("disagree", result[f"misuse/{label}"])


def test_wrapped_model_without_process_group_raises(
    misuse_ranks: list[dict[str, Any]],
) -> None:
    for result in misuse_ranks:
        assert re.search("process group", result["no_group"])


def test_all_reduced_bytes_match_bytes_per_update(
    ranks: list[dict[str, Any]],
) -> None:
    for result in ranks:
        reported = result["bytes/diagonal/reported"]
        assert result["bytes/diagonal/recorded"] == [reported, reported]  # per step
        assert reported == _diagonal_bytes(world=2)


def test_ekfac_all_reduces_its_eigenvalue_sums_per_layer(
    ranks: list[dict[str, Any]],
) -> None:
    """One buffer of the dense statistics, then each layer's d_C × d_K sums."""
    d_K, d_C = (2 * 3 * 3 + 1, 48 + 1), (3, 3)
    statistics = sum((k * k + c * c + 1) * 8 for k, c in zip(d_K, d_C, strict=True))
    statistics += 2 * 8  # the two ranks' option fingerprints
    sums = [k * c * 8 for k, c in zip(d_K, d_C, strict=True)]
    for result in ranks:
        assert result["bytes/ekfac/recorded"] == [statistics, *sums] * 2
        assert result["bytes/ekfac/reported"] == statistics + sum(sums)


def _diagonal_bytes(world: int = 1) -> int:
    d_K = (2 * 3 * 3 + 1, 48 + 1)  # inputs (+ bias) of the Conv2d and the Linear
    d_C = (3, 3)
    fingerprints = 8 * world if world > 1 else 0  # one per rank (`exchange`)
    return sum((k + c + 1) * 8 for k, c in zip(d_K, d_C, strict=True)) + fingerprints


def test_bytes_per_update_counts_d_numbers_per_diagonal_factor() -> None:
    diagonal = SINGD(_model(), structures=("diagonal", "diagonal"))
    assert bytes_per_update(diagonal) == _diagonal_bytes() == 608
    dense = SINGD(_model(), structures=("dense", "diagonal"))
    assert bytes_per_update(dense) == ((19**2 + 3 + 1) + (49**2 + 3 + 1)) * 8


# ------------------------------------------------------------------ the example
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize(
    ("processes", "options"),
    [
        (WORLD, []),
        (WORLD, ["--fsdp", "--distribute", "owned"]),
        (4, ["--hsdp", "2"]),  # two replicas of two shards, "shard"
    ],
)
def test_ddp_example_runs_under_torchrun(processes: int, options: list[str]) -> None:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(processes),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(_free_port()),
        str(ROOT / "docs" / "examples" / "ddp_train.py"),
        "--epochs",
        "1",
        *options,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        command,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert re.search(r"epoch 1/1: loss \d+\.\d+", done.stdout), output
    assert re.search(r"bytes per update step: \d+", done.stdout), output


@pytest.mark.parametrize("momentum", [0.0, 0.5])
@pytest.mark.parametrize("steps_before", [0, 2])
def test_dcp_round_trip_in_one_process(momentum: float, steps_before: int) -> None:
    """DCP's strict `set_optimizer_state_dict` needs state for every parameter,
    also for biases, without momentum and before the first step."""

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)).double()

    X = torch.randn(8, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (8,))
    options = {"momentum": momentum, "T": 1, "lr": 0.1, "lr_cov": 0.1}

    def step(model: nn.Module, optimizer: SINGD) -> None:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(X), y).backward()
        optimizer.step()

    model = make()
    optimizer = SINGD(model, **options)
    for _ in range(steps_before):
        step(model, optimizer)
    saved = copy.deepcopy(get_optimizer_state_dict(model, optimizer))
    twin = make()
    twin.load_state_dict(model.state_dict())
    twin_optimizer = SINGD(twin, **options)
    set_optimizer_state_dict(twin, twin_optimizer, optim_state_dict=saved)
    for _ in range(2):
        step(model, optimizer)
        step(twin, twin_optimizer)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)
