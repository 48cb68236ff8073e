"""Spawned gloo process groups for the sharding tests, and what the ranks train.

`spawn(job, world)` runs `job(results, out_dir)` on `world` fresh processes (one
torch thread each) and returns every rank's results; a hang, crash or exception
fails the calling test. Tensors travel through `torch.save` files. The training
pieces (`Case`, `train`, `reference`, and `train_with_event` for the step
guard's tests) are shared by the workers and by the single-process references
the tests compute in the parent.
"""

from __future__ import annotations

import importlib
import time
import traceback
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from singd_curvlinops import EKFAC, KFAC, SINGD
from singd_curvlinops.distributed import Shard

BATCH = 12  # global batch per step: divisible by 2 and 3 ranks and 2 micro-batches
STEPS = 6
TOLERANCE = 1e-10
# classes per model ("two": 2 output rows on 3 ranks, an empty FSDP2 shard)
CLASSES = {
    "three": 60,
    "two": 2,
    "norm": 60,
    "tied": 31,
    "embed": 31,
    "block": 60,
    "attention": 12,
    "conv1d": 60,
}
TOKENS = 5  # positions per sequence of the "tied" and "embed" models
SEQUENCES = ("tied", "embed")  # the models that read token sequences
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
DENSE = {**SPARSE, "T": 1, "structures": ("dense", "dense")}
IKFAC = {**SPARSE, "kfac_like": True, "structures": ("dense", "diagonal")}
KFAC_OPTIONS = {"lr": 0.05, "momentum": 0.5, "damping": 0.1, "T": 2}
EKFAC_OPTIONS = {"lr": 0.05, "momentum": 0.5, "damping": 0.01, "T": 2}


@dataclass(frozen=True)
class Case:
    """One training configuration.

    Attributes:
        options: Optimizer options.
        wrap: `"ddp"`, `"manual"` (gradients all-reduced by hand), `"accumulate"`
            (two micro-batches, DDP's `no_sync` on the first), `"fsdp"` or
            `"fsdp_accumulate"` (FSDP2, gradient sync off on the first), or
            `"hsdp"`, `"hsdp_accumulate"` (the same on a 2-d mesh: two replicas
            of half the ranks' shards each), `"hsdp_whole"` (every rank a
            replica of one shard).
        distribute: `"replicate"`, `"shard"`, `"owned"` (`Shard(factors="owned")`)
            or `"factors"` (`Shard(share="factors")`).
        optimizer: `"singd"`, `"kfac"` or `"ekfac"`.
        model: `"three"` (Conv2d 2→3, Linear 48→24, Linear 24→60), `"two"`
            (Conv2d 2→3, Linear 48→2), `"norm"` (`"three"` with a LayerNorm
            before the first Linear: fallback parameters), `"tied"` (an
            Embedding 31→8 tied to the output Linear 8→31, GPT-2's layout),
            `"embed"` (the same without the tie: BERT's and Llama's layout),
            `"block"` (`"three"` with its two Linears in one child: one FSDP2
            unit holding two layers, as a Transformer block is wrapped),
            `"attention"` (the image's rows as 16 tokens of 8 features, an
            `nn.TransformerEncoderLayer`, an `nn.MultiheadAttention` that FSDP2
            shards as a unit of its own, mean over tokens, Linear 8→12) or
            `"conv1d"` (Hugging Face's Conv1D 128→25 and 25→60, weights stored
            `[d_in, d_out]` beside their biases: GPT-2's layers).
        dtype: The model's and the data's dtype.
        device: The model's and the data's device (the GPU checks of
            `.ci/gpu/dist_check.py` train the same cases on `"cuda"`).
    """

    options: dict[str, Any] = field(default_factory=lambda: dict(SPARSE))
    wrap: str = "ddp"
    distribute: str = "shard"
    optimizer: str = "singd"
    model: str = "three"
    dtype: torch.dtype = torch.float64
    device: str = "cpu"


class LastPosition(nn.Module):
    """The logits of a sequence's last position."""

    def forward(self, X: Tensor) -> Tensor:
        return X[:, -1]


class SelfAttention(nn.Module):
    """`nn.MultiheadAttention` on `(x, x, x)`, its output only."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)

    def forward(self, X: Tensor) -> Tensor:
        return self.attn(X, X, X, need_weights=False)[0]


class MeanTokens(nn.Module):
    """The mean over a sequence's positions."""

    def forward(self, X: Tensor) -> Tensor:
        return X.mean(1)


