"""What the spawned ranks of `test_decompositions.py` run.

EKFAC under `distribute="shard"`: each eigendecomposition is computed on one
rank and shared (`singd_curvlinops.distributed.decompositions`). The job counts
the eigendecompositions each rank computes, and makes one fail.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch.distributed as dist

from singd_curvlinops.rules import ekfac as ekfac_rule
from tests.distributed.harness import EKFAC_OPTIONS, STEPS, Case, params, train

EKFAC_SHARD = Case(EKFAC_OPTIONS, "ddp", "shard", optimizer="ekfac")
FAILING = (49, 49)  # the input side of the model's first Linear (48 → 24)


def decompositions(results: dict[str, Any], out: Path) -> None:
    eigenbasis = ekfac_rule._eigenbasis
    shapes: list[tuple[int, ...]] = []

    def counted(factor: Any) -> Any:
        shapes.append(tuple(factor.shape))
        return eigenbasis(factor)

    ekfac_rule._eigenbasis = counted
    try:
        for distribute in ("replicate", "shard", "owned"):
            for model in ("three", "tied"):
                shapes.clear()
                case = replace(EKFAC_SHARD, distribute=distribute, model=model)
                trained, _, optimizer = train(case)
                results[f"{distribute}/{model}"] = _record(trained, optimizer, shapes)
    finally:
        ekfac_rule._eigenbasis = eigenbasis
    for distribute in ("replicate", "shard", "owned"):
        case = replace(EKFAC_SHARD, distribute=distribute)
        results[f"failure/{distribute}"] = _failing(case)
    dist.barrier()  # (every rank left the failed step in step with the others)
    results["after_failure"] = params(train(EKFAC_SHARD, steps=1)[0])
    results["steps"] = STEPS


def _record(trained: Any, optimizer: Any, shapes: list) -> dict[str, Any]:
    """The parameters, the decompositions computed, the plan, the kept buffers."""
    plan = getattr(optimizer.distribution, "plan", {})
    buffers = getattr(optimizer.distribution, "buffers", None)
    return {
        "params": params(trained),
        "shapes": list(shapes),
        "decomposers": [plan[layer].decomposers for layer in optimizer.layers]
        if plan
        else [],
        "owners": [plan[layer].owners for layer in optimizer.layers] if plan else [],
        "kept_bases": buffers is not None
        and any("bases" in str(key) for key in buffers._held),
    }


def _failing(case: Case) -> str:
    """Train with the first Linear's input-side eigendecomposition raising in
    the second update (on the rank that computes it)."""
    eigenbasis, calls = ekfac_rule._eigenbasis, []

    def failing(factor: Any) -> Any:
        if tuple(factor.shape) == FAILING:
            calls.append(factor.shape)
            if len(calls) == 2:
                raise ValueError("injected: LAPACK did not converge")
        return eigenbasis(factor)

    ekfac_rule._eigenbasis = failing
    try:
        train(case)
    except ValueError as error:
        return str(error)
    finally:
        ekfac_rule._eigenbasis = eigenbasis
    return "no error"
