"""The forward hooks that an optimizer's collector installs on a model.

A hook holds its collector weakly: a dropped optimizer stops collecting. A copy of
the model (`copy.deepcopy`, pickling) gets inert hooks, so that the original
collector never sees the copy's passes.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module


def own_parameters(module: Module, entries: Sequence[Any]) -> bool:
    """Return whether a module holds the parameters its layers were resolved with.

    Args:
        module: The module, during a forward call.
        entries: Its collector entries (each with `site.slot`).

    Returns:
        False during a `functional_call` with other tensors.
    """
    current = {slot.name: slot for slot in entries[0].site.adapter.slots(module)}
    for entry in entries:
        slot = current.get(entry.site.slot.name)
        if slot is None or slot.weight is not entry.site.slot.weight:
            return False
        if slot.bias is not entry.site.slot.bias:
            return False
    return True


def hook_gradient(output: Tensor, hook: Callable[[Tensor], None]) -> None:
    """Call `hook` with the gradient w.r.t. `output`, even if it changes in place.

    A linear layer's output on inputs with more than two dimensions is a view of
    the product's 2-D result. An in-place operation on it (`ReLU(inplace=True)`,
    `+=`) rebases the view's history, and a hook registered on the view never
    runs. A hook on the view's base, which holds the same elements in the same
    order and which only the view references, runs with the gradient w.r.t. the
    values before any in-place change (as a hook on a tensor that is not a view
    does); it is reshaped to `output`'s shape.

    Args:
        output: A layer's output in the forward pass.
        hook: Called with the gradient, shaped as `output`.
    """
    base = output._base
    same_elements = (
        base is not None
        and base.numel() == output.numel()
        and base.storage_offset() == output.storage_offset()
        and base.is_contiguous()
        and output.is_contiguous()
    )
    if not same_elements:
        output.register_hook(hook)
        return
    shape = output.shape  # (the hook must not hold `output` itself)
    base.register_hook(lambda grad: hook(grad.reshape(shape)))


class ModuleHook:
    """A module's forward (pre-)hook; holds its collector weakly.

    A copy of the model (`copy.deepcopy`, pickling) gets an inert hook: the
    original collector must not see the copy's passes.
    """

    __slots__ = ("_collector",)

    def __init__(self, collector: Any) -> None:
        self._collector = weakref.ref(collector)

    # The hooks run eagerly under `torch.compile`: they branch on the optimizer's
    # step counter and mutate its state, which Dynamo would otherwise trace into
    # one specialised graph per layer and phase until it hits its recompile limit.
    @torch.compiler.disable
    def __call__(
        self, module: Module, args: tuple, kwargs: dict[str, Any], output: Any
    ) -> Any:
        """Hand the call to the collector, if it is still alive.

        Args:
            module: The module.
            args: Positional inputs of the call.
            kwargs: Keyword inputs.
            output: Its output.

        Returns:
            A replacement output, or None.
        """
        collector = self._collector()
        if collector is not None:
            return collector.on_forward(module, args, kwargs, output)
        return None

    def __deepcopy__(self, memo: dict[int, Any]) -> _InertHook:
        """Return an inert hook for a copied model.

        Args:
            memo: `copy.deepcopy`'s memo.

        Returns:
            An `_InertHook`.
        """
        return _InertHook()

    def __reduce__(self) -> tuple[type, tuple]:
        """Pickle as an inert hook.

        Returns:
            How to build an `_InertHook`.
        """
        return _InertHook, ()


class PreHook(ModuleHook):
    """A module's forward pre-hook (for adapters that need `before_forward`)."""

    __slots__ = ()

    @torch.compiler.disable
    def __call__(self, module: Module, args: tuple, kwargs: dict[str, Any]) -> None:
        """Let the collector see the call's inputs before the forward pass.

        Args:
            module: The module.
            args: Positional inputs of the call.
            kwargs: Keyword inputs.
        """
        collector = self._collector()
        if collector is not None:
            collector.before_forward(module, args, kwargs)


class _InertHook:
    """The hook a copied model carries in place of an optimizer's: does nothing."""

    def __call__(self, *args: Any) -> None:
        return None


def remove_hook(module: Module, hook_id: int) -> None:
    """Remove the forward (pre-)hook registered under `hook_id` (as its handle would).

    Args:
        module: The module.
        hook_id: The id of the hook's `RemovableHandle`.
    """
    for hooks in (
        module._forward_hooks,
        module._forward_hooks_with_kwargs,
        module._forward_hooks_always_called,
        module._forward_pre_hooks,
        module._forward_pre_hooks_with_kwargs,
    ):
        hooks.pop(hook_id, None)
