"""What the spawned ranks of `test_sharding.py` run (one function per spawn).

Every function fills `results` with plain tensors and containers; the tests
compare them with single-process references.
"""

from __future__ import annotations

import copy
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from singd_curvlinops import KFAC, SINGD
from singd_curvlinops.bench.distributed import (
    EKFAC_STRATEGIES,
    STRATEGIES,
    Setting,
    _largest,
    measure_distributed,
)
from singd_curvlinops.distributed import Shard, bytes_per_step
from singd_curvlinops.distributed.fsdp import is_sharded
from singd_curvlinops.distributed.fsdp import local as local_shard
from singd_curvlinops.rules import KFACRule
from tests.distributed.harness import (
    BATCH,
    DENSE,
    EKFAC_OPTIONS,
    IKFAC,
    KFAC_OPTIONS,
    SPARSE,
    STEPS,
    TOKENS,
    Case,
    batch,
    build_model,
    make_optimizer,
    params,
    step_recording_warnings,
    train,
    train_heads,
    train_routed,
    train_step,
    wrap,
)

FSDP_EKFAC = Case(EKFAC_OPTIONS, "fsdp", "replicate", optimizer="ekfac")
EKFAC_SHARD = Case(EKFAC_OPTIONS, "ddp", "shard", optimizer="ekfac")
EKFAC_OWNED = replace(EKFAC_SHARD, distribute="owned")
SPARSE_SHARD = Case(SPARSE)
HIERARCHICAL = {**SPARSE, "T": 3, "structures": ("hierarchical5_5", "triutoeplitz")}
CASES_W2 = {
    "dense": Case(DENSE),
    "dense_replicate": Case(DENSE, distribute="replicate"),
    "sparse": Case(SPARSE),
    "hierarchical_manual": Case(HIERARCHICAL, "manual"),
    "ikfac": Case(IKFAC),
    "kfac": Case(KFAC_OPTIONS, optimizer="kfac"),
    "accumulate": Case(SPARSE, "accumulate"),
    "accumulate_dense": Case(DENSE, "accumulate"),  # statistics rows stack
    "factors_dense": Case(DENSE, distribute="factors"),
    "factors_sparse": Case(SPARSE, distribute="factors"),
    "owned_dense": Case(DENSE, distribute="owned"),
    "owned_sparse": Case(SPARSE, distribute="owned"),
    "owned_kfac": Case(KFAC_OPTIONS, distribute="owned", optimizer="kfac"),
    "owned_accumulate": Case(SPARSE, "accumulate", "owned"),
    "fsdp_replicate": Case(DENSE, "fsdp", "replicate"),
    "fsdp_shard": Case(SPARSE, "fsdp"),
    "fsdp_ikfac": Case(IKFAC, "fsdp"),
    "fsdp_kfac": Case(KFAC_OPTIONS, "fsdp", optimizer="kfac"),
    "fsdp_accumulate": Case(SPARSE, "fsdp_accumulate"),
    # layers inside a larger FSDP2 unit, and attention sharded as a unit: before
    # 2026-12-04 their statistics were silently dropped, or wrong
    "fsdp_block": Case(DENSE, "fsdp", model="block"),
    "fsdp_block_kfac": Case(KFAC_OPTIONS, "fsdp", optimizer="kfac", model="block"),
    "fsdp_attention": Case(DENSE, "fsdp", model="attention"),
    "fsdp_attention_kfac": Case(
        KFAC_OPTIONS, "fsdp", optimizer="kfac", model="attention"
    ),
    "fsdp_attention_replicate": Case(SPARSE, "fsdp", "replicate", model="attention"),
    # the AdamW fallback of whole-model training (issue 13) next to the layers
    "fallback_replicate": Case(DENSE, distribute="replicate", model="norm"),
    "fallback_shard": Case(DENSE, model="norm"),
    "fallback_owned": Case(SPARSE, distribute="owned", model="norm"),
    "fallback_kfac": Case(KFAC_OPTIONS, optimizer="kfac", model="norm"),
    "fallback_accumulate": Case(SPARSE, "accumulate", model="norm"),
    # an embedding tied to the output layer (GPT-2's layout): the twin's work and
    # factors are its layer's (before 2026-12-02 the step failed inside it)
    "tied_replicate": Case(DENSE, distribute="replicate", model="tied"),
    "tied_dense": Case(DENSE, model="tied"),
    "tied_sparse": Case(SPARSE, model="tied"),
    "tied_factors": Case(SPARSE, distribute="factors", model="tied"),
    "tied_ikfac": Case(IKFAC, model="tied"),
    "tied_kfac": Case(KFAC_OPTIONS, optimizer="kfac", model="tied"),
    "tied_accumulate": Case(DENSE, "accumulate", model="tied"),
    # under owned factors the owner projects each orientation's raw statistics
    # with its factors, then combines them (before 2026-12-02: a ValueError)
    "tied_owned": Case(DENSE, distribute="owned", model="tied"),
    "tied_owned_sparse": Case(SPARSE, distribute="owned", model="tied"),
    "tied_owned_kfac": Case(
        KFAC_OPTIONS, distribute="owned", optimizer="kfac", model="tied"
    ),
    "tied_owned_accumulate": Case(DENSE, "accumulate", "owned", model="tied"),
    # an embedding's one-hot side under owned factors: its diagonal travels
    # (before 2026-12-02 the hooks failed on its rows), as does a diagonal side's
    "embed_owned": Case(DENSE, distribute="owned", model="embed"),
    "embed_owned_ikfac": Case(IKFAC, distribute="owned", model="embed"),
    "embed_owned_kfac": Case(
        KFAC_OPTIONS, distribute="owned", optimizer="kfac", model="embed"
    ),
    "embed_owned_accumulate": Case(DENSE, "accumulate", "owned", model="embed"),
    # FSDP2 shards a table (and a weight tied to it) and Conv1D's weights by
    # columns of Γ, Conv1D's biases by rows (13 and 12 of 25); before 2026-12-04
    # a ValueError for every model with an embedding or a Conv1D
    **{
        f"fsdp_{model}{form}": replace(case, model=model)
        for model in ("embed", "conv1d")
        for form, case in {
            "": Case(DENSE, "fsdp"),
            "_sparse": Case(SPARSE, "fsdp"),
            "_replicate": Case(SPARSE, "fsdp", "replicate"),
            "_ikfac": Case(IKFAC, "fsdp"),
            "_kfac": Case(KFAC_OPTIONS, "fsdp", optimizer="kfac"),
            "_ekfac": FSDP_EKFAC,
            "_accumulate": Case(SPARSE, "fsdp_accumulate"),
        }.items()
    },
    # EKFAC under FSDP2 (before 2026-12-04: a ValueError): rows rotated by
    # Q_K, gathered, finished by every rank (EKFAC replicates its factor work)
    "fsdp_ekfac": FSDP_EKFAC,
    "fsdp_ekfac_accumulate": replace(FSDP_EKFAC, wrap="fsdp_accumulate"),
    "fsdp_attention_ekfac": replace(FSDP_EKFAC, model="attention"),
    # EKFAC on a tied embedding (before 2026-12-04: a ValueError): each example's
    # gradient sums the one-hot and the head's use, on every rank's examples
    "tied_ekfac": replace(FSDP_EKFAC, wrap="ddp", model="tied"),
    "fsdp_tied_ekfac": replace(FSDP_EKFAC, model="tied"),
    # grafting under FSDP2 (before 2026-12-04: a ValueError): norms summed over
    # the shards, AdamW's moments sharded as Γ's rows or columns
    "fsdp_graft": Case({**SPARSE, "graft": "adamw"}, "fsdp"),
    "fsdp_graft_replicate": Case({**DENSE, "graft": "sgd"}, "fsdp", "replicate"),
    "fsdp_embed_graft": Case({**SPARSE, "graft": "adamw"}, "fsdp", model="embed"),
    "fsdp_tied_graft_kfac": Case(
        {**KFAC_OPTIONS, "graft": "adamw"}, "fsdp", optimizer="kfac", model="tied"
    ),
    "fsdp_graft_accumulate": Case({**IKFAC, "graft": "adamw"}, "fsdp_accumulate"),
    "fsdp_tied": Case(DENSE, "fsdp", model="tied"),
    "fsdp_tied_kfac": Case(KFAC_OPTIONS, "fsdp", optimizer="kfac", model="tied"),
    # owned factors under FSDP2 (before 2026-12-05: a ValueError): every rank's
    # block of Γ to the layer's owner, its block of Δ back (`owner_blocks`)
    "fsdp_owned": Case(SPARSE, "fsdp", "owned"),
    "fsdp_owned_dense": Case(DENSE, "fsdp", "owned"),
    "fsdp_owned_ikfac": Case(IKFAC, "fsdp", "owned"),
    "fsdp_owned_kfac": Case(KFAC_OPTIONS, "fsdp", "owned", optimizer="kfac"),
    "fsdp_owned_accumulate": Case(SPARSE, "fsdp_accumulate", "owned"),
    "fsdp_owned_norm": Case(SPARSE, "fsdp", "owned", model="norm"),
    "fsdp_owned_block": Case(DENSE, "fsdp", "owned", model="block"),
    "fsdp_owned_attention": Case(DENSE, "fsdp", "owned", model="attention"),
    "fsdp_owned_embed": Case(DENSE, "fsdp", "owned", model="embed"),
    "fsdp_owned_embed_ikfac": Case(IKFAC, "fsdp", "owned", model="embed"),
    "fsdp_owned_tied": Case(DENSE, "fsdp", "owned", model="tied"),
    "fsdp_owned_tied_kfac": Case(
        KFAC_OPTIONS, "fsdp", "owned", optimizer="kfac", model="tied"
    ),
    "fsdp_owned_conv1d": Case(DENSE, "fsdp", "owned", model="conv1d"),
    "fsdp_owned_graft": Case({**SPARSE, "graft": "adamw"}, "fsdp", "owned"),
    # grafting on Conv1D's column shards with the bias split by rows (before
    # 2026-12-05 a ValueError): moments per parameter, norms over both parts
    "fsdp_conv1d_graft": Case({**SPARSE, "graft": "adamw"}, "fsdp", model="conv1d"),
    "fsdp_conv1d_graft_sgd": Case(
        {**DENSE, "graft": "sgd"}, "fsdp", "replicate", model="conv1d"
    ),
    "fsdp_conv1d_graft_kfac": Case(
        {**KFAC_OPTIONS, "graft": "adamw"}, "fsdp", optimizer="kfac", model="conv1d"
    ),
    "fsdp_conv1d_graft_accumulate": Case(
        {**IKFAC, "graft": "adamw"}, "fsdp_accumulate", model="conv1d"
    ),
    "fsdp_owned_conv1d_graft": Case(
        {**DENSE, "graft": "adamw"}, "fsdp", "owned", model="conv1d"
    ),
    # EKFAC under "shard" (before 2026-12-05 a ValueError): every rank updates
    # the factors, owners precondition
    "ekfac_shard": EKFAC_SHARD,
    "ekfac_shard_accumulate": replace(EKFAC_SHARD, wrap="accumulate"),
    "ekfac_shard_T1": replace(EKFAC_SHARD, options={**EKFAC_OPTIONS, "T": 1}),
    "ekfac_shard_tied": replace(EKFAC_SHARD, model="tied"),
    "fsdp_ekfac_shard": replace(EKFAC_SHARD, wrap="fsdp"),
    "fsdp_conv1d_ekfac_shard": replace(EKFAC_SHARD, wrap="fsdp", model="conv1d"),
    # EKFAC with owned factors (before 2026-12-05 a ValueError): the owner keeps
    # the state and updates; the others add their examples' projections
    "ekfac_owned": EKFAC_OWNED,
    "ekfac_owned_accumulate": replace(EKFAC_OWNED, wrap="accumulate"),
    "ekfac_owned_T1": replace(EKFAC_OWNED, options={**EKFAC_OPTIONS, "T": 1}),
    "ekfac_owned_tied": replace(EKFAC_OWNED, model="tied"),
    "ekfac_owned_norm": replace(EKFAC_OWNED, model="norm"),  # fallback parameters
    "fsdp_ekfac_owned": replace(EKFAC_OWNED, wrap="fsdp"),
    "fsdp_conv1d_ekfac_owned": replace(EKFAC_OWNED, wrap="fsdp", model="conv1d"),
}
CASES_W3 = {
    "dense": Case(DENSE),
    "ikfac": Case(IKFAC),
    "two_dense": Case(DENSE, model="two"),
    "two_kfac": Case(KFAC_OPTIONS, optimizer="kfac", model="two"),
    "two_owned": Case(SPARSE, distribute="owned", model="two"),
    "owned_dense": Case(DENSE, distribute="owned"),  # a helper on a third rank
    "factors_ikfac": Case(IKFAC, distribute="factors"),
    "fsdp_shard": Case(SPARSE, "fsdp"),
    "fsdp_two_kfac": Case(KFAC_OPTIONS, "fsdp", optimizer="kfac", model="two"),
    "fallback_ikfac": Case(IKFAC, model="norm"),
    "tied_dense": Case(DENSE, model="tied"),  # the tied layer split: a relay
    "embed_owned": Case(DENSE, distribute="owned", model="embed"),
    "tied_owned": Case(IKFAC, distribute="owned", model="tied"),
    "fsdp_embed": Case(SPARSE, "fsdp", model="embed"),  # 11, 11, 9 columns
    "fsdp_tied": Case(IKFAC, "fsdp", model="tied"),
    "fsdp_conv1d": Case(DENSE, "fsdp", model="conv1d"),  # 43, 43, 42 columns
    "fsdp_ekfac": replace(FSDP_EKFAC, options={**EKFAC_OPTIONS, "T": 1}),
    "fsdp_embed_ekfac": replace(FSDP_EKFAC, model="embed"),
    "fsdp_conv1d_ekfac": replace(FSDP_EKFAC, model="conv1d"),
    "tied_ekfac_accumulate": replace(FSDP_EKFAC, wrap="accumulate", model="tied"),
    # Linear 48→2 on 3 ranks: an empty shard takes part in the norms' sum
    "fsdp_two_graft": Case({**SPARSE, "graft": "adamw"}, "fsdp", model="two"),
    "fsdp_attention_graft": Case({**DENSE, "graft": "sgd"}, "fsdp", model="attention"),
    # owned factors under FSDP2: an empty shard, uneven columns, two idle ranks
    "fsdp_two_owned": Case(SPARSE, "fsdp", "owned", model="two"),
    "fsdp_conv1d_owned": Case(DENSE, "fsdp", "owned", model="conv1d"),
    "fsdp_tied_owned": Case(IKFAC, "fsdp", "owned", model="tied"),
    # K of the Linear 48→2 split by column blocks (17 + 16 + 16) under FSDP2,
    # its 2 rows of Γ on two of the three ranks (since 2026-12-05)
    "fsdp_two_owned_columns": Case(DENSE, "fsdp", "owned", model="two"),
    # uneven columns and bias rows (43, 43, 42 and 20, 20, 20 of 60)
    "fsdp_conv1d_graft": Case({**SPARSE, "graft": "adamw"}, "fsdp", model="conv1d"),
    # EKFAC's preconditioning owned: 2 layers on 3 ranks, and uneven columns
    "ekfac_shard_two": replace(EKFAC_SHARD, model="two"),
    "fsdp_conv1d_ekfac_shard": replace(EKFAC_SHARD, wrap="fsdp", model="conv1d"),
    "ekfac_owned_two": replace(EKFAC_OWNED, model="two"),  # an idle rank
    "ekfac_owned_embed": replace(EKFAC_OWNED, model="embed"),
    "fsdp_conv1d_ekfac_owned": replace(EKFAC_OWNED, wrap="fsdp", model="conv1d"),
}
GRAFT_LATER = Case(SPARSE, "fsdp")
RESUME_AT = 3
ROUTED = ("replicate", "shard", "owned", "factors")


