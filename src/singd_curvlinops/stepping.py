r"""The operations of one optimizer step on one layer, for a distribution strategy.

`KroneckerOptimizer.step` hands a `LayerStepper` to its distribution strategy
(`singd_curvlinops.distributed`), which decides where each operation runs:
`Replicate` calls `update_factors` for every layer, then `settle_factors`, then
`step_parameters` for every layer, on every rank; `Shard` lets each layer's owner
update the factors and precondition, and shares the results. The stepper knows
the rule, the collector, the state and the step's guard (`singd_curvlinops.guard`:
every factor and parameter update is a checked change), not the strategy.

Under FSDP2 a layer's parameters are shards (`DTensor`): `gradient` returns
this rank's rows of \(\Gamma\) (columns, for a weight stored transposed) and
`apply` updates them.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Parameter

from singd_curvlinops import parameter_update
from singd_curvlinops.collector import StatisticsCollector
from singd_curvlinops.distributed.collectives import named_collective
from singd_curvlinops.distributed.fsdp import (
    ShardPosition,
    block_parts,
    column_block,
    is_sharded,
    local,
    shard_position,
    split_bias,
    splits_columns,
)
from singd_curvlinops.distributed.layout import GRAFT, SHELL_KEYS, side_of
from singd_curvlinops.guard import StepGuard
from singd_curvlinops.layers import Layer
from singd_curvlinops.rules import FactorRule, FactorStatistics, Preconditioner
from singd_curvlinops.verdicts import choose, finite

Records = Callable[[Layer, tuple[int, ...]], Preconditioner]


def is_due(state: dict[str, Any], group: dict[str, Any]) -> bool:
    """Return whether a layer's factors update at its next step.

    Args:
        state: The layer's state.
        group: Its parameter group.

    Returns:
        Whether its step counter is a multiple of the group's `T`.
    """
    return state["step"] % group["T"] == 0


def has_gradient(layer: Layer) -> bool:
    """Return whether a layer takes part in this step (a parameter has a gradient).

    A layer without one (unused in the step's forward passes, say, in multi-task
    training) is left out of the step as `torch.optim` leaves out such a
    parameter: no factor update, no parameter step, and its step counter does
    not advance, so that its factors update every `T`-th step it takes part in.

    Args:
        layer: The layer.

    Returns:
        Whether any of its parameters has a gradient.
    """
    return any(p.grad is not None for p in layer.params)


def due_in_step(layer: Layer, state: dict[str, Any], group: Mapping[str, Any]) -> bool:
    """Return whether a layer's factors update in this step.

    Args:
        layer: The layer.
        state: Its state.
        group: Its parameter group.

    Returns:
        Whether it takes part in the step (`has_gradient`) and is due (`is_due`).
    """
    return has_gradient(layer) and is_due(state, group)


class LayerStepper:
    """The shell's per-layer operations within one step.

    Args:
        rule: The optimizer's factor rule.
        collector: Its statistics collector.
        state: Its state.
        groups: Its parameter groups.
        records: Its cached preconditioner of a layer for some sides.
        forget: Drops a layer's cached preconditioners of some sides.
        grad_scale: Scale of the gradients (a `GradScaler`'s), or None.
        current_scale: Gradient scale of this backward pass, if known.
        guard: The step's guard: every factor and parameter update is a checked
            change (`singd_curvlinops.guard`).
        step_options: Per layer, options that replace its group's in this step
            (`FactorRule.step_options`, evaluated and checked before the step).
    """

    def __init__(
        self,
        *,
        rule: FactorRule,
        collector: StatisticsCollector,
        state: dict[Parameter, dict[str, Any]],
        groups: list[dict[str, Any]],
        records: Records,
        forget: Callable[..., None],
        grad_scale: Tensor | None,
        current_scale: float | None,
        guard: StepGuard,
        step_options: Mapping[Layer, Mapping[str, Any]] | None = None,
    ) -> None:
        self.rule = rule
        self.guard = guard
        self.state = state
        self.groups = groups
        self.preconditioner = records
        self.forget = forget
        self._collector = collector
        self._grad_scale = grad_scale
        self._current_scale = current_scale
        self._step_options = step_options or {}

    def group(self, layer: Layer) -> dict[str, Any]:
        """Return the layer's parameter group.

        Args:
            layer: The layer.

        Returns:
            Its options (with this step's values of step-dependent options).
        """
        options = layer.options(self.groups[layer.group_index])
        values = self._step_options.get(layer)
        return options if values is None else ChainMap(dict(values), options)

    def due(self, layer: Layer) -> bool:
        """Return whether the layer's factors update in this step.

        Args:
            layer: The layer.

        Returns:
            Whether it has a gradient and its step counter is a multiple of its
            group's `T`.
        """
        return due_in_step(layer, self.state[layer.weight], self.group(layer))

    def _statistics_scale(self, layer: Layer) -> float:
        """Return the scale of the output gradients in this step's statistics.

        Args:
            layer: The layer.

        Returns:
            The current scale if known, else the one the layer expected.
        """
        return self._current_scale or self.state[layer.weight]["grad_scale"]

    def take(
        self,
        layer: Layer,
        project: Callable[[tuple[Any, Any]], tuple[Any, Any]] | None = None,
    ) -> FactorStatistics | None:
        """Remove and return the statistics of the layer's factor update.

        Args:
            layer: A due layer.
            project: Applied to each orientation's raw statistics before they
                are combined (see `StatisticsCollector.take`).

        Returns:
            The statistics (see `StatisticsCollector.take`), or None.
        """
        loss_average = self.group(layer)["loss_average"]
        scale = self._statistics_scale(layer)
        return self._collector.take(layer, loss_average, scale, project)

    def update(
        self,
        layer: Layer,
        statistics: FactorStatistics | None,
        sides: tuple[int, ...] | None = None,
        record: Preconditioner | None = None,
    ) -> None:
        """Update the layer's factors with the rule (nothing without statistics).

        Args:
            layer: The layer.
            statistics: From `take`.
            sides: The sides to update (rules with `splits_sides`); None: all.
            record: The factors the rule reads (default: the state's), e.g. a
                copy of a side updated before, whose previous value couples.
        """
        if statistics is None:
            return
        kwargs = {} if sides is None else {"sides": sides}
        if record is None and self.rule.reads_preconditioner:
            record = self.preconditioner(layer, ())
        state = self.state[layer.weight]
        self.guard.factor_update(
            layer,
            state,
            self._factor_parts(state, (0, 1) if sides is None else sides),
            partial(
                self.rule.update, state, self.group(layer), statistics, record, **kwargs
            ),
            checks=self.rule.checks_updates,
        )
        self.forget(layer, (0, 1) if sides is None else sides)

    def contribute(self, layer: Layer, statistics: FactorStatistics | None) -> None:
        """Take part in the collectives of a layer's update that another rank runs.

        Args:
            layer: A layer whose owner keeps its state (`Shard(factors="owned")`).
            statistics: From `take`, with the owner's decompositions.
        """
        if statistics is not None:
            device = local(layer.weight).device
            self.rule.contribute(self.group(layer), statistics, layer.dims, device)

    def _factor_parts(
        self, state: dict[str, Any], sides: tuple[int, ...]
    ) -> list[tuple[tuple[int, ...], list[str]]]:
        """Return the rule's state entries that an update of `sides` changes.

        Args:
            state: The layer's state.
            sides: The sides updated.

        Returns:
            `(sides, keys)` per verdict: one per side for a rule that splits its
            sides (its entries of no side join each), one for both otherwise.
        """
        keys = [
            key for key in state if key not in SHELL_KEYS and not key.startswith(GRAFT)
        ]
        if not self.rule.splits_sides:
            return [((0, 1), keys)]
        no_side = [key for key in keys if side_of(key, self.rule) is None]
        return [
            ((side,), [k for k in keys if side_of(k, self.rule) == side] + no_side)
            for side in sides
        ]

    def finish(self, layer: Layer, *, due: bool) -> None:
        """Drop statistics that are not due, advance the step counter.

        Args:
            layer: The layer.
            due: Whether its factors were due in this step.
        """
        if not due:
            self._collector.discard(layer)
        state = self.state[layer.weight]
        state["step"] += has_gradient(layer)
        state["grad_scale"] = self._statistics_scale(layer)

    def gradient(self, layer: Layer) -> Tensor | None:
        r"""Return the unscaled \(\Gamma\) (this rank's rows or columns under FSDP2).

        Args:
            layer: The layer.

        Returns:
            A new tensor `[rows, d_K]` (`[d_C, columns]`; with a bias beside
            column shards `[d_C, columns + 1]`, `fsdp.column_block`), or None if
            no parameter has a gradient.
        """
        params = tuple(local(p) for p in layer.params)
        grads = [None if p.grad is None else local(p.grad) for p in layer.params]
        if all(g is None for g in grads):
            return None
        if split_bias(layer):  # (`fsdp.column_block`)
            grad = column_block(layer, grads)
        elif not params[0].numel():
            d_K, d_C = layer.dims  # an empty shard: no rows (columns) of Γ
            return params[0].new_zeros((d_C, 0) if splits_columns(layer) else (0, d_K))
        else:
            grad = layer.gradient_matrix(params, grads)
        if self._grad_scale is not None:
            parameter_update.unscale_(grad, self._grad_scale)
        return grad

    def apply(self, layer: Layer, direction: Tensor) -> None:
        r"""Graft, then apply weight decay, momentum and the learning rate.

        With `graft` in the layer's group, \(\Delta\) is first rescaled to the
        norm of the grafted optimizer's direction on the layer's gradient
        (`parameter_update`); each parameter then takes its own group's options,
        and a parameter without a gradient is not touched.

        Args:
            layer: The layer.
            direction: \(\Delta\) in the layout of \(\Gamma\) (this rank's rows,
                or columns, under FSDP2: the layout of `gradient`); it may be
                overwritten.
        """
        blocked = split_bias(layer)
        shards = shard_position(layer.weight) if is_sharded(layer) else None
        if shards is not None and shards.count == 1:
            shards = None  # (the whole layer on this rank: nothing to combine)
        group = self.group(layer)
        choices = []
        if group["graft"] is not None:  # (on every rank: norms over all shards)
            choices = self._graft(layer, direction, group, shards=shards)
        if not blocked and not local(layer.params[0]).numel():  # an empty shard
            if choices:  # its grafting counter follows the other ranks' verdict
                passed = torch.ones((), dtype=torch.bool, device=direction.device)
                commit = partial(choose, choices)
                self.guard.parameter_update(
                    layer, passed, commit, defer=shards is not None
                )
            return
        parts = block_parts(layer, direction) if blocked else None
        steps = parameter_update.layer_steps(
            layer, direction, self.groups, self.state, local=local, parts=parts
        )
        if steps is None:
            return
        sound, apply = steps
        if choices:
            sound = sound & finite([new for _, new, _ in choices], sound.device)

        def commit(ok: Tensor) -> None:
            apply(ok)
            choose(choices, ok)

        self.guard.parameter_update(layer, sound, commit, defer=shards is not None)

    def _graft(
        self,
        layer: Layer,
        direction: Tensor,
        group: dict[str, Any],
        *,
        shards: ShardPosition | None,
    ) -> list[tuple[Tensor, Tensor, Tensor]]:
        r"""Rescale \(\Delta\) to the grafted direction's norm (`parameter_update`).

        Under FSDP2 both norms are summed over the ranks' blocks (one all-reduce
        of two numbers per layer, on every rank in the same order).

        Args:
            layer: The layer.
            direction: \(\Delta\) (this rank's block; rescaled in place).
            group: Its group.
            shards: Where this rank's block lies among the layer's FSDP2
                shards, if they are on several ranks (else None); under HSDP
                the norms are summed within the replica (`fsdp.shard_position`).

        Returns:
            `(target, new, old)` of the grafting entries, for the step's verdict.
        """
        states = [self.state[param] for param in layer.params]
        before = [
            {k: v.clone() for k, v in entry.items() if k.startswith(GRAFT)}
            for entry in states
        ]
        norm = parameter_update.graft_norm(self.gradient(layer), states, group, layer)
        blocks = parameter_update.graft_blocks(layer, direction)  # (without the
        # bias rows of other ranks, which a split bias's block carries)
        current = parameter_update.joint_norm(blocks)
        if shards is not None:
            dtype = torch.promote_types(norm.dtype, current.dtype)
            squares = torch.stack([norm.to(dtype), current.to(dtype)]).square()
            with named_collective("The sum of a grafted layer's norms over shards"):
                dist.all_reduce(squares, group=shards.group)
            norm, current = squares.sqrt().unbind()
        parameter_update.rescale(direction, norm, current)
        choices = []
        for entry, saved in zip(states, before, strict=True):
            for key in [key for key in entry if key.startswith(GRAFT)]:
                old = saved.get(key, torch.zeros_like(entry[key]))  # (new: zeros)
                choices.append((local(entry[key]), local(entry[key]), local(old)))
        return choices

    def update_factors(self, layer: Layer) -> None:
        """Do a layer's factor work of this step on this rank (replicated work).

        Args:
            layer: The layer.
        """
        due = self.due(layer)
        if due:
            self.update(layer, self.take(layer))
        self.finish(layer, due=due)

    def settle_factors(self) -> None:
        """Let the guard settle the verdicts on host numbers before preconditioning."""
        self.guard.settle_factors()

    def step_parameters(self, layer: Layer) -> None:
        """Precondition a layer's gradient and apply it (replicated work).

        Args:
            layer: The layer.
        """
        grad = self.gradient(layer)
        if grad is not None:
            direction = self.preconditioner(layer, (0, 1)).apply(grad, overwrite=True)
            self.apply(layer, direction)
