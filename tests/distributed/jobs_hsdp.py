"""What the spawned ranks of `test_hsdp.py` run: HSDP on four processes.

Every model is sharded by `fully_shard` on a 2-d mesh of two replicas of two
shards (`harness.wrap`, `"hsdp"`): ranks 0 and 1 hold one replica's shards,
ranks 2 and 3 the other's (`"hsdp_whole"`: four replicas of one shard).
"""

from __future__ import annotations

import copy
from functools import partial
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from singd_curvlinops.bench.distributed import STRATEGIES, Setting, measure_distributed
from singd_curvlinops.distributed import bytes_per_step
from tests.distributed.harness import (
    DENSE,
    EKFAC_OPTIONS,
    IKFAC,
    KFAC_OPTIONS,
    SPARSE,
    STEPS,
    Case,
    build_model,
    make_optimizer,
    params,
    train,
    train_step,
    wrap,
)

GRAFT = {**SPARSE, "graft": "adamw"}
CASES_HSDP = {
    "dense": Case(DENSE, "hsdp", "replicate"),
    "sparse": Case(SPARSE, "hsdp", "replicate"),
    "ikfac": Case(IKFAC, "hsdp", "replicate"),
    "kfac": Case(KFAC_OPTIONS, "hsdp", "replicate", optimizer="kfac"),
    "ekfac": Case(EKFAC_OPTIONS, "hsdp", "replicate", optimizer="ekfac"),
    "accumulate": Case(SPARSE, "hsdp_accumulate", "replicate"),
    # fallback parameters (the LayerNorm's), sharded and replicated alike
    "fallback": Case(DENSE, "hsdp", "replicate", model="norm"),
    # uneven shards in each replica (the convolution's 3 rows: 2 + 1)
    "two": Case(SPARSE, "hsdp", "replicate", model="two"),
    "tied": Case(DENSE, "hsdp", "replicate", model="tied"),
    "attention": Case(SPARSE, "hsdp", "replicate", model="attention"),
    # grafting's norms summed over a replica's shards; its moments as DTensors
    # on the 2-d mesh (`fsdp.gamma_zeros`); column shards, a bias beside them
    "graft": Case(GRAFT, "hsdp", "replicate"),
    "embed_graft": Case(
        {**DENSE, "graft": "adamw"}, "hsdp", "replicate", model="embed"
    ),
    "conv1d_graft": Case(GRAFT, "hsdp", "replicate", model="conv1d"),
    "conv1d_graft_sgd": Case(
        {**DENSE, "graft": "sgd"}, "hsdp_accumulate", "replicate", model="conv1d"
    ),
    # four replicas of one shard each: every rank holds whole layers
    "whole": Case({**DENSE, "graft": "adamw"}, "hsdp_whole", "replicate"),
    "whole_conv1d": Case(GRAFT, "hsdp_whole", "replicate", model="conv1d"),
    # owners among all four ranks; the shards' half products within a replica
    "shard_dense": Case(DENSE, "hsdp"),
    "shard_sparse": Case(SPARSE, "hsdp"),
    "shard_ikfac": Case(IKFAC, "hsdp"),
    "shard_kfac": Case(KFAC_OPTIONS, "hsdp", optimizer="kfac"),
    "shard_ekfac": Case(EKFAC_OPTIONS, "hsdp", optimizer="ekfac", model="tied"),
    "shard_accumulate": Case(SPARSE, "hsdp_accumulate"),
    "shard_fallback": Case(DENSE, "hsdp", model="norm"),
    "shard_attention": Case(DENSE, "hsdp", model="attention"),
    "shard_embed": Case(IKFAC, "hsdp", model="embed"),
    "shard_conv1d_graft": Case(GRAFT, "hsdp", model="conv1d"),
    "shard_whole": Case(DENSE, "hsdp_whole"),
    "factors_dense": Case(DENSE, "hsdp", "factors"),
    "factors_sparse": Case(SPARSE, "hsdp", "factors", model="two"),
    # owners among all four ranks gather Γ from their replica's shards; the
    # Conv1D 128→25's K split by column blocks over all four
    "owned_dense": Case(DENSE, "hsdp", "owned"),
    "owned_sparse": Case(SPARSE, "hsdp", "owned", model="two"),
    "owned_kfac": Case(KFAC_OPTIONS, "hsdp", "owned", optimizer="kfac"),
    "owned_ekfac": Case(EKFAC_OPTIONS, "hsdp", "owned", optimizer="ekfac"),
    "owned_accumulate": Case(IKFAC, "hsdp_accumulate", "owned"),
    "owned_fallback": Case(SPARSE, "hsdp", "owned", model="norm"),
    "owned_conv1d": Case(DENSE, "hsdp", "owned", model="conv1d"),
    "owned_conv1d_graft": Case(GRAFT, "hsdp", "owned", model="conv1d"),
    "owned_whole": Case(DENSE, "hsdp_whole", "owned", model="conv1d"),
}
RESUME_AT = 3
# DCP checkpoints saved on one mesh and loaded on the other: (saved, loaded,
# distribute), FSDP2's 1-d mesh over four processes and HSDP's 2-d one
CROSS_MESH = [
    ("fsdp", "hsdp", "owned"),
    ("hsdp", "fsdp", "shard"),
    ("fsdp", "hsdp", "replicate"),
]