def _plan(optimizer: Any) -> list:
    return [
        (a.owners, a.anchor, a.helper)
        for a in getattr(optimizer.distribution, "plan", {}).values()
    ]


def _equivalence(results: dict[str, Any], cases: dict[str, Case]) -> None:
    for name, case in cases.items():
        model, _, optimizer = train(case)
        results[f"params/{name}"] = params(model)
        results[f"plan/{name}"] = _plan(optimizer)
        held = [
            any(key.startswith(("K.", "A.")) for key in optimizer.state[layer.weight])
            for layer in optimizer.layers
        ]
        results[f"held/{name}"] = held
        plan = getattr(optimizer.distribution, "plan", {})
        results[f"split/{name}"] = [plan[layer].columns for layer in plan]
        results[f"momenta/{name}"] = [
            [
                any(key.startswith(f"{m}.") for key in optimizer.state[layer.weight])
                for m in ("m_K", "m_C")
            ]
            for layer in optimizer.layers
        ]
        state = optimizer.state_dict()  # collective when owned
        if not case.wrap.startswith("fsdp"):  # (DTensor momenta do not load in tests)
            results[f"state/{name}"] = state


class HandedOverRule(KFACRule):
    """KFAC's rule as another type: its owners get dense `U` handed over."""


class HandedOverKFAC(KFAC):
    """`KFAC` with a rule whose owners do not project raw rows (`projects_raw`)."""

    _rule_type = HandedOverRule


