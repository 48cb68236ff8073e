"""The optimizer's life on its model: hooks on, hooks off, steps without gradients.

`remove_hooks()` and `with` blocks take the hooks off; a dropped optimizer is
freed and its hooks come off; an optimizer built later on the same layers takes
the hooks over (a re-run notebook cell, Lightning's `lr_find` then `fit`), so that
rebuilding never piles up hooks; optimizers on disjoint parameters coexist. A step
without gradients changes nothing and says so, naming the optimizer's class.
"""

from __future__ import annotations

import copy
import gc
import re
import warnings
import weakref
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from singd_curvlinops import EKFAC, KFAC, SINGD
from tests.optimizer._layer_cases import CASES
from tests.optimizer.test_checkpoints import assert_same

OPTIMIZERS = (SINGD, KFAC, EKFAC)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(3, 4), nn.LayerNorm(4), nn.Tanh(), nn.Linear(4, 2)
    ).double()


def _batch(n: int = 6, seed: int = 1) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=generator, dtype=torch.float64)
    return x, torch.randint(0, 2, (n,), generator=generator)


def _backward(model: nn.Module, seed: int = 1) -> Tensor:
    x, y = _batch(seed=seed)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss


def _hooks(model: nn.Module) -> int:
    """Every module hook on the model (forward, pre-forward, backward)."""
    return sum(
        len(hooks)
        for module in model.modules()
        for hooks in (
            module._forward_hooks,
            module._forward_pre_hooks,
            module._backward_hooks,
            module._backward_pre_hooks,
        )
    )


def _tensor_hooks(model: nn.Module, x: Tensor) -> int:
    """Tensor hooks that a forward pass puts on the layers' outputs."""
    outputs = []
    handles = [
        m.register_forward_hook(lambda _m, _a, out: outputs.append(out))
        for m in model.modules()
        if isinstance(m, nn.Linear)
    ]
    model(x)
    for handle in handles:
        handle.remove()
    return sum(len(out._backward_hooks or {}) for out in outputs)


def _snapshot(model: nn.Module, optimizer: Any) -> tuple[list[Tensor], dict]:
    return (
        [p.detach().clone() for p in model.parameters()],
        copy.deepcopy(optimizer.state_dict()),
    )


# ------------------------------------------------------------ remove_hooks
@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_remove_hooks_takes_every_hook_off(cls: type) -> None:
    model = _model()
    optimizer = cls(model, T=1)
    assert _hooks(model) == 2
    assert _tensor_hooks(model, _batch()[0]) == 2
    optimizer.remove_hooks()
    optimizer.remove_hooks()  # idempotent
    assert _hooks(model) == 0
    assert _tensor_hooks(model, _batch()[0]) == 0
    _backward(model)
    assert not optimizer._collector.pending
    before = _snapshot(model, optimizer)
    with pytest.raises(RuntimeError, match=rf"{cls.__name__}.remove_hooks\(\)"):
        optimizer.step()
    assert_same(_snapshot(model, optimizer), before)  # state_dict still works


def test_a_with_block_removes_the_hooks_at_its_end() -> None:
    model = _model()
    with SINGD(model, T=1) as optimizer:
        assert isinstance(optimizer, SINGD)
        _backward(model)
        optimizer.step()
        assert _hooks(model) == 2
    assert _hooks(model) == 0
    with pytest.raises(RuntimeError, match="end of its with block"):
        optimizer.step()
    with pytest.raises(ZeroDivisionError), SINGD(model) as failing:  # noqa: PT012
        _backward(model)
        raise ZeroDivisionError  # the block's exception propagates
    assert _hooks(model) == 0 and failing._collector.hooks.removed


def test_hooks_removed_between_forward_and_backward_collect_nothing() -> None:
    model = _model()
    optimizer = SINGD(model, T=1)
    x, y = _batch()
    loss = nn.functional.cross_entropy(model(x), y)
    optimizer.remove_hooks()
    loss.backward()
    assert not optimizer._collector.pending


# ------------------------------------------------------- dropped optimizers
@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_a_dropped_optimizer_is_freed_at_once_and_its_hooks_come_off(
    cls: type,
) -> None:
    model = _model()
    optimizer = cls(model, T=1)
    _backward(model)
    optimizer.step()
    _backward(model)  # statistics and tensor hooks pending
    dropped = weakref.ref(optimizer)
    enabled = gc.isenabled()
    gc.disable()  # freed by reference counting: no cycle keeps it alive
    try:
        del optimizer
        assert dropped() is None
    finally:
        if enabled:
            gc.enable()
    assert _hooks(model) == 0
    assert _tensor_hooks(model, _batch()[0]) == 0


