r"""The `torch.optim` shell that `SINGD` and `KFAC` share.

`KroneckerOptimizer` finds the model's layers through their adapters
(`singd_curvlinops.layers`), resolves each into a `Layer` record when its
parameter group is registered, lets a `StatisticsCollector` hook them, and steps
them with a factor rule (`singd_curvlinops.rules`): every `T` steps the rule
updates the layer's factors from the collected statistics, every step the
preconditioned gradient \(P_C \Gamma P_K\) goes through `update.parameter_step`
(momentum, weight decay). AMP (skipped steps, gradient scales), data parallelism
(`singd_curvlinops.distributed`) and checkpoints (`singd_curvlinops.checkpoint`)
are handled here, for any rule and any layer type. All state is plain tensors in
`self.state`: per layer under its weight (the rule's factors, `"step"`,
`"grad_scale"`), per parameter its `"momentum_buffer"`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module, Parameter
from torch.nn.parallel import DataParallel, DistributedDataParallel
from torch.optim import Optimizer

from singd_curvlinops import _curvlinops, checkpoint, distributed
from singd_curvlinops._warnings import warn
from singd_curvlinops.collector import CollectionPlan, StatisticsCollector
from singd_curvlinops.layers import Layer, supported_layers
from singd_curvlinops.layers.layer_set import LayerSet, default_params
from singd_curvlinops.rules import FactorRule, Preconditioner
from singd_curvlinops.update import parameter_step


class KroneckerOptimizer(Optimizer):
    """Kronecker-factored preconditioning of a model's layers (the shared shell).

    Use its front doors `SINGD` and `KFAC`; the shell never knows which rule or
    layer types it drives.

    Args:
        model: The network whose supported layers are preconditioned.
        params: Parameters or parameter groups (None: all supported layers).
        defaults: Default options of the parameter groups.
        rule: The factor rule.
        warn_unsupported: Warn about parameters that no adapter owns.
        init_grad_scale: Expected gradient scale of the first step (AMP).

    Raises:
        TypeError: If `model` is not a module.
        ValueError: If an option is out of range, `init_grad_scale` is not
            positive, or the model has no supported layer.
    """

    _step_supports_amp_scaling = True  # `step` unscales gradients and statistics

    def __init__(
        self,
        model: Module,
        params: Iterable[Parameter] | Iterable[dict[str, Any]] | None,
        defaults: dict[str, Any],
        *,
        rule: FactorRule,
        warn_unsupported: bool,
        init_grad_scale: float,
    ) -> None:
        if not isinstance(model, Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model)}.")
        if isinstance(init_grad_scale, bool) or not init_grad_scale > 0:
            raise ValueError(f"init_grad_scale must be > 0, got {init_grad_scale!r}.")
        rule.check_group(dict(defaults))
        if isinstance(model, DistributedDataParallel) and not distributed.initialized():
            raise ValueError(
                "model is wrapped in DistributedDataParallel, but no torch.distributed "
                "process group is initialised (call init_process_group first)."
            )
        if isinstance(model, (DataParallel, DistributedDataParallel)):
            model = model.module  # hooks go on the wrapped layers
        self._rule = rule
        self._layers = LayerSet(model)
        if not self._layers.candidates:
            raise ValueError(
                f"model has no supported layer: {type(self).__name__} preconditions "
                f"{supported_layers()} layers."
            )
        self._collector = StatisticsCollector(self._collection_plan)
        self._preconditioners: dict[Layer, Preconditioner] = {}
        self._exchange = distributed.StatisticsExchange()
        self._init_grad_scale = float(init_grad_scale)
        if params is None:
            params = self._default_params(warn_unsupported)
        super().__init__(params, defaults)

    # ------------------------------------------------------------ construction
    def _default_params(self, warn_unsupported: bool) -> list[Parameter]:
        """Return the parameters of the supported layers; warn about the others.

        Args:
            warn_unsupported: Whether to warn about left-out parameters.

        Returns:
            The weights and biases of the supported layers.
        """
        params, left_out = default_params(self._layers.model, self._layers.candidates)
        if left_out and warn_unsupported:
            warn(
                f"{type(self).__name__} leaves out the parameters of unsupported "
                f"layers (optimize them with another optimizer): {', '.join(left_out)}."
            )
        return params

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group; its layers get hooks and are trained from now on.

        Args:
            param_group: As for any `torch.optim.Optimizer`; the options may be
                given per group.

        Raises:
            ValueError: If a parameter does not belong to a supported layer of the
                model, a layer's weight and bias are in different groups, or an
                option is out of range.
            TypeError: If an option has the wrong type.
        """
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._rule.check_group(group)
            layers = self._layers.add_group(group["params"], len(self.param_groups) - 1)
        except (ValueError, TypeError):
            self.param_groups.pop()
            raise
        for layer in layers:
            self._collector.attach(layer)
            self._init_state(layer, group)  # eager: state_dict() is complete

    def _init_state(self, layer: Layer, group: dict[str, Any]) -> None:
        """Create a layer's state: the rule's factors, counters, momentum buffers.

        Args:
            layer: The layer.
            group: Its parameter group.
        """
        state = self.state[layer.weight]
        dtypes = layer.factor_dtypes(group)
        state.update(
            self._rule.init_state(group, layer.dims, dtypes, layer.weight.device)
        )
        state["step"] = 0
        # scale of the output gradients expected in the next backward pass
        state["grad_scale"] = self._init_grad_scale
        for param in layer.params:  # every parameter has state (as DCP expects);
            # a zero buffer makes the first momentum step the step itself
            self.state[param]["momentum_buffer"] = torch.zeros_like(param)

    # ------------------------------------------------------------ read-only
    @property
    def layers(self) -> tuple[Layer, ...]:
        """The preconditioned layers, in the order of their parameter groups."""
        return tuple(self._layers)

    def preconditioner(self, layer: Layer | Module) -> Preconditioner:
        """Return a layer's current preconditioner (cached until its factors change).

        Args:
            layer: One of `self.layers`, or the module of exactly one of them.

        Returns:
            The rule's record; do not modify its matrices.
        """
        layer = self._layers.find(layer)
        cached = self._preconditioners.get(layer)
        if cached is None:
            group = self.param_groups[layer.group_index]
            cached = self._rule.preconditioner(self.state[layer.weight], group)
            self._preconditioners[layer] = cached
        return cached

    @property
    def curvature_pending(self) -> bool:
        """Whether factors from `set_curvature` await the next factor update."""
        return self._collector.handed_over

    def _collection_plan(self, layer: Layer) -> CollectionPlan | None:
        """Tell the collector what to collect for a layer's forward call.

        Args:
            layer: The layer.

        Returns:
            None unless the layer's factors are due at its next step.
        """
        if not self._due(layer):
            return None
        group = self.param_groups[layer.group_index]
        return CollectionPlan(
            kfac_approx=group["kfac_approx"],
            loss_average=group["loss_average"],
            dtypes=layer.factor_dtypes(group),
            grad_scale=self.state[layer.weight]["grad_scale"],
            project=partial(self._rule.project, self.preconditioner(layer)),
            per_example=self._rule.per_example,
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
        self._collector.hand_over(factors, self._layers.active(self.param_groups))

    # -------------------------------------------------------------------- step
    def set_current_grad_scale(self, grad_scale: float) -> None:
        """Tell the optimizer the gradient scale of the current backward pass.

        Needed only with a `GradScaler` whose `unscale_` is called before `step`
        (e.g. for gradient clipping): the gradients are then unscaled, but the
        statistics collected during the backward pass still carry the scale.

        Args:
            grad_scale: `scaler.get_scale()` of the current step.
        """
        self._current_grad_scale = float(grad_scale)

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        """Update factors (every `T` steps) and parameters.

        Args:
            closure: Optional function that recomputes the loss (forward and
                backward); evaluated with gradients enabled before the update.

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        layers = self._layers.active(self.param_groups)
        grad_scale = getattr(self, "grad_scale", None)  # set by torch.amp.GradScaler
        current_scale = (
            float(grad_scale)
            if grad_scale is not None
            else self.__dict__.pop("_current_grad_scale", None)
        )
        if distributed.world_size() > 1:
            due = [layer for layer in layers if self._due(layer)]
            self._exchange(
                self._collector.pending,
                layers,
                due,
                groups=self.param_groups,
                state=self.state,
                rule=self._rule,
            )
        if not self._all_finite(layers):
            self._skip_step(layers, current_scale)
            return loss
        for layer in layers:
            state = self.state[layer.weight]
            statistics_scale = current_scale or state["grad_scale"]
            self._step_layer(layer, grad_scale, statistics_scale)
            state["grad_scale"] = statistics_scale
        return loss

    def _all_finite(self, layers: list[Layer]) -> bool:
        """Check gradients and pending statistics for infinities and NaNs.

        Args:
            layers: The layers of this step.

        Returns:
            Whether every gradient (unless a `GradScaler` checked them) and every
            statistic is finite.
        """
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and bool(found_inf):
            return False
        gradients = []
        if found_inf is None:  # a GradScaler has checked the gradients already
            gradients = [
                p.grad for layer in layers for p in layer.params if p.grad is not None
            ]
        return self._collector.all_finite(gradients)

    def _skip_step(self, layers: list[Layer], current_scale: float | None) -> None:
        """Skip the step: warn, drop statistics, touch no parameter or factor.

        Args:
            layers: The layers of this step.
            current_scale: The gradient scale of this pass, if known.
        """
        self._collector.pending.clear()
        warn(
            f"{type(self).__name__} skipped a step: non-finite gradients or "
            "statistics. Parameters, factors and momenta are unchanged."
        )
        if current_scale is not None:  # the next pass runs at (about) this scale
            for layer in layers:
                self.state[layer.weight]["grad_scale"] = current_scale

    def _step_layer(
        self, layer: Layer, grad_scale: Tensor | None, statistics_scale: float
    ) -> None:
        """Update one layer's factors (if due) and parameters.

        Args:
            layer: The layer.
            grad_scale: Scale of the gradients (None: unscaled).
            statistics_scale: Scale of the output gradients in the statistics.
        """
        group = self.param_groups[layer.group_index]
        state = self.state[layer.weight]
        if self._due(layer):
            taken = self._collector.take(layer, group["loss_average"], statistics_scale)
            if taken is not None:
                self._rule.update(state, group, taken, self.preconditioner(layer))
                self._preconditioners.pop(layer, None)
        else:
            self._collector.discard(layer)
        state["step"] += 1
        grad = layer.adapter.gradient_matrix(layer.params)
        if grad is None:
            return
        if grad_scale is not None:
            grad.div_(grad_scale.to(grad.dtype))
        direction = self.preconditioner(layer).apply(grad, overwrite=True)
        parameter_step(
            layer.params,
            layer.adapter.from_matrix(direction, layer.params),
            [self.state[p]["momentum_buffer"] for p in layer.params],
            lr=group["lr"],
            momentum=group["momentum"],
            weight_decay=group["weight_decay"],
        )

    def _due(self, layer: Layer) -> bool:
        """Return whether a layer's factors update at its next step.

        Args:
            layer: The layer.

        Returns:
            Whether its step counter is a multiple of its group's `T`.
        """
        T = self.param_groups[layer.group_index]["T"]
        return self.state[layer.weight]["step"] % T == 0

    # ------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Return the state as plain tensors and containers (`weights_only` loads it).

        A callable `lr_cov` is replaced by a marker; `load_state_dict` restores the
        callable of the optimizer it loads into.

        Returns:
            The state dictionary.
        """
        return checkpoint.to_plain(super().state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state, keeping factors in their own dtype and validating it.

        Args:
            state_dict: From `state_dict()`, possibly of another process or device.
        """
        state_dict = checkpoint.from_plain(state_dict, self.param_groups)
        factors = checkpoint.validated_factors(
            state_dict,
            self.param_groups,
            {layer.weight: layer for layer in self._layers},
            self._rule,
        )
        super().load_state_dict(state_dict)
        checkpoint.restore_factors(self.state, factors)
        self._collector.clear()
        self._preconditioners.clear()

    # ------------------------------------------------------------------ copies
    def __deepcopy__(self, memo: dict[int, Any]) -> KroneckerOptimizer:
        """Copy the optimizer together with its model: `deepcopy((model, opt))`.

        Args:
            memo: `copy.deepcopy`'s memo, which must hold the model's copy.

        Returns:
            An optimizer of the copied model's layers, with a copy of the state.

        Raises:
            TypeError: If the model was not copied first (the copy's hooks would
                sit on the original model).
        """
        if id(self._layers.model) not in memo:
            raise TypeError(self._copy_message())
        twin = object.__new__(type(self))
        memo[id(self)] = twin
        skip = ("_collector", "_preconditioners")
        for key, value in self.__dict__.items():
            if key not in skip:
                twin.__dict__[key] = copy.deepcopy(value, memo)
        twin._preconditioners = {}
        layers = {layer: copy.deepcopy(layer, memo) for layer in self._layers}
        twin._collector = self._collector.copy_to(layers, twin._collection_plan, memo)
        return twin

    def __reduce_ex__(self, protocol: int) -> Any:
        """Refuse pickling and shallow copies: save `state_dict()` instead.

        Args:
            protocol: The pickle protocol.

        Raises:
            TypeError: Always.
        """
        raise TypeError(self._copy_message())

    def _copy_message(self) -> str:
        """Return the message for refused copies.

        Returns:
            What to do instead.
        """
        return (
            f"A {type(self).__name__} optimizer cannot be pickled or copied on its "
            "own: its hooks sit on the model. Save and load optimizer.state_dict() "
            "(with the model's), or copy both at once: "
            "copy.deepcopy((model, optimizer))."
        )