def _other_rule(results: dict[str, Any]) -> None:
    """Owned factors with a rule other than SINGD's and KFAC's; and tied weights."""
    for model in ("three", "tied"):
        case = Case(KFAC_OPTIONS, distribute="owned", optimizer="kfac", model=model)
        net = wrap(case, build_model(model))
        optimizer = HandedOverKFAC(
            net, distribute=Shard(factors="owned"), **case.options
        )
        run = partial(_train_steps, case, net, optimizer)
        results[f"other_rule/{model}"] = _error(run)
        results[f"params/other_rule/{model}"] = params(net.module)


def train_graft_later(case: Case) -> list[Tensor]:
    """Train with AdamW grafting switched on at step 2 (its moments made then).

    Returns:
        The parameters after `STEPS` steps.
    """
    model = build_model(case.model)
    net = wrap(case, model) if dist.is_initialized() else model
    optimizer = make_optimizer(case, net)
    for step in range(STEPS):
        if step == 2:
            optimizer.param_groups[0]["graft"] = "adamw"
        train_step(case, net, optimizer, step)
    return params(model)


def _train_steps(case: Case, net: nn.Module, optimizer: Any) -> None:
    for step in range(STEPS):
        train_step(case, net, optimizer, step)


def train_w2(results: dict[str, Any], out: Path) -> None:
    _equivalence(results, CASES_W2)
    _other_rule(results)
    for distribute in ("shard", "owned"):
        _resume(results, out, Case(SPARSE, distribute=distribute), distribute)
    # grafting moments are every rank's (regression: dropped on non-owners at load)
    grafted = Case({**SPARSE, "graft": "adamw"}, distribute="owned")
    _resume(results, out, grafted, "owned-graft")
    _resume(results, out, Case(SPARSE, "fsdp"), "fsdp", files=False)
    for model in ("embed", "conv1d"):  # column shards (a bias beside them)
        case = Case(DENSE, "fsdp", model=model)
        _resume(results, out, case, f"fsdp-{model}", files=False)
    # EKFAC's eigenbases and eigenvalues (replicated) beside sharded momenta
    _resume(results, out, replace(FSDP_EKFAC, model="tied"), "fsdp-ekfac", False)
    for model in ("three", "conv1d"):  # owned factors: Γ's blocks to the owners
        case = Case(DENSE, "fsdp", "owned", model=model)
        _resume(results, out, case, f"fsdp-owned-{model}", files=False)
    for saved, loaded in (("shard", "owned"), ("owned", "replicate")):
        _cross_dcp(results, saved, loaded)
    # grafting's moments as Γ's rows, columns; per parameter beside a split bias
    for model in ("three", "embed", "conv1d"):
        case = Case({**SPARSE, "graft": "adamw"}, "fsdp", model=model)
        _resume(results, out, case, f"fsdp-graft-{model}", files=False)
    results["graft_later"] = train_graft_later(GRAFT_LATER)
    conv1d = replace(GRAFT_LATER, model="conv1d")
    results["graft_later/conv1d"] = train_graft_later(conv1d)
    _resume(results, out, EKFAC_SHARD, "ekfac-shard")  # (owners precondition)
    _resume(results, out, EKFAC_OWNED, "ekfac-owned")  # (state on owners only)
    fsdp_owned_ekfac = replace(EKFAC_OWNED, wrap="fsdp", model="tied")
    _resume(results, out, fsdp_owned_ekfac, "fsdp-ekfac-owned", files=False)
    _resume(results, out, Case(DENSE), "shard-relay")  # a layer split by sides
    _resume(results, out, Case(DENSE, distribute="owned"), "owned-helper")
    _resume(results, out, Case(DENSE, model="tied"), "shard-tied")
    _resume(results, out, Case(DENSE, distribute="owned", model="tied"), "owned-tied")
    for saved, loaded in (
        ("replicate", "shard"),
        ("replicate", "owned"),
        ("shard", "replicate"),
        ("owned", "replicate"),
    ):
        _cross(results, out, saved, loaded)
    for saved, loaded in (
        ("replicate", "shard"),
        ("shard", "replicate"),
        ("replicate", "owned"),
        ("owned", "shard"),
    ):
        _cross(results, out, saved, loaded, EKFAC_SHARD)
    _bytes(results)
    for distribute in ("replicate", "shard", "owned", "factors"):
        results[f"heads/{distribute}"] = train_heads(distribute)
        results[f"heads/fsdp/{distribute}"] = train_heads(distribute, fsdp=True)
        results[f"buffers/{distribute}"] = _buffers(distribute)
    results["buffers/fsdp_owned"] = _buffers("owned", "fsdp")  # (`owner_blocks`)
    _routed(results)
    for model in ("three", "embed", "conv1d"):  # rows, columns, a bias beside them
        for distribute in ("shard", "owned"):
            trained = train_mixed_precision(model, distribute=distribute)
            results[f"fsdp_bfloat16/{model}/{distribute}"] = trained
    for distribute in ("replicate", "shard", "owned"):  # the gathers' buffer dtype
        case = Case(DENSE, distribute=distribute, dtype=torch.bfloat16)
        results[f"bfloat16/{distribute}"] = params(train(case)[0])
    settings = [Setting("cnn", "diagonal", 1, name) for name in STRATEGIES]
    results["bench"] = measure_distributed(settings, 1, 1, 0)
    settings = [Setting("cnn", "dense", 1, name, fsdp=True) for name in STRATEGIES]
    results["bench_fsdp"] = measure_distributed(settings, 1, 1, 0)
    ekfac = [
        Setting("cnn", "auto", 1, name, optimizer="ekfac") for name in EKFAC_STRATEGIES
    ]
    results["bench_ekfac"] = measure_distributed(ekfac, 1, 1, 0)
    results["bench_largest"] = _largest(float(dist.get_rank() + 1))