def test_many_dropped_optimizers_leave_no_hooks_behind() -> None:
    model = _model()
    for _ in range(5):
        optimizer = SINGD(model, T=1)
        _backward(model)
        optimizer.step()
    del optimizer
    gc.collect()
    assert _hooks(model) == 0


@pytest.mark.parametrize("case", list(CASES))
def test_an_update_step_keeps_no_activations_alive(case: str) -> None:
    """The gradient hooks must not form a cycle through their own tensor."""
    torch.manual_seed(0)
    model = CASES[case][0]().double()
    optimizer = SINGD(model, T=1)
    outputs = []

    def keep(_module: nn.Module, _args: Any, output: Any) -> None:
        outputs.append(weakref.ref(output[0] if isinstance(output, tuple) else output))

    for module in model.modules():
        module.register_forward_hook(keep)
    for _ in range(2):
        inputs = [x.double() if x.is_floating_point() else x for x in CASES[case][1](4)]
        model(*inputs).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    del inputs
    gc.collect()
    assert outputs and all(output() is None for output in outputs)
    dropped = weakref.ref(optimizer)
    del optimizer
    gc.collect()
    assert dropped() is None


# -------------------------------------------------------------- take-over
def test_rebuilding_on_the_same_model_takes_the_hooks_over() -> None:
    """A re-run notebook cell: every old optimizer stays referenced."""
    model = _model()
    optimizers = []
    for cls in (SINGD, KFAC, SINGD, EKFAC, SINGD):
        optimizers.append(cls(model, T=1))
        assert _hooks(model) == 2  # constant across rebuilds
        assert _tensor_hooks(model, _batch()[0]) == 2
    newest = optimizers[-1]
    for _ in range(3):
        _backward(model)
        assert len(newest._collector.pending) == 2
        assert all(not old._collector.pending for old in optimizers[:-1])
        newest.step()
        newest.zero_grad()
    for old, successor in zip(optimizers[:-1], optimizers[1:], strict=True):
        message = (
            rf"This {type(old).__name__} optimizer's hooks were removed.*a "
            rf"{type(successor).__name__} optimizer built later on the same model "
            r"took over layer '0'"
        )
        with pytest.raises(RuntimeError, match=message):
            old.step()
        old.remove_hooks()  # takes nothing off the newest optimizer
        assert _hooks(model) == 2


def test_an_optimizer_that_took_over_trains_like_a_fresh_one() -> None:
    model, fresh_model = _model(), _model()
    old = SINGD(model, T=1, lr=0.1)
    for seed in range(2):
        _backward(model, seed)
        old.step()
        old.zero_grad()
    fresh_model.load_state_dict(model.state_dict())
    new, fresh = SINGD(model, T=1, lr=0.1), SINGD(fresh_model, T=1, lr=0.1)
    for seed in range(3):
        for net, optimizer in ((model, new), (fresh_model, fresh)):
            _backward(net, seed)
            optimizer.step()
            optimizer.zero_grad()
    assert_same(_snapshot(model, new), _snapshot(fresh_model, fresh))


def test_a_failed_construction_takes_nothing_over() -> None:
    model = _model()
    optimizer = SINGD(model, T=1)
    with pytest.raises(ValueError, match="lr"):
        SINGD(model, lr=-1.0)
    with pytest.raises(ValueError, match="must be in the same parameter group"):
        SINGD(model, params=[model[0].weight, model[3].weight, model[3].bias])
    assert _hooks(model) == 2
    _backward(model)
    optimizer.step()
    assert optimizer.state[model[0].weight]["step"] == 1


def test_optimizers_on_disjoint_parameters_keep_their_hooks() -> None:
    model = _model()
    first = SINGD(model, params=model[0].parameters(), T=1, fallback=None)
    second = KFAC(model, params=model[3].parameters(), T=1, fallback=None)
    assert _hooks(model) == 2
    _backward(model)
    assert [layer.name for layer in first._collector.pending] == ["0"]
    assert [layer.name for layer in second._collector.pending] == ["3"]
    first.step()
    second.step()


def test_a_module_carries_one_optimizers_hooks() -> None:
    """Slots of one module: the attention adapter computes the module's products
    itself, which would hide one optimizer's uses from the other; the later one
    takes the module over."""
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(4, 2, batch_first=True).double()
    output = list(attention.out_proj.parameters())
    inputs = [attention.in_proj_weight, attention.in_proj_bias]
    first = SINGD(attention, params=inputs, T=1, fallback=None)
    second = KFAC(attention, params=output, T=1, fallback=None)
    assert _hooks(attention) == 2  # one optimizer's forward and pre-forward hooks
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    attention(x, x, x)[0].square().sum().backward()
    assert not first._collector.pending
    assert [layer.name for layer in second._collector.pending] == ["out_proj"]
    second.step()
    with pytest.raises(RuntimeError, match="KFAC optimizer built later"):
        first.step()


