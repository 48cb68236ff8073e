"""The statistics collector: what its hooks see, and what they hold on to."""

from __future__ import annotations

import gc
import weakref

import torch
from curvlinops import EFLinearOperator, GGNLinearOperator
from torch import nn

from singd_curvlinops import SINGD


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 2, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(2 * 4 * 4, 3),
    ).double()


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    X = torch.randn(6, 1, 8, 8, generator=generator, dtype=torch.float64)
    return X, torch.randint(0, 3, (6,), generator=generator)


def test_functional_calls_with_other_parameters_are_ignored() -> None:
    """curvlinops' vectorised products call the model through `functional_call`."""
    model = cnn()
    optimizer = SINGD(model, T=1)
    X, y = data()
    for operator in (EFLinearOperator, GGNLinearOperator):
        P = operator(
            model,
            nn.CrossEntropyLoss(),
            list(model.parameters()),
            [(X, y)],
            check_deterministic=False,
        )
        P @ torch.ones(P.shape[1], dtype=torch.float64)
    assert not optimizer._collector.pending
    nn.functional.cross_entropy(model(X), y).backward()
    assert len(optimizer._collector.pending) == 2


def test_a_dropped_optimizer_is_freed_and_stops_collecting() -> None:
    model = cnn()
    optimizer = SINGD(model, T=1)
    collector = weakref.ref(optimizer._collector)
    dropped = weakref.ref(optimizer)
    del optimizer
    gc.collect()
    assert dropped() is None and collector() is None
    X, y = data()
    nn.functional.cross_entropy(model(X), y).backward()  # the hooks do nothing
    fresh = SINGD(model, T=1)
    nn.functional.cross_entropy(model(X), y).backward()
    assert len(fresh._collector.pending) == 2
