"""`load_state_dict` validates the whole state dict before changing anything.

One regression test per corruption of issue 16, item 3 (a layer's entry removed,
a missing step counter, `lr = NaN`, `T = 0`, `momentum = 2`, a wrong-shape momentum
buffer, integer or non-finite factors) and the neighbouring cases: each asserts
the error type, that the message names the key, and that the optimizer's state
and the model's parameters are exactly as before.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

from singd_curvlinops import EKFAC, KFAC, SINGD
from tests.optimizer._state import (
    all_finite,
    assert_unchanged,
    make_model,
    snapshot,
    train,
)
from tests.optimizer.test_checkpoints import assert_same

# parameter ids of `make_model`'s state dict: 0, 1 the first layer (layer '0'),
# 2, 3 the last layer (layer '3'), 4, 5 the LayerNorm (fallback parameters)
OPTIONS = {"lr": 0.05, "T": 2, "structures": ("dense", "dense")}


def _trained(cls: type = SINGD, **options: Any) -> tuple[Any, Any, dict]:
    """A model, its optimizer after 3 steps, and the optimizer's state dict."""
    model = make_model()
    optimizer = cls(model, **(OPTIONS if cls is SINGD else {"T": 2}) | options)
    train(model, optimizer, range(3))
    return model, optimizer, copy.deepcopy(optimizer.state_dict())


def _set(path: tuple, value: Any) -> Callable[[dict], None]:
    def edit(state_dict: dict) -> None:
        target = state_dict
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return edit


def _delete(path: tuple) -> Callable[[dict], None]:
    def edit(state_dict: dict) -> None:
        target = state_dict
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]

    return edit


def _transform(path: tuple, function: Callable[[Any], Any]) -> Callable[[dict], None]:
    def edit(state_dict: dict) -> None:
        target = state_dict
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = function(target[path[-1]])

    return edit


