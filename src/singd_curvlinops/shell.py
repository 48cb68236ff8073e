r"""The `torch.optim` shell that `SINGD` and `KFAC` share.

`KroneckerOptimizer` finds the model's layers through their adapters
(`singd_curvlinops.layers`), resolves them into `Layer` records when their
parameter groups are registered (all groups of the constructor together, so a
layer's weight and bias may sit in different groups), lets a
`StatisticsCollector` hook them, and steps them with a factor rule
(`singd_curvlinops.rules`): every `T` steps the rule updates the layer's factors
from the collected statistics, every step the preconditioned gradient
\(P_C \Gamma P_K\) goes through `parameter_update` (grafting, then momentum and
weight decay per parameter). A distribution strategy (`singd_curvlinops.distributed`)
decides which rank does which layer's work, through the per-layer operations of
`singd_curvlinops.stepping`. Every other trainable parameter of the groups goes
to its group's fallback rule (AdamW or SGD, `rules.fallback`). AMP (skipped
steps, gradient scales) and checkpoints (`singd_curvlinops.checkpoint`) are
handled here, for any rule and any layer type. All state is plain tensors in
`self.state`: per layer under its first parameter (the rule's factors, `"step"`,
`"grad_scale"`), per layer parameter its `"momentum_buffer"`, per fallback
parameter its rule's state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module, Parameter
from torch.nn.parallel import DataParallel, DistributedDataParallel
from torch.optim import Optimizer

from singd_curvlinops import (
    _curvlinops,
    checkpoint,
    checkpoint_validation,
    curvature,
    distributed,
    parameter_update,
    verdicts,
)
from singd_curvlinops._hyperparameters import check_positive
from singd_curvlinops.bounds import finite
from singd_curvlinops.collection_plan import CollectionPlan
from singd_curvlinops.collection_planning import plan_collection
from singd_curvlinops.collector import StatisticsCollector
from singd_curvlinops.copies import CopiesWithModel
from singd_curvlinops.describe import OptimizerSummary, summarize
from singd_curvlinops.grad_scaling import GradScaling, without_autocast
from singd_curvlinops.guard import StepGuard
from singd_curvlinops.guarded import GuardedSteps
from singd_curvlinops.layers import Layer, supported_layers
from singd_curvlinops.layers.layer_set import LayerSet, empty_note
from singd_curvlinops.lifecycle import Lifecycle
from singd_curvlinops.option_guard import OptionGuard
from singd_curvlinops.preconditioner_cache import PreconditionerCache
from singd_curvlinops.registration import Registration
from singd_curvlinops.rules import FactorRule, Preconditioner
from singd_curvlinops.stepping import LayerStepper, due_in_step, is_due


class KroneckerOptimizer(
    Registration, CopiesWithModel, Lifecycle, GuardedSteps, GradScaling, Optimizer
):
    """Kronecker-factored preconditioning of a model's layers (the shared shell).

    Use its front doors `SINGD` and `KFAC`; the shell never knows which rule or
    layer types it drives.

    Args:
        model: The network whose supported layers are preconditioned.
        params: Parameters or parameter groups (None: every trainable parameter,
            or only those of supported layers if the default `fallback` is None).
        defaults: Default options of the parameter groups.
        rule: The factor rule.
        warn_unsupported: Warn about parameters that no adapter owns.
        init_grad_scale: Expected gradient scale of the first step (AMP).
        distribute: How the ranks of a `torch.distributed` job share the factor
            work: `"replicate"`, `"shard"` or a strategy object
            (`singd_curvlinops.distributed`).

    Raises:
        TypeError: If `model` is not a module, or `distribute` neither a string
            nor a strategy.
        ValueError: If an option is out of range, `init_grad_scale` is not
            positive, `distribute` names no strategy, or the model (or
            `params`) has no supported layer.
    """

    def __init__(
        self,
        model: Module,
        params: Iterable[Parameter] | Iterable[dict[str, Any]] | None,
        defaults: dict[str, Any],
        *,
        rule: FactorRule,
        warn_unsupported: bool,
        init_grad_scale: float,
        distribute: str | distributed.DistributionStrategy = "replicate",
    ) -> None:
        if not isinstance(model, Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model)}.")
        check_positive("init_grad_scale", init_grad_scale)
        rule.check_group(dict(defaults))
        distributed.check_data_parallel(model)
        if isinstance(model, (DataParallel, DistributedDataParallel)):
            model = model.module  # hooks go on the wrapped layers
        self._rule = rule
        self._layers = LayerSet(model)
        if not self._layers.candidates:
            raise ValueError(
                f"model has no supported layer: {type(self).__name__} preconditions "
                f"{supported_layers()} layers{empty_note(self._layers.empty, None)}."
            )
        self._distribution = distributed.resolve(distribute, tuple(defaults))
        strategy = self._distribution
        if rule.per_example and isinstance(strategy, distributed.Shard):
            if strategy.share != "directions":
                raise ValueError(
                    f"distribute={distribute!r}: {type(self).__name__}'s updates "
                    "read every rank's per-example gradients, so every rank runs "
                    "them or contributes to them, and no factors are shared: use "
                    "distribute='shard', Shard(factors='owned') or 'replicate'."
                )
        self._collector = StatisticsCollector(
            self._collection_plan, type(self).__name__
        )
        self._records = PreconditionerCache(self)
        self._fallback: set[Parameter] = set()
        self._options = OptionGuard(rule, self._fallback)  # options edited later
        self._init_grad_scale = float(init_grad_scale)
        if params is None:
            params = self._default_params(warn_unsupported, defaults["fallback"])
        self._registered = 0  # groups resolved into layers so far
        self._constructing = True
        super().__init__(params, defaults)
        self._constructing = False
        self._register()  # the constructor's groups together
        if not len(self._layers):
            raise ValueError(
                "The given parameters do not belong to a supported layer "
                f"({supported_layers()}) of the model: there is nothing to "
                f"precondition{empty_note(self._layers.empty, None)}."
            )

    # ------------------------------------------------------------ read-only
    @property
    def layers(self) -> tuple[Layer, ...]:
        """The preconditioned layers, in the order of their parameter groups."""
        return tuple(self._layers)

    @property
    def fallback_params(self) -> tuple[Parameter, ...]:
        """The parameters that the fallback rules train, in group order."""
        return tuple(p for _, p in self._fallback_params(self.param_groups))

    def describe(self) -> OptimizerSummary:
        """Return which parameters go to which rule and structure, with state bytes.

        Returns:
            A summary; `print(optimizer.describe())` shows it as a table.
        """
        return summarize(
            type(self).__name__,
            self.layers,
            self._fallback_params(self.param_groups),
            self.state,
            label=lambda layer: self._rule.label(self.param_groups[layer.group_index]),
            name=self._layers.name,
        )

    def preconditioner(self, layer: Layer | Module) -> Preconditioner:
        """Return a layer's current preconditioner (cached until its factors change).

        Args:
            layer: One of `self.layers`, or the module of exactly one of them.

        Returns:
            The rule's record; do not modify its matrices.

        Raises:
            ValueError: If the record is not finite (`KFAC`: a damped factor is
                singular, which `damping=0` allows). A step skips such a layer's
                update instead (the step guard); this method is for reading.
        """
        found = self._layers.find(layer)
        record = self._records(found, (0, 1))
        if not bool(finite(record.tensors(), found.weight.device)):
            raise ValueError(
                f"Layer {found.name!r}: its preconditioner is not finite (a damped "
                "factor is singular, or its inverse overflowed; possible with "
                "damping=0): raise the group's damping."
            )
        return record

    @property
    def distribution(self) -> distributed.DistributionStrategy:
        """The distribution strategy (`distribute=`); read-only."""
        return self._distribution

    @property
    def rule(self) -> FactorRule:
        """The factor rule; read-only."""
        return self._rule

    @property
    def curvature_pending(self) -> bool:
        """Whether factors from `set_curvature` await the next factor update."""
        return self._collector.handed_over

    def _collection_plan(self, layer: Layer) -> CollectionPlan | None:
        """Tell the collector what to collect for a layer's forward call.

        Args:
            layer: The layer.

        Returns:
            None unless the layer's factors are due at its next step; else
            `collection_planning.plan_collection`'s plan (its errors pass).
        """
        self._options.check(self.param_groups, (layer.group_index,))
        group = self.param_groups[layer.group_index]
        state = self.state[layer.weight]
        if not is_due(state, group):  # (its gradient arrives after this pass)
            return None
        return plan_collection(
            layer,
            group,
            state,
            rule=self._rule,
            distribution=self._distribution,
            records=self._records,
        )

    # --------------------------------------------------------------- curvature
    def set_curvature(self, kfac: Any) -> None:
        r"""Take the next factor update's statistics from a curvlinops KFAC operator.

        Instead of the empirical Fisher of the training pass, the next update of each
        layer uses the operator's Kronecker factors \(A\), \(G\) (SINGD projects
        them, \(H_K = \Pi(K^\top A K)\), \(H_C = \Pi(C^\top G C)\)): any
        `fisher_type` (empirical, Monte-Carlo, type-2, forward-only) and any data.
        The operator's factors are computed now if they were not yet.

        Args:
            kfac: A `curvlinops.KFACLinearOperator` over this optimizer's layers,
                built with `separate_weight_and_bias=False`.

        A `ValueError` names the layers if the operator covers others than the
        optimizer's, or dimensions that do not match.
        """
        factors = _curvlinops.kfac_factors(kfac)
        layers = self._layers.active(self.param_groups)
        self._collector.hand_over(curvature.by_layer(factors, layers))

    # -------------------------------------------------------------------- step
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        """Update factors (every `T` steps) and parameters.

        An option set to an invalid value since the last step, or an invalid
        value of a callable `lr_cov`, raises a `ValueError` (`TypeError` for a
        wrong type) that names it, before anything changes.

        Without gradients (no backward pass) nothing changes and a warning says
        so; after `remove_hooks()`, or once a later optimizer on the same layers
        has taken the hooks over, a `RuntimeError` says so.

        Args:
            closure: Optional function that recomputes the loss (forward and
                backward); evaluated with gradients enabled before the update.

        Returns:
            The closure's loss, or None.

        """
        self._collector.hooks.check()
        self._options.check(self.param_groups)
        loss = None
        if closure is not None:
            self._closure_without_scaler = getattr(self, "grad_scale", None) is None
            try:
                with torch.enable_grad():
                    loss = closure()
            finally:
                self._closure_without_scaler = False
        device = self.param_groups[0]["params"][0].device
        with torch.no_grad(), without_autocast(device):  # (a user's autocast region)
            self._update()
        return loss

    def _update(self) -> None:
        """Update factors and parameters from the gradients (the body of `step`)."""
        if not self._has_gradients():  # nothing changes (see `lifecycle`)
            self._step_without_gradients()
            return
        self._check_dormant()
        layers = self._layers.active(self.param_groups)
        step_options = self._options.step_options(layers, self.state, self.param_groups)
        fallback = list(self._fallback_params(self.param_groups))
        grad_scale = getattr(self, "grad_scale", None)  # set by torch.amp.GradScaler
        current_scale = self._current_scale(grad_scale)
        keys = [k for layer in layers for k in (layer, layer.twin) if k is not None]
        self._distribution.exchange(
            self._collector.pending,
            keys,
            [key for key in keys if self._due(key)],
            groups=self.param_groups,
            state=self.state,
            rule=self._rule,
        )
        handed_over = self._collector.handed_over_copy()
        guard = StepGuard(
            type(self).__name__,
            self.state,
            layers,
            [self._due(layer) for layer in layers],
            [(self._layers.name(p), p) for _, p in fallback],
            self._inputs_finite(layers, [p for _, p in fallback]),
            agree=self._distribution.agree,
            hint=self._rule.discard_hint,
            skip_hint=self._rule.skip_hint,
            factor_names=self._rule.side_names,
        )
        stepper = LayerStepper(
            rule=self._rule,
            collector=self._collector,
            state=self.state,
            groups=self.param_groups,
            records=self._records,
            forget=self._records.forget,
            grad_scale=grad_scale,
            current_scale=current_scale,
            step_options=step_options,
            guard=guard,
        )
        self._distribution.step(stepper, layers)
        parameter_update.step_fallback(
            [(p, group) for group, p in fallback],
            self.state,
            grad_scale,
            guard.fallback_update,
        )
        guard.commit_deferred()
        if not guard.settle():  # skipped as a whole: nothing changed
            self._collector.pending.clear()
            self._collector.restore_handed_over(handed_over)

    def _fallback_params(
        self, groups: list[dict[str, Any]]
    ) -> list[tuple[dict[str, Any], Parameter]]:
        """Return the fallback parameters of the current groups, with their group.

        Args:
            groups: The optimizer's parameter groups.

        Returns:
            `(group, parameter)` pairs in group order.
        """
        return [(g, p) for g in groups for p in g["params"] if p in self._fallback]

    def _due(self, layer: Layer) -> bool:
        """Return whether a layer's factors update at its next step.

        Args:
            layer: The layer.

        Returns:
            Whether it has a gradient (`stepping.has_gradient`) and its step
            counter is a multiple of its group's `T`.
        """
        group = self.param_groups[layer.group_index]
        return due_in_step(layer, self.state[layer.weight], group)

    # ------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Return the state as plain tensors and containers (`weights_only` loads it).

        A callable `lr_cov` is replaced by a marker; `load_state_dict` restores the
        callable of the optimizer it loads into.

        Under `distribute="shard"` every rank must call it: it gathers what only
        the owners keep (momenta, or all factors), so that it is complete.

        Returns:
            The state dictionary.
        """
        layers = self._layers.active(self.param_groups)
        with self._distribution.full_state(
            self.state, layers, self.param_groups, self._rule
        ):
            return checkpoint.to_plain(super().state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state, validated as a whole first (`checkpoint_validation`).

        Factors come back in the dtypes their layers compute them in; an empty
        `"state"` loads as the initial state. A missing or unknown key or an
        invalid value raises a `ValueError` (`TypeError` for a wrong type) that
        gives its path, and the optimizer is unchanged.

        Args:
            state_dict: From `state_dict()`, possibly of another process or device.
        """
        plan = checkpoint_validation.validate(
            state_dict,
            groups=self.param_groups,
            layers=self._layers,
            fallback=self._fallback,
            rule=self._rule,
        )
        kept = {p: self.state[p] for p in plan.kept if p in self.state}
        super().load_state_dict(plan.state_dict)
        checkpoint.restore_factors(self.state, plan.factors)
        self.state.update(kept)
        if plan.fresh:
            self._init_all_states()
        self._options.forget()
        params = [p for group in self.param_groups for p in group["params"]]
        weights = [layer.weight for layer in self._layers]
        verdicts.init_counters(self.state, params, weights)
        self._collector.clear()
        self._records.clear()
        self._distribution.loaded(self.state, self._rule)
