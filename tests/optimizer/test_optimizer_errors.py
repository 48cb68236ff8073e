"""Bad arguments to `SINGD` raise errors that name the argument and what is allowed.

Every option that can be set per parameter group is checked twice: as a
constructor argument and as a value in a parameter group dictionary.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from singd_curvlinops import SINGD


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


# (id, kwargs, exception, pattern) for options that may also be set per group
OPTION_ERRORS = [
    ("structure-unknown", {"structures": ("dense", "nope")}, ValueError,
     r"Unknown structure 'nope'\. Valid names: .*dense.*diagonal.*"
     r"triltoeplitz.*block\{B\}diagonal.*hierarchical\{K1\}_\{K2\}"),
    ("structure-block0", {"structures": ("block0diagonal", "dense")}, ValueError,
     r"Unknown structure 'block0diagonal'\. Valid names: "),
    ("structure-not-a-pair", {"structures": "dense"}, ValueError,
     r"structures must be a pair \(K structure, C structure\), got 'dense'"),
    ("structure-triple", {"structures": ("dense",) * 3}, ValueError,
     r"structures must be a pair"),
    ("structure-not-str", {"structures": ("dense", 3)}, TypeError,
     r"structure name must be a str"),
    ("lr-negative", {"lr": -0.1}, ValueError, r"lr must be >= 0\.0, got -0\.1"),
    ("lr-nan", {"lr": float("nan")}, ValueError, r"lr must be >= 0\.0, got nan"),
    ("lr-str", {"lr": "0.1"}, TypeError, r"lr must be a number, got '0\.1'"),
    ("lr-bool", {"lr": True}, TypeError, r"lr must be a number, got True"),
    ("damping-negative", {"damping": -1e-3}, ValueError,
     r"damping must be >= 0\.0, got -0\.001"),
    ("lr_cov-negative", {"lr_cov": -0.01}, ValueError,
     r"lr_cov must be >= 0\.0, got -0\.01"),
    ("lr_cov-str", {"lr_cov": "fast"}, TypeError, r"lr_cov must be a number"),
    ("weight_decay-negative", {"weight_decay": -1.0}, ValueError,
     r"weight_decay must be >= 0\.0, got -1\.0"),
    ("momentum-negative", {"momentum": -0.1}, ValueError,
     r"momentum must be in \[0\.0, 1\.0\), got -0\.1"),
    ("momentum-one", {"momentum": 1.0}, ValueError,
     r"momentum must be in \[0\.0, 1\.0\), got 1\.0"),
    ("alpha1-negative", {"alpha1": -0.1}, ValueError,
     r"alpha1 must be in \[0\.0, 1\.0\), got -0\.1"),
    ("alpha1-one", {"alpha1": 1.0}, ValueError,
     r"alpha1 must be in \[0\.0, 1\.0\), got 1\.0"),
    ("T-zero", {"T": 0}, ValueError, r"T must be a positive int, got 0"),
    ("T-negative", {"T": -1}, ValueError, r"T must be a positive int, got -1"),
    ("T-float", {"T": 2.5}, ValueError, r"T must be a positive int, got 2\.5"),
    ("T-bool", {"T": True}, ValueError, r"T must be a positive int, got True"),
    ("loss_average-unknown", {"loss_average": "mean"}, ValueError,
     r"loss_average must be one of \[None, 'batch', 'batch\+sequence'\], "
     r"got 'mean'"),
    ("kfac_approx-unknown", {"kfac_approx": "full"}, ValueError,
     r"kfac_approx must be one of \['expand', 'reduce'\], got 'full'"),
    ("kfac_like-not-bool", {"kfac_like": "yes"}, TypeError,
     r"kfac_like must be a bool, got 'yes'"),
    ("normalize_lr_cov-not-bool", {"normalize_lr_cov": 1}, TypeError,
     r"normalize_lr_cov must be a bool, got 1"),
    ("preconditioner_dtype-int", {"preconditioner_dtype": (torch.int32, None)},
     ValueError, r"preconditioner_dtype must be a pair of floating torch dtypes "
     r"or None \(one per factor; None: the parameter's dtype\), or None for both, "
     r"got \(torch\.int32, None\)"),
    ("preconditioner_dtype-single", {"preconditioner_dtype": torch.float32},
     ValueError, r"preconditioner_dtype must be a pair of floating torch dtypes"),
    ("preconditioner_dtype-str", {"preconditioner_dtype": ("float32", "float32")},
     ValueError, r"preconditioner_dtype must be a pair of floating torch dtypes"),
    ("preconditioner_dtype-complex",
     {"preconditioner_dtype": (None, torch.complex64)},
     ValueError, r"preconditioner_dtype must be a pair of floating torch dtypes"),
]  # fmt: skip

# (id, kwargs, exception, pattern) for constructor-only arguments
CONSTRUCTOR_ERRORS = [
    ("init_grad_scale-zero", {"init_grad_scale": 0.0}, ValueError,
     r"init_grad_scale must be > 0, got 0\.0"),
    ("init_grad_scale-negative", {"init_grad_scale": -2.0**16}, ValueError,
     r"init_grad_scale must be > 0, got -65536\.0"),
    ("init_grad_scale-nan", {"init_grad_scale": float("nan")}, ValueError,
     r"init_grad_scale must be > 0, got nan"),
    ("init_grad_scale-bool", {"init_grad_scale": True}, ValueError,
     r"init_grad_scale must be > 0, got True"),
]  # fmt: skip


def _ids(table):
    return [case[0] for case in table]


def _cases(table):
    return [case[1:] for case in table]


@pytest.mark.parametrize(
    "kwargs, exception, pattern",
    _cases(OPTION_ERRORS + CONSTRUCTOR_ERRORS),
    ids=_ids(OPTION_ERRORS + CONSTRUCTOR_ERRORS),
)
def test_bad_constructor_argument(kwargs, exception, pattern):
    with pytest.raises(exception, match=pattern):
        SINGD(_model(), **kwargs)


@pytest.mark.parametrize(
    "kwargs, exception, pattern", _cases(OPTION_ERRORS), ids=_ids(OPTION_ERRORS)
)
def test_bad_parameter_group_option(kwargs, exception, pattern):
    model = _model()
    good = {"params": model[0].parameters()}
    bad = {"params": model[2].parameters(), **kwargs}
    with pytest.raises(exception, match=pattern):
        SINGD(model, params=[good, bad])


@pytest.mark.parametrize(
    "kwargs, exception, pattern", _cases(OPTION_ERRORS), ids=_ids(OPTION_ERRORS)
)
def test_failed_add_param_group_leaves_the_optimizer_unchanged(
    kwargs, exception, pattern
):
    model = _model()
    opt = SINGD(model, params=model[0].parameters())
    with pytest.raises(exception, match=pattern):
        opt.add_param_group({"params": model[2].parameters(), **kwargs})
    assert len(opt.param_groups) == 1
    # the optimizer still works, and the rejected layer is not trained
    weight = model[2].weight.detach().clone()
    model(torch.randn(5, 3)).square().sum().backward()
    opt.step()
    assert torch.equal(model[2].weight, weight)


def test_valid_options_are_accepted_per_group():
    """Counterpart of the error tables: valid edge values construct fine."""
    model = _model()
    opt = SINGD(
        model,
        params=[
            {"params": model[0].parameters(), "momentum": 0.0, "alpha1": 0.0},
            {"params": model[2].parameters(), "T": 1, "structures": ["diagonal"] * 2},
        ],
        lr=0.0,
        damping=0.0,
        lr_cov=lambda step: 0.1,
        init_grad_scale=2.0**16,
        preconditioner_dtype=[torch.float64, None],
    )
    assert opt.param_groups[0]["momentum"] == 0.0
    assert opt.param_groups[1]["structures"] == ("diagonal", "diagonal")
    assert opt.param_groups[1]["preconditioner_dtype"] == (torch.float64, None)


# ----------------------------------------------------------- models and params
class _Mixed(nn.Module):
    """A supported layer next to unsupported ones (and a frozen one)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 3)
        self.lin = nn.Linear(3, 4)
        self.bn = nn.BatchNorm1d(4)
        self.circular = nn.Conv2d(1, 1, 3, padding=1, padding_mode="circular")
        self.frozen = nn.LayerNorm(4)
        self.frozen.requires_grad_(False)
        self.scale = nn.Parameter(torch.ones(()))


