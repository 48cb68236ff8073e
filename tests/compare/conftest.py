"""Fixtures of the comparison's tests: one torch thread, short budgets."""

import dataclasses

import pytest
import torch

from singd_curvlinops.compare.workloads import WORKLOADS


@pytest.fixture(autouse=True)
def _one_thread():
    """The workloads are tiny: one thread is fastest and deterministic."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def short(name: str, steps: int = 30, eval_every: int = 10):
    """A workload with a short step budget (same model, data and target)."""
    return dataclasses.replace(WORKLOADS[name], steps=steps, eval_every=eval_every)