def test_a_copied_model_and_optimizer_take_nothing_over() -> None:
    model = _model()
    optimizer = SINGD(model, T=1)
    model_copy, optimizer_copy = copy.deepcopy((model, optimizer))
    _backward(model)
    _backward(model_copy)
    assert len(optimizer._collector.pending) == 2
    assert len(optimizer_copy._collector.pending) == 2
    optimizer.step()
    optimizer_copy.step()


# ------------------------------------------------- steps without gradients
@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_a_step_without_a_backward_pass_changes_nothing(cls: type) -> None:
    model = _model()
    optimizer = cls(model, T=1, momentum=0.9, weight_decay=0.1)
    _backward(model)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    before = _snapshot(model, optimizer)
    for closure in (None, lambda: torch.tensor(3.0)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = optimizer.step(closure)
        assert loss is None if closure is None else loss.item() == 3.0
        assert len(caught) == 1
        assert str(caught[0].message).startswith(
            f"{cls.__name__}.step() found no gradients: "
        )
        assert caught[0].filename == __file__
        assert "step counters are as before" in str(caught[0].message)
    assert_same(_snapshot(model, optimizer), before)


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_gradients_set_to_none_drop_their_statistics(cls: type) -> None:
    """backward, zero_grad, step: a no-op; the next step is as if it never was."""
    model, twin = _model(), _model()
    optimizer, reference = cls(model, T=1), cls(twin, T=1)
    _backward(model, seed=5)
    optimizer.zero_grad(set_to_none=True)
    before = _snapshot(model, optimizer)
    with pytest.warns(UserWarning, match=rf"^{cls.__name__}\.step\(\) found no"):
        optimizer.step()
    assert_same(_snapshot(model, optimizer), before)
    assert not optimizer._collector.pending
    for net, opt in ((model, optimizer), (twin, reference)):
        _backward(net, seed=1)
        opt.step()
    assert_same(_snapshot(model, optimizer), _snapshot(twin, reference))


# -------------------------------------------------------------- messages
@pytest.mark.parametrize("cls", [KFAC, EKFAC], ids=lambda c: c.__name__)
def test_the_baselines_warnings_name_their_class(cls: type) -> None:
    name = cls.__name__
    model = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer = cls(model, T=1, fallback=None)  # leaves out the LayerNorm
        optimizer.step()  # no gradients
        with torch.no_grad():
            model(_batch()[0])
        model[0].weight.grad = torch.zeros_like(model[0].weight)
        optimizer.step()  # no statistics (for layer 0; the others sit out)
        _backward(model)
        model[3].weight.grad[0, 0] = float("nan")
        optimizer.step()  # skipped
    messages = [str(w.message) for w in caught]
    assert len(messages) == 4, messages
    assert "layer '0' received no statistics" in messages[2], messages
    assert all(message.startswith(name) for message in messages), messages
    assert not any(re.search(r"\bSINGD\b", message) for message in messages)
    assert {w.filename for w in caught} == {__file__}


@pytest.mark.parametrize("cls", [SINGD, KFAC, EKFAC], ids=lambda c: c.__name__)
@pytest.mark.parametrize("skipped", ["finite", "non-finite"])
def test_zero_grad_drops_the_statistics_of_a_skipped_batch(cls, skipped) -> None:
    """Statistics belong to their gradients; `zero_grad()` discards both.

    Before, a batch skipped after `backward()` entered the next factor update (a
    non-finite one made the next good step be skipped as a whole).
    """
    model, twin = _model(), _model()
    optimizer, reference = cls(model, T=1), cls(twin, T=1)
    x, y = _batch(seed=7)
    if skipped == "non-finite":
        x = x.clone()
        x[0, 0] = float("inf")
    # a finite loss whatever the input (its statistics are not finite)
    nn.functional.cross_entropy(model(x).nan_to_num(), y).backward()
    optimizer.zero_grad()  # the batch is skipped
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for net, opt in ((model, optimizer), (twin, reference)):
            for seed in (1, 2):
                opt.zero_grad()
                _backward(net, seed=seed)
                opt.step()
    assert_same(_snapshot(model, optimizer), _snapshot(twin, reference))


@pytest.mark.parametrize("cls", [SINGD, KFAC, EKFAC], ids=lambda c: c.__name__)
def test_a_model_cast_after_construction_raises_in_the_forward_pass(cls) -> None:
    """Before: a dtype error without a layer's name, inside `backward()`."""
    model = _model()
    optimizer = cls(model, T=1)
    model.float()  # was float64
    x, _ = _batch()
    with pytest.raises(ValueError, match=r"Layer '0': its factor .* model cast"):
        model(x.float())
    assert not optimizer._collector.pending
