r"""Recomputing a module with the `F.linear` calls of its slots exposed.

Some modules apply a child's weight themselves, `F.linear(x, child.weight, b)`,
where no hook of the child sees it (torchvision's Swin attention, timm's BEiT
and EVA attention). Their adapters recompute the module's output on collecting
passes under `LinearCalls`, a `torch.overrides.TorchFunctionMode` that hands
exactly the calls with a slot's weight to the adapter (which applies the slot
and records its use) and runs everything else as is; `recompute` replays the
call's random state (`replay`), so that dropout draws the same masks.
`RecomputingAdapter` is the base class of such adapters: they name the calls'
weights and how to apply them (`exposed`), and whether the module draws random
numbers (`draws_random`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor
from torch.nn import Module
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from singd_curvlinops.layers.base import LayerAdapter, Slot, Use
from singd_curvlinops.layers.replay import random_state, replayed

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


class LinearCalls(TorchFunctionMode):
    """Hand the `F.linear` calls with a slot's weight to `apply`.

    Args:
        weights: Per slot name, its weight.
        apply: `(name, x, weight, bias) -> output`, called instead of
            `F.linear` (the mode is off inside it).
    """

    def __init__(self, weights: Mapping[str, Tensor], apply: Apply) -> None:
        super().__init__()
        self.weights = dict(weights)
        self.apply = apply

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: PLW3201
        """Intercept `F.linear` with a slot's weight; run everything else as is."""
        kwargs = kwargs or {}
        if func is F.linear:
            x = args[0] if args else kwargs["input"]
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            for name, slot_weight in self.weights.items():
                if weight is slot_weight:
                    bias = args[2] if len(args) > 2 else kwargs.get("bias")
                    return self.apply(name, x, weight, bias)
        return func(*args, **kwargs)


def recompute(
    module: Module, args: tuple, kwargs: dict[str, Any], before: Any, calls: LinearCalls
) -> Any:
    """Run the module's `forward` again under `calls`, with its random state replayed.

    Args:
        module: The module.
        args: Positional arguments of the original call.
        kwargs: Keyword arguments of the original call.
        before: The random state before the original call (`replay.random_state`),
            or None without randomness.
        calls: The mode that exposes the slots' `F.linear` calls.

    Returns:
        The recomputed output.
    """
    device = call_input(args, kwargs).device
    with calls:
        return replayed(before, device, lambda: module.forward(*args, **kwargs))


class RecomputingAdapter(LayerAdapter):
    """An adapter whose module applies its slots' weights with `F.linear` itself.

    Subclasses define `exposed` and `draws_random`; on collecting passes the
    module's output is recomputed with the slots' calls handed to `exposed`'s
    `apply`, which records their uses.
    """

    needs_before_forward = True

    def exposed(
        self, module: Module, x: Tensor
    ) -> tuple[Mapping[str, Tensor], Apply, list[Use]]:
        """Return the slots' weights, how to apply them, and the list of uses.

        Args:
            module: The module, after its forward call.
            x: The call's input.

        Returns:
            `(weights, apply, uses)`: per slot name its weight; `apply` as for
            `LinearCalls`, which appends each call's use to `uses`.
        """
        raise NotImplementedError

    def draws_random(self, module: Module) -> bool:
        """Return whether a call of the module draws random numbers (dropout).

        Args:
            module: The module.

        Returns:
            Whether `before_forward` must keep the random state.
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

    def before_forward(self, module: Module, args: tuple, kwargs: dict) -> Any:
        """Return the random state before a call that draws random numbers.

        Args:
            module: The module.
            args: Positional arguments of the call.
            kwargs: Keyword arguments of the call.

        Returns:
            The random state (`replay.random_state`), or None.
        """
        if not self.draws_random(module):
            return None
        return random_state(call_input(args, kwargs).device)

    def forward_uses(
        self,
        module: Module,
        args: tuple,
        kwargs: dict[str, Any],
        output: Any,
        before: Any,
    ) -> tuple[list[Use], Any]:
        """Recompute the output with the slots' `F.linear` calls exposed.

        Args:
            module: The module, after its forward call.
            args: Positional arguments of the call.
            kwargs: Keyword arguments of the call.
            output: The module's output.
            before: The random state from `before_forward`.

        Returns:
            The slots' uses and the recomputed output (none without a graph).
        """
        if not isinstance(output, Tensor) or not output.requires_grad:
            return [], None
        weights, apply, uses = self.exposed(module, call_input(args, kwargs))
        return uses, recompute(
            module, args, kwargs, before, LinearCalls(weights, apply)
        )
