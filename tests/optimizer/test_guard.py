"""The step guard (issue 16): no infinity or NaN reaches parameters or state.

- Long runs at aggressive settings (T = 1, lr_cov = 1, damping = 1e-8; float32
  and bfloat16 factors; dense, diagonal, Toeplitz) end finite and still training.
- A factor update that overflows is discarded: the layer keeps its factors and
  steps with them (SINGD with a float or a callable lr_cov; KFAC, whose update
  counter is restored before it preconditions).
- A parameter step that overflows is skipped per layer (and per fallback
  parameter, with grafting): parameters, momenta, factors, AdamW and grafting
  state unchanged.
- Every event warns once, with the optimizer, the step, the layer and the cause,
  attributed to the caller's line; the counters are public, in `describe()`,
  checkpointed, and start at 0 for checkpoints written before them.
- One host read per step.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
from curvlinops import FisherType, KFACLinearOperator
from torch import Tensor, nn
from torch.nn.functional import mse_loss

from singd_curvlinops import EKFAC, KFAC, SINGD

pytestmark = pytest.mark.usefixtures("one_thread")
HERE = str(Path(__file__))
LEGACY = Path(__file__).parent / "data" / "legacy_checkpoints.pt"


# --------------------------------------------------------------------- helpers
def _mlp(*extra: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*extra, nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5))


def _batches(num: int, seed: int = 1) -> list[tuple[Tensor, Tensor]]:
    """A learnable regression problem (a fixed random teacher)."""
    generator = torch.Generator().manual_seed(seed)
    teacher = torch.randn(6, 5, generator=generator)
    batches = []
    for _ in range(num):
        X = torch.randn(16, 6, generator=generator)
        batches.append((X, torch.tanh(X @ teacher)))
    return batches


def _step(model: nn.Module, opt, X: Tensor, Y: Tensor, scale: float = 1.0) -> list:
    """One step; return the warnings it raised (all of them, always shown)."""
    opt.zero_grad()
    (mse_loss(model(X), Y) * scale).backward()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        opt.step()
    return [w for w in record if issubclass(w.category, UserWarning)]


def _state(opt, model: nn.Module) -> dict:
    """Clone the parameters and the complete optimizer state."""
    return {
        name: (
            p.detach().clone(),
            {
                k: v.clone() if isinstance(v, Tensor) else v
                for k, v in opt.state[p].items()
            },
        )
        for name, p in model.named_parameters()
    }


def _changed(before: dict, after: dict) -> set[str]:
    """Return `name` or `name:key` of everything that differs (bit for bit)."""
    changed = set()
    for name, (param, state) in before.items():
        new_param, new_state = after[name]
        if not torch.equal(param, new_param):
            changed.add(name)
        for key in state.keys() | new_state.keys():
            old, new = state.get(key), new_state.get(key)
            same = (
                torch.equal(old, new)
                if isinstance(old, Tensor) and isinstance(new, Tensor)
                else old == new
            )
            if not same:
                changed.add(f"{name}:{key}")
    return changed


def _messages(record: list) -> list[str]:
    return [str(w.message) for w in record]


# -------------------------------------------------------------- long runs
LONG_RUN_STEPS = 200


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("structure", ["dense", "diagonal", "triltoeplitz"])
def test_long_runs_at_aggressive_settings_keep_training(structure, dtype) -> None:
    """Without the trust region of `update.trust_region`, every one of these runs
    overflows within 5 steps and then skips every step."""
    model = _mlp()
    opt = SINGD(
        model,
        lr=3e-4,
        T=1,
        lr_cov=1.0,
        damping=1e-8,
        structures=(structure, structure),
        preconditioner_dtype=(dtype, dtype),
    )
    batches = _batches(LONG_RUN_STEPS)
    X_test, Y_test = torch.cat([X for X, _ in batches[-8:]]), None
    Y_test = torch.cat([Y for _, Y in batches[-8:]])
    with torch.no_grad():
        initial = mse_loss(model(X_test), Y_test).item()
    record, last = [], None
    for X, Y in batches:
        last = [p.detach().clone() for p in model.parameters()]
        record += _step(model, opt, X, Y)
    with torch.no_grad():
        final = mse_loss(model(X_test), Y_test).item()

    params = list(model.parameters())
    assert all(torch.isfinite(p).all() for p in params)
    assert all(
        torch.isfinite(v).all()
        for p in params
        for v in opt.state[p].values()
        if isinstance(v, Tensor)
    )
    assert all(not torch.equal(a, b) for a, b in zip(last, params, strict=True))
    assert final < 0.5 * initial, (initial, final)
    skipped = sum("skipped" in m for m in _messages(record))
    discarded = sum("discarded the factor update" in m for m in _messages(record))
    assert opt.discarded_factor_updates == discarded
    assert opt.skipped_steps <= skipped < LONG_RUN_STEPS // 10
    assert len(record) == skipped + discarded


# ------------------------------------------------------- factor updates
def _overflowing_singd(lr_cov) -> tuple[nn.Sequential, SINGD, Tensor, Tensor]:
    """Inputs of 1e10: U_K, U_C ~ 1e20 are finite in float32, their products
    in SINGD's momentum (tr(H_C) H_K ~ 1e40) are not."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    opt = SINGD(model, lr=1e-20, momentum=0.0, T=1, lr_cov=lr_cov, damping=1e-3)
    X = torch.randn(8, 4) * 1e10
    return model, opt, X, torch.zeros(8, 3)


