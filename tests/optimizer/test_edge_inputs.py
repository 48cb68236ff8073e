"""Edge inputs: empty batches contribute nothing; layers without entries are left out.

An empty batch (`N = 0`) of any layer type runs forward and backward without an
error and leaves the statistics, and hence the step, exactly as if it had not been
there (float64). A step after only empty batches is a step without statistics
and with zero gradients. A layer whose weight has no entries is not preconditioned:
its parameters go to the fallback rule, or are named in an error.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from singd_curvlinops import EKFAC, KFAC, SINGD
from singd_curvlinops import statistics as stats
from singd_curvlinops.layers import EmbeddingAdapter
from singd_curvlinops.pending import PendingStatistics
from singd_curvlinops.per_example import ExampleGradients
from singd_curvlinops.structures import DenseMatrix
from tests.optimizer._layer_cases import CASES

OPTIMIZERS = (SINGD, KFAC, EKFAC)


@pytest.fixture(autouse=True)
def _float64():
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(dtype)


def _loss(output: Tensor) -> Tensor:
    """A sum loss (finite on an empty batch)."""
    return output.square().sum()


def _pass(model: nn.Module, inputs: tuple, scale: float = 1.0) -> None:
    (_loss(model(*inputs)) * scale).backward()


def _pending(optimizer: Any) -> dict[str, tuple[list[Tensor], int]]:
    """The collector's pending statistics by layer name: tensors and examples."""
    return {
        layer.name: (record.H_K.tensors() + record.H_C.tensors(), record.num_examples)
        for layer, record in optimizer._collector.pending.items()
    }


