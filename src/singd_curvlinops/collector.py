r"""The statistics collector: hooks, micro-batch accumulation, hand-over, finiteness.

On a step that updates a layer's factors, a forward hook takes the layer's input
and installs a tensor hook on its output (no module backward hooks: they break
in-place activations). In the backward pass that hook turns input and output
gradient into the rows \(a\), \(\tilde g\) (the layer's adapter, curvlinops'
conventions) and the optimizer's rule into one micro-batch's statistics
\((H_K, H_C)\). Micro-batches accumulate into a `PendingStatistics` record:
\(H_K\) as the example-weighted mean, \(H_C\) as the sum, scaled at hand-out by
\(\nu(N)\) (`statistics.gradient_scale`) and the gradient-scale correction. For a
rule that needs per-example gradients (`FactorRule.per_example`, EKFAC), the
micro-batches' `"expand"` rows are also kept, in an `ExampleGradients` record that
the rule's update turns into sums of squares (scaled like \(H_C\)).

What to collect is asked of the optimizer per forward call (`CollectionPlan`);
the collector knows neither rules nor layer types. The hooks hold the collector
weakly: a dropped optimizer stops collecting. A copied model gets inert hooks
(see `_LayerHook`).
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module, Parameter
from torch.utils.hooks import RemovableHandle

from singd_curvlinops import statistics
from singd_curvlinops._warnings import warn
from singd_curvlinops.layers import Layer
from singd_curvlinops.per_example import ExampleGradients
from singd_curvlinops.rules import FactorStatistics
from singd_curvlinops.structures import StructuredMatrix
from singd_curvlinops.update import all_finite


@dataclass(slots=True)
class PendingStatistics:
    r"""A layer's statistics collected since its last factor update.

    Attributes:
        H_K: Mean of the micro-batches' \(H_K\), weighted by their examples.
        H_C: Sum of the micro-batches' \(H_C\) (before the scale \(\nu\)).
        num_examples: Examples \(N\) so far.
        grad_scale: The gradient scale that the rows \(\tilde g\) were divided by.
        examples: The rows for per-example gradients (rules with `per_example`).
    """

    H_K: StructuredMatrix
    H_C: StructuredMatrix
    num_examples: int
    grad_scale: float
    examples: ExampleGradients | None = None


@dataclass(frozen=True)
class CollectionPlan:
    """What to collect for one layer in one forward-backward pass.

    Attributes:
        kfac_approx: `"expand"` or `"reduce"`.
        loss_average: `None`, `"batch"` or `"batch+sequence"`.
        dtypes: Dtypes of the input and output rows (the factors').
        grad_scale: Scale of the output gradients expected in this pass.
        project: The rule's map from rows `(a, g)` to `(H_K, H_C)`.
        per_example: Whether to keep the rows for per-example gradients.
    """

    kfac_approx: str
    loss_average: statistics.LossAverage
    dtypes: tuple[torch.dtype, torch.dtype]
    grad_scale: float
    project: Callable[[Tensor, Tensor], tuple[StructuredMatrix, StructuredMatrix]]
    per_example: bool = False


class StatisticsCollector:
    """Collects the statistics of the layers it is attached to.

    Args:
        plan: A bound method (of the optimizer) that returns the `CollectionPlan`
            of a layer's forward call, or None if the layer collects nothing in
            this pass. It is held weakly: the optimizer is freed when it is
            dropped, and its collector stops collecting.
    """

    def __init__(self, plan: Callable[[Layer], CollectionPlan | None]) -> None:
        self._plan = weakref.WeakMethod(plan)
        self.pending: dict[Layer, PendingStatistics] = {}
        self._handed_over: dict[Layer, tuple[Tensor, Tensor]] = {}
        self._handles: dict[Layer, RemovableHandle] = {}
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ hooks
    def attach(self, layer: Layer) -> None:
        """Install the forward hook of a layer.

        Args:
            layer: The layer.
        """
        self._handles[layer] = layer.module.register_forward_hook(
            _LayerHook(self, layer), with_kwargs=True
        )

    def detach(self) -> None:
        """Remove every hook of this collector from the model."""
        for handle in self._handles.values():
            handle.remove()
        self._handles.clear()

    def on_forward(
        self, layer: Layer, args: tuple, kwargs: dict[str, Any], output: Any
    ) -> None:
        """If the layer collects in this pass, hook its output's gradient.

        Calls with parameters other than the layer's own (`torch.func`'s
        `functional_call`, as in curvlinops' vectorised products) are ignored.

        Args:
            layer: The layer.
            args: Positional inputs of its forward call.
            kwargs: Keyword inputs.
            output: Its output.
        """
        if not torch.is_grad_enabled() or not isinstance(output, Tensor):
            return
        if not output.requires_grad:
            return
        if layer.adapter.weight(layer.module) is not layer.weight:
            return  # called with other parameters (`torch.func.functional_call`)
        owner_plan = self._plan()
        plan = None if owner_plan is None else owner_plan(layer)
        if plan is None:
            return
        x = layer.adapter.layer_input(layer.module, args, kwargs)
        output.register_hook(partial(self._accumulate, layer, x, plan))

    @torch.compiler.disable
    def _accumulate(
        self, layer: Layer, x: Tensor, plan: CollectionPlan, grad_output: Tensor
    ) -> None:
        r"""Add one micro-batch's \(H_K\), \(H_C\) to the layer's pending statistics.

        Args:
            layer: The layer.
            x: Its input in the forward pass (batch first).
            plan: What to collect.
            grad_output: The gradient w.r.t. its output.
        """
        with torch.no_grad():
            a, g = _rows(layer, x, grad_output, plan, plan.kfac_approx)
            H_K, H_C = plan.project(a, g)
            batch = x.shape[0]
            pending = self.pending.get(layer)
            if pending is None:
                examples = ExampleGradients() if plan.per_example else None
                pending = PendingStatistics(H_K, H_C, batch, plan.grad_scale, examples)
                self.pending[layer] = pending
            else:
                total = pending.num_examples + batch
                pending.H_K.mul_(pending.num_examples / total).add_(
                    H_K, alpha=batch / total
                )
                pending.H_C.add_(H_C)
                pending.num_examples = total
            if pending.examples is not None:
                # per-example gradients sum over the positions, which "reduce" rows
                # do not carry: they are kept as "expand" rows
                if plan.kfac_approx != "expand":
                    a, g = _rows(layer, x, grad_output, plan, "expand")
                pending.examples.add(a, g, batch)

    # ------------------------------------------------------------ hand-out
    def hand_over(
        self,
        factors: dict[Parameter, tuple[Tensor, Tensor]],
        layers: Sequence[Layer],
    ) -> None:
        """Make dense factors the statistics of the layers' next factor update.

        Args:
            factors: `(U_K, U_C)` by layer weight (replaces an earlier hand-over).
            layers: The layers that must be covered, exactly.

        Raises:
            ValueError: If `factors` covers other layers, or their dimensions do
                not match; nothing is handed over then.
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
        self._handed_over = curvature

    def take(
        self, layer: Layer, loss_average: statistics.LossAverage, grad_scale: float
    ) -> FactorStatistics | None:
        r"""Remove and return the statistics for a layer's factor update.

        Handed-over factors take precedence over collected statistics; without
        either, the layer is named in a one-time warning.

        Args:
            layer: The layer.
            loss_average: Its group's `loss_average` (for \(\nu\)).
            grad_scale: Scale of the output gradients in this step's statistics.

        Returns:
            The statistics, \(H_C\) scaled to the convention of \(U_C\); or None.
        """
        handed_over = self._handed_over.pop(layer, None)
        pending = self.pending.pop(layer, None)
        if handed_over is not None:
            return FactorStatistics(handed_over=handed_over)
        if pending is None:
            if layer.name not in self._warned:
                self._warned.add(layer.name)
                warn(
                    f"Layer {layer.name!r} received no statistics (its forward hook "
                    "did not run, e.g. because it is called functionally); its "
                    "parameters are updated with the current factors until "
                    "statistics arrive."
                )
            return None
        unscale = (pending.grad_scale / grad_scale) ** 2
        nu = statistics.gradient_scale(loss_average, pending.num_examples)
        pending.H_C.mul_(nu * unscale)
        if pending.examples is not None:
            pending.examples.scale = nu * unscale
        return FactorStatistics(
            collected=(pending.H_K, pending.H_C), examples=pending.examples
        )

    def discard(self, layer: Layer) -> None:
        """Drop a layer's pending statistics (its factors are not due).

        Args:
            layer: The layer.
        """
        self.pending.pop(layer, None)

    def clear(self) -> None:
        """Drop all pending and handed-over statistics."""
        self.pending.clear()
        self._handed_over.clear()

    @property
    def handed_over(self) -> bool:
        """Whether factors from `set_curvature` await the next update."""
        return bool(self._handed_over)

    def all_finite(self, gradients: Iterable[Tensor]) -> bool:
        """Check gradients and pending statistics for infinities and NaNs.

        One host synchronisation decides.

        Args:
            gradients: The gradients to check besides the statistics.

        Returns:
            Whether every value is finite.
        """
        tensors = list(gradients)
        for pending in self.pending.values():
            tensors += pending.H_K.tensors() + pending.H_C.tensors()
        return bool(all_finite(tensors))

    # ------------------------------------------------------------- copies
    def copy_to(
        self, layers: dict[Layer, Layer], plan: Callable[[Layer], Any], memo: dict
    ) -> StatisticsCollector:
        """Return a collector with this one's statistics on copied layers.

        The copies' modules hold inert copies of this collector's hooks (see
        `_LayerHook.__deepcopy__`): they are replaced by live ones.

        Args:
            layers: Map from each of this collector's layers to its copy.
            plan: The copy's collection plan (a bound method).
            memo: `copy.deepcopy`'s memo (the statistics are deep-copied with it).

        Returns:
            The new collector, attached to the copied layers.
        """
        twin = StatisticsCollector(plan)
        twin.pending = {
            layers[k]: copy.deepcopy(v, memo) for k, v in self.pending.items()
        }
        twin._handed_over = {
            layers[k]: copy.deepcopy(v, memo) for k, v in self._handed_over.items()
        }
        twin._warned = set(self._warned)
        for layer, handle in self._handles.items():
            _remove_hook(layers[layer].module, handle.id)
            twin.attach(layers[layer])
        return twin


def _rows(
    layer: Layer, x: Tensor, grad_output: Tensor, plan: CollectionPlan, approx: str
) -> tuple[Tensor, Tensor]:
    r"""Return a micro-batch's rows \(a\), \(\tilde g\) in the factors' dtypes.

    Args:
        layer: The layer.
        x: Its input (batch first).
        grad_output: The gradient w.r.t. its output.
        plan: What is collected (dtypes, loss average, expected gradient scale).
        approx: `"expand"` or `"reduce"`.

    Returns:
        The input rows (a fresh buffer) and the output-gradient rows, divided by
        the expected gradient scale (possibly a view of `grad_output`).
    """
    adapter, module = layer.adapter, layer.module
    dtype_K, dtype_C = plan.dtypes
    a = adapter.input_rows(module, x.to(dtype_K), approx)
    g = adapter.gradient_rows(module, grad_output, approx, plan.loss_average)
    g = g.to(dtype_C)
    return a, (g / plan.grad_scale if plan.grad_scale != 1.0 else g)


class _LayerHook:
    """A layer's forward hook; holds its collector weakly.

    A copy of the model (`copy.deepcopy`, pickling) gets an inert hook: the
    original collector must not see the copy's passes.
    """

    __slots__ = ("_collector", "_layer")

    def __init__(self, collector: StatisticsCollector, layer: Layer) -> None:
        self._collector = weakref.ref(collector)
        self._layer = layer

    # The hooks run eagerly under `torch.compile`: they branch on the optimizer's
    # step counter and mutate its state, which Dynamo would otherwise trace into
    # one specialised graph per layer and phase until it hits its recompile limit.
    @torch.compiler.disable
    def __call__(
        self, module: Module, args: tuple, kwargs: dict[str, Any], output: Any
    ) -> None:
        collector = self._collector()
        if collector is not None:
            collector.on_forward(self._layer, args, kwargs, output)

    def __deepcopy__(self, memo: dict[int, Any]) -> _InertHook:
        return _InertHook()

    def __reduce__(self) -> tuple[type, tuple]:
        return _InertHook, ()


class _InertHook:
    """The hook a copied model carries in place of an optimizer's: does nothing."""

    def __call__(self, *args: Any) -> None:
        return None


def _remove_hook(module: Module, hook_id: int) -> None:
    """Remove the forward hook registered under `hook_id` (as its handle would).

    Args:
        module: The module.
        hook_id: The id of the hook's `RemovableHandle`.
    """
    for hooks in (
        module._forward_hooks,
        module._forward_hooks_with_kwargs,
        module._forward_hooks_always_called,
    ):
        hooks.pop(hook_id, None)
