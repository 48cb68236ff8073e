"""Property-based tests: randomly corrupted state dicts load validly or raise cleanly.

Hypothesis corrupts a valid state dict (of SINGD with dense and with sparse
factors, KFAC and EKFAC, all on a model with fallback parameters, after factor
updates and with momentum) one to three times: it deletes a key anywhere, changes
a tensor's dtype or shape, writes NaN or an infinity into it, replaces a value by
a bad one (NaN, infinities, negative, huge, wrong types), drops or repeats a
parameter id, adds an unknown parameter id, entry or option. Each corrupted state
dict either

- loads, and the optimizer then takes two steps with finite parameters and state,
  or
- raises `ValueError` or `TypeError`, and the optimizer and the model are exactly
  as before.

Any other exception, or a load that leaves the run non-finite, fails the test.
The examples are derandomized and bounded (`EXAMPLES` per configuration), so that
the module runs in seconds.
"""

from __future__ import annotations

import copy
from functools import cache
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from singd_curvlinops import EKFAC, KFAC, SINGD
from tests.optimizer._state import (
    all_finite,
    assert_unchanged,
    make_model,
    snapshot,
    train,
)

EXAMPLES = 30
# derandomize: the same examples in every run; no database to replay
PROPERTY = settings(
    max_examples=EXAMPLES, deadline=None, database=None, derandomize=True
)
CONFIGURATIONS = {
    "singd-dense": (SINGD, {"structures": ("dense", "dense"), "T": 2, "lr": 0.05}),
    "singd-sparse": (
        SINGD,
        {"structures": ("triltoeplitz", "block2diagonal"), "T": 2, "lr": 0.05},
    ),
    "kfac": (KFAC, {"T": 2, "lr": 0.05}),
    "ekfac": (EKFAC, {"T": 2, "lr": 0.05}),
}
BAD_VALUES = [
    float("nan"),
    float("inf"),
    -float("inf"),
    -1,
    0,
    2,
    1.5,
    10**400,
    "x",
    None,
    True,
    [],
]
DTYPES = [
    torch.int64,
    torch.bool,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.complex64,
]


@cache
def valid_state_dict(name: str) -> dict:
    """The state dict after three steps (a factor update at steps 0 and 2)."""
    cls, options = CONFIGURATIONS[name]
    model = make_model()
    optimizer = cls(model, **options)
    train(model, optimizer, range(3))
    return copy.deepcopy(optimizer.state_dict())


def paths(state_dict: dict) -> list[tuple]:
    """Every place of the state dict that a corruption may change."""
    found: list[tuple] = [("state",), ("param_groups",)]
    groups = state_dict.get("param_groups")
    if isinstance(groups, list):
        for index, group in enumerate(groups):
            found.append(("param_groups", index))
            if isinstance(group, dict):
                found += [("param_groups", index, key) for key in group]
    state = state_dict.get("state")
    if isinstance(state, dict):
        for param_id, entry in state.items():
            found.append(("state", param_id))
            if isinstance(entry, dict):
                found += [("state", param_id, key) for key in entry]
    return [path for path in found if _exists(state_dict, path)]


def _exists(state_dict: dict, path: tuple) -> bool:
    target: Any = state_dict
    for key in path:
        if not isinstance(target, (dict, list)):
            return False
        if isinstance(target, list) and not (
            isinstance(key, int) and 0 <= key < len(target)
        ):
            return False
        if isinstance(target, dict) and key not in target:
            return False
        target = target[key]
    return True


def _parent(state_dict: dict, path: tuple) -> Any:
    target: Any = state_dict
    for key in path[:-1]:
        target = target[key]
    return target


@st.composite
def corruptions(draw: st.DrawFn, state_dict: dict) -> dict:
    """Apply one to three random corruptions to a copy of `state_dict`."""
    state_dict = copy.deepcopy(state_dict)
    for _ in range(draw(st.integers(1, 3))):
        places = paths(state_dict)
        if not places:  # both top-level keys are gone
            break
        path = draw(st.sampled_from(places))
        parent = _parent(state_dict, path)
        key = path[-1]
        value = parent[key]
        kinds = ["delete", "replace"]
        if isinstance(value, Tensor):
            kinds += ["dtype", "reshape", "non-finite"]
        if isinstance(value, list):
            kinds += ["drop-item", "repeat-item", "bad-item"]
        if isinstance(value, dict):
            kinds += ["clear", "add-key"]
        kind = draw(st.sampled_from(kinds))
        if kind == "delete":
            del parent[key]
        elif kind == "replace":
            parent[key] = draw(st.sampled_from(BAD_VALUES))
        elif kind == "dtype":
            parent[key] = value.to(draw(st.sampled_from(DTYPES)))
        elif kind == "reshape":
            parent[key] = _reshaped(value, draw(st.integers(0, 2)))
        elif kind == "non-finite" and value.numel() and value.is_floating_point():
            value = value.clone()
            index = draw(st.integers(0, value.numel() - 1))
            value.view(-1)[index] = draw(st.sampled_from([float("nan"), float("inf")]))
            parent[key] = value
        elif kind == "drop-item" and value:
            value.pop(draw(st.integers(0, len(value) - 1)))
        elif kind == "repeat-item" and value:
            value.append(value[draw(st.integers(0, len(value) - 1))])
        elif kind == "bad-item" and value:
            value[draw(st.integers(0, len(value) - 1))] = draw(
                st.sampled_from(BAD_VALUES)
            )
        elif kind == "clear":
            value.clear()
        elif kind == "add-key":
            new_key = draw(
                st.sampled_from([99, "velocity", "skipped_steps", "K.extra"])
            )
            value[new_key] = draw(st.sampled_from([torch.zeros(3), 1, {}]))
    return state_dict


def _reshaped(tensor: Tensor, how: int) -> Tensor:
    if how == 0 or tensor.ndim == 0:
        return tensor.reshape(-1, 1)
    if how == 1:
        return tensor.flatten() if tensor.ndim > 1 else tensor.reshape(1, -1)
    return tensor.narrow(0, 0, max(tensor.shape[0] - 1, 0))


@pytest.mark.parametrize("name", sorted(CONFIGURATIONS))
@PROPERTY
@given(data=st.data())
def test_corrupted_state_dict_loads_validly_or_raises_cleanly(
    name: str, data: st.DataObject
) -> None:
    corrupted = data.draw(corruptions(valid_state_dict(name)))
    cls, options = CONFIGURATIONS[name]
    model = make_model(seed=1)
    optimizer = cls(model, **options)
    optimizer.load_state_dict(copy.deepcopy(valid_state_dict(name)))
    before = snapshot(model, optimizer)
    try:
        optimizer.load_state_dict(corrupted)
    except (ValueError, TypeError):
        assert_unchanged(model, optimizer, before)
        return
    train(model, optimizer, range(3, 5))
    assert all_finite(model, optimizer)


def test_the_corruptions_reach_both_outcomes() -> None:
    """The property is not vacuous: some corruptions load, most raise."""
    outcomes = {"loaded": 0, "raised": 0}

    @settings(max_examples=60, deadline=None, database=None, derandomize=True)
    @given(data=st.data())
    def count(data: st.DataObject) -> None:
        corrupted = data.draw(corruptions(valid_state_dict("singd-dense")))
        optimizer = SINGD(make_model(), **CONFIGURATIONS["singd-dense"][1])
        try:
            optimizer.load_state_dict(corrupted)
        except (ValueError, TypeError):
            outcomes["raised"] += 1
        else:
            outcomes["loaded"] += 1

    count()
    assert outcomes["loaded"] >= 3
    assert outcomes["raised"] >= 30
