"""The step guard's side of the shell (a mixin): its inputs and its public counts.

`singd_curvlinops.guard` checks every change a step makes; this mixin gives it the
step's inputs to check (gradients and statistics, without reading them on the
host) and reads the counts of what it skipped and discarded back out of the
optimizer's state, where they are checkpointed.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import Parameter

from singd_curvlinops.layers import Layer
from singd_curvlinops.verdicts import DISCARDED, SKIPPED, inputs_verdict, most, total


class GuardedSteps:
    """The counters and the input check of `KroneckerOptimizer`'s guarded steps."""

    @property
    def skipped_steps(self) -> int:
        """Steps in which the guard skipped an update, for the most skipped parameter.

        A step skipped as a whole (non-finite gradients or statistics) counts for
        every parameter, one skipped layer or fallback update for its parameters
        (`describe()` shows each layer's count). Checkpointed as the
        `"skipped_steps"` entry of each parameter's state (see the guide page
        "Failure modes").
        """
        params = [p for group in self.param_groups for p in group["params"]]
        return most((self.state[p] for p in params if p in self.state), SKIPPED)

    @property
    def discarded_factor_updates(self) -> int:
        """Factor updates the guard discarded (not finite), summed over the layers.

        Checkpointed as the `"discarded_factor_updates"` entry of each layer's
        weight's state.
        """
        weights = [layer.weight for layer in self._layers]
        return total((self.state[w] for w in weights if w in self.state), DISCARDED)

    def _inputs_finite(self, layers: list[Layer], others: list[Parameter]) -> Tensor:
        """Return whether the step's gradients and statistics are finite (no read).

        Args:
            layers: The layers of this step.
            others: The fallback parameters of this step.

        Returns:
            A 0-d boolean tensor (gradients unchecked if a `GradScaler` did),
            the same on every rank: statistics that the ranks hold differently
            after `Shard`'s exchange count with the verdict it agreed on
            (`PendingStatistics.agreed_finite`).
        """
        found_inf = getattr(self, "found_inf", None)
        params = [p for layer in layers for p in layer.params] + others
        tensors = [p.grad for p in params if p.grad is not None and found_inf is None]
        agreed = True  # (statistics whose verdict the ranks' exchange agreed on)
        for pending in self._collector.pending.values():
            if pending.agreed_finite is None:
                tensors += pending.H_K.tensors() + pending.H_C.tensors()
            else:
                agreed = agreed and pending.agreed_finite
        first = next((p for g in self.param_groups for p in g["params"]), None)
        device = torch.device("cpu") if first is None else first.device
        verdict = inputs_verdict(tensors, found_inf, device)
        return verdict if agreed else torch.zeros_like(verdict)
