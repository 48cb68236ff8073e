r"""The step guard: no infinity or NaN reaches the parameters or the optimizer state.

Every step of `KroneckerOptimizer` is checked at three stages, each with its own
remedy (the guide page *Failure modes* has the user's view):

1. **Inputs.** The gradients (unless a `GradScaler` checked them: its
   `found_inf`) and the collected statistics. If any is not finite, the step is
   *skipped as a whole*: no factor, momentum, parameter or step counter changes.
2. **Factor updates.** The entries a layer's factor update changes (factors,
   Riemannian momenta, eigenbases, eigenvalues; per side for rules that split
   them) must be finite. If not, the update is *discarded*: the entries keep
   their previous values and the layer preconditions with them. SINGD's rule
   checks its own update (`update.factor_step`, after limiting the step with
   `bounds.trust_region`, which keeps aggressive settings from blowing up in
   the first place); for the other rules the guard copies the entries first.
3. **Parameter updates.** Per layer: its new parameters and momentum buffers
   (`update.checked_parameter_steps`) and grafting moments; per fallback
   parameter: its new value and its rule's state. If any is not finite (an
   absurd `lr`; a preconditioner that is not, such as KFAC's inverse of a
   singular damped factor), that layer's (or parameter's) update is *skipped*:
   it keeps its parameters and state, the other layers step.

Each verdict is a 0-d boolean tensor on the device (`singd_curvlinops.verdicts`),
and every change is kept or undone on the device, so no verdict needs the host
while the step runs. `StepGuard.settle` stacks all verdicts into one tensor and
reads it once at the end of the step: it restores the numbers that live on the
host (a rule's update counter, the step counters of a skipped step), counts the
events in the state (`"skipped_steps"` of every parameter whose update was
skipped, `"discarded_factor_updates"` of a layer's weight) and warns once per
event, with the step and the layer. A rule whose preconditioner reads a number
that a discarded update changed (KFAC's update counter) costs one more read, of
its factor verdicts, before it preconditions (`settle_factors`).

Under a distribution strategy whose ranks decide apart (the owners of
`distribute="shard"`, FSDP2's shards), the verdicts are agreed on (a
minimum over the ranks) before they count, so that every rank applies, counts
and reports the same events. A sharded step without FSDP2 carries the verdicts
on the inputs and the factor updates in its `all_gather` (`shared_verdicts`,
`adopt`): the parameter steps, which every rank applies from the same gathered
numbers, need no agreement, and the step saves an all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.nn import Parameter

from singd_curvlinops._warnings import warn
from singd_curvlinops.bounds import finite_each
from singd_curvlinops.distributed.collectives import agree, world_size
from singd_curvlinops.distributed.fsdp import any_shards, is_sharded, local
from singd_curvlinops.layers import Layer
from singd_curvlinops.verdicts import (
    COUNTERS,
    DISCARDED,
    SKIPPED,
    Verdict,
    choose,
    count,
    finite,
)


class StepGuard:
    """The verdicts of one step (see the module docs).

    Args:
        optimizer: The optimizer's class name, for the warnings.
        state: The optimizer's state.
        layers: The layers of this step.
        due: Whether each layer's factors update in this step.
        fallback: The fallback parameters of this step, with their names.
        inputs: The verdict on the step's gradients and statistics.
        agree: Makes the ranks' verdicts one (a minimum over the ranks; the
            identity where every rank decides alike).
        hint: The likely cause of a discarded factor update, and its remedy.
        skip_hint: The likely cause of a layer's skipped update, and its remedy.
        factor_names: The factor of each side, as the warnings name it
            (`("K", "C")` for SINGD, `("A", "G")` for KFAC).
    """

    def __init__(
        self,
        optimizer: str,
        state: dict[Parameter, dict[str, Any]],
        layers: Sequence[Layer],
        due: Sequence[bool],
        fallback: Sequence[tuple[str, Parameter]],
        inputs: Tensor,
        *,
        agree: Callable[[Tensor], Tensor],
        hint: str,
        skip_hint: str,
        factor_names: tuple[str, str] = ("K", "C"),
    ) -> None:
        self.optimizer, self.state = optimizer, state
        self.hint, self.skip_hint = hint, skip_hint
        self.factor_names = factor_names
        self.layers, self.due, self.fallback = list(layers), list(due), list(fallback)
        self.inputs, self.device, self._agree = inputs, inputs.device, agree
        self.number = state[layers[0].weight]["step"] + 1 if layers else 1
        self._steps = {layer: state[layer.weight]["step"] for layer in layers}
        self._factors: dict[tuple[Layer, int], Verdict] = {}
        self._updates: dict[Layer | Parameter, Verdict] = {}
        self._deferred: list[tuple[Any, Verdict, Callable[[Tensor], None]]] = []
        self._adopted: list[bool] | None = None  # (`adopt`)

    # -------------------------------------------------------------- checking
    def require(self, ok: Tensor) -> None:
        """Count one more verdict with the step's inputs, before any change.

        For statistics formed during the step (by their owners, under
        `Shard(factors="owned")`), once the ranks agreed on them: if `ok` is
        False, the step is skipped as a whole, as for non-finite gradients.

        Args:
            ok: A 0-d boolean tensor, the same on every rank.
        """
        self.inputs = self.inputs & ok.to(self.device)

    def factor_update(
        self,
        layer: Layer,
        state: dict[str, Any],
        parts: Sequence[tuple[tuple[int, ...], Sequence[str]]],
        update: Callable[..., dict[int, Tensor] | None],
        *,
        checks: bool,
    ) -> None:
        """Run a layer's factor update as a checked change of its state entries.

        A rule that `checks` its own updates (SINGD) gets the inputs' verdict and
        returns one per side. Otherwise the entries of each part are copied
        first and take their previous values back unless all their new tensors
        are finite (and the step's inputs are).

        Args:
            layer: The layer.
            state: Its state.
            parts: `(sides, keys)`: the entries each verdict covers.
            update: Runs the rule's update (in place, on `state`).
            checks: Whether the rule checks its update itself (`accept=`).
        """
        if checks:
            for side, ok in update(accept=self.inputs).items():
                self._factors[layer, side] = Verdict(ok)
            return
        keys = [key for _, part in parts for key in part]
        before = {
            key: value.clone() if isinstance(value, Tensor) else value
            for key, value in state.items()
            if key in keys
        }
        update()
        for sides, part in parts:
            tensors = [k for k in part if isinstance(before[k], Tensor)]
            ok = finite([state[k] for k in tensors], self.device) & self.inputs
            choose([(state[k], state[k], before[k]) for k in tensors], ok)
            numbers = {k: before[k] for k in part if k not in tensors}
            verdict = Verdict(ok, state, numbers)
            for side in sides:
                self._factors[layer, side] = verdict

    def parameter_update(
        self,
        key: Layer | Parameter,
        sound: Tensor,
        commit: Callable[[Tensor], None],
        *,
        defer: bool = False,
        state: dict[str, Any] | None = None,
        numbers: dict[str, Any] | None = None,
    ) -> None:
        """Apply a layer's or a fallback parameter's update if it is sound.

        Args:
            key: The layer, or the fallback parameter.
            sound: Whether the update's new values are finite (0-d boolean).
            commit: Applies the update given the verdict (on the device).
            defer: Apply only in `commit_deferred`, once the ranks agreed
                (FSDP2 shards: each rank checks its rows alone).
            state: The state whose `numbers` the update changed.
            numbers: Those numbers before the update.
        """
        ok = sound.to(self.device) & self.inputs
        verdict = Verdict(ok, state, numbers or {})
        if defer:
            self._deferred.append((key, verdict, commit))
            return
        commit(ok)
        self._updates[key] = verdict

    def fallback_update(
        self,
        params: Sequence[Parameter],
        states: Sequence[dict[str, Any]],
        update: Callable[[], None],
    ) -> None:
        """Run a fallback rule's in-place update of some parameters as checked changes.

        Each parameter and its state are copied first (fallback parameters are
        few and small: norms, biases, embeddings of positions) and take their
        previous values back unless all of their new values are finite; the
        peaks of all of them are checked at once (`bounds.finite_each`).

        Args:
            params: The parameters.
            states: Their states.
            update: Runs the rule's step of all of them.
        """
        copies = []
        for param, state in zip(params, states, strict=True):
            keys = [key for key in state if key not in COUNTERS]
            before = {
                k: state[k].clone() if isinstance(state[k], Tensor) else state[k]
                for k in keys
            }
            copies.append((keys, before, param.detach().clone()))
        update()
        changes = []
        for param, state, (keys, before, old) in zip(
            params, states, copies, strict=True
        ):
            tensors = [k for k in keys if isinstance(before[k], Tensor)]
            pairs = [(param.detach(), old)] + [(state[k], before[k]) for k in tensors]
            choices = [(local(new), local(new), local(prev)) for new, prev in pairs]
            numbers = {k: before[k] for k in keys if k not in tensors}
            changes.append((param, state, choices, numbers))
        checks = finite_each(
            [[new for _, new, _ in c] for _, _, c, _ in changes], self.device
        )
        for (param, state, choices, numbers), sound in zip(
            changes, checks, strict=True
        ):
            self.parameter_update(
                param,
                sound,
                partial(choose, choices),
                defer=isinstance(param, DTensor) and world_size() > 1,
                state=state,
                numbers=numbers,
            )

    def commit_deferred(self) -> None:
        """Agree on the deferred verdicts (one all-reduce), then apply them.

        The agreement covers every FSDP2-sharded layer and sharded fallback
        parameter of the step, in order (True where a rank checked nothing, e.g.
        an empty shard), so that every rank takes part with the same flags.
        """
        keys = [layer for layer in self.layers if is_sharded(layer)]
        keys += [param for _, param in self.fallback if isinstance(param, DTensor)]
        if world_size() == 1 or not keys:
            return
        deferred = {key: (verdict, commit) for key, verdict, commit in self._deferred}
        passed = torch.ones((), dtype=torch.bool, device=self.device)
        flags = [deferred[k][0].flag if k in deferred else passed for k in keys]
        agreed = agree(torch.stack(flags))
        for index, key in enumerate(keys):
            if key in deferred:
                verdict, commit = deferred[key]
                verdict.flag = agreed[index]
                commit(verdict.flag)
                self._updates[key] = verdict
        self._deferred.clear()

    # ---------------------------------------------------- sharing the verdicts
    @property
    def shareable(self) -> bool:
        """Whether the ranks decide alike on everything but inputs and factors.

        True without FSDP2's shards (of layers or fallback parameters): every
        rank then applies the same gathered steps to the same parameters, so
        only the inputs' and the owners' factor verdicts differ between ranks,
        and a sharded step can carry them in its `all_gather` (`adopt`).
        """
        return not any_shards(self.layers, [p for _, p in self.fallback])

    def factor_keys(self) -> list[tuple[Layer, int]]:
        """Return `(layer, side)` of every side of every updated layer, in order."""
        pairs = zip(self.layers, self.due, strict=True)
        return [(layer, side) for layer, due in pairs if due for side in (0, 1)]

    def shared_verdicts(self) -> Tensor:
        """Return this rank's verdicts on the inputs and on the factor updates.

        Returns:
            `1 + 2 * (updated layers)` flags (1.0: kept, or not checked here),
            the same number on every rank.
        """
        passed = torch.ones((), dtype=torch.bool, device=self.device)
        factors = [self._factors.get(key) for key in self.factor_keys()]
        flags = [self.inputs] + [passed if v is None else v.flag for v in factors]
        return torch.stack([flag.to(self.device) for flag in flags]).float()

    def adopt(self, agreed: list[bool]) -> None:
        """Take every rank's `shared_verdicts`, combined, instead of an agreement.

        Args:
            agreed: Per flag, True only where it holds on every rank.
        """
        self._adopted = agreed

    # -------------------------------------------------------------- settling
    def settle_factors(self) -> None:
        """Read the factor verdicts that carry host numbers; restore failed ones.

        One host read, only if a recorded update changed a number (KFAC's update
        counter), so that the preconditioner built next sees the kept state.
        """
        pending = list(
            dict.fromkeys(
                v for v in self._factors.values() if v.numbers and not v.settled
            )
        )
        if not pending:
            return
        kept = torch.stack([v.flag.to(self.device) for v in pending]).tolist()
        for verdict, value in zip(pending, kept, strict=True):
            verdict.settled = True
            if not value:
                verdict.restore()

    def settle(self) -> bool:
        """Read every verdict at once; restore, count and warn (module docs).

        Returns:
            Whether the step's inputs were finite (False: skipped as a whole).
        """
        factor_keys = self.factor_keys()
        update_keys = self.layers + [param for _, param in self.fallback]
        verdicts = [self._factors.get(key) for key in factor_keys]
        verdicts += [self._updates.get(key) for key in update_keys]
        passed = torch.ones((), dtype=torch.bool, device=self.device)
        flags = [self.inputs] + [
            passed if v is None else v.flag.to(self.device) for v in verdicts
        ]
        if self._adopted is not None:  # the ranks agree on the rest by design
            rest = flags[1 + len(factor_keys) :]
            values = self._adopted + (torch.stack(rest).tolist() if rest else [])
        else:
            values = self._agree(torch.stack(flags)).tolist()  # the step's one read
        for verdict, kept in zip(verdicts, values[1:], strict=True):
            if verdict is not None and not kept and not verdict.settled:
                verdict.restore()
        if not values[0]:
            self._skip_all()
            return False
        split = 1 + len(factor_keys)
        self._report_factors(factor_keys, values[1:split])
        self._report_updates(update_keys, values[split:])
        return True

    def _skip_all(self) -> None:
        """Undo the step counters of a step skipped as a whole; count and warn."""
        for layer, step in self._steps.items():
            self.state[layer.weight]["step"] = step
        params = [p for layer in self.layers for p in layer.params]
        params += [param for _, param in self.fallback]
        for param in params:
            if param.grad is not None and param in self.state:
                count(self.state[param], SKIPPED)
        warn(
            f"{self.optimizer} skipped step {self.number}: non-finite gradients or "
            "statistics (the loss or an activation overflowed, or a GradScaler "
            "found infinities). Parameters, factors and momenta are unchanged."
        )

    def _report_factors(
        self, keys: list[tuple[Layer, int]], values: list[bool]
    ) -> None:
        """Count and warn about the discarded factor updates, once per layer.

        Args:
            keys: `(layer, side)` per verdict.
            values: The agreed verdicts.
        """
        failed: dict[Layer, list[int]] = {}
        for (layer, side), kept in zip(keys, values, strict=True):
            if not kept:
                failed.setdefault(layer, []).append(side)
        for layer, sides in failed.items():
            count(self.state[layer.weight], DISCARDED)
            factors = " and ".join(self.factor_names[side] for side in sides)
            warn(
                f"{self.optimizer} discarded the factor update of layer "
                f"{layer.name!r} ({factors}) at step {self.number}: it was not "
                "finite. The layer keeps its previous factors. Likely cause: "
                f"{self.hint}."
            )

    def _report_updates(self, keys: list[Any], values: list[bool]) -> None:
        """Count and warn about the skipped layer and fallback updates.

        Args:
            keys: Layers, then fallback parameters.
            values: The agreed verdicts.
        """
        names = {param: name for name, param in self.fallback}
        for key, kept in zip(keys, values, strict=True):
            if kept:
                continue
            if isinstance(key, Layer):
                params = [p for p in key.params if p.grad is not None]
                what = f"the update of layer {key.name!r}"
                cause = self.skip_hint
            else:
                params = [key]
                what = f"the fallback update of parameter {names[key]!r}"
                cause = "lr (times fallback_lr_ratio) too large: lower it"
            for param in params:
                count(self.state[param], SKIPPED)
            warn(
                f"{self.optimizer} skipped {what} at step {self.number}: it would "
                "have made a parameter or its optimizer state non-finite. They "
                f"are unchanged. Likely cause: {cause}."
            )