def train_w3(results: dict[str, Any], out: Path) -> None:
    _equivalence(results, CASES_W3)
    _routed(results)


def train_mixed_precision(
    model_name: str, steps: int = 4, distribute: str = "shard"
) -> dict[str, Any]:
    """Train in float32 under FSDP2 computing in bfloat16 (`MixedPrecisionPolicy`,
    the usual configuration of large models); one process: float32 throughout.

    Returns:
        The parameters, and the warnings of the steps (a layer without
        statistics would warn).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    case = Case(DENSE, "fsdp", distribute, model=model_name)
    model = build_model(model_name).float()
    net = model
    if world > 1:
        policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
        for layer in model:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mp_policy=policy)
        net = fully_shard(model, mp_policy=policy)
    optimizer = make_optimizer(case, net)
    messages = []
    for step in range(steps):
        X, y = batch(step, model_name)
        X = X.float() if X.is_floating_point() else X
        local = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        optimizer.zero_grad()
        F.cross_entropy(net(X[local]).float(), y[local]).backward()
        messages += step_recording_warnings(optimizer)
    return {"params": params(model), "messages": messages}


def _routed(results: dict[str, Any]) -> None:
    """Heads that some ranks' examples do not reach (`train_routed`)."""
    for distribute in ROUTED:
        results[f"routed/{distribute}"] = train_routed(distribute)
        results[f"routed/{distribute}/kfac"] = train_routed(distribute, kfac=True)


