r"""A use's rows \(a\), \(\tilde g\) in the layout of the layer it feeds.

An adapter gives the rows of one application of a slot (`LayerAdapter.use_input_rows`,
`use_gradient_rows`) with the slot's own bias column. The layer may differ: its bias
may be frozen or another slot's (`Site.bias_column`), a use may cover only some of
its output rows (`Use.out_rows`), and a transposed site feeds the layer's twin,
whose output side is the layer's input side. `use_rows` puts both together.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from singd_curvlinops.layers.base import Use
from singd_curvlinops.layers.layer import Layer, Site
from singd_curvlinops.statistics import LossAverage, SparseRows


def layer_gradient_rows(g: Tensor, use: Use, layer: Layer, site: Site) -> Tensor:
    r"""Bring a use's rows \(\tilde g\) to the width of its layer's output side.

    A use of some output rows (`Use.out_rows`) has zero gradients for the others;
    a transposed site's output side is the layer's input side, whose bias column
    it does not use (zero).

    Args:
        g: The use's rows `[rows, d]`.
        use: The use.
        layer: The layer.
        site: The use's site.

    Returns:
        `[rows, width]`.
    """
    width = layer.dims[0] if site.transposed else layer.dims[1]
    if use.out_rows is None and g.shape[1] == width:
        return g
    rows = use.out_rows if use.out_rows is not None else slice(0, g.shape[1])
    padded = g.new_zeros(g.shape[0], width)
    padded[:, rows] = g
    return padded


def layer_input_rows(
    site: Site,
    use: Use,
    num_rows: int,
    kfac_approx: str,
    dtype: torch.dtype,
    device: torch.device,
) -> Any:
    r"""Return a use's input rows \(a\) in its layer's layout (see `BiasColumn`).

    Args:
        site: The use's site.
        use: The use.
        num_rows: The number of gradient rows (for a bias-only layer).
        kfac_approx: `"expand"` or `"reduce"`.
        dtype: The rows' dtype.
        device: The rows' device (for a bias-only layer).

    Returns:
        A tensor `[rows, d_K]` that the rule may overwrite, or `SparseRows`.
    """
    if site.bias_column == "only":  # aᵀa = 1: the mean of the constant column
        value = num_rows**-0.5 if num_rows else 0.0
        return torch.full((num_rows, 1), value, dtype=dtype, device=device)
    a = site.adapter.use_input_rows(site.module, use, kfac_approx)
    if isinstance(a, SparseRows):
        return a.to(dtype)
    a = a.to(dtype)
    if site.bias_column == "append_zero":
        return torch.cat([a, a.new_zeros(a.shape[0], 1)], dim=1)
    if site.bias_column == "zero":
        a[:, -1] = 0.0
    elif site.bias_column == "drop":
        return a[:, :-1]
    return a


def use_rows(
    layer: Layer,
    site: Site,
    use: Use,
    grad_output: Tensor,
    kfac_approx: str,
    *,
    loss_average: LossAverage,
    grad_scale: float,
    dtypes: tuple[torch.dtype, torch.dtype],
) -> tuple[Any, Tensor]:
    r"""Return one use's rows \(a\), \(\tilde g\) in the layer's layout and dtypes.

    Args:
        layer: The layer.
        site: The use's site.
        use: The use.
        grad_output: The gradient w.r.t. the use's output, batch first.
        kfac_approx: `"expand"` or `"reduce"`.
        loss_average: `None`, `"batch"` or `"batch+sequence"`.
        grad_scale: The gradient scale expected in this pass (divided out).
        dtypes: Dtypes of the input and output rows.

    Returns:
        The input rows (a fresh buffer, or `SparseRows`) and the output-gradient
        rows, divided by `grad_scale`.
    """
    g = site.adapter.use_gradient_rows(
        site.module, use, grad_output, kfac_approx, loss_average
    )
    if grad_scale != 1.0:  # before the cast: scaled rows may overflow dtypes[1]
        g = g.to(torch.promote_types(g.dtype, dtypes[1])) / grad_scale
    g = layer_gradient_rows(g.to(dtypes[1]), use, layer, site)
    a = layer_input_rows(site, use, g.shape[0], kfac_approx, dtypes[0], g.device)
    return a, g