def build_model(name: str) -> nn.Sequential:
    torch.manual_seed(0)
    if name == "attention":
        encoder = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        body = [nn.Flatten(1, 2), encoder, SelfAttention(8, 2), MeanTokens()]
        return nn.Sequential(*body, nn.Linear(8, CLASSES[name])).double()
    if name in SEQUENCES:  # tokens → Embedding → Linear → head (tied or not)
        embed = nn.Embedding(CLASSES[name], 8)
        head = nn.Linear(8, CLASSES[name], bias=False)
        if name == "tied":
            head.weight = embed.weight
        body = [embed, nn.Linear(8, 8), nn.Tanh(), head, LastPosition()]
        return nn.Sequential(*body).double()
    if name == "conv1d":  # Hugging Face's Conv1D (weight [d_in, d_out], a bias)
        from transformers.pytorch_utils import Conv1D

        body = [nn.Flatten(), Conv1D(25, 128), nn.Tanh(), Conv1D(CLASSES[name], 25)]
        return nn.Sequential(*body).double()
    if name == "two":
        tail = [nn.Linear(48, CLASSES["two"])]
    elif name == "norm":  # the LayerNorm's parameters go to the AdamW fallback
        tail = [
            nn.LayerNorm(48),
            nn.Linear(48, 24),
            nn.ReLU(),
            nn.Linear(24, CLASSES["norm"]),
        ]
    elif name == "block":  # one child: one FSDP2 unit
        tail = [
            nn.Sequential(nn.Linear(48, 24), nn.ReLU(), nn.Linear(24, CLASSES["block"]))
        ]
    else:
        tail = [nn.Linear(48, 24), nn.ReLU(), nn.Linear(24, CLASSES["three"])]
    conv = nn.Conv2d(2, 3, 3, stride=2, padding=1)
    return nn.Sequential(conv, nn.ReLU(), nn.Flatten(), *tail).double()


