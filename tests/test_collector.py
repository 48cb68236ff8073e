"""The statistics collector: what its hooks see, and what they hold on to."""

from __future__ import annotations

import copy
import gc
import warnings
import weakref

import pytest
import torch
from curvlinops import EFLinearOperator, GGNLinearOperator
from torch import nn

from singd_curvlinops import KFAC, SINGD


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


class _ChangedInPlace(nn.Module):
    """A layer whose output the next operation changes, in place or not."""

    def __init__(self, layer: nn.Module, change: str, in_place: bool) -> None:
        super().__init__()
        self.layer, self.change, self.in_place = layer, change, in_place
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, shift = self.layer(x), x.sum(-1, keepdim=True)
        if self.change == "relu":
            h = torch.relu_(h) if self.in_place else torch.relu(h)
        elif self.change == "add":
            h = h.add_(shift) if self.in_place else h + shift
        elif self.in_place:  # "part": one feature scaled in place
            h[..., 0].mul_(3.0)
        else:
            h = torch.cat([3.0 * h[..., :1], h[..., 1:]], -1)
        out = self.head(h)
        return out.flatten(1, -2).mean(1) if out.dim() > 2 else out


def _factors_of(layer: nn.Module, change: str, in_place: bool, x: torch.Tensor):
    torch.manual_seed(0)
    model = _ChangedInPlace(copy.deepcopy(layer), change, in_place).double()
    optimizer = KFAC(model, T=1, lr=0.0, fallback="sgd")
    nn.functional.cross_entropy(model(x), torch.tensor([0, 1, 2, 0, 1, 2])).backward()
    optimizer.step()
    state = optimizer.state[optimizer.layers[0].weight]
    return state["A.mat"], state["G.mat"]


@pytest.mark.parametrize("change", ["relu", "add", "part"])
@pytest.mark.parametrize("shape", [(6, 4), (6, 3, 4), (6, 2, 3, 4)])
@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_an_output_changed_in_place_keeps_its_statistics(kind, shape, change) -> None:
    """A linear layer's output on inputs of more than two dimensions is a view;
    an in-place change of it (`ReLU(inplace=True)`, `+=`) dropped the hook on it,
    and with it the layer's statistics (a "received no statistics" warning, and
    the layer stepped with its old factors). The factors must equal those of the
    same computation done out of place."""
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    layer = nn.Linear(4, 5) if kind == "linear" else Conv1D(5, 4)
    x = torch.randn(*shape, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "received no statistics"
        in_place = _factors_of(layer, change, True, x)
    out_of_place = _factors_of(layer, change, False, x)
    for actual, expected in zip(in_place, out_of_place, strict=True):
        assert expected.abs().max() > 1e-3  # (statistics that a loss gradient formed)
        torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-15)
