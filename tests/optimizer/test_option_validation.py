"""Options are validated at construction and whenever a step reads them.

Issue 16, items 2 and 3: `inf` and NaN hyperparameters are rejected with the
argument's name and range; an option edited in `param_groups` after construction
(`T = 0`, `lr = NaN`) and a callable `lr_cov` that returns a non-finite, negative
or non-number value raise a clear error before the step changes anything, while
schedulers that set `lr` at every step keep working.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from singd_curvlinops import EKFAC, KFAC, SINGD
from tests.optimizer._state import (
    all_finite,
    assert_unchanged,
    batch,
    make_model,
    snapshot,
    train,
)

INF, NAN = float("inf"), float("nan")

# (option, bad value, pattern) for every real-valued option
FLOAT_OPTIONS = [
    ("lr", INF, r"lr must be >= 0\.0, got inf \(it must be finite\)"),
    ("damping", INF, r"damping must be >= 0\.0, got inf"),
    ("weight_decay", INF, r"weight_decay must be >= 0\.0, got inf"),
    ("momentum", INF, r"momentum must be in \[0\.0, 1\.0\), got inf"),
    ("fallback_lr_ratio", INF, r"fallback_lr_ratio must be >= 0\.0, got inf"),
    ("fallback_eps", INF, r"fallback_eps must be >= 0\.0, got inf"),
    ("fallback_betas", (0.9, INF), r"fallback_betas\[1\] must be in \[0\.0, 1\.0\)"),
    ("fallback_eps", NAN, r"fallback_eps must be >= 0\.0, got nan"),
    ("lr", 10**400, r"lr must be >= 0\.0, got 1000.* \(it must be finite\)"),
    ("max_dense_dim", INF, r"max_dense_dim must be a positive int or None, got inf"),
    ("T", INF, r"T must be a positive int, got inf"),
]
SINGD_OPTIONS = [
    ("lr_cov", INF, r"lr_cov must be >= 0\.0, got inf"),
    ("lr_cov", NAN, r"lr_cov must be >= 0\.0, got nan"),
    ("alpha1", -INF, r"alpha1 must be in \[0\.0, 1\.0\), got -inf"),
]
KFAC_OPTIONS = [("ema_decay", NAN, r"ema_decay must be in \[0\.0, 1\.0\), got nan")]
CASES = (
    [(SINGD, *case) for case in FLOAT_OPTIONS + SINGD_OPTIONS]
    + [(KFAC, *case) for case in FLOAT_OPTIONS + KFAC_OPTIONS]
    + [(EKFAC, *case) for case in KFAC_OPTIONS]
)
IDS = [f"{cls.__name__}-{name}-{value}"[:40] for cls, name, value, _ in CASES]


@pytest.mark.parametrize(("cls", "name", "value", "pattern"), CASES, ids=IDS)
def test_non_finite_hyperparameter_is_rejected(
    cls: type, name: str, value: Any, pattern: str
) -> None:
    with pytest.raises(ValueError, match=pattern):
        cls(make_model(), **{name: value})
    model = make_model()  # the same check for a parameter group's option
    groups = [
        {"params": model[0].parameters()},
        {"params": [*model[2].parameters(), *model[3].parameters()], name: value},
    ]
    with pytest.raises(ValueError, match=pattern):
        cls(model, groups)


def test_options_beyond_the_parameters_dtype_are_rejected_at_construction() -> None:
    """The step would pass them as `alpha` to float32 tensors, which fails."""
    names = [(SINGD, "lr"), (SINGD, "lr_cov"), (KFAC, "weight_decay")]
    for cls, name in [*names, (SINGD, "damping"), (KFAC, "damping")]:
        with pytest.raises(ValueError, match=rf"{name} = 1e\+39 does not fit"):
            cls(make_model(), **{name: 1e39})
    # IKFAC adds damping · KᵀK as `alpha`: 1e5 does not fit float16 factors
    with pytest.raises(ValueError, match=r"damping = 100000 does not fit torch.f"):
        SINGD(make_model().half(), kfac_like=True, damping=1e5)
    model = make_model().double()  # float64 holds it: the guard's business then
    optimizer = SINGD(model, lr=1e39, lr_cov=1e39)
    assert optimizer.param_groups[0]["lr"] == 1e39
    with pytest.raises(ValueError, match=r"lr_cov = 1e\+39 does not fit torch.float32"):
        SINGD(model, lr_cov=1e39, preconditioner_dtype=(torch.float32, None))


@pytest.mark.parametrize("value", [INF, NAN, -1.0, True])
def test_bad_init_grad_scale_is_rejected(value: float) -> None:
    with pytest.raises(ValueError, match=r"init_grad_scale must be > 0, got"):
        SINGD(make_model(), init_grad_scale=value)


# --------------------------------------------------------- edited param_groups
# (id, edit of param_groups[0], exception, pattern)
EDITS = [
    ("T-zero", lambda g: g.update(T=0), ValueError,
     r"param_groups\[0\]: T must be a positive int, got 0"),
    ("T-float", lambda g: g.update(T=2.5), ValueError,
     r"param_groups\[0\]: T must be a positive int, got 2\.5"),
    ("lr-nan", lambda g: g.update(lr=NAN), ValueError,
     r"param_groups\[0\]: lr must be >= 0\.0, got nan"),
    ("lr-inf", lambda g: g.update(lr=INF), ValueError,
     r"param_groups\[0\]: lr must be >= 0\.0, got inf"),
    ("lr-tensor", lambda g: g.update(lr=torch.tensor([0.1, 0.2])), TypeError,
     r"param_groups\[0\]: lr must be a number"),
    ("momentum-two", lambda g: g.update(momentum=2), ValueError,
     r"param_groups\[0\]: momentum must be in \[0\.0, 1\.0\), got 2"),
    ("damping-none", lambda g: g.update(damping=None), TypeError,
     r"param_groups\[0\]: damping must be a number, got None"),
    ("lr_cov-inf", lambda g: g.update(lr_cov=INF), ValueError,
     r"param_groups\[0\]: lr_cov must be >= 0\.0, got inf"),
    ("betas-nan", lambda g: g.update(fallback_betas=(NAN, 0.9)), ValueError,
     r"param_groups\[0\]: fallback_betas\[0\] must be in"),
    ("loss_average", lambda g: g.update(loss_average="mean"), ValueError,
     r"param_groups\[0\]: loss_average must be one of"),
    ("T-deleted", lambda g: g.pop("T"), ValueError,
     r"param_groups\[0\] lacks the option 'T'"),
    ("structures-fixed", lambda g: g.update(structures=("diagonal", "diagonal")),
     ValueError, r"param_groups\[0\]: structures is fixed when the optimizer is"),
    ("max_dense_dim-fixed", lambda g: g.update(max_dense_dim=8192), ValueError,
     r"param_groups\[0\]: max_dense_dim is fixed .* was 4096, now 8192"),
    ("dtype-fixed", lambda g: g.update(preconditioner_dtype=(torch.float16, None)),
     ValueError, r"param_groups\[0\]: preconditioner_dtype is fixed"),
    ("fallback-none", lambda g: g.update(fallback=None), ValueError,
     r"param_groups\[0\]: fallback=None, but the group holds parameters"),
    ("lr_cov-returns-nan", lambda g: g.update(lr_cov=lambda step: NAN), ValueError,
     r"lr_cov \(a callable\) returned nan at step 3; it must return a finite"),
    ("lr_cov-returns-negative", lambda g: g.update(lr_cov=lambda step: -1),
     ValueError, r"lr_cov \(a callable\) returned -1 at step 3"),
    ("lr_cov-returns-inf", lambda g: g.update(lr_cov=lambda step: INF), ValueError,
     r"lr_cov \(a callable\) returned inf at step 3"),
    ("lr_cov-returns-str", lambda g: g.update(lr_cov=lambda step: "0.1"),
     ValueError, r"lr_cov \(a callable\) returned '0\.1' at step 3"),
    ("lr_cov-returns-tensor", lambda g: g.update(lr_cov=lambda s: torch.ones(2)),
     ValueError, r"lr_cov \(a callable\) returned tensor\(\[1\., 1\.\]\) at step 3"),
    # beyond float32, the parameters' dtype: failed inside the step before
    ("lr-beyond-float32", lambda g: g.update(lr=1e39), ValueError,
     r"param_groups\[0\]: lr = 1e\+39 does not fit torch.float32 \(largest"),
    ("weight_decay-beyond-float32", lambda g: g.update(weight_decay=1e39),
     ValueError, r"weight_decay = 1e\+39 does not fit torch.float32"),
    ("lr_cov-beyond-float32", lambda g: g.update(lr_cov=1e39), ValueError,
     r"lr_cov = 1e\+39 does not fit torch.float32 .* the factors it scales"),
    ("damping-beyond-float32", lambda g: g.update(damping=1e39), ValueError,
     r"damping = 1e\+39 does not fit torch.float32 .* the factors it scales"),
    ("lr_cov-returns-beyond-float32", lambda g: g.update(lr_cov=lambda s: 1e39),
     ValueError, r"param_groups\[0\] at step 3: lr_cov = 1e\+39 does not fit"),
    ("fallback-lr-beyond-float32", lambda g: g.update(fallback_lr_ratio=1e40),
     ValueError, r"lr · fallback_lr_ratio = 5e\+38 does not fit torch.float32"),
]  # fmt: skip


@pytest.mark.parametrize("where", ["before forward", "before step"])
@pytest.mark.parametrize(
    ("edit", "exception", "pattern"),
    [case[1:] for case in EDITS],
    ids=[case[0] for case in EDITS],
)
def test_edited_option_raises_before_anything_changes(
    edit: Callable[[dict], Any], exception: type, pattern: str, where: str
) -> None:
    """Edited before the forward pass, the hooks raise; after it, `step` does."""
    model = make_model()
    optimizer = SINGD(model, lr=0.05, T=1)
    train(model, optimizer, range(3))
    good = dict(optimizer.param_groups[0])
    optimizer.zero_grad()
    X, y = batch(3)
    if where == "before step":
        torch.nn.functional.mse_loss(model(X), y).backward()
    edit(optimizer.param_groups[0])
    before = snapshot(model, optimizer)
    with pytest.raises(exception, match=pattern):
        if where == "before forward":
            torch.nn.functional.mse_loss(model(X), y).backward()
        optimizer.step()
    assert_unchanged(model, optimizer, before)
    # repaired, the run goes on
    optimizer.param_groups[0].clear()
    optimizer.param_groups[0].update(good)
    train(model, optimizer, range(4, 6))
    assert optimizer.state[model[0].weight]["step"] == 5
    assert all_finite(model, optimizer)


def test_scheduler_and_valid_edits_keep_working() -> None:
    model = make_model()
    optimizer = SINGD(model, lr=0.1, T=1)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.5)
    for step in range(3):
        train(model, optimizer, range(step, step + 1))
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.0125)
    optimizer.param_groups[0]["T"] = 3  # a valid edit takes effect
    optimizer.param_groups[0]["fallback_betas"] = [0.8, 0.99]  # normalised
    train(model, optimizer, range(3, 4))
    assert optimizer.param_groups[0]["fallback_betas"] == (0.8, 0.99)
    assert not optimizer._due(optimizer.layers[0])  # step 4 is not a multiple of 3
    assert all_finite(model, optimizer)


def test_callable_lr_cov_is_called_once_per_due_layer() -> None:
    calls: list[int] = []

    def schedule(step: int) -> float:
        calls.append(step)
        return 0.05

    model = make_model()
    optimizer = SINGD(model, lr_cov=schedule, T=2)
    train(model, optimizer, range(4))
    assert calls == [0, 0, 2, 2]  # two layers, updated at steps 0 and 2


def test_preconditioner_dtype_none_means_the_parameters_dtype_for_both() -> None:
    """The docs' "None: the parameter's" also holds for the whole option."""
    model = nn.Sequential(nn.Linear(4, 3)).double()
    optimizer = SINGD(model, preconditioner_dtype=None)
    assert optimizer.param_groups[0]["preconditioner_dtype"] == (None, None)
    assert optimizer.state[model[0].weight]["K.mat"].dtype == torch.float64
    with pytest.raises(ValueError, match=r"or None for both, got torch\.float32"):
        SINGD(model, preconditioner_dtype=torch.float32)