UNSUPPORTED = [  # with fallback=None (an Embedding is a supported layer)
    "bn.weight",
    "bn.bias",
    "circular.weight",
    "circular.bias",
    "scale",
]


@pytest.mark.parametrize(
    "model",
    [
        nn.Sequential(nn.ReLU()),
        nn.Sequential(),
        nn.Sequential(nn.Embedding(4, 2, max_norm=1.0), nn.LayerNorm(2)),
        nn.Sequential(nn.Conv2d(1, 1, 3, padding=1, padding_mode="reflect")),
        nn.Sequential(nn.Linear(2, 2).requires_grad_(False)),
    ],
    ids=[
        "relu",
        "empty",
        "maxnorm-embedding-layernorm",
        "reflect-conv",
        "frozen-linear",
    ],
)
def test_model_without_supported_layer(model):
    with pytest.raises(
        ValueError, match=r"model has no supported layer.*Linear.*Conv2d"
    ):
        SINGD(model)


@pytest.mark.parametrize("model", [None, [nn.Linear(2, 2)], nn.Linear(2, 2).weight])
def test_model_not_a_module(model):
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module"):
        SINGD(model)


def test_foreign_parameters_raise():
    model = _model()
    stranger = nn.Parameter(torch.zeros(3))
    with pytest.raises(
        ValueError,
        match=r"1 parameter\(s\) of shapes \[\(3,\)\] do not belong to a supported "
        r"layer",
    ):
        SINGD(model, params=[*model.parameters(), stranger], fallback=None)