def train_hsdp(results: dict[str, Any], out: Path) -> None:
    """Train every case; resume six through DCP; record collectives, the
    benchmark and errors."""
    for name, case in CASES_HSDP.items():
        model, _, optimizer = train(case)
        results[f"params/{name}"] = params(model)
        plan = getattr(optimizer.distribution, "plan", {})
        results[f"plan/{name}"] = [list(a.owners) for a in plan.values()]
    resumed = ("graft", "conv1d_graft", "shard_dense", "shard_conv1d_graft")
    for name in (*resumed, "owned_dense", "owned_conv1d"):
        results[f"resume/{name}"] = _resume(CASES_HSDP[name])
    watched = ("dense", "graft", "conv1d_graft", "whole", "shard_dense")
    for name in (*watched, "owned_sparse", "owned_conv1d"):
        case = CASES_HSDP[name]
        net = wrap(case, build_model(case.model))
        optimizer = make_optimizer(case, net)
        recorded = _recorded(partial(train_step, case, net, optimizer, 0))
        results[f"collectives/{name}"] = recorded
        results[f"bytes/{name}"] = bytes_per_step(optimizer, update=True)
        plan = getattr(optimizer.distribution, "plan", {})
        results[f"split/{name}"] = [a.columns for a in plan.values()]
    for saved, loaded, distribute in CROSS_MESH:
        tag = f"{saved}->{loaded}/{distribute}"
        results[f"cross/{tag}"] = _cross_mesh(saved, loaded, distribute, out)
    for replicas in (1, 2):  # `bench --distributed --fsdp`, and `--hsdp 2`
        settings = [
            Setting("cnn", "dense", 1, name, fsdp=True, replicas=replicas)
            for name in STRATEGIES
        ]
        results[f"bench/{replicas}"] = measure_distributed(settings, 1, 1, 0)
    results["misuse/unsharded"] = _error(_unsharded_layer)
    results["misuse/meshes"] = _error(_two_meshes)


def _resume(case: Case) -> dict[str, Any]:
    """Train with a DCP checkpoint at `RESUME_AT`; resume from it in a new run."""
    model = build_model(case.model)
    net = wrap(case, model)
    optimizer = make_optimizer(case, net)
    for step in range(STEPS):
        if step == RESUME_AT:
            saved = copy.deepcopy(get_optimizer_state_dict(net, optimizer))
            weights = copy.deepcopy(model.state_dict())
        train_step(case, net, optimizer, step)
    uninterrupted = params(model)
    model = build_model(case.model)
    net = wrap(case, model)
    model.load_state_dict(weights)
    optimizer = make_optimizer(case, net)
    set_optimizer_state_dict(net, optimizer, optim_state_dict=saved)
    for step in range(RESUME_AT, STEPS):
        train_step(case, net, optimizer, step)
    return {"uninterrupted": uninterrupted, "resumed": params(model)}


