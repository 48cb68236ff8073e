"""The structure policy and the memory budget (`structures`, `max_dense_dim`)."""

from __future__ import annotations

import pytest
from torch import nn

from singd_curvlinops import KFAC, SINGD
from singd_curvlinops.structure_policy import stored_numbers
from tests.layers._helpers import LargestTensor


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(40, 10), nn.Tanh(), nn.Linear(10, 300))


def _structures(optimizer) -> dict:
    return {layer.name: layer.structures for layer in optimizer.layers}


def test_auto_is_dense_within_the_budget_and_diagonal_above() -> None:
    optimizer = SINGD(_model(), max_dense_dim=100)
    assert _structures(optimizer) == {
        "0": ("dense", "dense"),
        "2": ("dense", "diagonal"),
    }
    assert "C.diag" in optimizer.state[optimizer.layers[1].weight]
    kfac = KFAC(_model(), max_dense_dim=100)
    assert _structures(kfac) == {"0": ("dense", "dense"), "2": ("dense", "diagonal")}


def test_a_dimension_equal_to_the_budget_is_within_it() -> None:
    """`max_dense_dim` is the largest dense dimension (the first layer's K: 41)."""
    assert _structures(SINGD(_model(), max_dense_dim=41))["0"] == ("dense", "dense")
    assert _structures(SINGD(_model(), max_dense_dim=40))["0"] == ("diagonal", "dense")
    dense = ("dense", "dense")
    optimizer = SINGD(_model(), structures=dense, max_dense_dim=300)
    assert _structures(optimizer)["2"] == dense
    with pytest.raises(ValueError, match="dimension 300"):
        SINGD(_model(), structures=dense, max_dense_dim=299)


def test_callable_policy_is_asked_per_layer() -> None:
    asked = []

    def policy(name, dims):
        asked.append((name, dims))
        return ("diagonal", "dense") if name == "0" else ("dense", "block5diagonal")

    optimizer = SINGD(_model(), structures=policy, max_dense_dim=None)
    assert asked == [("0", (41, 10)), ("2", (11, 300))]
    assert _structures(optimizer) == {
        "0": ("diagonal", "dense"),
        "2": ("dense", "block5diagonal"),
    }


@pytest.mark.parametrize(
    "structures", [("dense", "dense"), lambda name, dims: ("dense", "dense")]
)
def test_factor_over_the_budget_raises_naming_layer_dimension_and_options(
    structures,
) -> None:
    with pytest.raises(ValueError) as error:
        SINGD(_model(), structures=structures, max_dense_dim=100)
    message = str(error.value)
    for part in (
        "Layer '2'",
        "output-side (C)",
        "dimension 300",
        "max_dense_dim",
        "'auto'",
    ):
        assert part in message, part


def test_a_layer_named_in_its_own_group_may_exceed_the_budget() -> None:
    model = _model()
    optimizer = SINGD(
        model,
        [
            {"params": model[0].parameters()},
            {"params": model[2].parameters(), "max_dense_dim": None},
        ],
        structures=("dense", "dense"),
        max_dense_dim=100,
    )
    assert _structures(optimizer)["2"] == ("dense", "dense")


def test_budget_counts_stored_numbers_without_allocating() -> None:
    recorder = LargestTensor()
    with recorder:
        assert stored_numbers("dense", 100_000) == 10**10
        assert stored_numbers("diagonal", 100_000) == 100_000
    assert recorder.largest == 0  # meta tensors only


def test_vocabulary_sized_output_layer_is_refused_dense() -> None:
    """A language model's 50,257 x 50,257 factor (9.4 GiB) is refused at once."""
    model = nn.Sequential(nn.Embedding(50_257, 4), nn.Linear(4, 50_257, bias=False))
    with pytest.raises(ValueError, match=r"Layer '1'.*dimension 50257"):
        SINGD(model, structures=("dense", "dense"))
    optimizer = SINGD(model)  # auto: diagonal
    assert _structures(optimizer) == {
        "0": ("diagonal", "dense"),
        "1": ("dense", "diagonal"),
    }


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"structures": "dense"}, r"structures must be a pair"),
        ({"structures": ("dense", "nonsense")}, r"nonsense"),
        ({"max_dense_dim": 0}, r"max_dense_dim must be a positive int or None"),
        ({"max_dense_dim": 2.5}, r"max_dense_dim must be a positive int or None"),
        (
            {"structures": lambda name, dims: "dense"},
            r"must return a pair|no valid pair",
        ),
    ],
)
def test_bad_policies(options, match) -> None:
    with pytest.raises(ValueError, match=match):
        SINGD(_model(), **options)


def test_structures_policy_survives_a_checkpoint() -> None:
    def policy(name, dims):
        return ("diagonal", "diagonal")

    model = _model()
    optimizer = SINGD(model, structures=policy)
    state_dict = optimizer.state_dict()
    assert isinstance(state_dict["param_groups"][0]["structures"], str)
    twin = SINGD(model, structures=policy)
    twin.load_state_dict(state_dict)
    assert twin.param_groups[0]["structures"] is policy
    with pytest.raises(ValueError, match="callable structures"):
        SINGD(model, structures=("diagonal", "diagonal")).load_state_dict(state_dict)
