"""What the ranks of the column-split tests run (`test_columns`).

The `"two"` model's Linear 48→2 holds most of its dense factor state, so under
`Shard(factors="owned")` its 49-dimensional `K` is split by column blocks
(49 columns: 25 + 24 on two ranks, 17 + 16 + 16 on three).
"""

from __future__ import annotations

import copy
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from singd_curvlinops.distributed import bytes_per_step
from tests.distributed.harness import (
    DENSE,
    IKFAC,
    Case,
    build_model,
    make_optimizer,
    params,
    train,
    train_step,
    wrap,
)
from tests.distributed.jobs import _recorded

OWNED = {"model": "two", "distribute": "owned"}
CASES = {
    "dense": Case(DENSE, **OWNED),
    "T3": Case({**DENSE, "T": 3}, **OWNED),
    "ikfac": Case(IKFAC, **OWNED),
    "normalize": Case({**DENSE, "T": 2, "normalize_lr_cov": True}, **OWNED),
    "accumulate": Case({**DENSE, "T": 2}, "accumulate", **OWNED),
    # a block-diagonal C: its raw statistics stay diagonal blocks (1 x 1 here)
    "blocks": Case({**DENSE, "structures": ("dense", "block1diagonal")}, **OWNED),
}
REPLICATE = Case(DENSE, model="two", distribute="replicate")
STEPS, RESUME_AT = 6, 3


def _train(results: dict[str, Any], cases: dict[str, Case]) -> None:
    for name, case in cases.items():
        model, _, optimizer = train(case)
        results[f"params/{name}"] = params(model)
        results[f"plan/{name}"] = [
            a.columns for a in getattr(optimizer.distribution, "plan", {}).values()
        ]
        results[f"shapes/{name}"] = [
            {
                k: tuple(v.shape)
                for k, v in optimizer.state[layer.weight].items()
                if isinstance(v, torch.Tensor) and k != "momentum_buffer"
            }
            for layer in optimizer.layers
        ]
        results[f"state/{name}"] = optimizer.state_dict()  # a collective
        try:
            optimizer.preconditioner(optimizer.layers[-1])
        except ValueError as error:
            results[f"error/{name}"] = str(error)


def _checkpoints(results: dict[str, Any], out: Path) -> None:
    """Save under one mode at RESUME_AT, load under another, train on."""
    owned = CASES["dense"]
    for saved_under, loaded_under in (
        (owned, REPLICATE),
        (REPLICATE, owned),
        (owned, owned),
        (owned, Case(DENSE, model="two", distribute="shard")),
    ):
        model = build_model("two")
        net = wrap(saved_under, model)
        optimizer = make_optimizer(saved_under, net)
        for step in range(RESUME_AT):
            train_step(saved_under, net, optimizer, step)
        state = copy.deepcopy(optimizer.state_dict())
        model_state = {k: v.clone() for k, v in model.state_dict().items()}
        for step in range(RESUME_AT, STEPS):
            train_step(saved_under, net, optimizer, step)
        expected = params(model)
        resumed = build_model("two")
        resumed.load_state_dict(model_state)
        net = wrap(loaded_under, resumed)
        optimizer = make_optimizer(loaded_under, net)
        optimizer.load_state_dict(state)
        for step in range(RESUME_AT, STEPS):
            train_step(loaded_under, net, optimizer, step)
        tag = f"{saved_under.distribute}->{loaded_under.distribute}"
        results[f"resume/{tag}"] = (params(resumed), expected)


def _bytes(results: dict[str, Any]) -> None:
    case = CASES["normalize"]
    model = build_model("two")
    net = wrap(case, model)
    optimizer = make_optimizer(case, net)
    for step in range(2):
        results[f"bytes/{step}"] = _recorded(
            partial(train_step, case, net, optimizer, step)
        )
        results[f"bytes/{step}/reported"] = bytes_per_step(optimizer, update=step == 0)


def train_w2(results: dict[str, Any], out: Path) -> None:
    _train(results, {**CASES, "replicate": REPLICATE})
    _checkpoints(results, out)
    _bytes(results)


def train_w3(results: dict[str, Any], out: Path) -> None:
    _train(results, {name: CASES[name] for name in ("dense", "T3", "ikfac")})
    results["rank"] = dist.get_rank()
