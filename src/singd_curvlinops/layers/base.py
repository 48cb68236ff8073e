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

A module may hold several linear maps (*slots*): `torch.nn.MultiheadAttention`
has an input and an output projection. `slots` names them, `forward_uses` says
which input and output tensor each application of a slot in one forward call has
(a `Use`), and `submodules` names the child modules whose parameters the adapter
handles itself. The defaults describe one slot, named `""`, applied once per call.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module, Parameter

from singd_curvlinops import statistics


@dataclass(frozen=True, eq=False)
class Slot:
    r"""One linear map of a module: \(y = W x + b\) with a weight, a bias or both.

    Attributes:
        name: The slot's name within its module (`""` for single-slot modules).
        weight: Its weight, or None (a slot that only adds a bias).
        bias: Its bias `[d_out]`, or None.
        transposed: Whether the weight is stored `[d_in, d_out]` (as an embedding
            table or Hugging Face's `Conv1D`) instead of `[d_out, d_in]`. Two slots
            that share a weight in opposite layouts use it in opposite orientations.
        one_hot: Whether the slot's inputs are one-hot rows (`SparseRows`): its
            input factor is exactly diagonal and is stored as a diagonal.
    """

    name: str
    weight: Parameter | None
    bias: Parameter | None
    transposed: bool = False
    one_hot: bool = False


@dataclass(frozen=True, eq=False)
class Use:
    """One application of a slot in a forward call.

    Attributes:
        slot: The slot's name.
        x: Its input, batch (example) dimension first, in the adapter's layout.
        output: The tensor whose gradient is the slot's output gradient (None
            in the copy that its gradient hook holds, which must not reference
            the tensor itself). If it is a view that covers all of its base (a
            linear layer's product on more than two dimensions), the hook sits on
            the base (`hooks.hook_gradient`), which nothing else may use.
        out_rows: Which of the slot's output features `output` holds (None: all),
            e.g. the query rows of a packed attention projection.
        batch_dim: The batch dimension of `output` (and of its gradient).
    """

    slot: str
    x: Any
    output: Tensor | None
    out_rows: slice | None = None
    batch_dim: int = 0

    def batch_first(self, batch_dim: int, sequence: bool = False) -> Use:
        """Return this use of inputs whose batch is at `batch_dim` (`Site.batch_dim`).

        Args:
            batch_dim: The batch dimension of the module's input and output.
            sequence: Whether the inputs are sequences (`Site.sequence`): a 2-D
                input `[S, d]` is then one example.

        Returns:
            The use with the batch moved first in `x` and `batch_dim` set (None
            for one unbatched sequence); itself for `batch_dim=0` or an input
            without that dimension besides its features.
        """
        if not isinstance(self.x, Tensor) or self.batch_dim is None:
            return self
        if sequence and self.x.dim() == 2:
            return replace(self, x=self.x.unsqueeze(0), batch_dim=None)
        if not batch_dim or self.x.dim() < batch_dim + 2:
            return self
        return replace(self, x=self.x.movedim(batch_dim, 0), batch_dim=batch_dim)


