r"""Memory of an optimizer: its persistent state and the peak of a training step.

- **State**: the bytes of every tensor in `optimizer.state` (for `SINGD`: the
  factors `K`, `C`, their momenta and the parameters' momentum buffers; for
  `KFAC`: `A`, `G` and the momentum buffers; for AdamW: both moment estimates), plus
  the reference `singd`'s factors, which it keeps in attributes outside
  `optimizer.state`. This is what a checkpoint stores; derived caches such as
  SINGD's \(K K^\top\) or KFAC's inverses are not state and are counted by
  `cache_bytes` instead.
- **Step peak**: torch has no allocator statistics on the CPU (nothing like
  `torch.cuda.max_memory_allocated`), so one step runs under `torch.profiler` with
  `profile_memory=True`, which records every allocation and every release of a
  block allocated during the session. The peak of the running sum of these events
  is the largest amount of memory that the step allocated and held at the same
  time: activations, gradients, statistics and temporaries. Tensors that existed
  before the step (parameters, the batch, the optimizer state) are not included.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.profiler import ProfilerActivity, profile

MIB = 2**20


def _tensors(value: Any) -> list[Tensor]:
    """Collect the tensors in nested containers and structured matrices.

    Args:
        value: A tensor, structured matrix, mapping or sequence.

    Returns:
        The tensors found.
    """
    if isinstance(value, Tensor):
        return [value]
    if hasattr(value, "named_tensors"):
        return [tensor for _, tensor in value.named_tensors()]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


def _unique_bytes(tensors: list[Tensor]) -> int:
    """Return the bytes of `tensors`, counting tensors that share memory once.

    Args:
        tensors: The tensors.

    Returns:
        Their total size in bytes.
    """
    seen, total = set(), 0
    for tensor in tensors:
        key = (tensor.data_ptr(), tensor.numel(), tensor.dtype)
        if key not in seen:
            seen.add(key)
            total += tensor.numel() * tensor.element_size()
    return total


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Return the size of the optimizer's persistent state in bytes.

    Counts `optimizer.state` and, for the reference, its factors and momenta,
    which it keeps outside `optimizer.state` (`Ks`, `Cs`, `m_Ks`, `m_Cs`).
    Tensors that share memory are counted once.

    Args:
        optimizer: The optimizer after some steps.

    Returns:
        The size in bytes.
    """
    tensors = _tensors(list(optimizer.state.values()))
    for attribute in ("Ks", "Cs", "m_Ks", "m_Cs"):
        tensors += _tensors(getattr(optimizer, attribute, {}))
    return _unique_bytes(tensors)


def cache_bytes(optimizer: torch.optim.Optimizer) -> int:
    r"""Return the size of the cached preconditioner of `SINGD` or `KFAC` in bytes.

    `SINGD` keeps \(K K^\top\) and \(C C^\top\) between factor updates, `KFAC` its
    damped inverses, `EKFAC` its damped inverse eigenvalues: the matrices of each
    layer's `optimizer.preconditioner`, derived from the state and rebuilt when
    missing. Tensors that are also part of
    the state are not counted again.

    Args:
        optimizer: The optimizer after some steps.

    Returns:
        The size in bytes (0 for optimizers without such a cache).
    """
    state = {
        (t.data_ptr(), t.numel(), t.dtype)
        for t in _tensors(list(optimizer.state.values()))
    }
    records = [
        optimizer.preconditioner(layer) for layer in getattr(optimizer, "layers", ())
    ]
    cached = _tensors(
        [
            (r.K, r.C, r.KKt, r.CCt, getattr(r, "inverse_eigenvalues", None))
            for r in records
        ]
    )
    return _unique_bytes(
        [t for t in cached if (t.data_ptr(), t.numel(), t.dtype) not in state]
    )


@contextlib.contextmanager
def _silenced_stderr() -> Iterator[None]:
    """Send the process's standard error to the null device for a while.

    The profiler's C++ backend logs a few lines per session directly to file
    descriptor 2, which `warnings` filters cannot reach.

    Yields:
        None; standard error is restored on exit.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w", encoding="utf-8") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def peak_allocated_bytes(function: Callable[[], Any]) -> int:
    """Return the peak of memory allocated by `function` and held at the same time.

    Runs `function` once under `torch.profiler` with `profile_memory=True` and
    returns the maximum of the running sum of its CPU allocation and release events
    in time order. Releases of blocks that were allocated before the call are not
    recorded by the profiler, so memory that `function` frees but did not allocate
    does not lower the result.

    Args:
        function: The work to measure, e.g. one training step.

    Returns:
        Bytes; 0 if `function` allocates nothing.
    """
    with (
        _silenced_stderr(),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler,
    ):
        function()
    events = [
        event
        for event in profiler.profiler.kineto_results.events()
        if event.name() == "[memory]" and event.device_type().name == "CPU"
    ]
    events.sort(key=lambda event: event.start_ns())
    running = peak = 0
    for event in events:
        running += event.nbytes()
        peak = max(peak, running)
    return peak
