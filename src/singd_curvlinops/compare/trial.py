"""One run: a workload trained by one optimizer at one point of its space, one seed.

The clock runs only over training steps (`zero_grad`, forward, backward, `step`,
the schedule), never over evaluation: the validation metric is computed every
`eval_every` steps with the clock stopped, without gradients and in float32.
Runs train on the CPU (the budgets are sized for two cores).

A run **diverges** when its training loss or a parameter is not finite at an
evaluation, or when the optimizer raises an arithmetic error (an
eigendecomposition that fails, say); it stops there, and its final metric is
NaN. Steps in which the step guard of `SINGD`, `KFAC` or `EKFAC` skips an update
are counted.

After training, the memory of a training step is measured: the largest peak of
`MEMORY_STEPS` further steps under the memory profiler
(`singd_curvlinops.bench.memory.peak_allocated_bytes`, which sees what a step
allocates and holds at once, not the parameters or the state; torch keeps no
allocator statistics on the CPU).
"""

from __future__ import annotations

import math
import re
import time
import warnings
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

import torch

from singd_curvlinops.bench.memory import MIB, peak_allocated_bytes, state_bytes
from singd_curvlinops.compare.optimizers import OptimizerSpec, warmup_cosine
from singd_curvlinops.compare.workloads import Problem, Workload

MEMORY_STEPS = 5  # one factor update of the K-FAC family (T = 5)
# the warnings of the optimizers' step guard (`singd_curvlinops.guard`), which
# counts the skipped steps itself (`skipped_steps`)
_GUARD = re.compile(r"^\w+ (skipped|discarded) ")


class Precision(str, Enum):
    """The precision of a run.

    - `float32`: parameters, computation and factors in float32 (the reference);
    - `bf16`: bfloat16 autocast, Kronecker factors in bfloat16;
    - `bf16-fp32-factors`: bfloat16 autocast, factors (and KFAC's inverses) in
      float32.
    """

    FLOAT32 = "float32"
    BF16 = "bf16"
    BF16_FP32_FACTORS = "bf16-fp32-factors"

    @property
    def autocast(self) -> bool:
        """Whether the forward pass runs under bfloat16 autocast.

        Returns:
            True for the bfloat16 precisions.
        """
        return self is not Precision.FLOAT32

    @property
    def factor_dtype(self) -> torch.dtype:
        """The dtype of the Kronecker factors.

        Returns:
            bfloat16 for `bf16`, else float32.
        """
        return torch.bfloat16 if self is Precision.BF16 else torch.float32


@dataclass
class RunResult:
    """What one run recorded (stored as a plain dictionary with the trial).

    Attributes:
        curve: `[step, training seconds, metric]` at step 0 and at every
            evaluation.
        final_metric: The metric after the last step (NaN if diverged).
        diverged: Whether the run diverged.
        error: The optimizer's exception message, if it raised one.
        skipped_steps: Steps in which the optimizer's step guard skipped an
            update (`skipped_steps` of `SINGD`, `KFAC`, `EKFAC`; 0 for others).
        seconds: Training seconds of the whole run.
        step_peak_mib: Memory a training step allocates and holds at once.
        state_mib: The optimizer's state after training.
    """

    curve: list[list[float]] = field(default_factory=list)
    final_metric: float = math.nan
    diverged: bool = False
    error: str | None = None
    skipped_steps: int = 0
    seconds: float = 0.0
    step_peak_mib: float = math.nan
    state_mib: float = math.nan

    def to_dict(self) -> dict[str, Any]:
        """Return the result as a JSON-serialisable dictionary.

        Returns:
            The fields by name.
        """
        return asdict(self)

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> RunResult:
        """Rebuild a result from `to_dict`'s dictionary.

        Args:
            record: The dictionary.

        Returns:
            The result.
        """
        return cls(**record)


def _finite(loss: torch.Tensor, model: torch.nn.Module) -> bool:
    """Return whether the loss and every parameter are finite.

    Args:
        loss: The last training loss.
        model: The network.

    Returns:
        True if nothing is infinite or NaN.
    """
    tensors = [loss.detach(), *(p.detach() for p in model.parameters())]
    return bool(torch.stack([t.isfinite().all() for t in tensors]).all())


