"""Shared fixtures: seeded randomness and per-class dimension parametrisation."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrise `dim` with the test class's `DIMS`."""
    if "dim" in metafunc.fixturenames and hasattr(metafunc.cls, "DIMS"):
        metafunc.parametrize("dim", metafunc.cls.DIMS)