@pytest.mark.parametrize("lr_cov", [0.5, lambda step: 0.5], ids=["float", "callable"])
def test_an_overflowing_factor_update_is_discarded(lr_cov) -> None:
    model, opt, X, Y = _overflowing_singd(lr_cov)
    before = _state(opt, model)
    weight = model[0].weight
    opt.zero_grad()
    mse_loss(model(X), Y).backward()
    grad = torch.cat([weight.grad, model[0].bias.grad[:, None]], dim=1)
    assert torch.isfinite(grad).all()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        opt.step()

    assert _messages(record) == [
        "SINGD discarded the factor update of layer '0' (K and C) at step 1: it was "
        "not finite. The layer keeps its previous factors. Likely cause: "
        f"{opt.rule.discard_hint}."
    ]
    assert record[0].filename == HERE
    state = opt.state[weight]
    for key in ("K.mat", "C.mat", "m_K.mat", "m_C.mat"):
        assert torch.equal(state[key], before["0.weight"][1][key]), key
    # the step proceeded with the previous factors K = C = I: Δ = Γ
    expected = before["0.weight"][0] - 1e-20 * weight.grad
    torch.testing.assert_close(weight.detach(), expected, rtol=1e-6, atol=0)
    assert not torch.equal(weight.detach(), before["0.weight"][0])
    assert (opt.discarded_factor_updates, opt.skipped_steps) == (1, 0)
    assert (state["discarded_factor_updates"], state["skipped_steps"]) == (1, 0)

    # ordinary batches: the factors update again, nothing more is discarded
    for _ in range(3):
        assert _step(model, opt, X * 1e-10, Y) == []
    assert not torch.equal(state["K.mat"], before["0.weight"][1]["K.mat"])
    assert opt.discarded_factor_updates == 1