class LayerAdapter(ABC):
    """How a Kronecker optimizer treats one type of layer (see the module docs).

    Adapters are stateless; one instance serves every layer of its type.

    Attributes:
        description: The layer type as users know it, for messages, e.g.
            `"torch.nn.Linear"`.
        transposed: Whether the default slot's weight is stored `[d_in, d_out]`.
        one_hot: Whether the default slot's inputs are one-hot rows.
        needs_before_forward: Whether `before_forward` must run before each
            collecting forward call (the forward hook then also runs when the
            call raises, so that what `before_forward` entered is left).
        unbatched_dims: The number of dimensions of an unbatched input (one
            example, as `torch.nn` accepts it: `[d_in]` for a linear layer,
            `[C, H, W]` for a convolution); None: the adapter has none.
    """

    description: str = ""
    transposed: bool = False  # the default slot's weight is stored [d_in, d_out]
    one_hot: bool = False  # the default slot's inputs are one-hot rows
    needs_before_forward: bool = False  # whether to call `before_forward`
    unbatched_dims: int | None = 1  # an input of this rank is one example

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
        weight = self.weight(module)  # (from its shape: no op on an FSDP2 DTensor)
        d_in = weight.shape[1:].numel()
        return d_in + int(self.bias(module) is not None), weight.shape[0]

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
        d_in = weight.shape[1:].numel()
        slices = [matrix[:, :d_in].reshape(*weight.shape, *extra)]
        if len(params) == 2:
            slices.append(matrix[:, d_in].reshape(*params[1].shape, *extra))
        return slices

    def slots(self, module: Module) -> tuple[Slot, ...]:
        """Return the linear maps of `module`.

        Args:
            module: A matching layer.

        Returns:
            One slot named `""` with `weight(module)` and `bias(module)`.
        """
        return (
            Slot(
                "",
                self.weight(module),
                self.bias(module),
                transposed=self.transposed,
                one_hot=self.one_hot,
            ),
        )

    def submodules(self, module: Module) -> tuple[Module, ...]:
        """Return child modules whose parameters this adapter handles with `module`.

        They are not matched on their own (e.g. the output projection of an
        attention module, which the module applies functionally).

        Args:
            module: A matching layer.

        Returns:
            The children; none by default.
        """
        return ()

    def slot_dims(self, module: Module, slot: Slot) -> tuple[int, int]:
        """Return `(d_in, d_out)` of a slot, without a bias column.

        Args:
            module: A matching layer.
            slot: One of `slots(module)`.

        Returns:
            `dims(module)` less the bias column.
        """
        d_K, d_C = self.dims(module)
        return d_K - int(self.bias(module) is not None), d_C

    def before_forward(self, module: Module, args: tuple, kwargs: dict) -> Any:
        """Return what `forward_uses` needs from before the forward call, if any.

        Called only if `needs_before_forward` is set, and only when the module's
        statistics are collected in this pass.

        Args:
            module: The layer.
            args: Positional arguments of the call.
            kwargs: Keyword arguments of the call.

        Returns:
            Anything; None by default. An entered `capture.CallCapture` is left
            by the collector after the call, also when the call raises.
        """
        return None

    def forward_uses(
        self,
        module: Module,
        args: tuple,
        kwargs: dict[str, Any],
        output: Any,
        before: Any,
    ) -> tuple[list[Use], Any]:
        """Return the slot applications of a forward call, and a replacement output.

        Called when the module's statistics are collected in this pass. An adapter
        whose module applies a slot where no hook can reach it exposes the
        applications during the call (`capture.CapturingAdapter`), or computes
        the module's output again with them exposed and returns that output in
        place of the original (it must be the same function of the inputs).

        Args:
            module: The layer, after its forward call.
            args: Positional arguments of the call.
            kwargs: Keyword arguments of the call.
            output: The module's output.
            before: What `before_forward` returned.

        Returns:
            The uses, and the output to return instead of `output` (None: keep).
        """
        if not isinstance(output, Tensor) or not output.requires_grad:
            return [], None
        x = self.layer_input(module, args, kwargs)
        if isinstance(x, Tensor) and x.dim() == self.unbatched_dims:
            return [Use("", x.unsqueeze(0), output, batch_dim=None)], None
        return [Use("", x, output)], None

    def use_input_rows(self, module: Module, use: Use, kfac_approx: str) -> Any:
        r"""Return the input rows \(a\) of one use, with the slot's bias column.

        Args:
            module: The layer.
            use: One of the uses from `forward_uses`.
            kfac_approx: `"expand"` or `"reduce"`.

        Returns:
            `input_rows(module, use.x, kfac_approx)` by default.
        """
        return self.input_rows(module, use.x, kfac_approx)

    def use_gradient_rows(
        self,
        module: Module,
        use: Use,
        grad_output: Tensor,
        kfac_approx: str,
        loss_average: statistics.LossAverage,
    ) -> Tensor:
        r"""Return the output-gradient rows \(\tilde g\) of one use.

        Args:
            module: The layer.
            use: One of the uses from `forward_uses`.
            grad_output: Gradient w.r.t. `use.output`, batch dimension first.
            kfac_approx: `"expand"` or `"reduce"`.
            loss_average: `None`, `"batch"` or `"batch+sequence"`.

        Returns:
            `gradient_rows(module, grad_output, ...)` by default.
        """
        return self.gradient_rows(module, grad_output, kfac_approx, loss_average)

    # ------------------------------------------------------------ statistics
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
