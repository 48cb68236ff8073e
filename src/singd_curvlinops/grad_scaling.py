"""The `torch.amp.GradScaler` side of the shell (a mixin): which scale a step has.

A `GradScaler` drives `step` through `_step_supports_amp_scaling`: it hands over
the scale of the gradients (`grad_scale`) and its count of infinities
(`found_inf`). The statistics were collected during the scaled backward pass and
divided by the scale the layer expected then; `step` corrects them with the scale
this mixin reports (`collector.StatisticsCollector.take`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch import Tensor
from torch.amp.autocast_mode import is_autocast_available


def without_autocast(device: torch.device) -> AbstractContextManager:
    """Return a context in which `torch.autocast` is off on `device`.

    The statistics hooks and `step` may run inside the user's autocast region
    (Lightning's manual optimisation under `precision="bf16-mixed"` runs the
    whole training step in it): the factor work must keep its own dtypes, not
    autocast's (a SINGD update failed on mixed dtypes, KFAC's was 2 to 21 times
    off in bfloat16 before 2026-12-02).

    Args:
        device: The device of the tensors involved.

    Returns:
        The context (a no-op where autocast does not exist).
    """
    if not is_autocast_available(device.type):
        return nullcontext()
    return torch.autocast(device_type=device.type, enabled=False)


class GradScaling:
    """The scale of `KroneckerOptimizer`'s steps under (and without) a scaler."""

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """Whether `step` unscales gradients and statistics itself (for `GradScaler`).

        True, so that a `GradScaler` hands over scaled gradients and their scale;
        False while `step` runs a closure that no `GradScaler` drives, so that a
        framework that clips gradients inside the closure (Lightning with
        `precision="bf16-mixed"`, which has no scaler) sees an optimizer whose
        gradients it may clip.
        """
        return not self.__dict__.get("_closure_without_scaler", False)

    def set_current_grad_scale(self, grad_scale: float) -> None:
        """Tell the optimizer the gradient scale of the current backward pass.

        Needed only with a `GradScaler` whose `unscale_` is called before `step`
        (e.g. for gradient clipping): the gradients are then unscaled, but the
        statistics collected during the backward pass still carry the scale.

        Args:
            grad_scale: `scaler.get_scale()` of the current step.
        """
        self._current_grad_scale = float(grad_scale)

    def _current_scale(self, grad_scale: Tensor | None) -> float | None:
        """Return the scale of this step's backward passes (`set_current_grad_scale`).

        Args:
            grad_scale: The scale a `GradScaler` handed over, or None.

        Returns:
            The handed-over or told scale; 1.0 when no scaler drives the step
            (nothing is scaled, whatever an earlier step's scaler used); None
            after `scaler.unscale_` without `set_current_grad_scale` (the
            statistics are then taken to carry the scale they expected).
        """
        told = self.__dict__.pop("_current_grad_scale", None)
        if grad_scale is not None:
            return float(grad_scale)
        if told is not None:
            return told
        return 1.0 if getattr(self, "found_inf", None) is None else None