class TwoHeads(nn.Module):
    """A shared body and two heads used in turn: a layer has no gradient in a step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(8, 6)
        self.heads = nn.ModuleList([nn.Linear(6, 3), nn.Linear(6, 3)])

    def forward(self, X: Tensor, head: int) -> Tensor:
        return self.heads[head](torch.tanh(self.body(X)))


def with_unused_parameters(model: nn.Module) -> nn.Module:
    """Wrap `model` in DDP that allows unused parameters (in a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return model
    return DistributedDataParallel(model, find_unused_parameters=True)


def train_heads(
    distribute: str, steps: int = 2 * STEPS, *, fsdp: bool = False
) -> list[Tensor]:
    """Train `TwoHeads` (T = 2) with the heads in turn; one process: the whole batch.

    Under DDP (`find_unused_parameters`) the resting head has no gradient on any
    rank, so it sits the step out on every rank alike; so it does under FSDP2
    (`fsdp`: a unit for the body and for each head, and the root).
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = TwoHeads().double()
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for unit in (model.body, *model.heads):
            fully_shard(unit)
        net = fully_shard(model)
    else:
        net = with_unused_parameters(model)
    optimizer = SINGD(net, distribute=strategy(distribute), **{**DENSE, "T": 2})
    for step in range(steps):
        generator = torch.Generator().manual_seed(step)
        X = torch.randn(BATCH, 8, generator=generator, dtype=torch.float64)
        y = torch.randint(0, 3, (BATCH,), generator=generator)
        local = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        optimizer.zero_grad()
        F.cross_entropy(net(X[local], step % 2), y[local]).backward()
        optimizer.step()
    return params(model)


class RoutedHeads(TwoHeads):
    """`TwoHeads` with each example routed by the sign of its first input (a
    mixture of experts' router): a head that none of a rank's examples reach is
    not called there, and that rank has no statistics for it."""

    def forward(self, X: Tensor) -> Tensor:
        hidden = torch.tanh(self.body(X))
        routes = (X[:, 0] <= 0).long()
        out = hidden.new_zeros(len(X), 3)
        for index, head in enumerate(self.heads):
            if (routes == index).any():
                out[routes == index] = head(hidden[routes == index])
        return out


def train_routed(
    distribute: str, kfac: bool = False, steps: int = STEPS
) -> list[Tensor]:
    """Train `RoutedHeads` (dense, T = 1; or KFAC); one process: the whole batch.

    The first half of the global batch goes to the first head, the rest to the
    second: on two ranks each head sees one rank's examples only (on three, the
    middle rank's are split), and DDP (`find_unused_parameters`) averages its
    gradient over all ranks.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = RoutedHeads().double()
    net = with_unused_parameters(model)
    cls, options = (KFAC, KFAC_OPTIONS) if kfac else (SINGD, DENSE)
    optimizer = cls(net, distribute=strategy(distribute), **options)
    first_half = torch.where(torch.arange(BATCH) < BATCH // 2, 1.0, -1.0)
    for step in range(steps):
        generator = torch.Generator().manual_seed(step)
        X = torch.randn(BATCH, 8, generator=generator, dtype=torch.float64)
        X[:, 0] = X[:, 0].abs() * first_half
        y = torch.randint(0, 3, (BATCH,), generator=generator)
        local = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        optimizer.zero_grad()
        F.cross_entropy(net(X[local]), y[local]).backward()
        optimizer.step()
    return params(model)


def batch(step: int, model: str) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(step)
    if model in SEQUENCES:  # token sequences; the target: the next token
        tokens = torch.randint(
            0, CLASSES[model], (BATCH, TOKENS + 1), generator=generator
        )
        return tokens[:, :-1], tokens[:, -1]
    X = torch.randn(BATCH, 2, 8, 8, generator=generator, dtype=torch.float64)
    return X, torch.randint(0, CLASSES[model], (BATCH,), generator=generator)


def strategy(name: str) -> Any:
    named = {"owned": Shard(factors="owned"), "factors": Shard(share="factors")}
    return named.get(name, name)


def make_optimizer(case: Case, net: nn.Module) -> Any:
    cls = {"singd": SINGD, "kfac": KFAC, "ekfac": EKFAC}[case.optimizer]
    return cls(net, distribute=strategy(case.distribute), **case.options)


def sharded(case: Case) -> bool:
    """Whether FSDP2 shards the case's model (on a 1-d mesh, or HSDP's 2-d one)."""
    return case.wrap.startswith(("fsdp", "hsdp"))


def wrap(case: Case, model: nn.Module) -> nn.Module:
    if sharded(case):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = None  # (FSDP2's default: a 1-d mesh over every rank)
        if case.wrap.startswith("hsdp"):  # ("hsdp_whole": one shard per replica)
            world = dist.get_world_size()
            shape = (world, 1) if case.wrap == "hsdp_whole" else (2, world // 2)
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        for attention in model.modules():  # a unit of its own inside its child's
            if isinstance(attention, nn.MultiheadAttention):
                fully_shard(attention, mesh=mesh)
        units = [[layer] for layer in model if any(True for _ in layer.parameters())]
        if case.model == "tied":  # FSDP2 shards a tied weight in one unit
            units = [[model[0], model[3]], [model[1]]]
        for unit in units:
            fully_shard(unit, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    if case.wrap == "manual":
        return model
    return DistributedDataParallel(model)


def train_step(case: Case, net: nn.Module, optimizer: Any, step: int) -> None:
    """One step on this rank's share of the global batch (all of it alone)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    X, y = batch(step, case.model)
    X = X.to(case.dtype) if X.is_floating_point() else X
    local = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    X, y = X[local].to(case.device), y[local].to(case.device)
    optimizer.zero_grad()
    if case.wrap.endswith("accumulate") and world > 1:
        micro = list(zip(X.chunk(2), y.chunk(2), strict=True))
        for index, (X_micro, y_micro) in enumerate(micro):
            last = index == len(micro) - 1
            _sync(net, case, last)
            with nullcontext() if last or sharded(case) else net.no_sync():
                share = len(X_micro) / len(X)  # the mean, micro-batches of any size
                (F.cross_entropy(net(X_micro), y_micro) * share).backward()
    else:
        F.cross_entropy(net(X), y).backward()
        if case.wrap == "manual" and world > 1:
            for param in net.parameters():
                dist.all_reduce(param.grad)
                param.grad /= world
    optimizer.step()


def _sync(net: nn.Module, case: Case, last: bool) -> None:
    if sharded(case):
        net.set_requires_gradient_sync(last)


def params(model: nn.Module) -> list[Tensor]:
    """The full parameters (gathered from FSDP2's shards: a collective)."""
    full = [
        p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()
    ]
    return [p.detach().clone() for p in full]


def train(case: Case, steps: int = STEPS) -> tuple[nn.Module, nn.Module, Any]:
    model = build_model(case.model).to(case.device, case.dtype)
    net = wrap(case, model) if dist.is_initialized() else model
    optimizer = make_optimizer(case, net)
    for step in range(steps):
        train_step(case, net, optimizer, step)
    return model, net, optimizer


def reference(case: Case, steps: int = STEPS) -> list[Tensor]:
    """One process on the concatenated batch (call without a process group)."""
    single = replace(case, wrap="manual", distribute="replicate")
    return params(train(single, steps)[0])


def step_recording_warnings(optimizer: Any) -> list[str]:
    """Take `optimizer.step()`; return the messages of the warnings it gave."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        optimizer.step()
    return [str(w.message) for w in record]


def train_with_event(case: Case, event: str, world: int, rank: int) -> dict[str, Any]:
    """Train STEPS steps on this rank's share, with an event for the step guard.

    Events: `"inf"` (step 2: an infinite input, in rank 0's share), `"huge"`
    (step 3: inputs and loss times 1e100, `lr` 1e-230), `"wide"` (step 3: inputs
    times 1e150), `"overflow"` (step 3: inputs times 1e160, whose float64
    factors overflow), `"lrblow"` (step 2: `lr` 1e308), `"singular"` (the first
    input channel always zero, and from step 2 `damping` 0: KFAC's damped
    factors of the convolution are singular); any other name changes nothing
    (`"trust"`: the case's `lr_cov` is the event). Without a process group: one
    process on the whole batch, as the reference.

    Returns:
        The parameters, the warnings' messages, the skipped steps, the
        discarded factor updates per layer, and per layer whether its `K` is
        split by column blocks (empty without a sharded plan).
    """
    model = build_model(case.model)
    if world > 1:
        net = wrap(case, model)
    else:
        net, case = model, replace(case, distribute="replicate", wrap="manual")
    optimizer = make_optimizer(case, net)
    messages = []
    for step in range(STEPS):
        X, y = batch(step, case.model)
        factor, lr = 1.0, case.options["lr"]
        if step == 2 and event == "inf":
            X = X.clone()
            X[0, 0, 0, 0] = float("inf")
        elif step == 3 and event == "huge":
            X, factor, lr = X * 1e100, 1e100, 1e-230
        elif step == 3 and event == "wide":
            X = X * 1e150
        elif step == 3 and event == "overflow":  # (float64 products of 1e160)
            X = X * 1e160
        elif step == 2 and event == "lrblow":
            lr = 1e308
        elif event == "singular":
            X = X.clone()
            X[:, 0] = 0.0
            if step == 2:
                optimizer.param_groups[0]["damping"] = 0.0
        optimizer.param_groups[0]["lr"] = lr
        share = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        optimizer.zero_grad()
        (F.cross_entropy(net(X[share]), y[share]) * factor).backward()
        messages += step_recording_warnings(optimizer)
    plan = getattr(optimizer.distribution, "plan", {})
    return {
        "params": params(model),
        "messages": messages,
        "skipped": optimizer.skipped_steps,
        "discarded": [
            optimizer.state[layer.weight].get("discarded_factor_updates", 0)
            for layer in optimizer.layers
        ],
        "split": [plan[layer].columns for layer in optimizer.layers] if plan else [],
    }


# -------------------------------------------------------------- the processes
def _worker(rank: int, world: int, out_dir: str, job: str, timeout: float) -> None:
    torch.set_num_threads(1)
    out = Path(out_dir)
    results: dict[str, Any] = {"error": None}
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{out / 'store'}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout),
        )
        module, name = job.split(":")
        getattr(importlib.import_module(module), name)(results, out)
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # reported by the parent
        results["error"] = traceback.format_exc()
    torch.save(results, out / f"rank{rank}.pt")


def spawn(job: str, world: int, out_dir: Path, *, timeout: float = 30.0) -> list[dict]:
    """Run `job` ("module:function") on `world` processes; fail on any problem."""
    context = mp.get_context("spawn")
    processes = [
        context.Process(target=_worker, args=(r, world, str(out_dir), job, timeout))
        for r in range(world)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + 150.0
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    hung = [process for process in processes if process.is_alive()]
    for process in hung:
        process.kill()
        process.join()
    if hung:
        pytest.fail(f"{len(hung)} of {world} processes hung")
    results = [
        torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in range(world)
    ]
    for r, result in enumerate(results):
        assert result["error"] is None, f"rank {r}:\n{result['error']}"
    return results