# ---------------------------------------------------------------- checkpoints
def _checkpoint(case: Case, out: Path, tag: str, files: bool) -> dict[str, Any]:
    """Train to RESUME_AT, save (rank-0 file and DCP), train on; record all."""
    model = build_model(case.model)
    net = wrap(case, model)
    optimizer = make_optimizer(case, net)
    saved: dict[str, Any] = {}
    for step in range(STEPS):
        if step == RESUME_AT:
            state = optimizer.state_dict()  # on every rank: collective when owned
            if files and dist.get_rank() == 0:
                torch.save(
                    {"model": model.state_dict(), "optimizer": state}, out / f"{tag}.pt"
                )
            dist.barrier()
            saved["dcp"] = copy.deepcopy(get_optimizer_state_dict(net, optimizer))
            saved["model"] = copy.deepcopy(model.state_dict())
        train_step(case, net, optimizer, step)
    saved["params"] = params(model)
    saved["state"] = _plain(optimizer.state_dict())
    return saved


def _continue(case: Case, model_state: dict, load: Any) -> tuple[list, dict]:
    model = build_model(case.model)
    net = wrap(case, model)
    model.load_state_dict(model_state)
    optimizer = make_optimizer(case, net)
    load(net, optimizer)
    for step in range(RESUME_AT, STEPS):
        train_step(case, net, optimizer, step)
    return params(model), _plain(optimizer.state_dict())


def _plain(state: Any) -> Any:
    """Replace DTensors (FSDP2's momenta) by their local shards."""
    if hasattr(state, "to_local"):
        return state.to_local().clone()
    if isinstance(state, dict):
        return {key: _plain(value) for key, value in state.items()}
    if isinstance(state, list):
        return [_plain(value) for value in state]
    return state


def _resume(results: dict, out: Path, case: Case, tag: str, files: bool = True) -> None:
    saved = _checkpoint(case, out, tag, files)
    results[f"resume/{tag}/uninterrupted"] = (saved["params"], saved["state"])
    if files:
        file = torch.load(out / f"{tag}.pt", weights_only=True)
        results[f"resume/{tag}/file"] = _continue(
            case, file["model"], lambda net, opt: opt.load_state_dict(file["optimizer"])
        )
    results[f"resume/{tag}/dcp"] = _continue(
        case,
        saved["model"],
        lambda net, opt: set_optimizer_state_dict(
            net, opt, optim_state_dict=saved["dcp"]
        ),
    )