def test_unsupported_layer_parameters_raise():
    model = _Mixed()
    with pytest.raises(
        ValueError, match=r"2 parameter\(s\) of shapes \[\(4,\), \(4,\)\] do not belong"
    ):
        SINGD(
            model,
            params=[*model.lin.parameters(), *model.bn.parameters()],
            fallback=None,
        )


def test_parameters_of_another_model_raise():
    with pytest.raises(ValueError, match="do not belong to a supported layer"):
        SINGD(_model(), params=_model().parameters())


# (weight and bias in different groups of the constructor are accepted since
# issue 13: tests/optimizer/test_param_groups_split.py)
@pytest.mark.parametrize("split", ["bias-missing", "weight-missing"])
def test_weight_and_bias_split(split):
    model = _model()
    first, second = model[0], model[2]
    params = {
        "bias-missing": [first.weight, *second.parameters()],
        "weight-missing": [first.bias, *second.parameters()],
    }[split]
    with pytest.raises(
        ValueError,
        match=r"The weight and bias of layer '0' must be in the same parameter group",
    ):
        SINGD(model, params=params)


def test_unsupported_parameters_warn_once_naming_them():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        opt = SINGD(_Mixed(), fallback=None)
    messages = [str(w.message) for w in record if w.category is UserWarning]
    assert len(messages) == 1, messages
    for name in UNSUPPORTED:
        assert name in messages[0]
    assert "frozen" not in messages[0]
    assert "lin." not in messages[0]
    assert record[0].filename == __file__  # points at the caller
    assert len(opt.param_groups[0]["params"]) == 3  # lin.weight, lin.bias, emb


def test_unsupported_parameters_no_warning_when_disabled():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = SINGD(_Mixed(), warn_unsupported=False, fallback=None)
    assert len(opt.param_groups[0]["params"]) == 3


def test_no_warning_when_every_parameter_is_supported():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SINGD(_model())


def test_no_warning_when_params_are_given():
    model = _Mixed()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SINGD(model, params=model.lin.parameters())