def _assert_same(actual: Any, expected: Any) -> None:
    """Compare nested states (tensors to 1e-12)."""
    if isinstance(expected, Tensor):
        torch.testing.assert_close(actual, expected, atol=1e-12, rtol=0)
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys()
        for key in expected:
            _assert_same(actual[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            _assert_same(a, e)
    else:
        assert actual == expected


def _pair(
    case: str, cls: type, **options: Any
) -> tuple[nn.Module, Any, nn.Module, Any]:
    """Two identical models, each with its optimizer."""
    torch.manual_seed(0)
    model = CASES[case][0]()
    twin = copy.deepcopy(model)
    options = {"T": 1, "lr": 0.1, **options}
    return model, cls(model, **options), twin, cls(twin, **options)


@pytest.mark.parametrize(
    ("case", "cls"),
    [
        (case, cls)
        for case in CASES
        for cls in OPTIMIZERS
        # EKFAC does not take an embedding's one-hot rows on any batch (its
        # per-example gradients need dense rows): not an edge-input matter
        if (case, cls) != ("embedding", EKFAC)
    ],
    ids=lambda value: value if isinstance(value, str) else value.__name__,
)
def test_an_empty_batch_contributes_nothing(case: str, cls: type) -> None:
    model, optimizer, twin, reference = _pair(case, cls, loss_average=None)
    inputs = CASES[case][1]
    torch.manual_seed(1)
    empty, batch = inputs(0), inputs(6)
    _pass(model, empty)  # raises nothing ...
    assert not optimizer._collector.pending  # ... and collects nothing
    _pass(model, batch)
    _pass(twin, batch)
    _assert_same(_pending(optimizer), _pending(reference))
    optimizer.step()
    reference.step()
    _assert_same(list(model.parameters()), list(twin.parameters()))
    _assert_same(optimizer.state_dict(), reference.state_dict())


@pytest.mark.parametrize("loss_average", [None, "batch", "batch+sequence"])
@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_an_empty_micro_batch_leaves_accumulation_unchanged(
    cls: type, loss_average: str | None
) -> None:
    model, optimizer, twin, reference = _pair(
        "linear-sequence", cls, loss_average=loss_average, kfac_approx="expand"
    )
    inputs = CASES["linear-sequence"][1]
    torch.manual_seed(1)
    first, empty, second = inputs(3), inputs(0), inputs(5)
    for _ in range(2):
        # the PyTorch convention: each micro-batch's loss over the total examples
        for micro in (first, empty, second):
            _pass(model, micro, 1 / 8)
        for micro in (first, second):
            _pass(twin, micro, 1 / 8)
        _assert_same(_pending(optimizer), _pending(reference))
        optimizer.step()
        reference.step()
        optimizer.zero_grad()
        reference.zero_grad()
    _assert_same(list(model.parameters()), list(twin.parameters()))
    _assert_same(optimizer.state_dict(), reference.state_dict())


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_a_step_after_only_empty_batches_keeps_the_factors(cls: type) -> None:
    """Zero gradients, no statistics: factors kept, weight decay still acts."""
    torch.manual_seed(0)
    model = CASES["linear-sequence"][0]()
    lr, decay = 0.1, 0.25
    optimizer = cls(model, T=1, lr=lr, weight_decay=decay, momentum=0.0)
    _pass(model, CASES["linear-sequence"][1](4))  # a first update, then empty ones
    optimizer.step()
    optimizer.zero_grad()
    factors = {
        p: {k: v.clone() if isinstance(v, Tensor) else v for k, v in s.items()}
        for p, s in optimizer.state.items()
    }
    weights = [layer.weight.detach().clone() for layer in optimizer.layers]
    for _ in range(2):
        _pass(model, CASES["linear-sequence"][1](0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.step()
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2, messages  # one per layer
    assert all(
        m.startswith(f"{cls.__name__}: layer ") and "only with empty batches" in m
        for m in messages
    ), messages
    assert {w.filename for w in caught} == {__file__}
    for layer, before in zip(optimizer.layers, weights, strict=True):
        state, old = optimizer.state[layer.weight], factors[layer.weight]
        assert state["step"] == old["step"] + 1
        for key, value in old.items():
            if key not in ("step", "grad_scale") and isinstance(value, Tensor):
                torch.testing.assert_close(state[key], value, atol=0, rtol=0)
        # Δ = P_C·0·P_K + γ W, no momentum: W ← W − β₂ γ W
        torch.testing.assert_close(
            layer.weight.detach(), before * (1 - lr * decay), atol=1e-15, rtol=0
        )


def test_an_empty_batch_with_a_mean_loss_steps_without_error() -> None:
    """A mean over no examples is NaN, but the gradients are zeros: nothing skips."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = SINGD(model, T=1)
    before = model.weight.detach().clone()
    loss = nn.functional.cross_entropy(
        model(torch.randn(0, 3)), torch.zeros(0, dtype=torch.long)
    )
    loss.backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.step()
    assert not any("skipped a step" in str(w.message) for w in caught)
    assert optimizer.state[model.weight]["step"] == 1
    torch.testing.assert_close(model.weight.detach(), before, atol=0, rtol=0)


@pytest.mark.parametrize("kfac_approx", ["expand", "reduce"])
def test_rows_of_an_empty_batch_are_empty(kfac_approx: str) -> None:
    a = stats.input_rows(torch.randn(0, 5, 3), kfac_approx, bias=True)
    assert a.shape == (0, 4)
    g = stats.gradient_rows(torch.randn(0, 5, 2), kfac_approx, "batch+sequence")
    assert g.shape == (0, 2)
    assert stats.gradient_scale("batch", 0) == 0.0
    embedding = nn.Embedding(7, 3)
    sparse = EmbeddingAdapter().input_rows(
        embedding, torch.zeros(0, 5, dtype=torch.long), kfac_approx
    )
    assert sparse.shape == (0, 7)
    assert not sparse.gram_diagonal().any()


def test_empty_rows_leave_pending_and_example_records_unchanged() -> None:
    H_K, H_C = DenseMatrix(torch.eye(2)), DenseMatrix(torch.eye(3))
    record = PendingStatistics.open(
        H_K, H_C, rows=4, examples=2, grad_scale=1.0, pass_id=7
    )
    record.add(
        DenseMatrix(torch.zeros(2, 2)),
        DenseMatrix(torch.zeros(3, 3)),
        rows=0,
        examples=0,
        pass_id=7,
    )
    record.close()
    assert record.num_examples == 2
    torch.testing.assert_close(record.H_K.to_dense(), torch.eye(2))
    examples = ExampleGradients()
    examples.add(torch.zeros(0, 2), torch.zeros(0, 3), 0)
    assert not examples.chunks


# --------------------------------------------------------------- zero dims
class _WithZero(nn.Module):
    """A trained linear layer next to a layer without entries."""

    def __init__(
        self, zero: nn.Module, zero_input: Callable[[Tensor], Tensor] | None
    ) -> None:
        super().__init__()
        self.main = nn.Linear(3, 2)
        self.zero = zero
        self._zero_input = zero_input  # None: torch cannot apply the layer

    def forward(self, x: Tensor) -> Tensor:
        if self._zero_input is None:
            return self.main(x)
        return self.main(x) + self.zero(self._zero_input(x)).sum()


ZERO_LAYERS = {
    "linear-3-0": (lambda: nn.Linear(3, 0), lambda x: x),
    "linear-0-3": (lambda: nn.Linear(0, 3), lambda x: x[:, :0]),
    "conv-0-channels-in": (
        lambda: nn.Conv2d(0, 3, 1),
        lambda x: x[:, :0, None, None],
    ),
    "conv-0-channels-out": (lambda: nn.Conv2d(3, 0, 1), None),
    "embedding-dim-0": (
        lambda: nn.Embedding(5, 0),
        lambda x: torch.zeros(x.shape[0], dtype=torch.long),
    ),
    "embedding-0-rows": (
        lambda: nn.Embedding(0, 3),
        lambda x: torch.zeros(x.shape[0], 0, dtype=torch.long),
    ),
}


def _zero_model(case: str) -> _WithZero:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: initialising zero-element tensors
        zero, zero_input = ZERO_LAYERS[case]
        return _WithZero(zero(), zero_input)


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("case", list(ZERO_LAYERS))
def test_a_layer_without_entries_goes_to_the_fallback(case: str, cls: type) -> None:
    model = _zero_model(case)
    optimizer = cls(model, T=1)
    assert [layer.name for layer in optimizer.layers] == ["main"]
    zero_params = set(model.zero.parameters())
    assert set(optimizer.fallback_params) == zero_params
    before = [p.detach().clone() for p in model.zero.parameters()]
    _loss(model(torch.randn(4, 3))).backward()
    optimizer.step()
    assert optimizer.state[model.main.weight]["step"] == 1
    for param, old in zip(model.zero.parameters(), before, strict=True):
        assert torch.isfinite(param).all()
        if param.grad is not None and not param.grad.any():
            torch.testing.assert_close(param.detach(), old)


@pytest.mark.parametrize("case", list(ZERO_LAYERS))
def test_a_layer_without_entries_is_named_when_refused(case: str) -> None:
    model = _zero_model(case)
    note = re.escape("layers whose weight has no entries are not preconditioned: ")
    with pytest.raises(ValueError, match=note + r"\['zero'\]"):
        SINGD(model, params=model.parameters(), fallback=None)
    with pytest.raises(ValueError, match=r"model has no supported layer.*" + note):
        SINGD(model.zero)
    with pytest.warns(UserWarning, match="leaves out .*zero"):
        optimizer = SINGD(model, fallback=None)
    assert [layer.name for layer in optimizer.layers] == ["main"]
    assert not optimizer.fallback_params


@pytest.mark.parametrize(
    ("module", "shape"),
    [(nn.Linear(4, 3), (4,)), (nn.Conv2d(2, 3, 3, padding=1), (2, 5, 5))],
    ids=["Linear", "Conv2d"],
)
def test_an_unbatched_input_is_one_example(module: nn.Module, shape) -> None:
    """`torch.nn` takes an input without batch dimension; so do the statistics.

    Before, the backward pass of an update step failed inside the hooks.
    """
    x = torch.randn(*shape, dtype=torch.float64)
    factors = []
    for batched in (False, True):
        model = copy.deepcopy(module).double()
        optimizer = KFAC(model, lr=0.0, T=1)
        model(x.unsqueeze(0) if batched else x).square().sum().backward()
        optimizer.step()
        state = optimizer.state[model.weight]
        factors.append((state["A.mat"], state["G.mat"]))
    for unbatched, batched in zip(*factors, strict=True):
        torch.testing.assert_close(unbatched, batched, rtol=1e-13, atol=0.0)


class _PaddingConv(nn.Conv2d):
    """Pads its input in `forward`, as timm's `Conv2dSame` (TF's "SAME")."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(nn.functional.pad(x, (0, 1, 0, 1)))


class _ScaledEmbedding(nn.Embedding):
    """Multiplies the lookup, as Gemma's `GemmaTextScaledWordEmbedding`."""

    def forward(self, ids: Tensor) -> Tensor:
        return super().forward(ids) * 4.0


class _PositionalEmbedding(nn.Embedding):
    """Looks up its own positions, as BART's learned positional embedding."""

    def forward(self, ids: Tensor) -> Tensor:
        positions = torch.arange(ids.shape[1]).expand_as(ids) + 2
        return super().forward(positions)


class _Tokens(nn.Module):
    def __init__(self, embedding: nn.Module) -> None:
        super().__init__()
        self.embedding, self.head = embedding, nn.Linear(4, 3)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.embedding(ids).mean(1))


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.Sequential(
            _PaddingConv(2, 3, 2, stride=2), nn.Flatten(), nn.Linear(27, 3)
        ),
        lambda: _Tokens(_ScaledEmbedding(16, 4)),
        lambda: _Tokens(_PositionalEmbedding(16, 4)),
    ],
    ids=["Conv2dSame", "scaled-embedding", "positional-embedding"],
)
def test_a_subclass_with_its_own_forward_goes_to_the_fallback(make) -> None:
    """Its function is not its base class's, so neither are its statistics.

    Before, the padding convolution's input factor paired unpadded patches with
    the output's locations, the scaled embedding's output factor was off by the
    scale squared, and the positional embedding took token ids for positions
    (wrong statistics, or an `IndexError` inside the hooks).
    """
    torch.manual_seed(0)
    model = make().double()
    subclass = model[0] if isinstance(model, nn.Sequential) else model.embedding
    inputs = (
        torch.randn(4, 2, 5, 5, dtype=torch.float64)
        if isinstance(subclass, nn.Conv2d)
        else torch.randint(0, 6, (4, 5))
    )
    optimizer = SINGD(model, lr=0.1, T=1)
    assert all(layer.module is not subclass for layer in optimizer.layers)
    assert set(subclass.parameters()) <= set(optimizer.fallback_params)
    before = [p.detach().clone() for p in subclass.parameters()]
    for _ in range(2):
        optimizer.zero_grad()
        model(inputs).square().sum().backward()
        optimizer.step()
    for p, q in zip(subclass.parameters(), before, strict=True):
        assert not torch.equal(p, q)
