"""Seeded float64 rows and a tight comparison, for the statistics-as-rows tests."""

from __future__ import annotations

import torch

TOLERANCE = 1e-12


def random_rows(n: int, d: int, seed: int) -> torch.Tensor:
    """Return `n` seeded standard-normal rows of width `d` in float64."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=generator, dtype=torch.float64)


def close(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Return whether two tensors agree to `TOLERANCE` (relative and absolute)."""
    return torch.allclose(actual, expected, rtol=TOLERANCE, atol=TOLERANCE)
