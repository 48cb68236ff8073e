"""What a statistics collector collects for one layer in one pass.

The optimizer answers this per layer and forward call; the collector
(`singd_curvlinops.collector`) knows neither rules nor layer types.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from singd_curvlinops import statistics
from singd_curvlinops.structures import StructuredMatrix

Project = Callable[[Any, Tensor], tuple[StructuredMatrix, StructuredMatrix]]


@dataclass(frozen=True)
class CollectionPlan:
    """What to collect for one layer in one forward-backward pass.

    Attributes:
        kfac_approx: `"expand"` or `"reduce"`.
        loss_average: `None`, `"batch"` or `"batch+sequence"`.
        dtypes: Dtypes of the input and output rows (the factors').
        grad_scale: Scale of the output gradients expected in this pass.
        project: The rule's map from rows `(a, g)` to `(H_K, H_C)`.
        project_transposed: The same for the layer seen transposed (its twin):
            the factors' sides swapped; None if the layer has no twin.
        per_example: Whether to keep the rows for per-example gradients.
    """

    kfac_approx: str
    loss_average: statistics.LossAverage
    dtypes: tuple[torch.dtype, torch.dtype]
    grad_scale: float
    project: Project
    project_transposed: Project | None = None
    per_example: bool = False
