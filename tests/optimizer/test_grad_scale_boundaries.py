"""Gradient scales that reach past a dtype, or outlive their scaler.

- float16 parameters under `GradScaler`'s default scale `2**16`, which float16
  cannot hold: the gradients are unscaled in float32 arithmetic, so the run is
  the same as at `2**15` (scales are powers of two: exact) and it trains.
- float16 factors under a scaler: the output gradients are unscaled before they
  are cast to the factors' dtype, so no scaled row overflows and no step is
  skipped; the run equals the unscaled one.
- A run that continues without its scaler (AMP switched off, or resumed in full
  precision) takes its statistics as unscaled: it continues exactly as a run
  that never had a scaler.

The float16 tests also run on a GPU where there is one: on CUDA, dividing a
float16 gradient in place by the scaler's zero-dimensional float32 scale
computes in float16 (`2**16` becomes `inf`), which made every step a zero step
there until 2026-12-04 while the same division on the CPU was exact.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from singd_curvlinops import EKFAC, KFAC, SINGD

pytestmark = pytest.mark.usefixtures("one_thread")
OPTIMIZERS = {"SINGD": SINGD, "KFAC": KFAC, "EKFAC": EKFAC}
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def _data(dtype: torch.dtype, device: str = "cpu") -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    X = torch.randn(32, 6, generator=generator)
    y = torch.randint(0, 3, (32,), generator=generator)
    return X.to(device, dtype), y.to(device)


def _model(dtype: torch.dtype, device: str = "cpu") -> nn.Sequential:
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    return layers.to(device, dtype)


def _scaled_run(
    cls: type, init_scale: float, device: str, steps: int = 5
) -> tuple[list[Tensor], list[float], int]:
    """float16 model, float32 factors, one `GradScaler` at `init_scale`."""
    model = _model(torch.float16, device)
    optimizer = cls(
        model, lr=0.05, T=1, preconditioner_dtype=(torch.float32, torch.float32)
    )
    scaler = torch.amp.GradScaler(device, init_scale=init_scale, growth_interval=100)
    X, y = _data(torch.float16, device)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(X).float(), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.item())
    params = [p.detach().clone() for p in model.parameters()]
    return params, losses, optimizer.skipped_steps


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_float16_parameters_train_under_the_default_scale(name: str, device) -> None:
    assert torch.tensor(2.0**16, dtype=torch.float16).isinf()
    default, losses, skipped = _scaled_run(OPTIMIZERS[name], 2.0**16, device)
    lower, _, _ = _scaled_run(OPTIMIZERS[name], 2.0**15, device)
    assert skipped == 0
    assert losses[-1] < 0.95 * losses[0], losses
    for p, q in zip(default, lower, strict=True):
        assert torch.equal(p, q)


def _backward_and_step(
    loss: Tensor, optimizer: Any, scaler: torch.amp.GradScaler | None
) -> None:
    """Backward and step, through the scaler if there is one."""
    if scaler is None:
        loss.backward()
        optimizer.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


def _float16_factor_run(
    scaler: torch.amp.GradScaler | None, device: str
) -> tuple[list, int]:
    """float32 model, float16 factors, a sum loss (large scaled rows)."""
    model = _model(torch.float32, device)
    optimizer = SINGD(
        model,
        lr=0.01,
        lr_cov=0.1,
        T=1,
        loss_average=None,
        preconditioner_dtype=(torch.float16, torch.float16),
        init_grad_scale=scaler.get_scale() if scaler is not None else 1.0,
    )
    X, _ = _data(torch.float32, device)
    Y = torch.tanh(X[:, :3])
    trajectory = []
    for _ in range(6):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(X), Y, reduction="sum")
        _backward_and_step(loss, optimizer, scaler)
        trajectory.append([p.detach().clone() for p in model.parameters()])
    return trajectory, optimizer.skipped_steps


@pytest.mark.parametrize("device", DEVICES)
def test_float16_factors_take_unscaled_rows_under_a_scaler(device: str) -> None:
    reference, skipped = _float16_factor_run(None, device)
    scaled, scaled_skipped = _float16_factor_run(
        torch.amp.GradScaler(device, init_scale=2.0**16, growth_interval=2), device
    )
    assert skipped == scaled_skipped == 0
    assert not torch.equal(reference[0][0], reference[-1][0])
    for step, (ref, got) in enumerate(zip(reference, scaled, strict=True)):
        for p, q in zip(ref, got, strict=True):
            torch.testing.assert_close(
                q, p, rtol=1e-5, atol=1e-7, msg=lambda m, s=step: f"step {s}: {m}"
            )


def _step(model, optimizer, X, y, scaler=None) -> None:
    optimizer.zero_grad()
    _backward_and_step(nn.functional.cross_entropy(model(X), y), optimizer, scaler)


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("resumed", [False, True], ids=["live", "resumed"])
def test_a_run_that_drops_its_scaler_continues_unscaled(name: str, resumed) -> None:
    """float64: scaling by powers of two is exact, so the runs agree bit for bit."""
    cls = OPTIMIZERS[name]
    X, y = _data(torch.float64)
    model = _model(torch.float64)
    optimizer = cls(model, lr=0.05, T=2)
    for _ in range(6):
        _step(model, optimizer, X, y)
    reference = [p.detach().clone() for p in model.parameters()]

    model = _model(torch.float64)
    optimizer = cls(model, lr=0.05, T=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=1)
    for _ in range(3):
        _step(model, optimizer, X, y, scaler)
    if resumed:
        saved = optimizer.state_dict()
        optimizer = cls(model, lr=0.05, T=2)
        optimizer.load_state_dict(saved)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no skipped step, no missing statistics
        for _ in range(3):
            _step(model, optimizer, X, y)
    scales = {entry.get("grad_scale") for entry in optimizer.state.values()}
    assert scales - {None} == {1.0}
    for p, q in zip(model.parameters(), reference, strict=True):
        assert torch.equal(p.detach(), q)


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("inside", ["backward", "step", "both"])
def test_backward_and_step_inside_autocast_change_nothing(name, inside) -> None:
    """As in Lightning's manual optimisation under `precision="bf16-mixed"`.

    Before, SINGD's factor update failed on mixed dtypes and KFAC's statistics
    were formed in bfloat16 (2 to 21 times off).
    """
    X, y = _data(torch.float32)

    def train(inside: str) -> list[Tensor]:
        model = _model(torch.float32)
        optimizer = OPTIMIZERS[name](model, lr=0.05, T=1)
        for _ in range(3):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(model(X).float(), y)
                if inside in ("backward", "both"):
                    loss.backward()
            if inside not in ("backward", "both"):
                loss.backward()
            step_inside = inside in ("step", "both")
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=step_inside):
                optimizer.step()
        return [p.detach().clone() for p in model.parameters()]

    reference = train("none")
    for p, q in zip(train(inside), reference, strict=True):
        assert torch.equal(p, q)