def _cross_mesh(saved: str, loaded: str, distribute: str, out: Path) -> dict:
    """Save model and optimizer with DCP at `RESUME_AT` on one mesh, resume on
    the other (DCP reshards the DTensors); record both runs' parameters."""
    import torch.distributed.checkpoint as dcp

    case = Case(GRAFT, saved, distribute)
    model = build_model(case.model)
    net = wrap(case, model)
    optimizer = make_optimizer(case, net)
    folder = out / f"{saved}-{loaded}-{distribute}"
    for step in range(STEPS):
        if step == RESUME_AT:
            state = get_optimizer_state_dict(net, optimizer)
            dcp.save(
                {"model": model.state_dict(), "optim": state}, checkpoint_id=folder
            )
        train_step(case, net, optimizer, step)
    uninterrupted = params(model)
    case = Case(GRAFT, loaded, distribute)
    model = build_model(case.model)
    net = wrap(case, model)
    optimizer = make_optimizer(case, net)
    target = {
        "model": model.state_dict(),
        "optim": get_optimizer_state_dict(net, optimizer),
    }
    dcp.load(target, checkpoint_id=folder)
    model.load_state_dict(target["model"])
    set_optimizer_state_dict(net, optimizer, optim_state_dict=target["optim"])
    for step in range(RESUME_AT, STEPS):
        train_step(case, net, optimizer, step)
    return {"uninterrupted": uninterrupted, "resumed": params(model)}


def _recorded(function: Any) -> list[tuple[str, int, int]]:
    """Return `(kind, bytes, processes)` of every all-reduce, all-gather, all-to-all.

    An all-gather's bytes are what each process receives, an all-to-all's what
    it sends.
    """
    originals = dist.all_reduce, dist.all_gather, dist.all_to_all_single
    recorded: list[tuple[str, int, int]] = []

    def processes(kwargs: dict) -> int:
        return dist.get_world_size(kwargs.get("group"))

    def all_reduce(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        kind = "all_reduce" if tensor.is_floating_point() else "checks"
        size = tensor.numel() * tensor.element_size()
        recorded.append((kind, size, processes(kwargs)))
        return originals[0](tensor, *args, **kwargs)

    def all_gather(tensors: list, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        size = len(tensors) * tensor.numel() * tensor.element_size()
        recorded.append(("all_gather", size, processes(kwargs)))
        return originals[1](tensors, tensor, *args, **kwargs)

    def all_to_all_single(output: Any, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        size = tensor.numel() * tensor.element_size()
        recorded.append(("all_to_all", size, processes(kwargs)))
        return originals[2](output, tensor, *args, **kwargs)

    dist.all_reduce, dist.all_gather = all_reduce, all_gather
    dist.all_to_all_single = all_to_all_single
    try:
        function()
    finally:
        dist.all_reduce, dist.all_gather, dist.all_to_all_single = originals
    return recorded


def _unsharded_layer() -> None:
    """One `"shard"` step of a model whose last layer FSDP2 leaves whole (HSDP)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(
        "cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("r", "s")
    )
    case = Case(SPARSE, "hsdp")
    model = build_model(case.model)
    for layer in model[:-1]:  # (no root unit: the last Linear stays plain)
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    train_step(case, model, make_optimizer(case, model), 0)


def _two_meshes() -> None:
    """One step of a model whose units FSDP2 shards on meshes of two shapes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    flat = init_device_mesh("cpu", (world,))
    hybrid = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("r", "s"))
    case = Case(SPARSE, "fsdp", "replicate")
    model = build_model(case.model)
    fully_shard(model[0], mesh=hybrid)
    for layer in model[1:]:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=flat)
    net = fully_shard(model, mesh=flat)
    train_step(case, net, make_optimizer(case, net), 0)


def _error(function: Any) -> str:
    """Return `"Type: message"` of what `function` raises (or `"no error"`)."""
    try:
        function()
    except (ValueError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"