def _nan_at_0(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.clone()
    tensor.view(-1)[0] = float("nan")
    return tensor


def _inf_at_last(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.clone()
    tensor.view(-1)[-1] = float("inf")
    return tensor


# (id, edit, exception, pattern): every pattern names the key's path
CORRUPTIONS = [
    ("layer-entry-removed", _delete(("state", 2)), ValueError,
     r"state_dict\['state'\]\[2\] is missing: .*layer '3'"),
    ("bias-entry-removed", _delete(("state", 1)), ValueError,
     r"state_dict\['state'\]\[1\] is missing: .*parameter '0\.bias' of layer '0'"),
    ("fallback-entry-removed", _delete(("state", 4)), ValueError,
     r"state_dict\['state'\]\[4\] is missing: .*fallback parameter '2\.weight'"),
    ("step-counter-missing", _delete(("state", 0, "step")), ValueError,
     r"state_dict\['state'\]\[0\] \(layer '0'\) lacks 'step'"),
    ("step-counter-negative", _set(("state", 0, "step"), -1), ValueError,
     r"state_dict\['state'\]\[0\]\['step'\] \(layer '0'\) must be a non-negative"),
    ("step-counter-float", _set(("state", 0, "step"), 2.0), TypeError,
     r"state_dict\['state'\]\[0\]\['step'\] \(layer '0'\) must be a non-negative int"),
    ("grad-scale-missing", _delete(("state", 0, "grad_scale")), ValueError,
     r"state_dict\['state'\]\[0\] \(layer '0'\) lacks 'grad_scale'"),
    ("grad-scale-zero", _set(("state", 0, "grad_scale"), 0.0), ValueError,
     r"state_dict\['state'\]\[0\]\['grad_scale'\] \(layer '0'\) must be > 0"),
    ("grad-scale-inf", _set(("state", 0, "grad_scale"), float("inf")), ValueError,
     r"\['grad_scale'\] \(layer '0'\) must be > 0, got inf \(it must be finite\)"),
    ("lr-nan", _set(("param_groups", 0, "lr"), float("nan")), ValueError,
     r"state_dict\['param_groups'\]\[0\]: lr must be >= 0\.0, got nan"),
    ("lr-inf", _set(("param_groups", 0, "lr"), float("inf")), ValueError,
     r"state_dict\['param_groups'\]\[0\]: lr must be >= 0\.0, got inf"),
    ("T-zero", _set(("param_groups", 0, "T"), 0), ValueError,
     r"state_dict\['param_groups'\]\[0\]: T must be a positive int, got 0"),
    ("momentum-two", _set(("param_groups", 0, "momentum"), 2), ValueError,
     r"state_dict\['param_groups'\]\[0\]: momentum must be in \[0\.0, 1\.0\), got 2"),
    ("damping-string", _set(("param_groups", 0, "damping"), "0.1"), TypeError,
     r"state_dict\['param_groups'\]\[0\]: damping must be a number"),
    ("fallback-none", _set(("param_groups", 0, "fallback"), None), ValueError,
     r"state_dict\['param_groups'\]\[0\]: fallback=None, but the group holds"),
    ("dtype-name", _set(("param_groups", 0, "preconditioner_dtype"), ["flt", None]),
     ValueError, r"state_dict\['param_groups'\]\[0\]\['preconditioner_dtype'\]"),
    ("params-missing", _delete(("param_groups", 0, "params")), ValueError,
     r"state_dict\['param_groups'\]\[0\] lacks 'params'"),
    ("params-repeated", _set(("param_groups", 0, "params"), [0, 1, 2, 3, 4, 4]),
     ValueError, r"state_dict\['param_groups'\]\[0\]\['params'\] repeats .* 4"),
    ("unknown-param-id", _set(("state", 99), {"momentum_buffer": torch.zeros(2)}),
     ValueError, r"state_dict\['state'\] has entries for \[99\]"),
    ("momentum-buffer-shape", _set(("state", 0, "momentum_buffer"), torch.zeros(4, 3)),
     ValueError, r"state_dict\['state'\]\[0\]\['momentum_buffer'\] \(layer '0'\) "
     r"must have shape \(3, 4\), got \(4, 3\)"),
    ("bias-momentum-shape", _set(("state", 3, "momentum_buffer"), torch.zeros(3)),
     ValueError, r"state_dict\['state'\]\[3\]\['momentum_buffer'\] \(parameter "
     r"'3\.bias' of layer '3'\) must have shape \(2,\)"),
    ("momentum-buffer-missing", _delete(("state", 1, "momentum_buffer")), ValueError,
     r"state_dict\['state'\]\[1\] \(parameter '0\.bias' of layer '0'\) lacks "
     r"'momentum_buffer'"),
    ("momentum-buffer-nan", _transform(("state", 0, "momentum_buffer"), _nan_at_0),
     ValueError, r"\['momentum_buffer'\] \(layer '0'\) has non-finite entries"),
    ("integer-factor", _transform(("state", 0, "K.mat"), lambda t: t.long()),
     TypeError, r"state_dict\['state'\]\[0\]\['K\.mat'\] \(layer '0'\) must be a "
     r"floating-point tensor, got dtype torch\.int64"),
    ("complex-factor", _transform(("state", 2, "m_C.mat"), lambda t: t.cfloat()),
     TypeError, r"state_dict\['state'\]\[2\]\['m_C\.mat'\] \(layer '3'\)"),
    ("nan-factor", _transform(("state", 0, "K.mat"), _nan_at_0), ValueError,
     r"state_dict\['state'\]\[0\]\['K\.mat'\] \(layer '0'\) has non-finite"),
    ("inf-factor", _transform(("state", 2, "C.mat"), _inf_at_last), ValueError,
     r"state_dict\['state'\]\[2\]\['C\.mat'\] \(layer '3'\) has non-finite"),
    ("factor-missing", _delete(("state", 0, "m_K.mat")), ValueError,
     r"state_dict\['state'\]\[0\] \(layer '0'\): the factors do not match .*"
     r"missing \['m_K\.mat'\]"),
    ("factor-foreign", _set(("state", 0, "K.diag"), torch.ones(5)), ValueError,
     r"state_dict\['state'\]\[0\] \(layer '0'\): the factors .* foreign \['K\.diag'\]"),
    ("factor-shape", _transform(("state", 0, "C.mat"), lambda t: t[:2, :2]),
     ValueError, r"\(layer '0'\): the factors .* 'C\.mat' of shape \(2, 2\) "
     r"\(expected \(3, 3\)\)"),
    ("factor-not-a-tensor", _set(("state", 0, "K.mat"), 1.0), TypeError,
     r"state_dict\['state'\]\[0\]\['K\.mat'\] \(layer '0'\) must be a "
     r"floating-point tensor of shape \(5, 5\), got float"),
    ("factor-overflows-its-dtype", _set(("state", 0, "K.mat"), torch.full(
        (5, 5), 1e300, dtype=torch.float64)), ValueError,
     r"state_dict\['state'\]\[0\]\['K\.mat'\] \(layer '0'\) has non-finite"),
    ("unknown-entry", _set(("state", 0, "velocity"), torch.zeros(3, 4)), ValueError,
     r"state_dict\['state'\]\[0\] \(layer '0'\) has the unknown entries "
     r"\['velocity'\]"),
    ("graft-half-pair", _set(("state", 0, "graft_exp_avg"), torch.zeros(3, 5)),
     ValueError, r"state_dict\['state'\]\[0\] \(layer '0'\) has one of "
     r"\['graft_exp_avg', 'graft_exp_avg_sq'\] without the other"),
    ("adamw-step-missing", _delete(("state", 4, "step")), ValueError,
     r"state_dict\['state'\]\[4\] \(fallback parameter '2\.weight'\) lacks 'step'"),
    ("adamw-moment-shape", _set(("state", 5, "exp_avg_sq"), torch.zeros(4)),
     ValueError, r"state_dict\['state'\]\[5\]\['exp_avg_sq'\] \(fallback parameter "
     r"'2\.bias'\) must have shape \(3,\)"),
    ("adamw-moment-inf", _transform(("state", 4, "exp_avg"), _inf_at_last),
     ValueError, r"state_dict\['state'\]\[4\]\['exp_avg'\] .* non-finite"),
    ("adamw-state-gone", _set(("state", 4), {}), ValueError,
     r"state_dict\['state'\]\[4\] \(fallback parameter '2\.weight'\) lacks the "
     r"state of its fallback rule 'adamw'"),
    ("bad-optional-counter", _set(("state", 0, "skipped_steps"), -2), ValueError,
     r"state_dict\['state'\]\[0\]\['skipped_steps'\] \(layer '0'\) must be a "
     r"non-negative int below 2\*\*63, got -2"),
    ("state-not-a-mapping", _set(("state",), [1, 2]), TypeError,
     r"state_dict\['state'\] must be a mapping"),
    ("groups-missing", _delete(("param_groups",)), ValueError,
     r"state_dict lacks 'param_groups'"),
    ("entry-not-a-mapping", _set(("state", 3), 5), TypeError,
     r"state_dict\['state'\]\[3\] must be a mapping"),
    ("groups-not-a-list", _set(("param_groups",), {"params": []}), TypeError,
     r"state_dict\['param_groups'\] must be a list, got dict"),
    ("group-not-a-mapping", _set(("param_groups", 0), [0, 1]), TypeError,
     r"state_dict\['param_groups'\]\[0\] must be a mapping, got list"),
    ("params-not-a-list", _set(("param_groups", 0, "params"), 6), TypeError,
     r"state_dict\['param_groups'\]\[0\]\['params'\] must be a list of parameter "
     r"ids, got int"),
    ("params-unhashable", _set(("param_groups", 0, "params"), [0, 1, [2], 3, 4, 5]),
     ValueError, r"\['params'\] repeats or has an invalid parameter id \[2\]"),
    ("params-too-few", _set(("param_groups", 0, "params"), [0, 1, 2]), ValueError,
     r"parameter groups of sizes \[3\], this optimizer of sizes \[6\]"),
    ("graft-step-alone", _set(("state", 0, "graft_step"), 3), ValueError,
     r"state_dict\['state'\]\[0\] \(layer '0'\) has 'graft_step' without the "
     r"grafting moments"),
    # a bias keeps grafting moments of its own only beside FSDP2's column shards
    ("graft-on-a-bias", _set(("state", 1, "graft_exp_avg"), torch.zeros(3)),
     ValueError, r"state_dict\['state'\]\[1\] \(parameter '0\.bias' of layer "
     r"'0'\) has the unknown entries \['graft_exp_avg'\]"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("edit", "exception", "pattern"),
    [case[1:] for case in CORRUPTIONS],
    ids=[case[0] for case in CORRUPTIONS],
)
def test_corrupted_state_dict_raises_and_changes_nothing(
    edit: Callable[[dict], None], exception: type, pattern: str
) -> None:
    _, _, saved = _trained(momentum=0.9)
    edit(saved)
    model, optimizer, _ = _trained(momentum=0.9)
    before = snapshot(model, optimizer)
    with pytest.raises(exception, match=pattern):
        optimizer.load_state_dict(saved)
    assert_unchanged(model, optimizer, before)
    train(model, optimizer, range(3, 5))  # and it still trains
    assert all_finite(model, optimizer)


def test_a_state_dict_that_is_not_a_mapping_raises_and_changes_nothing() -> None:
    model, optimizer, saved = _trained(momentum=0.9)
    before = snapshot(model, optimizer)
    with pytest.raises(TypeError, match="state_dict must be a mapping, got list"):
        optimizer.load_state_dict(list(saved.items()))
    assert_unchanged(model, optimizer, before)


@pytest.mark.parametrize(
    ("saved", "built"),
    [
        ("triltoeplitz", "triutoeplitz"),
        ("triltopleftdiag", "triutopleftdiag"),
        ("trilbottomrightdiag", "triubottomrightdiag"),
    ],
)
def test_structures_that_store_alike_do_not_load_as_each_other(saved, built) -> None:
    """Their tensors have the same names and shapes: the saved structures decide."""
    _, _, state = _trained(structures=(saved, "dense"))
    model, optimizer, _ = _trained(structures=(built, "dense"))
    before = snapshot(model, optimizer)
    pattern = rf"gives the layer structures \('{saved}', 'dense'\), this optimizer"
    with pytest.raises(ValueError, match=pattern):
        optimizer.load_state_dict(state)
    assert_unchanged(model, optimizer, before)
    assert optimizer.param_groups[0]["structures"] == (built, "dense")


# --------------------------------------------------------------- other rules
@pytest.mark.parametrize(
    ("cls", "edit", "pattern"),
    [
        (KFAC, _set(("state", 0, "updates"), -1), r"\[0\]\['updates'\] \(layer '0'\)"),
        (
            KFAC,
            _delete(("state", 2, "updates")),
            r"\[2\] \(layer '3'\) lacks 'updates'",
        ),
        (KFAC, _transform(("state", 0, "A.mat"), _nan_at_0), r"\['A\.mat'\].*non-fin"),
        (KFAC, _set(("param_groups", 0, "ema_decay"), 1.0), r"ema_decay must be in"),
        (EKFAC, _transform(("state", 2, "eigenvalues"), _inf_at_last), r"eigenvalues"),
        (EKFAC, _delete(("state", 0, "Q_G.mat")), r"missing \['Q_G\.mat'\]"),
    ],
    ids=[
        "kfac-updates-negative",
        "kfac-updates-missing",
        "kfac-nan-factor",
        "kfac-ema-decay",
        "ekfac-inf-eigenvalue",
        "ekfac-basis-missing",
    ],
)
def test_corrupted_kfac_state_raises(cls: type, edit: Callable, pattern: str) -> None:
    _, _, saved = _trained(cls)
    edit(saved)
    model, optimizer, _ = _trained(cls)
    before = snapshot(model, optimizer)
    with pytest.raises((ValueError, TypeError), match=pattern):
        optimizer.load_state_dict(saved)
    assert_unchanged(model, optimizer, before)


# ------------------------------------------------------------- what loads
def test_optional_counters_load() -> None:
    """The step guard's counters may appear (ints or 0-d integer tensors)."""
    _, source, saved = _trained()
    saved["state"][0]["skipped_steps"] = 2
    saved["state"][2]["discarded_factor_updates"] = torch.tensor(1)
    saved["state"][4]["skipped_steps"] = 0
    model, optimizer, _ = _trained()
    optimizer.load_state_dict(saved)
    assert optimizer.state[model[0].weight]["skipped_steps"] == 2
    assert optimizer.state[model[3].weight]["discarded_factor_updates"] == 1
    train(model, optimizer, range(3, 5))
    assert all_finite(model, optimizer)


def test_empty_state_loads_as_the_initial_state() -> None:
    """A state dict with an empty `"state"` restarts every layer and parameter."""
    model, optimizer, saved = _trained()
    saved["state"] = {}
    saved["param_groups"][0]["lr"] = 0.01
    optimizer.load_state_dict(saved)
    fresh = SINGD(make_model(), **OPTIONS)
    fresh.param_groups[0]["lr"] = 0.01
    expected = fresh.state_dict()
    assert_same(expected["state"], optimizer.state_dict()["state"], "state")
    assert optimizer.param_groups[0]["lr"] == 0.01
    train(model, optimizer, range(3, 5))
    assert optimizer.state[model[0].weight]["step"] == 2


@pytest.mark.parametrize("entry", ["absent", "empty"])
def test_frozen_parameter_without_entry_keeps_its_state(entry: str) -> None:
    """`torch.distributed.checkpoint` leaves out parameters that are frozen."""
    model, optimizer, saved = _trained()
    model[2].weight.requires_grad_(False)
    if entry == "absent":
        del saved["state"][4]
    else:
        saved["state"][4] = {}
    kept = copy.deepcopy(optimizer.state[model[2].weight])
    optimizer.load_state_dict(saved)
    assert_same(kept, optimizer.state[model[2].weight], "kept state")


def test_counter_tensor_and_other_factor_dtype_load() -> None:
    """A 0-d integer counter loads; a factor in another dtype is cast to its own."""
    model, optimizer, saved = _trained()
    saved["state"][0]["step"] = torch.tensor(3)
    saved["state"][0]["m_C.mat"] = saved["state"][0]["m_C.mat"].double()
    optimizer.load_state_dict(saved)
    state = optimizer.state[model[0].weight]
    assert state["m_C.mat"].dtype == state["C.mat"].dtype == torch.float32
    assert torch.equal(state["m_C.mat"], saved["state"][0]["m_C.mat"].float())
    train(model, optimizer, range(3, 5))
    assert all_finite(model, optimizer)
