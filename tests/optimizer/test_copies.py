"""Copies: `deepcopy((model, optimizer))` trains the copy; a lone copy or pickle fails.

The optimizer's hooks sit on the model, so an optimizer can only be copied together
with its model; `state_dict()` is the way to save it.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from singd_curvlinops import KFAC, SINGD

OPTIMIZERS = {
    "singd-T2": lambda m: SINGD(m, lr=0.1, lr_cov=0.1, T=2),
    "ikfac-sparse": lambda m: SINGD(
        m, lr=0.1, kfac_like=True, T=1, structures=("diagonal", "triltoeplitz")
    ),
    "kfac": lambda m: KFAC(m, lr=0.1, damping=0.1, T=2),
}


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(48, 4)
    ).double()


def batches(num: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(8, 2, 4, 4, generator=generator, dtype=torch.float64),
            torch.randint(0, 4, (8,), generator=generator),
        )
        for _ in range(num)
    ]


def train(net: nn.Module, optimizer: torch.optim.Optimizer, data: list) -> None:
    for X, y in data:
        optimizer.zero_grad()
        nn.functional.cross_entropy(net(X), y).backward()
        optimizer.step()


def parameters(net: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize("make", OPTIMIZERS.values(), ids=OPTIMIZERS)
def test_copy_of_model_and_optimizer_trains_the_copy(make) -> None:
    net, twin_net = model(), model()
    optimizer, twin_optimizer = make(net), make(twin_net)
    train(net, optimizer, batches(3))
    train(twin_net, twin_optimizer, batches(3))
    net_copy, optimizer_copy = copy.deepcopy((net, optimizer))
    assert optimizer_copy.layers[0].module is net_copy[0]
    frozen = parameters(net)
    frozen_state = copy.deepcopy(optimizer.state_dict())
    train(net_copy, optimizer_copy, batches(3, seed=2))
    train(twin_net, twin_optimizer, batches(3, seed=2))
    # the copy continues exactly as an uninterrupted twin ...
    for p_copy, p_twin in zip(
        net_copy.parameters(), twin_net.parameters(), strict=True
    ):
        assert torch.equal(p_copy, p_twin)
    # ... and the originals did not move, nor collect the copy's statistics
    for p, p0 in zip(net.parameters(), frozen, strict=True):
        assert torch.equal(p, p0)
    assert not optimizer._collector.pending
    assert str(optimizer.state_dict()) == str(frozen_state)


def test_original_keeps_training_after_a_copy() -> None:
    net, twin_net = model(), model()
    optimizer, twin_optimizer = (
        OPTIMIZERS["singd-T2"](net),
        OPTIMIZERS["singd-T2"](twin_net),
    )
    train(net, optimizer, batches(2))
    train(twin_net, twin_optimizer, batches(2))
    copy.deepcopy((net, optimizer))
    train(net, optimizer, batches(3, seed=2))
    train(twin_net, twin_optimizer, batches(3, seed=2))
    for p, p_twin in zip(net.parameters(), twin_net.parameters(), strict=True):
        assert torch.equal(p, p_twin)


def test_copied_model_alone_does_not_feed_the_optimizer() -> None:
    net = model()
    optimizer = SINGD(net, T=1)
    X, y = batches(1)[0]
    nn.functional.cross_entropy(copy.deepcopy(net)(X), y).backward()
    assert not optimizer._collector.pending
    nn.functional.cross_entropy(net(X), y).backward()
    assert len(optimizer._collector.pending) == 2


@pytest.mark.parametrize("make", OPTIMIZERS.values(), ids=OPTIMIZERS)
def test_lone_copy_and_pickle_raise(make) -> None:
    optimizer = make(model())
    name = type(optimizer).__name__
    pattern = rf"A {name} optimizer cannot be pickled or copied on its own.*state_dict"
    with pytest.raises(TypeError, match=pattern):
        copy.deepcopy(optimizer)
    with pytest.raises(TypeError, match=pattern):
        pickle.dumps(optimizer)
    with pytest.raises(TypeError, match=pattern):
        copy.copy(optimizer)


def test_model_with_hooks_still_pickles() -> None:
    net = model()
    optimizer = SINGD(net, T=1)
    restored = pickle.loads(pickle.dumps(net))
    X, y = batches(1)[0]
    nn.functional.cross_entropy(restored(X), y).backward()
    assert not optimizer._collector.pending
    torch.testing.assert_close(restored(X), net(X), rtol=0, atol=0)


@pytest.mark.parametrize("make", OPTIMIZERS.values(), ids=OPTIMIZERS)
def test_a_copy_under_a_scheduler_steps_the_copy(make) -> None:
    """A scheduler wraps the optimizer's `step`; the copy must not take the wrapper.

    Before, the copy's `step()` stepped the original model and optimizer.
    """
    net = model()
    optimizer = make(net)
    torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    train(net, optimizer, batches(1))
    net_copy, optimizer_copy = copy.deepcopy((net, optimizer))
    frozen = parameters(net)
    train(net_copy, optimizer_copy, batches(2, seed=2))
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), frozen, strict=True))
    assert not all(
        torch.equal(p, q) for p, q in zip(net_copy.parameters(), frozen, strict=True)
    )
    layer = optimizer_copy.layers[0]
    assert optimizer_copy.state[layer.weight]["step"] == 3


def test_a_copy_keeps_which_optimizer_holds_the_hooks() -> None:
    """A removed or taken-over optimizer's copy is removed too (before: revived)."""
    net = model()
    old = SINGD(net, lr=0.1)
    new = SINGD(net, lr=0.1)  # takes the hooks over
    net_copy, new_copy, old_copy = copy.deepcopy((net, new, old))
    train(net_copy, new_copy, batches(1))
    with pytest.raises(RuntimeError, match="hooks were removed"):
        train(net_copy, old_copy, batches(1))
    with SINGD(net, lr=0.1) as scoped:
        pass
    _, scoped_copy = copy.deepcopy((net, scoped))
    with pytest.raises(RuntimeError, match="hooks were removed"):
        scoped_copy.step()
