r"""The only module that knows curvlinops' KFAC conventions.

For a supported layer, a batch of its inputs \(x\) and of the gradients \(g\) of the
loss with respect to its outputs become two *factor matrices* (rows are data):

- `input_rows`: \(a\) with \(a^\top a = U_K\), the input covariance (Kronecker factor
  \(A\)) that `curvlinops.KFACLinearOperator` computes on this batch: Conv2d patches
  from `curvlinops.kfac_utils`, weight-sharing dimensions flattened (`"expand"`) or
  averaged (`"reduce"`), a column of ones for the bias, normalised by the number of
  examples \(N\) (and by the weight-sharing size for `"expand"`);
- `gradient_rows`: \(\tilde g\) with \(\tilde g^\top \tilde g \cdot \nu = U_C\), the
  gradient covariance (Kronecker factor \(G\)), where the scale \(\nu\)
  (`gradient_scale`) depends on the loss reduction: the loss-average rows below undo
  the \(1 / (N R)\) that a mean puts on every output gradient.

| `loss_average` | curvlinops' loss reduction | loss terms per example \(R\) | \(\nu\) |
|---|---|---|---|
| `None` | `"sum"` | — | \(1\) |
| `"batch"` | `"mean"` | \(1\) | \(N\) |
| `"batch+sequence"` | `"mean"` | weight-sharing size \(S\) of the layer | \(N\) |

(\(\tilde g\) already carries the \(\sqrt{R}\).) Both normalisations refer to the
whole batch, so micro-batches accumulate exactly: average the per-micro-batch \(U_K\)
weighted by their sizes, sum \(\tilde g^\top \tilde g\), and apply \(\nu\) with the
total \(N\) (the PyTorch convention divides each micro-batch loss by the number of
micro-batches, which makes the output gradients those of the concatenated batch).

For `"batch+sequence"`, \(R\) is the layer's weight-sharing size (the sequence
length for `Linear` layers on `[batch, sequence, features]`), which equals
curvlinops' `num_per_example_loss_terms` when every position carries a loss term.

A `torch_geometric.nn.GCNConv` (weight `lin.weight`, its own `bias`) is treated as
a `Linear` layer on its aggregated node features \(\hat A X\) (`layer_input`, see
`singd_curvlinops._gnn`): nodes are the examples, \(N\) is the number of nodes.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from curvlinops.kfac import KFACLinearOperator, KFACType
from curvlinops.kfac_utils import extract_averaged_patches, extract_patches
from einconv.utils import get_conv_paddings
from torch import Tensor
from torch.nn import Conv2d, Linear, Module, Parameter

from singd_curvlinops import _gnn

LossAverage = Literal["batch", "batch+sequence"] | None
LOSS_AVERAGES: tuple[LossAverage, ...] = (None, "batch", "batch+sequence")
KFAC_APPROXES: tuple[str, ...] = tuple(kind.value for kind in KFACType)
SUPPORTED_MODULES: tuple[type[Module], ...] = (Linear, Conv2d)


def is_supported(module: Module) -> bool:
    """Return whether SINGD can precondition `module`'s weight (and bias).

    Args:
        module: A layer.

    Returns:
        True for `Linear`, for `Conv2d` with zero padding mode and for a
        `torch_geometric.nn.GCNConv` whose weight is materialised.
    """
    if isinstance(module, Conv2d):
        return module.padding_mode == "zeros"
    if isinstance(module, Linear):
        return True
    return _gnn.is_gcn(module) and _gnn.is_materialized(module)


def _is_gcn(module: Module) -> bool:
    """Return whether a layer is a GCNConv (cheap for the built-in layers).

    Args:
        module: A layer.

    Returns:
        False for `Linear` and `Conv2d` without looking for torch_geometric.
    """
    return not isinstance(module, (Linear, Conv2d)) and _gnn.is_gcn(module)


def layer_weight(module: Module) -> Parameter:
    """Return the weight of a supported layer (a GCNConv's is `lin.weight`).

    Args:
        module: A supported layer.

    Returns:
        The weight, `[d_out, ...]`.
    """
    if _is_gcn(module):
        return module.lin.weight
    return module.weight


def layer_params(module: Module) -> list[Parameter]:
    """Return the preconditioned parameters of a supported layer, weight first.

    Args:
        module: A supported layer.

    Returns:
        `[weight]` or `[weight, bias]`.
    """
    weight = layer_weight(module)
    return [weight] if module.bias is None else [weight, module.bias]


def layer_input(module: Module, args: tuple, kwargs: dict[str, Any]) -> Tensor:
    r"""Return the input whose rows form the layer's input factor, detached.

    Args:
        module: A supported layer, after a forward call.
        args: Positional arguments of the call.
        kwargs: Keyword arguments of the call.

    Returns:
        The input \(x\) (`Linear`, `Conv2d`) or the aggregated node features
        \(\hat A X\), `[nodes, d_in]` (GCNConv).
    """
    if _is_gcn(module):
        return _gnn.aggregated_input(module, args, kwargs)
    return args[0].detach()


def factor_dims(module: Module) -> tuple[int, int]:
    """Return the dimensions `(d_K, d_C)` of a layer's Kronecker factors.

    Args:
        module: A supported layer.

    Returns:
        `d_K = d_in (+1 with bias)` and `d_C = d_out`, with `d_in` the flattened
        input side of the weight (`C_in / groups * k1 * k2` for Conv2d).
    """
    weight = layer_weight(module)
    d_in = weight[0].numel()
    return d_in + int(module.bias is not None), weight.shape[0]


def _conv_patches(x: Tensor, module: Conv2d, kfac_approx: str) -> Tensor:
    """Extract the patches of a Conv2d input with curvlinops' extractors.

    String padding with unequal left/right amounts (`'same'` with an even kernel) is
    applied explicitly before extraction, which curvlinops does not support itself.

    Args:
        x: Layer input, `[batch, C_in, I1, I2]`.
        module: The convolution.
        kfac_approx: `"expand"` or `"reduce"`.

    Returns:
        `[batch, O1 * O2, d_in]` (expand) or `[batch, d_in]` (reduce).
    """
    padding = module.padding
    if isinstance(padding, str):
        pads = [
            get_conv_paddings(k, s, padding, d)
            for k, s, d in zip(
                module.kernel_size, module.stride, module.dilation, strict=True
            )
        ]
        if any(left != right for left, right in pads):
            (top, bottom), (left, right) = pads
            x = torch.nn.functional.pad(x, (left, right, top, bottom))
            padding = 0
    extract = (
        extract_patches
        if kfac_approx == KFACType.EXPAND
        else (extract_averaged_patches)
    )
    return extract(
        x, module.kernel_size, module.stride, padding, module.dilation, module.groups
    )


def _shared_rows(x: Tensor, kfac_approx: str, reduce_op: str) -> tuple[Tensor, int]:
    """Flatten (expand) or reduce (reduce) the weight-sharing dimensions.

    Args:
        x: Tensor `[batch, ..., features]`.
        kfac_approx: `"expand"` or `"reduce"`.
        reduce_op: `"mean"` (inputs) or `"sum"` (output gradients) for reduce.

    Returns:
        The rows `[batch (* shared), features]` and the weight-sharing size.
    """
    shared = x.shape[1:-1].numel()
    if kfac_approx == KFACType.EXPAND:
        return x.reshape(-1, x.shape[-1]), shared  # "b ... d -> (b ...) d"
    if x.ndim == 2:
        return x, shared
    rows = x.flatten(1, -2)  # "b ... d -> b (...) d"
    return (rows.mean(1) if reduce_op == "mean" else rows.sum(1)), shared


def input_rows(module: Module, x: Tensor, kfac_approx: str) -> Tensor:
    r"""Return \(a\) with \(a^\top a\) equal to curvlinops' input covariance.

    Args:
        module: A supported layer.
        x: The layer's input; `[batch, ..., d_in]` (Linear),
            `[batch, C_in, I1, I2]` (Conv2d) or \(\hat A X\), `[nodes, d_in]`
            (GCNConv).
        kfac_approx: `"expand"` or `"reduce"`.

    Returns:
        Tensor `[rows, d_K]`, normalised by \(\sqrt{N S}\) (expand) or
        \(\sqrt{N}\) (reduce) for a batch of \(N\) examples; for convolutions
        (expand) the transposed view of a contiguous `[d_K, rows]` buffer.
    """
    batch_size = x.shape[0]
    if isinstance(module, Conv2d):
        x = _conv_patches(x, module, kfac_approx)
    if kfac_approx == KFACType.EXPAND:
        scale = (batch_size * x.shape[1:-1].numel()) ** -0.5
    else:
        x, _ = _shared_rows(x, kfac_approx, "mean")
        scale = batch_size**-0.5
    # Scale into a preallocated buffer with the bias column: one pass over x,
    # without flattening copies or a concatenation. Its layout follows x's:
    # convolution patches are feature-major (a view of unfold's [N, d_in, O1 O2]),
    # so the buffer is too, and `a` is returned as the view of its transpose.
    d_in, d_K = x.shape[-1], x.shape[-1] + int(module.bias is not None)
    if x.stride(-1) == 1:
        a = x.new_empty(x.shape[:-1].numel(), d_K)
        torch.mul(x, scale, out=a[:, :d_in].unflatten(0, x.shape[:-1]))
        a[:, d_in:] = scale
        return a
    a_T = x.new_empty(d_K, *x.shape[:-1])
    torch.mul(x.movedim(-1, 0), scale, out=a_T[:d_in])
    a_T[d_in:] = scale
    return a_T.flatten(1).T


def gradient_rows(
    module: Module, g: Tensor, kfac_approx: str, loss_average: LossAverage
) -> Tensor:
    r"""Return \(\tilde g\) with \(\nu\,\tilde g^\top \tilde g\) = curvlinops' gradient covariance.

    Args:
        module: A supported layer.
        g: Gradient of the loss w.r.t. the layer's output; `[batch, ..., d_out]`
            (Linear), `[batch, C_out, O1, O2]` (Conv2d) or `[nodes, d_out]`
            (GCNConv).
        kfac_approx: `"expand"` or `"reduce"` (reduce sums over shared dimensions).
        loss_average: `None`, `"batch"` or `"batch+sequence"`.

    Returns:
        Tensor `[rows, d_out]`, multiplied by \(\sqrt{R}\) for `"batch+sequence"`.
    """  # noqa: E501
    if isinstance(module, Conv2d) and kfac_approx == KFACType.EXPAND:
        # "b c o1 o2 -> (b o1 o2) c" as the transpose of a feature-major copy
        # "c (b o1 o2)": contiguous runs of O1 O2 instead of a transposition
        rows, shared = g.transpose(0, 1).flatten(1).T, g.shape[2:].numel()
    else:
        if isinstance(module, Conv2d):
            g = g.flatten(2).transpose(1, 2)  # "b c o1 o2 -> b (o1 o2) c"
        rows, shared = _shared_rows(g, kfac_approx, "sum")
    if loss_average == "batch+sequence":
        rows = rows * shared**0.5
    return rows


def gradient_scale(loss_average: LossAverage, num_examples: int) -> float:
    r"""Return \(\nu\), the factor from \(\sum \tilde g^\top \tilde g\) to \(U_C\).

    Args:
        loss_average: `None`, `"batch"` or `"batch+sequence"`.
        num_examples: Number of examples \(N\) of the (accumulated) batch.

    Returns:
        \(N\) for a mean loss, 1 for a sum loss.
    """
    return 1.0 if loss_average is None else float(num_examples)


def grad_matrix(module: Module) -> Tensor | None:
    r"""Return the layer's gradient as the matrix \(\Gamma = [\nabla W\; \nabla b]\).

    Args:
        module: A supported layer.

    Returns:
        A new tensor `[d_out, d_K]` (the caller may overwrite it), or None if the
        weight has no gradient. A missing bias gradient counts as zero.
    """
    weight = layer_weight(module)
    if weight.grad is None:
        return None
    grad = weight.grad.flatten(1)
    if module.bias is None:
        return grad.clone()
    bias_grad = module.bias.grad
    if bias_grad is None:
        bias_grad = torch.zeros_like(module.bias)
    return torch.cat([grad, bias_grad.unsqueeze(1)], dim=1)


def kfac_factors(kfac: Any) -> dict[Parameter, tuple[Tensor, Tensor]]:
    r"""Read the Kronecker factors \((U_K, U_C)\) of a `KFACLinearOperator` per layer.

    The operator must be built with `separate_weight_and_bias=False`, so that its
    input factor carries the bias column, as SINGD's \(K\) does. Factors are
    computed first if the operator has not done so yet.

    Args:
        kfac: A `curvlinops.KFACLinearOperator`.

    Returns:
        Map from each layer's weight to (input covariance `[d_K, d_K]`, gradient
        covariance `[d_C, d_C]`).

    Raises:
        TypeError: If `kfac` is not a `KFACLinearOperator`.
        ValueError: If it separates weight and bias.
    """
    if not isinstance(kfac, KFACLinearOperator):
        raise TypeError(
            f"Expected a curvlinops.KFACLinearOperator, got {type(kfac).__name__}."
        )
    if kfac._separate_weight_and_bias:
        raise ValueError(
            "The KFACLinearOperator must be built with separate_weight_and_bias=False "
            "(SINGD's input factor includes the bias column)."
        )
    if not kfac._input_covariances or not kfac._gradient_covariances:
        kfac.compute_kronecker_factors()
    factors = {}
    for name, positions in kfac._mapping.items():
        weight = kfac._params[positions["weight"]]
        factors[weight] = (
            kfac._input_covariances[name],
            kfac._gradient_covariances[name],
        )
    return factors


def check_kfac_approx(kfac_approx: object) -> str:
    """Validate `kfac_approx`.

    Args:
        kfac_approx: Candidate value.

    Returns:
        The value as a plain string.

    Raises:
        ValueError: If it is not one of curvlinops' `KFACType` values.
    """
    if kfac_approx not in KFAC_APPROXES:
        raise ValueError(
            f"kfac_approx must be one of {list(KFAC_APPROXES)}, got {kfac_approx!r}."
        )
    return str(KFACType(kfac_approx).value)


def check_loss_average(loss_average: object) -> LossAverage:
    """Validate `loss_average`.

    Args:
        loss_average: Candidate value.

    Returns:
        The value.

    Raises:
        ValueError: If it is not `None`, `"batch"` or `"batch+sequence"`.
    """
    if loss_average not in LOSS_AVERAGES:
        raise ValueError(
            f"loss_average must be one of {list(LOSS_AVERAGES)}, got {loss_average!r}."
        )
    return loss_average