def _cross(
    results: dict,
    out: Path,
    saved_under: str,
    loaded_under: str,
    base: Case = SPARSE_SHARD,
) -> None:
    """Save under one strategy (a rank-0 file), resume under another."""
    prefix = "" if base.optimizer == "singd" else f"{base.optimizer}/"
    tag = f"cross_{base.optimizer}_{saved_under}"
    if f"cross/{prefix}{saved_under}" not in results:
        saved_case = replace(base, distribute=saved_under)
        saved = _checkpoint(saved_case, out, tag, True)
        results[f"cross/{prefix}{saved_under}"] = saved["params"]
    file = torch.load(out / f"{tag}.pt", weights_only=True)
    results[f"cross/{prefix}{saved_under}->{loaded_under}"] = _continue(
        replace(base, distribute=loaded_under),
        file["model"],
        lambda net, opt: opt.load_state_dict(file["optimizer"]),
    )[0]


def _cross_dcp(results: dict, saved_under: str, loaded_under: str) -> None:
    """Save through DCP under FSDP2 with one strategy, resume with another."""
    saved = _checkpoint(Case(DENSE, "fsdp", saved_under), Path(), "", files=False)
    results[f"cross/fsdp/{saved_under}"] = saved["params"]
    results[f"cross/fsdp/{saved_under}->{loaded_under}"] = _continue(
        Case(DENSE, "fsdp", loaded_under),
        saved["model"],
        lambda net, opt: set_optimizer_state_dict(
            net, opt, optim_state_dict=saved["dcp"]
        ),
    )[0]


# ---------------------------------------------------------------------- bytes
def _bytes(results: dict[str, Any]) -> None:
    """Record the floating-point collectives of an update and a plain step."""
    local = BATCH // dist.get_world_size()
    for name, case in (
        ("shard", Case(SPARSE)),
        ("shard_dense", Case({**DENSE, "T": 2})),  # statistics as rows (gram_rows)
        ("owned", Case(SPARSE, distribute="owned")),
        ("owned_dense", Case({**DENSE, "T": 2}, distribute="owned")),  # a helper
        ("factors", Case(SPARSE, distribute="factors")),
        # the embedding's one-hot side and IKFAC's diagonal sides: their diagonals
        ("owned_embed", Case(IKFAC, distribute="owned", model="embed")),
        # FSDP2's blocks of Γ to their owners and of Δ back (`owner_blocks`)
        ("fsdp_owned", Case(SPARSE, "fsdp", "owned")),
        ("fsdp_owned_conv1d", Case({**DENSE, "T": 2}, "fsdp", "owned", model="conv1d")),
        ("ekfac_shard", EKFAC_SHARD),  # (T = 2; its owners precondition)
        ("ekfac_owned", EKFAC_OWNED),
    ):
        model = build_model(case.model)
        net = wrap(case, model)
        optimizer = make_optimizer(case, net)
        # rows of statistics per rank: the convolution's 4 x 4 output positions,
        # a sequence's positions (`"expand"`); none for the embedding's lookups
        positions = TOKENS if case.model == "embed" else 1
        rows = {
            layer.name: local * (16 if layer.weight.dim() == 4 else positions)
            for layer in optimizer.layers
            if not isinstance(layer.sites[0].module, nn.Embedding)
        }
        for step in range(2):  # T = 2: an update step, then a plain one
            recorded = _recorded(partial(train_step, case, net, optimizer, step))
            results[f"bytes/{name}/{step}"] = recorded
            results[f"bytes/{name}/{step}/reported"] = bytes_per_step(
                optimizer, update=step == 0, rows=rows
            )
        results[f"bytes/{name}/dense"] = bytes_per_step(optimizer, update=True)
        results[f"bytes/{name}/keys"] = sum(  # layers and transposed twins
            1 + (layer.twin is not None) for layer in optimizer.layers
        )
    for model in ("embed", "conv1d"):  # FSDP2's column shards, with a bias or not
        case = Case(SPARSE, "fsdp", "replicate", model=model)
        net = wrap(case, build_model(case.model))
        optimizer = make_optimizer(case, net)
        results[f"bytes/fsdp_{model}"] = _recorded(
            partial(train_step, case, net, optimizer, 0)
        )
        results[f"bytes/fsdp_{model}/reported"] = bytes_per_step(optimizer, update=True)
    case = Case({**SPARSE, "graft": "adamw"}, "fsdp", "replicate")  # norms' sums
    net = wrap(case, build_model(case.model))
    optimizer = make_optimizer(case, net)
    recorded = _recorded(partial(train_step, case, net, optimizer, 0))
    results["bytes/fsdp_graft"] = recorded
    results["bytes/fsdp_graft/reported"] = bytes_per_step(optimizer, update=True)
    for distribute in ("replicate", "shard", "owned"):  # a twin's statistics too
        case = Case(DENSE, distribute=distribute, model="tied")
        net = wrap(case, build_model(case.model))
        optimizer = make_optimizer(case, net)
        recorded = _recorded(partial(train_step, case, net, optimizer, 0))
        results[f"bytes/tied/{distribute}"] = recorded
        results[f"bytes/tied/{distribute}/reported"] = bytes_per_step(
            optimizer, update=True
        )


