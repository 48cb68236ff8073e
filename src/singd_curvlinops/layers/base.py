r"""The contract of a layer adapter: how one layer type enters a Kronecker optimizer.

A layer \(y = W x + b\) (applied at every position of a weight-sharing dimension,
for convolutions to every patch) is preconditioned through its *gradient matrix*
\(\Gamma = [\nabla W\; \nabla b] \in \mathbb{R}^{d_C \times d_K}\), \(d_K = d_\text{in}
(+1)\), \(d_C = d_\text{out}\), and its KFAC statistics, the rows \(a\) and
\(\tilde g\) of `singd_curvlinops.statistics`. An adapter states, for one module
type:

- which parameters the layer owns (`parameters`, weight first) and the dimensions
  \((d_K, d_C)\) (`dims`);
- how one tensor per parameter (its gradients, a direction) is arranged in the
  layout of \(\Gamma\) (`to_matrix`) and split back (`from_matrix`);
- which tensor of a forward call is its input \(x\) (`layer_input`, batch first)
  and how \(x\) and the output gradient become the rows \(a\), \(\tilde g\)
  (`input_rows`, `gradient_rows`) whose products are curvlinops' factors.

The defaults fit a weight `[d_out, ...]` whose trailing dimensions flatten into
\(d_\text{in}\), an optional `bias` attribute, and a `[batch, ..., d_in]` input:
`torch.nn.Linear` needs nothing else. Adapters see modules and tensors, never
factors or optimizer state; register new ones with `register_layer`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module, Parameter

from singd_curvlinops import statistics


class LayerAdapter(ABC):
    """How a Kronecker optimizer treats one type of layer (see the module docs).

    Adapters are stateless; one instance serves every layer of its type.

    Attributes:
        description: The layer type as users know it, for messages, e.g.
            `"torch.nn.Linear"`.
    """

    description: str = ""

    @abstractmethod
    def matches(self, module: Module) -> bool:
        """Return whether this adapter handles `module`.

        Args:
            module: A submodule of the model.

        Returns:
            True for a module of this adapter's type in a supported configuration.
        """

    def weight(self, module: Module) -> Parameter:
        """Return the layer's weight, `[d_out, ...]`.

        Args:
            module: A matching layer.

        Returns:
            The weight parameter.
        """
        return module.weight

    def bias(self, module: Module) -> Parameter | None:
        """Return the layer's bias, `[d_out]`, or None.

        Args:
            module: A matching layer.

        Returns:
            The bias parameter, if the layer has one.
        """
        return getattr(module, "bias", None)

    def parameters(self, module: Module) -> tuple[Parameter, ...]:
        """Return the preconditioned parameters, weight first.

        Args:
            module: A matching layer.

        Returns:
            `(weight,)` or `(weight, bias)`.
        """
        bias = self.bias(module)
        weight = self.weight(module)
        return (weight,) if bias is None else (weight, bias)

    def dims(self, module: Module) -> tuple[int, int]:
        """Return the dimensions `(d_K, d_C)` of the layer's Kronecker factors.

        Args:
            module: A matching layer.

        Returns:
            `d_K = d_in (+1 with bias)` and `d_C = d_out`.
        """
        weight = self.weight(module)
        return weight[0].numel() + int(self.bias(module) is not None), weight.shape[0]

    def to_matrix(
        self, tensors: Sequence[Tensor], params: tuple[Parameter, ...]
    ) -> Tensor:
        r"""Arrange one tensor per parameter into the layer's matrix layout.

        For gradients this is \(\Gamma = [\nabla W\; \nabla b]\). Trailing
        dimensions beyond a parameter's shape (e.g. the columns of a batch of
        vectors) are kept at the end.

        Args:
            tensors: `[*param.shape, *extra]` for each of `params`, in their order.
            params: The layer's parameters, as `parameters` returns them.

        Returns:
            Tensor `[d_C, d_K, *extra]`; a view of `tensors[0]` where possible,
            a new tensor if the layer has several parameters.
        """
        weight = params[0]
        extra = tensors[0].shape[weight.ndim :]
        matrix = tensors[0].reshape(weight.shape[0], -1, *extra)
        if len(params) == 1:
            return matrix
        return torch.cat([matrix, tensors[1].unsqueeze(1)], dim=1)

    def from_matrix(
        self, matrix: Tensor, params: tuple[Parameter, ...]
    ) -> list[Tensor]:
        """Split a tensor in the layer's matrix layout into one tensor per parameter.

        The inverse of `to_matrix`.

        Args:
            matrix: Tensor `[d_C, d_K, *extra]`.
            params: The layer's parameters.

        Returns:
            `[*param.shape, *extra]` per parameter, views of `matrix` where the
            layout allows.
        """
        weight, extra = params[0], matrix.shape[2:]
        d_in = weight[0].numel()
        slices = [matrix[:, :d_in].reshape(*weight.shape, *extra)]
        if len(params) == 2:
            slices.append(matrix[:, d_in].reshape(*params[1].shape, *extra))
        return slices

    def gradient_matrix(
        self,
        params: tuple[Parameter, ...],
        grads: Sequence[Tensor | None] | None = None,
    ) -> Tensor | None:
        r"""Return \(\Gamma = [\nabla W\; \nabla b]\), `[d_C, d_K]`.

        Args:
            params: The layer's parameters.
            grads: Their gradients (default: each parameter's `.grad`); e.g. the
                local row shards of FSDP2 gradients, with `params` the local
                shards of the parameters.

        Returns:
            A new tensor (the caller may overwrite it), or None if the weight has
            no gradient. A missing bias gradient counts as zero.
        """
        if grads is None:
            grads = [p.grad for p in params]
        if grads[0] is None:
            return None
        grads = [
            torch.zeros_like(p) if g is None else g
            for p, g in zip(params, grads, strict=True)
        ]
        matrix = self.to_matrix(grads, params)
        storage = matrix.untyped_storage().data_ptr()
        if storage == grads[0].untyped_storage().data_ptr():
            return matrix.clone()  # a view of the weight's gradient
        return matrix

    def layer_input(
        self, module: Module, args: tuple, kwargs: dict[str, Any]
    ) -> Tensor:
        r"""Return the input of a forward call, batch (example) dimension first.

        Args:
            module: The layer, after its forward call.
            args: Positional arguments of the call.
            kwargs: Keyword arguments of the call.

        Returns:
            The detached input \(x\); `x.shape[0]` is the number of examples.
        """
        return args[0].detach()

    def input_rows(self, module: Module, x: Tensor, kfac_approx: str) -> Tensor:
        r"""Return \(a\), `[rows, d_K]`, with \(a^\top a\) = curvlinops' \(A\).

        Args:
            module: The layer.
            x: Its input from `layer_input`.
            kfac_approx: `"expand"` or `"reduce"`.

        Returns:
            A fresh buffer the caller may overwrite.
        """
        return statistics.input_rows(x, kfac_approx, bias=self.bias(module) is not None)

    def gradient_rows(
        self,
        module: Module,
        grad_output: Tensor,
        kfac_approx: str,
        loss_average: statistics.LossAverage,
    ) -> Tensor:
        r"""Return \(\tilde g\), `[rows, d_C]`, with \(\nu \tilde g^\top \tilde g = G\).

        Args:
            module: The layer.
            grad_output: Gradient of the loss w.r.t. the layer's output.
            kfac_approx: `"expand"` or `"reduce"`.
            loss_average: `None`, `"batch"` or `"batch+sequence"`.

        Returns:
            The rows, possibly a view of `grad_output` (do not overwrite).
        """
        return statistics.gradient_rows(grad_output, kfac_approx, loss_average)

    def __deepcopy__(self, memo: dict[int, Any]) -> LayerAdapter:
        """Return the adapter itself: adapters are stateless.

        Args:
            memo: `copy.deepcopy`'s memo.

        Returns:
            `self`.
        """
        return self

    def __repr__(self) -> str:
        """Return the class name and the layer type it handles.

        Returns:
            E.g. `LinearAdapter(torch.nn.Linear)`.
        """
        return f"{type(self).__name__}({self.description})"
