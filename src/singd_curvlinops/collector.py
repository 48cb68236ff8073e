r"""The statistics collector: hooks, accumulation, hand-over, finiteness.

On a step that updates a layer's factors, a forward hook on each module that
applies it asks the module's adapter for the *uses* of the call (input and output
of each application of a slot; `LayerAdapter.forward_uses`) and installs a tensor
hook on each use's output (`hooks.hook_gradient`: it also runs if the output is
changed in place later; no module backward hooks: they break in-place
activations). In the first backward pass that computes the layer's parameter
gradients (`hooks.UsePasses`: not a gradient penalty's `autograd.grad` w.r.t. the
inputs) that hook turns input and output gradient into the rows \(a\), \(\tilde g\)
(the adapter, curvlinops' conventions), brings them into the layer's layout (bias
column, output rows of a partial use) and hands them to the optimizer's rule,
which forms one use's statistics \((H_K, H_C)\). Uses accumulate in a
`PendingStatistics` record (`singd_curvlinops.pending`: uses of one backward pass
concatenate, passes average), scaled at hand-out by \(\nu(N)\) and the
gradient-scale correction, both orientations of a tied weight combined
(`pending.hand_out`). For a rule
that needs per-example gradients (`FactorRule.per_example`, EKFAC), the uses'
`"expand"` rows are also kept, in an `ExampleGradients` record that the rule's
update turns into sums of squares (scaled like \(H_C\)).

What to collect is asked of the optimizer per forward call
(`collection_plan.CollectionPlan`); the collector knows neither rules nor layer
types. The hooks hold the collector weakly, and their `attachment.HookSet` removes
them when it is dropped, when the optimizer removes them (`remove_hooks`) or when
a later optimizer takes its layers over. A copied model gets inert hooks (see
`hooks.ModuleHook`). A use without entries (an empty batch) contributes nothing.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module

from singd_curvlinops import statistics
from singd_curvlinops._warnings import warn
from singd_curvlinops.attachment import HookSet
from singd_curvlinops.collection_plan import CollectionPlan
from singd_curvlinops.grad_scaling import without_autocast
from singd_curvlinops.hooks import (
    ModuleHook,
    PreHook,
    UsePasses,
    gradient_nodes,
    hook_gradient,
    own_parameters,
    remove_hook,
)
from singd_curvlinops.layers import Layer, Site, Use
from singd_curvlinops.layers.capture import CallCapture
from singd_curvlinops.layers.rows import use_rows
from singd_curvlinops.pending import (
    Pair,
    PendingStatistics,
    backward_pass_id,
    hand_out,
)
from singd_curvlinops.per_example import ExampleGradients
from singd_curvlinops.rules import FactorStatistics


@dataclass(frozen=True, eq=False)
class _Entry:
    """A site of a layer on a hooked module, and where its statistics go.

    Attributes:
        layer: The layer.
        site: The site.
        key: The layer, or its twin for a transposed site.
    """

    layer: Layer
    site: Site
    key: Layer


class StatisticsCollector:
    """Collects the statistics of the layers it is attached to.

    Args:
        plan: A bound method (of the optimizer) that returns the `CollectionPlan`
            of a layer's forward call, or None if the layer collects nothing in
            this pass. It is held weakly: the optimizer is freed when it is
            dropped, and its collector stops collecting.
        owner: The optimizer's class name, for messages.
    """

    def __init__(
        self, plan: Callable[[Layer], CollectionPlan | None], owner: str = "SINGD"
    ) -> None:
        self._plan = weakref.WeakMethod(plan)
        self._pending: dict[Layer, PendingStatistics] = {}
        self._handed_over: dict[Layer, tuple[Tensor, Tensor]] = {}
        self._entries: dict[Module, list[_Entry]] = {}
        self.hooks = HookSet(owner)
        self._before: dict[Module, Any] = {}
        self._layers: list[Layer] = []
        self._warned: set[str] = set()

    @property
    def pending(self) -> dict[Layer, PendingStatistics]:
        """The pending statistics by layer (or twin), every open pass closed."""
        for record in self._pending.values():
            record.close()
        return self._pending

    # ------------------------------------------------------------------ hooks
    def attach(self, layer: Layer) -> None:
        """Hook the modules of a layer's sites (one pair of hooks per module).

        Another optimizer's hooks on these modules are removed
        (`attachment.HookSet.hook`).

        Args:
            layer: The layer.
        """
        self._layers.append(layer)
        for site in layer.sites:
            key = layer.twin if site.transposed else layer
            module = site.module
            if module not in self._entries:
                self._entries[module] = []
                # an adapter that enters something before the call must leave it
                # also when the call raises
                register = [
                    partial(
                        module.register_forward_hook,
                        ModuleHook(self),
                        with_kwargs=True,
                        always_call=site.adapter.needs_before_forward,
                    )
                ]
                if site.adapter.needs_before_forward:
                    register.append(
                        partial(
                            module.register_forward_pre_hook,
                            PreHook(self),
                            with_kwargs=True,
                        )
                    )
                self.hooks.hook(module, layer.name, *register)
            self._entries[module].append(_Entry(layer, site, key))

    def remove_hooks(self, reason: str) -> None:
        """Remove every hook of this collector from the model; drop its statistics.

        Args:
            reason: Why, for the message of a later `step`.
        """
        self.hooks.remove(reason)
        self.clear()

    def _active(self, module: Module) -> list[tuple[_Entry, CollectionPlan]]:
        """Return the entries of a module's call that collect, with their plans.

        Calls with parameters other than the layers' own (`torch.func`'s
        `functional_call`, as in curvlinops' vectorised products) collect
        nothing; FSDP2's unsharded copies count as the layers' own
        (`hooks.unsharded`).

        Args:
            module: The called module.

        Returns:
            The collecting entries (none outside autograd or off update steps).
        """
        entries = self._entries.get(module)
        owner_plan = self._plan()
        if not entries or owner_plan is None or not torch.is_grad_enabled():
            return []
        plans: dict[Layer, CollectionPlan | None] = {}
        for entry in entries:
            if entry.layer not in plans:
                plans[entry.layer] = owner_plan(entry.layer)
        active = [(e, plans[e.layer]) for e in entries if plans[e.layer] is not None]
        if active and not own_parameters(module, entries):
            return []
        return active

    def before_forward(self, module: Module, args: tuple, kwargs: dict) -> None:
        """Keep what the adapter needs from before a collecting call.

        Args:
            module: The module.
            args: Positional inputs of its forward call.
            kwargs: Keyword inputs.
        """
        if self._active(module):
            adapter = self._entries[module][0].site.adapter
            self._before[module] = adapter.before_forward(module, args, kwargs)

    def on_forward(
        self, module: Module, args: tuple, kwargs: dict[str, Any], output: Any
    ) -> Any:
        """If the module's layers collect in this pass, hook the uses' outputs.

        Args:
            module: The module.
            args: Positional inputs of its forward call.
            kwargs: Keyword inputs.
            output: Its output.

        Returns:
            A replacement output from the adapter, or None.
        """
        before = self._before.pop(module, None)
        if isinstance(before, CallCapture):
            before.leave()
        active = self._active(module)
        if not active or output is None:  # None: the call raised (`always_call`)
            return None
        site = active[0][0].site
        uses, replacement = site.adapter.forward_uses(
            module, args, kwargs, output, before
        )
        uses = [  # (a use without a graph gets no gradient: nothing to collect)
            use.batch_first(site.batch_dim, site.sequence)
            for use in uses
            if use.output.requires_grad
        ]
        nodes = {entry.layer: gradient_nodes(entry.layer.params) for entry, _ in active}
        for use in uses:
            # the hook must not hold its own tensor: autograd keeps tensor hooks in
            # C++, where gc cannot see the cycle (activations would be kept)
            record = replace(use, output=None)
            for entry, plan in active:
                if entry.site.slot.name == use.slot:
                    passes = UsePasses(nodes[entry.layer])
                    hook = partial(self._accumulate, entry, record, plan, passes)
                    hook_gradient(use.output, hook)
        return replacement

    @torch.compiler.disable
    def _accumulate(
        self,
        entry: _Entry,
        use: Use,
        plan: CollectionPlan,
        passes: UsePasses,
        grad_output: Tensor,
    ) -> None:
        r"""Add one use's \(H_K\), \(H_C\) to its layer's pending statistics.

        Only in the first backward pass that computes its gradients (`UsePasses`).

        Args:
            entry: The layer's site on the module.
            use: The application.
            plan: What to collect.
            passes: Which backward pass the use's rows come from.
            grad_output: The gradient w.r.t. the use's output.
        """
        if self.hooks.removed is not None or not grad_output.numel():
            return  # hooks removed since the forward pass, or an empty batch
        decision = passes.decide()
        if decision == "repeat" and f"repeat {entry.layer.name}" not in self._warned:
            self._warned.add(f"repeat {entry.layer.name}")
            warn(UsePasses.repeated(self.hooks.owner, entry.layer.name))
        if decision != "collect":
            return
        with torch.no_grad(), without_autocast(grad_output.device):
            site = entry.site
            dtype_a, dtype_g = plan.dtypes[::-1] if site.transposed else plan.dtypes
            if use.batch_dim is None:
                grad_output = grad_output.unsqueeze(0)
            elif use.batch_dim:
                grad_output = grad_output.movedim(use.batch_dim, 0)
            rows = partial(
                use_rows,
                entry.layer,
                site,
                use,
                grad_output,
                loss_average=plan.loss_average,
                grad_scale=plan.grad_scale,
                dtypes=(dtype_a, dtype_g),
            )
            a, g = rows(plan.kfac_approx)
            project = plan.project_transposed if site.transposed else plan.project
            H_K, H_C = project(a, g)
            counts = {
                "rows": a.shape[0],
                "examples": grad_output.shape[0],
                "pass_id": backward_pass_id(),
            }
            pending = self._pending.get(entry.key)
            if pending is None:
                pending = PendingStatistics.open(
                    H_K, H_C, grad_scale=plan.grad_scale, **counts
                )
                if plan.per_example:
                    pending.examples = ExampleGradients()
                self._pending[entry.key] = pending
            else:
                pending.add(H_K, H_C, **counts)
            if pending.examples is not None:
                # per-example gradients sum over the positions, which "reduce" rows
                # do not carry: they are kept as "expand" rows
                if plan.kfac_approx != "expand":
                    a, g = rows("expand")
                if site.transposed:  # the twin's rows, in the layer's orientation
                    a, g = g, a
                pending.examples.add(a, g, counts["examples"], counts["pass_id"])

    # ------------------------------------------------------------ hand-out
    def hand_over(self, curvature: dict[Layer, tuple[Tensor, Tensor]]) -> None:
        """Make dense factors the statistics of the layers' next factor update.

        Args:
            curvature: `(U_K, U_C)` by layer, every layer covered
                (`curvature.by_layer`; replaces an earlier hand-over).
        """
        self._handed_over = curvature

    def take(
        self,
        layer: Layer,
        loss_average: statistics.LossAverage,
        grad_scale: float,
        project: Callable[[Pair], Pair] | None = None,
    ) -> FactorStatistics | None:
        r"""Remove and return the statistics for a layer's factor update.

        Handed-over factors take precedence over collected statistics; without
        either, the layer is named in a one-time warning.

        Args:
            layer: The layer.
            loss_average: Its group's `loss_average` (for \(\nu\)).
            grad_scale: Scale of the output gradients in this step's statistics.
            project: Applied to each orientation's raw statistics before they
                combine (`pending.hand_out`), or None.

        Returns:
            The statistics (`pending.hand_out`), or None.
        """
        handed_over = self._handed_over.pop(layer, None)
        records = [
            (record, key.swapped)
            for key in (layer, layer.twin)
            if key is not None and (record := self.pending.pop(key, None)) is not None
        ]
        if handed_over is not None:
            return FactorStatistics(handed_over=handed_over)
        if not records:
            if layer.name not in self._warned:
                self._warned.add(layer.name)
                warn(
                    f"{self.hooks.owner}: layer {layer.name!r} received no "
                    "statistics for its factor update (no backward pass with "
                    "examples reached it since the last one: it was called "
                    "functionally or under torch.no_grad(), or only with empty "
                    "batches); its factors are kept and its parameters updated with "
                    "them until statistics arrive."
                )
            return None
        return hand_out(records, loss_average, grad_scale, project)

    def discard(self, layer: Layer) -> None:
        """Drop a layer's pending statistics (its factors are not due).

        Args:
            layer: The layer.
        """
        self._pending.pop(layer, None)
        if layer.twin is not None:
            self._pending.pop(layer.twin, None)

    def clear(self) -> None:
        """Drop all pending and handed-over statistics."""
        self._pending.clear()
        self._handed_over.clear()

    def handed_over_copy(self) -> dict[Layer, tuple[Tensor, Tensor]]:
        """Return the statistics that `set_curvature` handed over, not yet used.

        Returns:
            A shallow copy, for `restore_handed_over` after a skipped step.
        """
        return dict(self._handed_over)

    def restore_handed_over(self, saved: dict[Layer, tuple[Tensor, Tensor]]) -> None:
        """Hand over again what a skipped step took (`handed_over_copy`).

        Args:
            saved: From `handed_over_copy` before the step.
        """
        self._handed_over = dict(saved)

    @property
    def handed_over(self) -> bool:
        """Whether factors from `set_curvature` await the next update."""
        return bool(self._handed_over)

    # ------------------------------------------------------------- copies
    def copy_to(
        self, layers: dict[Layer, Layer], plan: Callable[[Layer], Any], memo: dict
    ) -> StatisticsCollector:
        """Return a collector with this one's statistics on copied layers.

        The copies' modules hold inert copies of this collector's hooks (see
        `hooks.ModuleHook.__deepcopy__`): they are replaced by live ones.

        Args:
            layers: Map from each of this collector's layers to its copy.
            plan: The copy's collection plan (a bound method).
            memo: `copy.deepcopy`'s memo (the statistics are deep-copied with it).

        Returns:
            The new collector, attached to the copied layers.
        """
        keys = dict(layers)
        keys.update({k.twin: v.twin for k, v in layers.items() if k.twin is not None})
        twin = StatisticsCollector(plan, self.hooks.owner)
        twin._pending = {
            keys[k]: copy.deepcopy(v, memo) for k, v in self._pending.items()
        }
        twin._handed_over = {
            keys[k]: copy.deepcopy(v, memo) for k, v in self._handed_over.items()
        }
        twin._warned = set(self._warned)
        for module, handles in self.hooks.handles.items():
            for handle in handles if id(module) in memo else ():
                remove_hook(memo[id(module)], handle.id)
        if self.hooks.removed is not None:  # removed or taken over: so is the copy
            twin.hooks.remove(self.hooks.removed)
        for layer in self._layers if self.hooks.removed is None else ():
            twin.attach(layers[layer])
        return twin