def test_kfac_discards_an_overflowing_update_before_it_preconditions() -> None:
    """Handed-over factors of ~1e9 overflow KFAC's float16 factors. The update is
    discarded, and so is its update counter before the preconditioner is built:
    the step preconditions with the identity (no update yet), not with
    `(0 + damping)^-1`."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    X, Y = torch.randn(8, 4), torch.randn(8, 3)
    huge = KFACLinearOperator(
        model,
        nn.MSELoss(),
        list(model.parameters()),
        [(X * 1e4, Y)],
        fisher_type=FisherType.EMPIRICAL,
        separate_weight_and_bias=False,
        check_deterministic=False,
    )
    huge.compute_kronecker_factors()  # before the optimizer's hooks see the data
    opt = KFAC(
        model,
        lr=0.1,
        momentum=0.0,
        T=1,
        damping=1e-3,
        preconditioner_dtype=(torch.float16, torch.float16),
    )
    opt.set_curvature(huge)
    weight = model[0].weight
    before = weight.detach().clone()
    record = _step(model, opt, X, Y)

    assert len(record) == 1 and "KFAC discarded the factor update of layer '0'" in (
        str(record[0].message)
    )
    assert record[0].filename == HERE
    state = opt.state[weight]
    assert state["updates"] == 0
    assert not state["A.mat"].any() and not state["G.mat"].any()
    # the identity in float16 (with `(0 + damping)^-1` the step were 1000 times)
    torch.testing.assert_close(
        weight.detach(), before - 0.1 * weight.grad, rtol=1e-3, atol=1e-3
    )
    assert opt.discarded_factor_updates == 1
    assert _step(model, opt, X, Y) == [] and state["updates"] == 1


# ---------------------------------------------------------- parameter steps
def test_an_overflowing_parameter_step_is_skipped_and_changes_nothing() -> None:
    """lr = 1e38 in float32 (valid, finite): θ - lr Δ overflows in every layer.
    The third step is not a factor update step (T = 3): nothing at all changes
    but the step counters and the skip counts."""
    model = _mlp()
    opt = SINGD(model, lr=0.01, T=3, lr_cov=0.1, weight_decay=1e-4)
    batches = _batches(8)
    for X, Y in batches[:2]:
        _step(model, opt, X, Y)
    before = _state(opt, model)
    opt.param_groups[0]["lr"] = 1e38
    record = _step(model, opt, *batches[2], scale=1e3)

    assert _messages(record) == [
        f"SINGD skipped the update of layer {name!r} at step 3: it would have made "
        "a parameter or its optimizer state non-finite. They are unchanged. "
        "Likely cause: lr too large for the layer's preconditioned gradient, or "
        "factors too large (damping too small): lower lr or raise damping."
        for name in ("0", "2")
    ]
    assert {w.filename for w in record} == {HERE}
    names = [name for name, _ in model.named_parameters()]
    bookkeeping = {f"{n}:{k}" for n in names for k in ("skipped_steps",)}
    bookkeeping |= {f"{n}:step" for n in ("0.weight", "2.weight")}
    assert _changed(before, _state(opt, model)) == bookkeeping
    assert all(opt.state[p]["skipped_steps"] == 1 for p in model.parameters())
    assert opt.skipped_steps == 1 and opt.discarded_factor_updates == 0

    opt.param_groups[0]["lr"] = 0.01  # training goes on
    assert _step(model, opt, *batches[3]) == []
    assert _changed(before, _state(opt, model)) >= set(names)


def test_fallback_and_grafting_state_is_guarded() -> None:
    """AdamW state on the edge of float32: the first moment of a fallback
    parameter (a LayerNorm's weight) and the grafting moment of the first
    layer, both 3e38, make the bias-corrected AdamW direction infinite. Those two
    updates are skipped (with AdamW's step count), everything else steps."""
    model = _mlp(nn.LayerNorm(6))
    opt = SINGD(model, lr=1e-3, T=1, lr_cov=0.1, graft="adamw")
    batches = _batches(4)
    _step(model, opt, *batches[0])
    opt.state[model[0].weight]["exp_avg"].fill_(3e38)
    opt.state[model[1].weight]["graft_exp_avg"].fill_(3e38)
    before = _state(opt, model)
    record = _step(model, opt, *batches[1])

    assert _messages(record) == [
        "SINGD skipped the update of layer '1' at step 2: it would have made a "
        "parameter or its optimizer state non-finite. They are unchanged. Likely "
        "cause: lr too large for the layer's preconditioned gradient, or factors "
        "too large (damping too small): lower lr or raise damping.",
        "SINGD skipped the fallback update of parameter '0.weight' at step 2: it "
        "would have made a parameter or its optimizer state non-finite. They are "
        "unchanged. Likely cause: lr (times fallback_lr_ratio) too large: lower it.",
    ]
    changed = _changed(before, _state(opt, model))
    factors = ("K.mat", "C.mat", "m_K.mat", "m_C.mat", "step")
    stepped = {"3.weight", "3.bias", "0.bias"}
    assert changed == (
        {f"{n}:skipped_steps" for n in ("0.weight", "1.weight", "1.bias")}
        | {f"{n}.weight:{key}" for n in ("1", "3") for key in factors}
        | stepped
        | {f"{n}:momentum_buffer" for n in ("3.weight", "3.bias")}
        | {"3.weight:graft_exp_avg", "3.weight:graft_exp_avg_sq"}
        | {"0.bias:step", "0.bias:exp_avg", "0.bias:exp_avg_sq"}
    )
    assert opt.skipped_steps == 1


# ------------------------------------------------------- whole steps, counts
def test_a_step_skipped_as_a_whole_is_counted_and_named() -> None:
    model = _mlp()
    opt = SINGD(model, lr=0.05, T=2, lr_cov=0.1)
    batches = _batches(6)
    for X, Y in batches[:2]:
        _step(model, opt, X, Y)
    X, Y = batches[2]
    record = _step(model, opt, X.clone().fill_(math.inf), Y)

    assert _messages(record) == [
        "SINGD skipped step 3: non-finite gradients or statistics (the loss or an "
        "activation overflowed, or a GradScaler found infinities). Parameters, "
        "factors and momenta are unchanged."
    ]
    assert record[0].filename == HERE
    assert opt.skipped_steps == 1
    assert all(opt.state[p]["skipped_steps"] == 1 for p in model.parameters())
    assert opt.state[model[0].weight]["step"] == 2
    text = str(opt.describe())
    assert text.splitlines()[1].split()[-2:] == ["skipped", "discarded"]
    assert _step(model, opt, *batches[3]) == []  # the next step is step 3 again
    assert opt.state[model[0].weight]["step"] == 3


def test_a_skipped_step_drops_its_statistics() -> None:
    """Also where only the model's gradients are reset (`model.zero_grad()`):
    the next step is the one a run without the bad batch takes, bit for bit."""
    batches = _batches(3)
    expected = _mlp()
    expected_opt = SINGD(expected, lr=0.05, T=1, lr_cov=0.1)
    for X, Y in batches:
        _step(expected, expected_opt, X, Y)
    model = _mlp()
    opt = SINGD(model, lr=0.05, T=1, lr_cov=0.1)
    for X, Y in batches[:2]:
        _step(model, opt, X, Y)
    X, Y = batches[2]
    assert len(_step(model, opt, X.clone().fill_(math.inf), Y)) == 1  # skipped
    model.zero_grad()
    mse_loss(model(X), Y).backward()
    opt.step()
    names = [name for name, _ in model.named_parameters()]
    changed = _changed(_state(expected_opt, expected), _state(opt, model))
    assert changed == {f"{name}:skipped_steps" for name in names}  # only the count


@pytest.mark.parametrize("cls", [KFAC, EKFAC], ids=lambda cls: cls.__name__)
def test_kfac_and_ekfac_skip_a_non_finite_step_without_raising(cls) -> None:
    """The update runs on the device before the verdict is read: KFAC's averages
    and EKFAC's eigendecomposition see NaN statistics and must not raise."""
    model = _mlp()
    opt = cls(model, lr=0.05, T=1, damping=0.1)
    batches = _batches(4)
    _step(model, opt, *batches[0])
    before = _state(opt, model)
    X, Y = batches[1]
    record = _step(model, opt, X.clone().fill_(math.nan), Y)

    assert _messages(record) == [
        f"{cls.__name__} skipped step 2: non-finite gradients or statistics (the "
        "loss or an activation overflowed, or a GradScaler found infinities). "
        "Parameters, factors and momenta are unchanged."
    ]
    names = [name for name, _ in model.named_parameters()]
    assert _changed(before, _state(opt, model)) == {f"{n}:skipped_steps" for n in names}
    assert _step(model, opt, *batches[2]) == []
    assert opt.state[model[0].weight]["updates"] == 2


def test_a_skipped_step_keeps_the_handed_over_curvature() -> None:
    model = _mlp()
    X, Y = _batches(1)[0]
    kfac = KFACLinearOperator(
        model,
        nn.MSELoss(),
        list(model.parameters()),
        [(X, Y)],
        fisher_type=FisherType.EMPIRICAL,
        separate_weight_and_bias=False,
        check_deterministic=False,
    )
    kfac.compute_kronecker_factors()
    opt = SINGD(model, lr=0.05, T=1)
    opt.set_curvature(kfac)
    assert len(_step(model, opt, X.clone().fill_(math.nan), Y)) == 1  # skipped
    assert opt.curvature_pending
    assert _step(model, opt, X, Y) == [] and not opt.curvature_pending


def test_counters_survive_checkpoints_and_legacy_checkpoints_start_at_zero(
    tmp_path: Path,
) -> None:
    model, opt, X, Y = _overflowing_singd(0.5)
    _step(model, opt, X, Y)  # one discarded factor update
    _step(model, opt, X.fill_(math.nan), Y)  # one step skipped as a whole
    assert (opt.skipped_steps, opt.discarded_factor_updates) == (1, 1)
    torch.save(opt.state_dict(), tmp_path / "opt.pt")

    fresh_model, fresh, *_ = _overflowing_singd(0.5)
    fresh.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    assert (fresh.skipped_steps, fresh.discarded_factor_updates) == (1, 1)
    state = fresh.state[fresh_model[0].weight]
    assert (state["skipped_steps"], state["discarded_factor_updates"]) == (1, 1)

    from tests.optimizer.data.make_legacy_checkpoints import CONFIGURATIONS, make_model

    record = torch.load(LEGACY, weights_only=True)["singd-dense"]
    cls, options, dtype = CONFIGURATIONS["singd-dense"]
    model = make_model(dtype)
    legacy = cls(model, **options)
    saved = record["optimizer"]["state"]
    assert not any(
        "skipped_steps" in s or "discarded_factor_updates" in s for s in saved.values()
    )
    legacy.load_state_dict(record["optimizer"])
    assert (legacy.skipped_steps, legacy.discarded_factor_updates) == (0, 0)
    # every parameter holds its counters again (a DCP template must have them)
    assert all(legacy.state[p]["skipped_steps"] == 0 for p in model.parameters())
    assert all(
        legacy.state[layer.weight]["discarded_factor_updates"] == 0
        for layer in legacy.layers
    )


def test_a_fresh_state_dict_holds_the_counters_at_zero() -> None:
    """So that a `torch.distributed.checkpoint` load, which reads the keys of the
    loading optimizer's state dict, restores them."""
    model = _mlp(nn.LayerNorm(6))
    opt = SINGD(model)
    state = opt.state_dict()["state"]
    assert len(state) == len(list(model.parameters()))
    assert all(entry["skipped_steps"] == 0 for entry in state.values())
    ordered = [p for group in opt.param_groups for p in group["params"]]
    weights = {layer.weight for layer in opt.layers}
    weights = [i for i, p in enumerate(ordered) if p in weights]
    assert all(state[i]["discarded_factor_updates"] == 0 for i in weights)


# ------------------------------------------------------------ host reads
class _HostReads:
    """Count the reads of tensor values on the host within a block."""

    NAMES = ("item", "tolist", "__bool__", "__float__", "__int__", "numpy")

    def __enter__(self) -> _HostReads:
        self.count, self._originals = 0, {n: getattr(Tensor, n) for n in self.NAMES}

        def counting(original):
            def read(tensor, *args, **kwargs):
                self.count += 1
                return original(tensor, *args, **kwargs)

            return read

        for name, original in self._originals.items():
            setattr(Tensor, name, counting(original))
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._originals.items():
            setattr(Tensor, name, original)


@pytest.mark.parametrize("structure", ["dense", "diagonal", "triltoeplitz"])
def test_a_step_reads_the_device_once(structure: str) -> None:
    model = _mlp(nn.LayerNorm(6))
    opt = SINGD(model, lr=0.01, T=2, lr_cov=0.1, structures=(structure, structure))
    for X, Y in _batches(4):  # update steps and steps between updates
        opt.zero_grad()
        mse_loss(model(X), Y).backward()
        with _HostReads() as reads:
            opt.step()
        assert reads.count == 1
