"""Numerical robustness of `SINGD`: non-finite steps, AMP, autocast and dtypes.

- A step with non-finite gradients or statistics is skipped with a warning and
  changes nothing (bit for bit); training continues on the next finite batch.
- `torch.amp.GradScaler` (CPU, float32 model) reproduces the unscaled trajectory,
  also across scale changes, overflows, `init_grad_scale` and the clipping path
  (`unscale_` + `set_current_grad_scale`).
- `torch.autocast` with bfloat16 trains.
- Every structure trains in float64, float32 and bfloat16, also with a
  `preconditioner_dtype` different from the parameters'.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import Tensor, nn
from torch.nn.functional import mse_loss

from singd_curvlinops import SINGD

FACTOR_PREFIXES = ("K.", "C.", "m_K.", "m_C.")
STRUCTURES = [
    "dense",
    "diagonal",
    "block3diagonal",
    "hierarchical2_2",
    "triltoeplitz",
    "triutoeplitz",
    "trilbottomrightdiag",
    "triltopleftdiag",
    "triubottomrightdiag",
    "triutopleftdiag",
]
D_IN, D_HIDDEN, D_OUT, BATCH = 6, 8, 5, 16


# --------------------------------------------------------------------- helpers
# Tiny problems: one thread (oversubscribed CPUs slow small FFTs 1000-fold).
pytestmark = pytest.mark.usefixtures("one_thread")


def _mlp(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(D_IN, D_HIDDEN), nn.Tanh(), nn.Linear(D_HIDDEN, D_OUT)
    ).to(dtype)


def _batches(num: int, dtype: torch.dtype = torch.float32, seed: int = 1):
    """Batches of a learnable regression problem (a fixed random teacher)."""
    generator = torch.Generator().manual_seed(seed)
    teacher = torch.randn(D_IN, D_OUT, generator=generator)
    batches = []
    for _ in range(num):
        X = torch.randn(BATCH, D_IN, generator=generator)
        batches.append((X.to(dtype), torch.tanh(X @ teacher).to(dtype)))
    return batches


def _linears(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]


def _factors(opt: SINGD, model: nn.Module) -> dict[tuple[int, str], Tensor]:
    return {
        (i, key): value
        for i, layer in enumerate(_linears(model))
        for key, value in opt.state[layer.weight].items()
        if key.startswith(FACTOR_PREFIXES)
    }


def _snapshot(opt: SINGD, model: nn.Module) -> dict:
    """Clone parameters and the complete optimizer state (factors, momenta, steps)."""
    params = [p.detach().clone() for p in model.parameters()]
    state = {
        i: {
            key: value.clone() if isinstance(value, Tensor) else value
            for key, value in opt.state[p].items()
        }
        for i, p in enumerate(model.parameters())
    }
    return {"params": params, "state": state}


# Bookkeeping that a skipped step may update: the gradient scale to expect next,
# and the count of skipped steps (added by the step guard, issue 16).
BOOKKEEPING = ("grad_scale", "skipped_steps")


def _assert_bit_identical(before: dict, after: dict) -> None:
    """Parameters, factors, momenta and step counters are unchanged, bit for bit."""
    for p_before, p_after in zip(before["params"], after["params"], strict=True):
        assert torch.equal(p_before, p_after), "a skipped step changed a parameter"
    assert before["state"].keys() == after["state"].keys()
    for i, state in before["state"].items():
        assert state.keys() == after["state"][i].keys(), "a skipped step added state"
        for key, value in state.items():
            if key in BOOKKEEPING:
                continue
            new = after["state"][i][key]
            if isinstance(value, Tensor):
                assert value.dtype == new.dtype
                assert torch.equal(value, new), f"a skipped step changed {key!r}"
            else:
                assert value == new, f"a skipped step changed {key!r}"


def _all_finite(opt: SINGD, model: nn.Module) -> bool:
    tensors = [p.detach() for p in model.parameters()]
    tensors += list(_factors(opt, model).values())
    return all(torch.isfinite(t).all() for t in tensors)


def _loss(model: nn.Module, X: Tensor, Y: Tensor) -> Tensor:
    return mse_loss(model(X).float(), Y.float())


def _train_step(model: nn.Module, opt: SINGD, X: Tensor, Y: Tensor) -> float:
    opt.zero_grad()
    loss = _loss(model, X, Y)
    loss.backward()
    opt.step()
    return loss.item()


def _no_skip_warnings(record: list[warnings.WarningMessage]) -> bool:
    return not any("skipped" in str(w.message) for w in record)


# ------------------------------------------------------- non-finite gradients
def _inf_input(X: Tensor) -> Tensor:
    X = X.clone()
    X[0, 0] = math.inf
    return X


def _nan_input(X: Tensor) -> Tensor:
    X = X.clone()
    X[3, 1] = math.nan
    return X


CORRUPTIONS = {
    "inf-input": (_inf_input, 1.0),
    "nan-input": (_nan_input, 1.0),
    "loss-times-inf": (lambda X: X, math.inf),
}


@pytest.mark.parametrize("T", [1, 3], ids=["update-step", "no-update-step"])
@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_non_finite_gradients_skip_the_step(corruption, T):
    corrupt, loss_factor = CORRUPTIONS[corruption]
    model = _mlp()
    opt = SINGD(model, lr=0.05, T=T, lr_cov=0.05)
    batches = _batches(12)
    X0, Y0 = batches[0]
    for X, Y in batches[:4]:  # momenta and factors that are not trivial
        _train_step(model, opt, X, Y)
    # with T=3, the corrupted step (the layers' fifth) collects no statistics
    before = _snapshot(opt, model)
    loss_before = _loss(model, X0, Y0).item()

    X, Y = batches[4]
    opt.zero_grad()
    (_loss(model, corrupt(X), Y) * loss_factor).backward()
    assert not all(torch.isfinite(p.grad).all() for p in model.parameters())
    with pytest.warns(UserWarning, match="skipped"):
        opt.step()
    _assert_bit_identical(before, _snapshot(opt, model))

    # training continues normally on finite batches
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _train_step(model, opt, X, Y)
        assert not all(
            torch.equal(p0, p)
            for p0, p in zip(before["params"], model.parameters(), strict=True)
        ), "the first finite step after a skipped one did not change the parameters"
        for _ in range(20):
            _train_step(model, opt, X0, Y0)
    assert _no_skip_warnings(record)
    assert _all_finite(opt, model)
    assert _loss(model, X0, Y0).item() < 0.8 * loss_before


def test_skipped_step_is_a_no_op_for_the_trajectory():
    """Skipping a step leaves the trajectory as if the bad batch never happened."""
    batches = _batches(8)
    trajectories = []
    for insert_bad_batch in (False, True):
        model = _mlp()
        opt = SINGD(model, lr=0.05, T=2, lr_cov=0.1)
        for i, (X, Y) in enumerate(batches):
            if insert_bad_batch and i == 3:
                opt.zero_grad()
                _loss(model, _inf_input(X), Y).backward()
                with pytest.warns(UserWarning, match="skipped"):
                    opt.step()
            _train_step(model, opt, X, Y)
        trajectories.append([p.detach().clone() for p in model.parameters()])
    for reference, skipped in zip(*trajectories, strict=True):
        assert torch.equal(reference, skipped)


def test_non_finite_statistics_with_finite_gradients_skip_the_step():
    """An input entry of 1e25 overflows the input statistics, not the gradient.

    The first layer's pre-activation of that example is ~1e25, so `tanh` saturates
    and its derivative is exactly 0: the example's output gradient is 0, and so is
    its contribution 0 * 1e25 to the weight gradient (finite). Its contribution to
    the input covariance, (1e25)^2 / N, overflows float32.
    """
    model = _mlp()
    opt = SINGD(model, lr=0.05, T=1, lr_cov=0.05)
    batches = _batches(4)
    X0, Y0 = batches[0]
    for X, Y in batches[:2]:
        _train_step(model, opt, X, Y)
    before = _snapshot(opt, model)
    loss_before = _loss(model, X0, Y0).item()

    X, Y = batches[2]
    X = X.clone()
    X[0, 2] = 1e25
    opt.zero_grad()
    _loss(model, X, Y).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters()), (
        "the construction should give finite gradients"
    )
    with pytest.warns(UserWarning, match="skipped"):
        opt.step()
    _assert_bit_identical(before, _snapshot(opt, model))

    for _ in range(15):
        _train_step(model, opt, X0, Y0)
    assert _all_finite(opt, model)
    assert _loss(model, X0, Y0).item() < 0.8 * loss_before


# ------------------------------------------------------------------ GradScaler
def _run(
    batches,
    *,
    scaler: torch.amp.GradScaler | None = None,
    clip: float | None = None,
    tell: bool = True,
    **kwargs,
) -> tuple[list[list[Tensor]], list[float]]:
    """Train on `batches`; return the parameters after every step and grad norms.

    With `scaler` and `clip`, `tell=False` leaves out `set_current_grad_scale`.
    """
    model = _mlp()
    opt = SINGD(model, **{"lr": 0.05, "T": 2, "lr_cov": 0.1, **kwargs})
    trajectory, norms = [], []
    for X, Y in batches:
        opt.zero_grad()
        loss = _loss(model, X, Y)
        if scaler is None:
            loss.backward()
            if clip is not None:
                norms.append(nn.utils.clip_grad_norm_(model.parameters(), clip).item())
            opt.step()
        else:
            scaler.scale(loss).backward()
            if clip is not None:
                scaler.unscale_(opt)
                if tell:
                    opt.set_current_grad_scale(scaler.get_scale())
                norms.append(nn.utils.clip_grad_norm_(model.parameters(), clip).item())
            scaler.step(opt)
            scaler.update()
        trajectory.append([p.detach().clone() for p in model.parameters()])
    return trajectory, norms


def _assert_same_trajectory(reference, other) -> None:
    assert len(reference) == len(other)
    for step, (ref_params, params) in enumerate(zip(reference, other, strict=True)):
        for ref, p in zip(ref_params, params, strict=True):
            torch.testing.assert_close(
                p, ref, rtol=1e-5, atol=1e-7, msg=lambda m, s=step: f"step {s}: {m}"
            )


def _scaler(**kwargs) -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", enabled=True, **kwargs)


def test_grad_scaler_reproduces_the_unscaled_trajectory():
    batches = _batches(10)
    reference, _ = _run(batches)
    # growth_interval=3: the scale changes between steps, so statistics collected
    # under one scale are used at a step with another.
    scaler = _scaler(init_scale=2.0**16, growth_interval=3)
    scaled, _ = _run(batches, scaler=scaler)
    assert scaler.get_scale() == 2.0**19
    _assert_same_trajectory(reference, scaled)
    # the scaled run must not coincide with a trivially static one
    assert not torch.equal(reference[0][0], reference[-1][0])


def test_grad_scaler_found_inf_skips_the_step_and_training_continues():
    batches = _batches(8)
    reference, _ = _run(batches)

    model = _mlp()
    opt = SINGD(model, lr=0.05, T=2, lr_cov=0.1)
    scaler = _scaler(init_scale=2.0**16)
    trajectory = []
    for i, (X, Y) in enumerate(batches):
        if i == 3:  # an extra batch that overflows
            before = _snapshot(opt, model)
            opt.zero_grad()
            scaler.scale(_loss(model, _inf_input(X), Y)).backward()
            with pytest.warns(UserWarning, match="skipped"):
                scaler.step(opt)
            scaler.update()
            assert scaler.get_scale() == 2.0**15
            _assert_bit_identical(before, _snapshot(opt, model))
        opt.zero_grad()
        scaler.scale(_loss(model, X, Y)).backward()
        scaler.step(opt)
        scaler.update()
        trajectory.append([p.detach().clone() for p in model.parameters()])
    _assert_same_trajectory(reference, trajectory)


def test_grad_scaler_overflowing_init_scale_backs_off_and_trains():
    """A scale of 2**127 overflows the scaled sum loss in float32.

    The scaler halves its scale after every overflow; once the scaled gradients
    are finite, SINGD must take the step (its statistics, unscaled, are finite).
    """
    X, Y = _batches(1)[0]
    model = _mlp()
    opt = SINGD(model, lr=0.01, T=1, lr_cov=0.05, loss_average=None)
    scaler = _scaler(init_scale=2.0**127)
    loss_before = mse_loss(model(X), Y, reduction="sum").item()
    skipped, finite_grads = [], []
    for _ in range(30):
        before = _snapshot(opt, model)
        opt.zero_grad()
        scaler.scale(mse_loss(model(X), Y, reduction="sum")).backward()
        finite_grads.append(
            all(torch.isfinite(p.grad).all() for p in model.parameters())
        )
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            scaler.step(opt)
        skipped.append(not _no_skip_warnings(record))
        scaler.update()
        if skipped[-1]:
            _assert_bit_identical(before, _snapshot(opt, model))
    assert skipped[0] and not finite_grads[0], "the first step should overflow"
    assert any(finite_grads), "the scaler did not back off"
    first_finite = finite_grads.index(True)
    assert not any(skipped[first_finite:]), (
        f"SINGD skipped steps {[i for i, s in enumerate(skipped) if s]} although the "
        f"scaled gradients were finite from step {first_finite} on (final scale "
        f"{scaler.get_scale():.3g})"
    )
    assert _all_finite(opt, model)
    assert mse_loss(model(X), Y, reduction="sum").item() < 0.8 * loss_before


@pytest.mark.parametrize("init_scale", [2.0**16, 2.0**100], ids=["2^16", "2^100"])
def test_init_grad_scale_reproduces_the_unscaled_trajectory(init_scale):
    """With `init_grad_scale`, even the first step's statistics are unscaled.

    At 2**100, statistics of scaled output gradients would overflow float32 on the
    first step if the optimizer did not know the scale already.
    """
    batches = _batches(6)
    reference, _ = _run(batches)
    scaler = _scaler(init_scale=init_scale)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        scaled, _ = _run(batches, scaler=scaler, init_grad_scale=scaler.get_scale())
    assert _no_skip_warnings(record)
    _assert_same_trajectory(reference, scaled)


def test_grad_scaler_with_unscale_and_clipping_matches_unscaled_clipping():
    batches = _batches(10)
    clip = 0.3
    reference, norms = _run(batches, clip=clip)
    assert max(norms) > clip, "clipping must be active for the test to mean much"
    scaler = _scaler(init_scale=2.0**16, growth_interval=3)
    scaled, scaled_norms = _run(batches, scaler=scaler, clip=clip)
    assert scaler.get_scale() == 2.0**19
    torch.testing.assert_close(scaled_norms, norms, rtol=1e-5, atol=0.0)
    _assert_same_trajectory(reference, scaled)


def test_unscale_without_telling_the_scale_takes_the_expected_one():
    """After `scaler.unscale_` alone, the statistics carry the scale they expected.

    With a scale that never changes (and `init_grad_scale`, so that the first
    step expects it too) that is the actual scale: the run is the unscaled one.
    """
    batches = _batches(6)
    clip = 0.3
    reference, _ = _run(batches, clip=clip)
    scaler = _scaler(init_scale=2.0**16, growth_interval=1000)
    silent, _ = _run(
        batches, scaler=scaler, clip=clip, tell=False, init_grad_scale=2.0**16
    )
    assert scaler.get_scale() == 2.0**16
    _assert_same_trajectory(reference, silent)


# -------------------------------------------------------------------- autocast
def _cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, stride=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 3 * 3, 3),
    )


@pytest.mark.parametrize("architecture", ["mlp", "cnn"])
def test_autocast_bfloat16_trains(architecture):
    generator = torch.Generator().manual_seed(2)
    if architecture == "mlp":
        model = _mlp()
        X, Y = _batches(1)[0]
    else:
        model = _cnn()
        X = torch.randn(BATCH, 2, 7, 7, generator=generator)
        Y = torch.randn(BATCH, 3, generator=generator)
    opt = SINGD(model, lr=0.05, T=2, lr_cov=0.05)
    losses = []
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(25):
            opt.zero_grad()
            with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
                output = model(X)
                assert output.dtype == torch.bfloat16  # autocast is active
                loss = mse_loss(output.float(), Y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    assert _no_skip_warnings(record)
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.7 * losses[0]
    assert _all_finite(opt, model)
    for p in model.parameters():
        assert p.dtype == torch.float32
    for value in _factors(opt, model).values():
        assert value.dtype == torch.float32


# ---------------------------------------------------- structures and dtypes
def _train_structure(
    structure: str,
    dtype: torch.dtype,
    preconditioner_dtype: tuple[torch.dtype | None, torch.dtype | None],
    steps: int = 20,
) -> tuple[nn.Module, SINGD, list[float]]:
    model = _mlp(dtype)
    opt = SINGD(
        model,
        lr=0.05,
        T=1,
        lr_cov=0.05,
        structures=(structure, structure),
        preconditioner_dtype=preconditioner_dtype,
    )
    X, Y = _batches(1, dtype)[0]
    losses = []
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        losses = [_train_step(model, opt, X, Y) for _ in range(steps)]
    assert _no_skip_warnings(record)
    losses.append(_loss(model, X, Y).item())
    return model, opt, losses


def _assert_trained(model, opt, losses, param_dtype, factor_dtypes) -> None:
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.5 * losses[0], losses
    assert _all_finite(opt, model)
    for p in model.parameters():
        assert p.dtype == param_dtype
        assert opt.state[p]["momentum_buffer"].dtype == param_dtype
    factors = _factors(opt, model)
    assert {key.split(".")[0] for _, key in factors} == {"K", "C", "m_K", "m_C"}
    momentum_norms = {}
    for (layer, key), value in factors.items():
        prefix = key.split(".")[0]
        if prefix.startswith("m_"):
            norm = value.double().abs().sum().item()
            momentum_norms[layer, prefix] = (
                momentum_norms.get((layer, prefix), 0) + norm
            )
    assert len(momentum_norms) == 4
    assert all(n > 0 for n in momentum_norms.values()), "factors were not updated"
    for (_, key), value in factors.items():
        side = 0 if key.split(".")[0] in ("K", "m_K") else 1
        assert value.dtype == factor_dtypes[side], key


@pytest.mark.parametrize(
    "dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str
)
@pytest.mark.parametrize("structure", STRUCTURES)
def test_every_structure_trains_in_every_dtype(structure, dtype):
    model, opt, losses = _train_structure(structure, dtype, (None, None))
    _assert_trained(model, opt, losses, dtype, (dtype, dtype))


PRECONDITIONER_DTYPES = [
    (torch.bfloat16, (torch.float32, torch.float32)),
    (torch.float32, (torch.float64, torch.float64)),
    (torch.float32, (torch.bfloat16, torch.bfloat16)),
    (torch.bfloat16, (torch.float32, None)),
    (torch.float64, (None, torch.float32)),
]


@pytest.mark.parametrize(
    "param_dtype, preconditioner_dtype",
    PRECONDITIONER_DTYPES,
    ids=[f"{p}-{k}-{c}" for p, (k, c) in PRECONDITIONER_DTYPES],
)
@pytest.mark.parametrize(
    "structure", ["dense", "diagonal", "hierarchical2_2", "triltoeplitz"]
)
def test_preconditioner_dtype_differs_from_parameters(
    structure, param_dtype, preconditioner_dtype
):
    model, opt, losses = _train_structure(structure, param_dtype, preconditioner_dtype)
    factor_dtypes = tuple(d or param_dtype for d in preconditioner_dtype)
    _assert_trained(model, opt, losses, param_dtype, factor_dtypes)