def _buffers(distribute: str, wrap_name: str = "ddp") -> dict[str, Any]:
    """Train the dense case; record the message buffers after steps 2 and 4.

    Per slot its storage address (the same after both: lent again, not
    reallocated), and whether any state tensor lives in a buffer's storage
    (it must not: the next step overwrites the buffers).
    """
    case = Case(DENSE, wrap_name, distribute)
    net = wrap(case, build_model(case.model))
    optimizer = make_optimizer(case, net)
    seen = []
    for step in range(4):
        train_step(case, net, optimizer, step)
        if step in (1, 3):
            held = optimizer.distribution.buffers._held
            seen.append({_slot(key): held[key].data_ptr() for key in held})
    buffers = {tensor.data_ptr() for tensor in held.values()}
    state = [
        local_shard(value).untyped_storage().data_ptr()
        for entries in optimizer.state.values()
        for value in entries.values()
        if isinstance(value, torch.Tensor)
    ]
    return {"after": seen, "aliased": sorted(buffers.intersection(state))}


def _slot(key: tuple) -> str:
    """Name a buffer's key (slot, dtype, device); a layer by its name."""
    slot = key[0] if isinstance(key[0], tuple) else (key[0],)
    return repr(tuple(getattr(part, "name", part) for part in slot))


def _recorded(function: Any) -> dict[str, int]:
    """Return the bytes of the all-reduces, all-gathers, all-to-alls, sends and
    reduces."""
    originals = dist.all_reduce, dist.all_gather, dist.all_to_all_single, dist.isend
    reduce = dist.reduce
    recorded = {
        "all_reduce": [],
        "all_gather": [],
        "all_to_all": [],
        "isend": [],
        "reduce": [],  # (EKFAC's eigenvalue sums to their owner: destination, bytes)
        "checks": [],  # the integer all-reduces: checks and agreements
    }

    def reducing(tensor: torch.Tensor, dst: int, *args: Any, **kwargs: Any) -> Any:
        recorded["reduce"].append((dst, tensor.numel() * tensor.element_size()))
        return reduce(tensor, dst, *args, **kwargs)

    def isend(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        recorded["isend"].append(tensor.numel() * tensor.element_size())
        return originals[3](tensor, *args, **kwargs)

    def all_to_all_single(
        output: torch.Tensor, tensor: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Any:
        recorded["all_to_all"].append(tensor.numel() * tensor.element_size())
        return originals[2](output, tensor, *args, **kwargs)

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        kind = "all_reduce" if tensor.is_floating_point() else "checks"
        recorded[kind].append(tensor.numel() * tensor.element_size())
        return originals[0](tensor, *args, **kwargs)

    def all_gather(
        tensors: list, tensor: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Any:
        recorded["all_gather"].append(
            len(tensors) * tensor.numel() * tensor.element_size()
        )
        return originals[1](tensors, tensor, *args, **kwargs)

    dist.all_reduce, dist.all_gather = all_reduce, all_gather
    dist.all_to_all_single, dist.isend = all_to_all_single, isend
    dist.reduce = reducing
    try:
        function()
    finally:
        dist.all_reduce, dist.all_gather, dist.all_to_all_single, dist.isend = originals
        dist.reduce = reduce
    return recorded


# --------------------------------------------------------------------- misuse
def misuse(results: dict[str, Any], out: Path) -> None:
    rank = dist.get_rank()
    for label, options in {
        "distribute": ("replicate", "shard"),
        "factors": ("shard", "owned"),
    }.items():
        case = Case(SPARSE, "manual", options[rank])
        results[f"misuse/{label}"] = _error(lambda case=case: train(case, steps=1))
    results["misuse/resumed_apart"] = _error(lambda: _resumed_apart(rank))
    for distribute in ("replicate", "shard", "owned"):
        for T in (1, 2):
            results[f"misuse/options/{distribute}/{T}"] = _options_apart(
                rank, distribute, T
            )
    for distribute in ("shard", "owned"):
        for change in ("T", "layer"):
            for T in (1, 2):
                results[f"misuse/changed_apart/{distribute}/{change}/{T}"] = _changed(
                    rank, distribute, T, change, alike=False
                )
            results[f"misuse/changed_alike/{distribute}/{change}"] = _changed(
                rank, distribute, 2, change, alike=True
            )
    case = Case(SPARSE, "manual", "owned")
    optimizer = train(case, steps=1)[2]
    results["misuse/not_held"] = [
        _error(partial(optimizer.preconditioner, layer)) for layer in optimizer.layers
    ]
    alone, _ = dist.new_subgroups(group_size=1)  # each rank a group of its own
    everyone = dist.new_group(list(range(dist.get_world_size())))
    for distribute in ("replicate", "shard", "owned"):
        for label, group in {"subgroup": alone, "all": everyone}.items():
            results[f"misuse/ddp_{label}/{distribute}"] = _error(
                partial(_ddp_over, group, distribute)
            )
        results[f"misuse/fsdp_submesh/{distribute}"] = _error(
            partial(_fsdp_on_submesh, distribute)
        )
        results[f"misuse/hsdp/{distribute}"] = _error(partial(_hsdp, distribute))
        results[f"misuse/column_parallel/{distribute}"] = _error(
            partial(_column_parallel, distribute)
        )
        results[f"misuse/fsdp_own_layout/{distribute}"] = _error(
            partial(_fsdp_own_layout, distribute)
        )
    dist.barrier()
    _never_steps(results, out, rank)  # last: the process group is broken afterwards


def _error(function: Any) -> str:
    try:
        function()
    except (RuntimeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _ddp_over(group: Any, distribute: str) -> None:
    """One step of a model in `DistributedDataParallel` over `group`."""
    case = Case(SPARSE, "ddp", distribute)
    model = build_model(case.model)
    net = DistributedDataParallel(model, process_group=group)
    train_step(case, net, make_optimizer(case, net), 0)


def _fsdp_on_submesh(distribute: str) -> None:
    """One step of a model sharded by FSDP2 on a mesh of this rank alone."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(
        "cpu", (dist.get_world_size(), 1), mesh_dim_names=("a", "b")
    )
    case = Case(SPARSE, "fsdp", distribute)
    model = build_model(case.model)
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh["b"])
    net = fully_shard(model, mesh=mesh["b"])
    train_step(case, net, make_optimizer(case, net), 0)


def _hsdp(distribute: str) -> None:
    """One step of a model that HSDP shards on a 2-d mesh of one replica."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(
        "cpu", (1, dist.get_world_size()), mesh_dim_names=("replicate", "shard")
    )
    case = Case(SPARSE, "fsdp", distribute)
    model = build_model(case.model)
    net = fully_shard(model, mesh=mesh)
    train_step(case, net, make_optimizer(case, net), 0)


def _column_parallel(distribute: str) -> None:
    """Ask whether a layer is sharded whose weight tensor parallelism splits.

    The weight of the last Linear is a `DTensor` sharded along its dimension 1
    (columns, as `RowwiseParallel` places it) on a 1-d mesh over every rank.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard as Placement
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    case = Case(SPARSE, "manual", distribute)
    model = build_model(case.model)
    weight = distribute_tensor(model[-1].weight.detach(), mesh, [Placement(1)])
    model[-1].weight = nn.Parameter(weight)
    for layer in make_optimizer(case, model).layers:
        is_sharded(layer)


def _fsdp_own_layout(distribute: str) -> None:
    """One step of FSDP2 on a user-registered layer type that arranges `Γ` itself.

    `Dense` stores its kernel `[d_in, d_out]`, but its adapter does not declare
    the weight transposed: the optimizer cannot know which axis of `Γ` the
    shards are.
    """
    from torch.distributed.fsdp import fully_shard

    from singd_curvlinops.layers import register_layer, unregister_layer
    from tests.layers.test_registry import Dense, DenseAdapter

    adapter = register_layer(DenseAdapter())
    try:
        case = Case(SPARSE, "fsdp", distribute)
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Flatten(), Dense(2 * 8 * 8, 6), nn.Tanh(), nn.Linear(6, 60)
        ).double()
        net = fully_shard(model)
        train_step(case, net, make_optimizer(case, net), 0)
    finally:
        unregister_layer(adapter)


def _resumed_apart(rank: int) -> None:
    """Rank 1 resumes from a later checkpoint than rank 0."""
    case = Case(SPARSE, "manual", "shard")
    model = build_model(case.model)
    optimizer = SINGD(model, distribute="shard", **case.options)
    if rank == 1:
        state = optimizer.state_dict()
        for entry in state["state"].values():
            if "step" in entry:  # the layers' entries (not the biases')
                entry["step"] += 1
        optimizer.load_state_dict(state)
    train_step(case, model, optimizer, 0)


def _options_apart(rank: int, distribute: str, T: int) -> tuple[int, str]:
    """Rank 1 doubles its learning rate after step 0 (a scheduler on one rank).

    Returns:
        The step that raised (-1: none within four steps) and its error.
    """
    case = Case({**SPARSE, "T": T}, "manual", distribute)
    model = build_model(case.model)
    optimizer = make_optimizer(case, model)
    for step in range(4):
        if step == 1 and rank == 1:
            optimizer.param_groups[0]["lr"] *= 2
        message = _error(lambda step=step: train_step(case, model, optimizer, step))
        if message != "no error":
            return step, message
    return -1, "no error"


def _changed(
    rank: int, distribute: str, T: int, change: str, *, alike: bool
) -> tuple[int, str, list[torch.Tensor]]:
    """Rank 1 (every rank if `alike`) changes its configuration during training.

    Before step 2 (T = 1: an update step of rank 0) or step 3 (T = 2: a step
    between updates of rank 0) it sets its factor update interval to 3
    (`change="T"`) or removes the first layer's weight from its parameter group
    (`"layer"`: one layer fewer, so a shorter statistics summary).

    Returns:
        The step that raised (-1: none within five steps), its error, and the
        parameters after the last step (none if one raised).
    """
    case = Case({**SPARSE, "T": T}, "manual", distribute)
    model = build_model(case.model)
    optimizer = make_optimizer(case, model)
    for step in range(5):
        if step == 1 + T and (alike or rank == 1):
            group = optimizer.param_groups[0]
            if change == "T":
                group["T"] = 3
            else:
                weight = next(model.parameters())
                group["params"] = [p for p in group["params"] if p is not weight]
        message = _error(lambda step=step: train_step(case, model, optimizer, step))
        if message != "no error":
            return step, message, []
    return -1, "no error", [p.detach().clone() for p in model.parameters()]


def _never_steps(results: dict[str, Any], out: Path, rank: int) -> None:
    """Rank 1 never calls step(): rank 0 must time out with a message."""
    signal = out / "rank0_done"
    case = Case(SPARSE, "manual", "shard")
    model = build_model(case.model)
    optimizer = make_optimizer(case, model)
    if rank == 0:
        X, y = batch(0, case.model)
        F.cross_entropy(model(X), y).backward()  # (no collective before the step)
        results["misuse/never_steps"] = _error(optimizer.step)
        signal.touch()
        return
    deadline = time.monotonic() + 60
    while not signal.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
