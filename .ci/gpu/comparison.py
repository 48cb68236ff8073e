"""How the GPU checks compare runs: flat parameters, relative differences, devices."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

CPU = torch.device("cpu")


def flat(tensors: Iterable[Tensor]) -> Tensor:
    """Return the tensors, detached, flattened and concatenated on the CPU."""
    return torch.cat([t.detach().reshape(-1).to(CPU) for t in tensors])


def rel(a: Tensor, b: Tensor) -> float:
    """Return max|a - b| / max|b|, the largest difference relative to `b`."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def state_devices(optimizer: torch.optim.Optimizer) -> set[str]:
    """Return the device types of the optimizer's non-empty state tensors."""
    return {
        value.device.type
        for state in optimizer.state.values()
        for value in state.values()
        if torch.is_tensor(value) and value.numel() > 0
    }
