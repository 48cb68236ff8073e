"""Exposing a module's slots during its own forward call.

Some modules apply a slot's weight where no hook reaches it: inside a torch
function (`torch.nn.functional.multi_head_attention_forward`) or with
`F.linear(x, child.weight, b)` in their own code. A `CallCapture` is a
`torch.overrides.TorchFunctionMode` that its adapter's `before_forward` enters
just before such a call (`LayerAdapter.before_forward`, a forward pre-hook) and
that the collector leaves right after it, in the module's forward hook, which is
registered to run also when the call raises (`always_call=True`). While it is
entered, it hands the torch functions that apply the slots to the adapter, which
computes them with the slots' products exposed and appends their `Use`s; every
other function runs as it is. So the module runs once, as written, and draws its
random numbers (dropout) once, at the same points as without the optimizer.
The exposed products run eagerly under `torch.compile` (`torch.compiler.disable`):
traced into a graph, the tensors whose gradients the statistics need would be
extra outputs of the graph, which the loss's gradient does not reach.
`CapturingAdapter` is the base class of the adapters that capture.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

from torch.nn import Module
from torch.overrides import TorchFunctionMode

from singd_curvlinops.layers.base import LayerAdapter, Use


class CallCapture(TorchFunctionMode):
    """A torch function mode for one module call that collects its slots' uses.

    Subclasses implement `__torch_function__`: the calls that apply a slot go to
    the adapter, which appends to `uses`; every other call runs as it is (inside
    the handler the mode is off).

    Attributes:
        uses: The applications of the module's slots in this call, in order.
    """

    def __init__(self) -> None:
        super().__init__()
        self.uses: list[Use] = []
        self._entered = False

    def enter(self) -> CallCapture:
        """Push the mode onto the torch function mode stack (before the call).

        Returns:
            Itself.
        """
        self.__enter__()
        self._entered = True
        return self

    def leave(self) -> None:
        """Pop the mode again (after the call, or after it raised); idempotent."""
        if self._entered:
            self._entered = False
            self.__exit__(None, None, None)


class CapturingAdapter(LayerAdapter):
    """An adapter whose module applies its slots where no hook reaches them.

    Subclasses define `capture`: the mode that exposes one call's slots. On
    collecting passes `before_forward` enters it and `forward_uses` returns the
    uses it recorded; the module's output is its own.
    """

    needs_before_forward = True

    @abstractmethod
    def capture(self, module: Module, args: tuple, kwargs: dict) -> CallCapture:
        """Return the (not yet entered) mode that exposes the slots of one call.

        Args:
            module: The module, before its forward call.
            args: Positional arguments of the call.
            kwargs: Keyword arguments of the call.

        Returns:
            The capture.
        """

    def before_forward(self, module: Module, args: tuple, kwargs: dict) -> CallCapture:
        """Enter the call's capture; the collector leaves it after the call.

        Args:
            module: The module.
            args: Positional arguments of the call.
            kwargs: Keyword arguments of the call.

        Returns:
            The entered capture.
        """
        return self.capture(module, args, kwargs).enter()

    def forward_uses(
        self,
        module: Module,
        args: tuple,
        kwargs: dict[str, Any],
        output: Any,
        before: Any,
    ) -> tuple[list[Use], Any]:
        """Return the uses that the call's capture recorded.

        Args:
            module: The module, after its forward call.
            args: Positional arguments of the call.
            kwargs: Keyword arguments of the call.
            output: The module's output.
            before: The capture from `before_forward` (left already).

        Returns:
            The uses, and None: the output is the module's own.
        """
        return (before.uses if isinstance(before, CallCapture) else []), None