def _evaluate(problem: Problem) -> float:
    """Return the validation metric, without gradients or autocast.

    Args:
        problem: The run's problem.

    Returns:
        The metric.
    """
    with torch.no_grad():
        return float(problem.evaluate())


class _Training:
    """The training loop of one run (state shared by its small methods).

    Args:
        workload: The workload.
        problem: Its problem for the run's seed.
        optimizer: The optimizer.
        precision: The run's precision.
    """

    def __init__(
        self,
        workload: Workload,
        problem: Problem,
        optimizer: torch.optim.Optimizer,
        precision: Precision,
    ) -> None:
        self.workload, self.problem, self.optimizer = workload, problem, optimizer
        self.scheduler = warmup_cosine(optimizer, workload.steps)
        self.autocast = torch.autocast(
            "cpu", dtype=torch.bfloat16, enabled=precision.autocast
        )
        self.loss = torch.zeros(())

    def step(self) -> None:
        """Run one training step (not timed here)."""
        self.optimizer.zero_grad(set_to_none=True)
        with self.autocast:
            self.loss = self.problem.loss()
        self.loss.backward()
        self.optimizer.step()
        self.scheduler.step()

    def run(self, result: RunResult) -> None:
        """Train for the workload's budget, evaluating every `eval_every` steps.

        Args:
            result: Filled in place: curve, seconds, final metric, divergence.
        """
        workload, seconds = self.workload, 0.0
        result.curve.append([0, 0.0, _evaluate(self.problem)])
        for step in range(1, workload.steps + 1):
            start = time.perf_counter()
            self.step()
            seconds += time.perf_counter() - start
            if step % workload.eval_every and step != workload.steps:
                continue
            if not _finite(self.loss, self.problem.model):
                result.diverged = True
                break
            result.curve.append([step, seconds, _evaluate(self.problem)])
        result.seconds = seconds
        if not result.diverged:
            result.final_metric = result.curve[-1][2]


def run_trial(
    workload: Workload,
    optimizer: OptimizerSpec,
    params: dict[str, float],
    seed: int,
    precision: Precision | str = Precision.FLOAT32,
) -> RunResult:
    """Train one run and record its validation curve, cost and outcome.

    Warnings other than the step guard's (skipped steps, discarded factor
    updates) are issued again after the run.

    Args:
        workload: The workload.
        optimizer: The optimizer.
        params: Values of the optimizer's searched hyperparameters.
        seed: Seed of the initial weights and the data order.
        precision: The run's precision.

    Returns:
        The run's result.
    """
    precision = Precision(precision)
    problem = workload.build(seed)
    factor_dtype = precision.factor_dtype if optimizer.family.bf16_precisions else None
    built = optimizer.build(problem.model, params, workload.loss_average, factor_dtype)
    training = _Training(workload, problem, built, precision)
    result = RunResult()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            training.run(result)
            if not result.diverged:
                peaks = [
                    peak_allocated_bytes(training.step) for _ in range(MEMORY_STEPS)
                ]
                result.step_peak_mib = max(peaks) / MIB
        except (ArithmeticError, RuntimeError, ValueError) as error:
            result.diverged, result.error = True, f"{type(error).__name__}: {error}"
            result.final_metric = math.nan
    for warning in caught:
        if not _GUARD.match(str(warning.message)):
            warnings.warn_explicit(
                warning.message, warning.category, warning.filename, warning.lineno
            )
    result.skipped_steps = getattr(built, "skipped_steps", 0)
    result.state_mib = state_bytes(built) / MIB
    return result


def seconds_to_target(workload: Workload, result: RunResult) -> tuple[float, float]:
    """Return the steps and training seconds at the first evaluation on target.

    Args:
        workload: The workload (its target).
        result: A run's result.

    Returns:
        `(steps, seconds)`, both infinite if the run never reached the target.
    """
    for step, seconds, metric in result.curve:
        if workload.reached(metric):
            return float(step), float(seconds)
    return float("inf"), float("inf")
