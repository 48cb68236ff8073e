"""The forward hooks that an optimizer's collector installs on a model.

A hook holds its collector weakly: a dropped optimizer stops collecting. A copy of
the model (`copy.deepcopy`, pickling) gets inert hooks, so that the original
collector never sees the copy's passes.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import get_gradient_edge
from torch.distributed.tensor import DTensor
from torch.nn import Module


def own_parameters(module: Module, entries: Sequence[Any]) -> bool:
    """Return whether a module holds the parameters its layers were resolved with.

    FSDP2 swaps a sharded parameter (a `DTensor`) for its unsharded copy while
    the parameter's unit runs (`unsharded`): that copy counts as the parameter.

    Args:
        module: The module, during a forward call (or just before it).
        entries: Its collector entries (each with `site.slot`).

    Returns:
        False during a `functional_call` with other tensors.
    """
    current = {slot.name: slot for slot in entries[0].site.adapter.slots(module)}
    for entry in entries:
        slot = current.get(entry.site.slot.name)
        if slot is None or not unsharded(slot.weight, entry.site.slot.weight):
            return False
        if not unsharded(slot.bias, entry.site.slot.bias):
            return False
    return True


def unsharded(current: Tensor | None, registered: Tensor | None) -> bool:
    """Return whether `current` is `registered`, or FSDP2's unsharded copy of it.

    While an FSDP2 unit runs its forward pass, the modules inside it hold plain
    tensors of the full shape in place of their sharded parameters; FSDP2's
    post-forward hook swaps the `DTensor`s back. The optimizer's hooks of a
    module that is a unit of its own see the copies before the call (FSDP2's
    pre-forward hook runs first) and the `DTensor`s after it; those of a module
    inside a larger unit (a Transformer block sharded as one, the usual
    wrapping) see the copies in both.

    Args:
        current: The module's parameter now (or None).
        registered: The parameter the layer was resolved with (or None).

    Returns:
        True if they are the same tensor, or `registered` is a `DTensor` and
        `current` a plain tensor of its (global) shape and dtype (so a
        `functional_call` with such tensors on a sharded model would collect;
        curvlinops' products, the reason for the check, do not run on one).
    """
    if current is registered:
        return True
    return (
        isinstance(registered, DTensor)
        and isinstance(current, Tensor)
        and not isinstance(current, DTensor)
        and current.shape == registered.shape
        and current.dtype == registered.dtype
    )


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


def gradient_nodes(params: Sequence[Tensor]) -> tuple[Any, ...]:
    """Return the autograd nodes that receive the gradients of leaf parameters.

    Args:
        params: A layer's trained parameters.

    Returns:
        Their gradient accumulators (`torch.autograd.graph.get_gradient_edge`);
        none for FSDP2's shards (`DTensor`s), whose forward pass uses
        unsharded copies with accumulators of their own: every pass collects.
    """
    if any(isinstance(p, DTensor) for p in params):
        return ()
    return tuple(get_gradient_edge(p).node for p in params if p.requires_grad)


def reached_parameters(nodes: Sequence[Any]) -> tuple[str, ...]:
    """Return how the running backward pass computes each parameter's gradient.

    `backward()` runs every accumulator it reaches; `backward(inputs=...)` and
    `torch.autograd.grad(outputs, inputs)` run only what their `inputs` need, so
    a gradient penalty's `autograd.grad` w.r.t. the network's inputs, or one
    w.r.t. a layer's output, reaches none of the layer's parameters.
    `autograd.grad` w.r.t. the parameters themselves captures their gradients
    without running the accumulators; torch then raises for the leaf.

    Args:
        nodes: From `gradient_nodes`, taken in the forward pass.

    Returns:
        Per node `"accumulated"` (into `.grad`; also where torch cannot tell),
        `"captured"` (returned by `autograd.grad`) or `""` (not computed).

    Raises:
        RuntimeError: If torch raises for another reason than a captured leaf.
    """
    will_execute = getattr(torch._C, "_will_engine_execute_node", None)
    if will_execute is None:  # pragma: no cover - every supported torch has it
        return ("accumulated",) * len(nodes)
    reached = []
    for node in nodes:
        try:
            reached.append("accumulated" if will_execute(node) else "")
        except RuntimeError as error:  # a leaf that `autograd.grad` captures
            if "autograd.grad" not in str(error):  # pragma: no cover
                raise
            reached.append("captured")
    return tuple(reached)


@dataclass(eq=False)
class UsePasses:
    """Which backward pass gives one use of a layer (in one forward call) its rows.

    A tensor hook runs once per backward pass, so every call of `decide` is
    another pass of the same forward call.

    Attributes:
        nodes: `gradient_nodes` of the layer's parameters, taken in the forward.
        reached: What the collecting pass computed (`reached_parameters`), or
            None before it.
    """

    nodes: tuple[Any, ...]
    reached: tuple[str, ...] | None = None

    def decide(self) -> str:
        """Return what the running backward pass does with the use's gradient.

        - A pass that computes no gradient of the layer's parameters adds
          nothing, nor does `autograd.grad(..., create_graph=True)` for them (a
          penalty on the parameter gradients, a meta-learning inner step): the
          training pass differentiates its result again, and collects.
        - Of the others, the first collects. A later one is left out; it is
          named (`"repeat"`) if it accumulates into `.grad` a gradient that the
          first one computed too (`backward(retain_graph=True)` twice, or
          `autograd.grad` for the parameters before `backward()`); repeated
          `autograd.grad` calls (curvlinops' Monte-Carlo samples on a model that
          the optimizer hooks) are left out silently.
        - Under FSDP2 (no `nodes`) every pass collects, as before 2026-12-02.

        Returns:
            `"collect"`, `"skip"` or `"repeat"` (skipped with a warning).
        """
        if not self.nodes:
            return "collect"
        reached = reached_parameters(self.nodes)
        if not any(reached) or ("captured" in reached and torch.is_grad_enabled()):
            return "skip"
        if self.reached is None:
            self.reached = reached
            return "collect"
        pairs = zip(self.reached, reached, strict=True)
        again = any(first and now == "accumulated" for first, now in pairs)
        return "repeat" if again else "skip"

    @staticmethod
    def repeated(owner: str, name: str) -> str:
        """Return the warning for a layer's `"repeat"` (once per layer).

        Args:
            owner: The optimizer's class name.
            name: The layer's name.

        Returns:
            The message, with the remedy.
        """
        return (
            f"{owner}: layer {name!r} got gradients of one forward pass in two "
            "backward passes that computed its parameters' gradients "
            "(backward(retain_graph=True) twice, or autograd.grad for the "
            "parameters before backward()); its statistics keep the first pass. "
            "For several losses, sum them and call backward() once."
        )


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
