r"""Exposing the `F.linear` calls of a module's slots during the module's own call.

Some modules apply a child's weight themselves, `F.linear(x, child.weight, b)`,
where no hook of the child sees it (torchvision's Swin attention, timm's BEiT
and EVA attention). Their adapters enter `LinearCalls` for the duration of a
collecting call (`capture.CallCapture`): a torch function mode that hands exactly
the calls with a slot's weight to the adapter, which applies the slot and
records its use, and runs everything else as is. `LinearCallsAdapter` is the
base class of such adapters: they name the calls' weights and how to apply them
(`exposed`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.nn import functional as F

from singd_curvlinops.layers.base import Slot, Use
from singd_curvlinops.layers.capture import CallCapture, CapturingAdapter

Apply = Callable[[str, Tensor, Tensor, Tensor | None], Tensor]


def call_input(args: tuple, kwargs: dict[str, Any]) -> Tensor:
    """Return a module call's input: its first positional argument, or `x`.

    Args:
        args: Positional arguments of the call.
        kwargs: Keyword arguments of the call.

    Returns:
        The input tensor.
    """
    return args[0] if args else kwargs["x"]


def weight_dims(slot: Slot) -> tuple[int, int]:
    """Return `(d_in, d_out)` of a slot whose weight is stored `[d_out, d_in]`.

    Args:
        slot: The slot.

    Returns:
        The weight's `(columns, rows)`.
    """
    d_out, d_in = slot.weight.shape
    return d_in, d_out


class LinearCalls(CallCapture):
    """Hand the `F.linear` calls with a slot's weight to `apply`.

    Args:
        weights: Per slot name, its weight.
        apply: `(name, x, weight, bias) -> output`, called instead of
            `F.linear` (the mode is off inside it); it appends the call's use to
            `uses`.
        uses: The list `apply` appends to.
    """

    def __init__(
        self, weights: Mapping[str, Tensor], apply: Apply, uses: list[Use]
    ) -> None:
        super().__init__()
        self.weights = dict(weights)
        self.apply = apply
        self.uses = uses

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: PLW3201
        """Intercept `F.linear` with a slot's weight; run everything else as is."""
        kwargs = kwargs or {}
        if func is F.linear:
            x = args[0] if args else kwargs["input"]
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            for name, slot_weight in self.weights.items():
                if weight is slot_weight:
                    bias = args[2] if len(args) > 2 else kwargs.get("bias")
                    return _exposed(self.apply, name, x, weight, bias)
        return func(*args, **kwargs)


@torch.compiler.disable
def _exposed(
    apply: Apply, name: str, x: Tensor, weight: Tensor, bias: Tensor | None
) -> Tensor:
    """Run `apply` eagerly, also under `torch.compile` (`capture`).

    Args:
        apply: The adapter's application of a slot.
        name: The slot.
        x: The call's input.
        weight: The slot's weight.
        bias: The call's bias.

    Returns:
        The product.
    """
    return apply(name, x, weight, bias)


class LinearCallsAdapter(CapturingAdapter):
    """An adapter whose module applies its slots' weights with `F.linear` itself.

    Subclasses define `exposed`; on collecting passes the module's call runs
    under `LinearCalls`, which hands the slots' calls to `exposed`'s `apply`.
    """

    def exposed(
        self, module: Module, x: Tensor
    ) -> tuple[Mapping[str, Tensor], Apply, list[Use]]:
        """Return the slots' weights, how to apply them, and the list of uses.

        Args:
            module: The module, before its forward call.
            x: The call's input.

        Returns:
            `(weights, apply, uses)`: per slot name its weight; `apply` as for
            `LinearCalls`, which appends each call's use to `uses`.
        """
        raise NotImplementedError

    def slot_dims(self, module: Module, slot: Slot) -> tuple[int, int]:
        """Return `(d_in, d_out)` of a slot (`weight_dims`).

        Args:
            module: The module.
            slot: One of its slots.

        Returns:
            The weight's `(columns, rows)`.
        """
        return weight_dims(slot)

    def capture(self, module: Module, args: tuple, kwargs: dict) -> LinearCalls:
        """Return the mode that hands the slots' `F.linear` calls to `exposed`.

        Args:
            module: The module, before its forward call.
            args: Positional arguments of the call.
            kwargs: Keyword arguments of the call.

        Returns:
            The capture.
        """
        return LinearCalls(*self.exposed(module, call_input(args, kwargs)))
