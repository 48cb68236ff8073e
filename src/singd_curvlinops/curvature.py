"""Kronecker factors handed to the next factor update (`set_curvature`).

`_curvlinops.kfac_factors` reads a curvlinops `KFACLinearOperator`'s factors by
parameter; `by_layer` matches them to the optimizer's layers, checking that they
cover exactly those layers with their dimensions, before the collector keeps
them (`StatisticsCollector.hand_over`).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor
from torch.nn import Parameter

from singd_curvlinops.layers import Layer


def by_layer(
    factors: dict[Parameter, tuple[Tensor, Tensor]], layers: Sequence[Layer]
) -> dict[Layer, tuple[Tensor, Tensor]]:
    """Return the factors `(U_K, U_C)` by layer (detached).

    Args:
        factors: `(U_K, U_C)` by layer weight (a bias-only layer's bias).
        layers: The layers that must be covered, exactly.

    Returns:
        The same factors, keyed by layer.

    Raises:
        ValueError: If `factors` covers other layers, or their dimensions do
            not match.
    """
    by_weight = {layer.weight: layer for layer in layers}

    def names(weights: set) -> list[str]:
        return sorted(
            by_weight[w].name if w in by_weight else str(tuple(w.shape))
            for w in weights
        )

    if set(factors) != set(by_weight):
        raise ValueError(
            "The KFACLinearOperator must cover exactly the optimizer's layers: "
            f"missing {names(set(by_weight) - set(factors))}, extra "
            f"{names(set(factors) - set(by_weight))}."
        )
    curvature = {}
    for weight, (U_K, U_C) in factors.items():
        layer = by_weight[weight]
        if (U_K.shape[0], U_C.shape[0]) != layer.dims:
            raise ValueError(
                f"Layer {layer.name!r}: the operator's factors have dimensions "
                f"{(U_K.shape[0], U_C.shape[0])}, the layer {layer.dims} (is "
                "the bias included?)."
            )
        curvature[layer] = (U_K.detach(), U_C.detach())
    return curvature
