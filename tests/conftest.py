"""Shared fixtures: seeded randomness and per-class dimension parametrisation."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """Tiny problems: one torch thread (oversubscribed CPUs slow them down a lot)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrise `dim` with the test class's `DIMS`."""
    if "dim" in metafunc.fixturenames and hasattr(metafunc.cls, "DIMS"):
        metafunc.parametrize("dim", metafunc.cls.DIMS)
