"""Helpers of the validation tests: small models, training, exact snapshots.

A snapshot holds the optimizer's `state_dict()`, its group options and the model's
parameters as copies; `assert_unchanged` compares them with the live objects
exactly (tensors bit for bit, with dtype and device), so that a rejected load or
step provably changed nothing.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from tests.optimizer.test_checkpoints import assert_same


def make_model(seed: int = 0) -> nn.Module:
    """Linear -> LayerNorm (fallback parameters) -> Linear; `d_K` = 5, 4."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.LayerNorm(3), nn.Linear(3, 2))


def batch(step: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(6, 4, generator=generator), torch.randn(
        6, 2, generator=generator
    )


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        optimizer.zero_grad()
        X, y = batch(step)
        nn.functional.mse_loss(model(X), y).backward()
        optimizer.step()


@dataclass
class Snapshot:
    state_dict: dict[str, Any]
    options: list[dict[str, Any]]
    params: list[Tensor]


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> Snapshot:
    options = [
        {k: v for k, v in group.items() if k != "params"}
        for group in optimizer.param_groups
    ]
    return Snapshot(
        copy.deepcopy(optimizer.state_dict()),
        copy.deepcopy(options),
        [p.detach().clone() for p in model.parameters()],
    )


def assert_unchanged(
    model: nn.Module, optimizer: torch.optim.Optimizer, before: Snapshot
) -> None:
    after = optimizer.state_dict()
    assert_same(before.state_dict["state"], after["state"], "state")
    saved_groups = before.state_dict["param_groups"]
    assert [g["params"] for g in saved_groups] == [
        g["params"] for g in after["param_groups"]
    ]
    assert len(before.options) == len(optimizer.param_groups)
    for saved, group in zip(before.options, optimizer.param_groups, strict=True):
        live = {k: v for k, v in group.items() if k != "params"}
        assert saved.keys() == live.keys()
        for key, value in saved.items():
            assert _same_value(value, live[key]), key
    for index, (old, new) in enumerate(
        zip(before.params, model.parameters(), strict=True)
    ):
        assert_same(old, new.detach(), f"parameter {index}")


def _same_value(a: Any, b: Any) -> bool:
    """Equality of option values that treats NaN as NaN and tensors entrywise."""
    if a is b:
        return True
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return (
            isinstance(a, Tensor)
            and isinstance(b, Tensor)
            and torch.equal(a, b)
            and a.dtype == b.dtype
        )
    if isinstance(a, float) and isinstance(b, float) and a != a:
        return b != b
    if isinstance(a, (tuple, list)) and type(a) is type(b) and len(a) == len(b):
        return all(_same_value(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def all_finite(model: nn.Module, optimizer: torch.optim.Optimizer) -> bool:
    """Whether every parameter and every state tensor is finite."""
    tensors = [p.detach() for p in model.parameters()]
    for entry in optimizer.state.values():
        tensors += [v for v in entry.values() if isinstance(v, Tensor)]
    return all(bool(t.isfinite().all()) for t in tensors if t.is_floating_point())
