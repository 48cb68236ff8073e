"""Statistics equal curvlinops' KFAC factors (empirical Fisher) to 1e-12 in float64.

For each layer, `aᵀa` must equal `KFACLinearOperator`'s input covariance and
`ν g̃ᵀ g̃` its gradient covariance, with `separate_weight_and_bias=False`, for every
supported layer configuration, both KFAC approximations and every `loss_average`.
"""

from __future__ import annotations

import pytest
import torch
from curvlinops import KFACLinearOperator
from curvlinops.kfac import FisherType
from torch import Tensor, nn

from singd_curvlinops import KFAC, statistics
from singd_curvlinops.layers import Conv2dAdapter, LinearAdapter, adapter_for

RTOL = 1e-12


class ClassesSecond(nn.Module):
    """[batch, seq, classes] -> [batch, classes, seq], CrossEntropyLoss's layout."""

    def forward(self, x: Tensor) -> Tensor:
        return x.transpose(1, 2)


class MeanOverSequence(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.mean(1)


def conv_net(**conv_kwargs) -> nn.Module:
    conv = nn.Conv2d(4, 6, 3, **conv_kwargs)
    with torch.no_grad():
        out = conv(torch.zeros(1, 4, 9, 9))
    return nn.Sequential(conv, nn.ReLU(), nn.Flatten(), nn.Linear(out[0].numel(), 3))


MODELS = {
    "mlp": (
        lambda: nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3, bias=False)),
        (7, 5),
    ),
    "sequence": (
        lambda: nn.Sequential(
            nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3), ClassesSecond()
        ),
        (7, 6, 5),
    ),
    "pooled-sequence": (
        lambda: nn.Sequential(
            nn.Linear(5, 4), nn.ReLU(), MeanOverSequence(), nn.Linear(4, 3)
        ),
        (7, 6, 5),
    ),
    "conv-stride2": (lambda: conv_net(stride=2, padding=1), (5, 4, 9, 9)),
    "conv-groups2": (lambda: conv_net(groups=2, bias=False), (5, 4, 9, 9)),
    "conv-dilation2": (lambda: conv_net(dilation=2, padding=2), (5, 4, 9, 9)),
    "conv-same": (lambda: conv_net(padding="same"), (5, 4, 9, 9)),
    "conv-valid": (lambda: conv_net(padding="valid", stride=(2, 1)), (5, 4, 9, 9)),
}
# loss_average values consistent with each model's loss terms per example
CASES = [
    (model, approx, average)
    for model in MODELS
    for approx in ("expand", "reduce")
    for average in (
        (None, "batch+sequence") if model == "sequence" else (None, "batch")
    )
]


def labels(model_name: str, shape: tuple[int, ...]) -> Tensor:
    if model_name == "sequence":
        return torch.randint(0, 3, shape[:2])
    return torch.randint(0, 3, shape[:1])


def our_factors(model: nn.Module, X: Tensor, y: Tensor, loss_func, approx, average):
    """Capture inputs and output gradients with hooks and apply `statistics`."""
    captured: dict[str, dict[str, Tensor]] = {}
    handles = []
    for name, module in model.named_modules():
        if adapter_for(module) is not None:

            def hook(module, inputs, output, name=name):
                captured[name] = {"x": inputs[0].detach()}
                output.register_hook(lambda g: captured[name].update(g=g.detach()))

            handles.append(module.register_forward_hook(hook))
    loss_func(model(X), y).backward()
    for handle in handles:
        handle.remove()
    factors = {}
    for name, module in model.named_modules():
        if name in captured:
            adapter = adapter_for(module)
            a = adapter.input_rows(module, captured[name]["x"], approx)
            g = adapter.gradient_rows(module, captured[name]["g"], approx, average)
            nu = statistics.gradient_scale(average, X.shape[0])
            factors[name] = (a.T @ a, nu * g.T @ g)
    return factors


def curvlinops_factors(model, X, y, loss_func, approx, params=None):
    """curvlinops' `(input, gradient)` covariances by layer name (empirical Fisher);
    `params`: the parameters (default: all trainable ones)."""
    if params is None:
        params = [p for p in model.parameters() if p.requires_grad]
    kfac = KFACLinearOperator(
        model,
        loss_func,
        params,
        [(X, y)],
        fisher_type=FisherType.EMPIRICAL,
        kfac_approx=approx,
        separate_weight_and_bias=False,
        check_deterministic=False,
    )
    kfac.compute_kronecker_factors()
    state = kfac.state_dict()
    return state["input_covariances"], state["gradient_covariances"]


def assert_close(actual: Tensor, expected: Tensor, what: str) -> None:
    error = (actual - expected).norm() / expected.norm()
    print(what, f"relative error {error:.2e}")
    assert actual.shape == expected.shape
    assert error <= RTOL, what


@pytest.mark.parametrize("model_name, approx, average", CASES, ids=str)
def test_factors_equal_curvlinops(model_name, approx, average) -> None:
    torch.manual_seed(0)
    build, shape = MODELS[model_name]
    model = build().double()
    X = torch.randn(*shape, dtype=torch.float64)
    y = labels(model_name, shape)
    loss_func = nn.CrossEntropyLoss(reduction="sum" if average is None else "mean")
    ours = our_factors(model, X, y, loss_func, approx, average)
    model.zero_grad()
    inputs, gradients = curvlinops_factors(model, X, y, loss_func, approx)
    assert set(ours) == set(inputs) == set(gradients)
    for name, (U_K, U_C) in ours.items():
        assert_close(U_K, inputs[name], f"{name} input covariance")
        assert_close(U_C, gradients[name], f"{name} gradient covariance")


@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("kernel_size", [2, 4, (4, 3)])
def test_same_padding_with_even_kernel(approx, kernel_size) -> None:
    """Unequal 'same' padding (curvlinops refuses it) equals explicit zero padding."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, kernel_size, padding="same").double()
    model = nn.Sequential(conv, nn.Flatten(), nn.Linear(4 * 6 * 7, 3)).double()
    pads = [
        (total // 2, total - total // 2)
        for total in (k - 1 for k in nn.modules.utils._pair(kernel_size))
    ]
    (top, bottom), (left, right) = pads
    explicit_conv = nn.Conv2d(3, 4, kernel_size).double()
    explicit_conv.load_state_dict(conv.state_dict())
    explicit = nn.Sequential(
        nn.ZeroPad2d((left, right, top, bottom)), explicit_conv, *model[1:]
    )
    X = torch.randn(5, 3, 6, 7, dtype=torch.float64)
    y = torch.randint(0, 3, (5,))
    loss_func = nn.CrossEntropyLoss()
    assert torch.allclose(model(X), explicit(X))
    ours = our_factors(model, X, y, loss_func, approx, "batch")
    inputs, gradients = curvlinops_factors(explicit, X, y, loss_func, approx)
    assert_close(ours["0"][0], inputs["1"], "input covariance")
    assert_close(ours["0"][1], gradients["1"], "gradient covariance")


def test_factor_dims_and_support() -> None:
    def dims(module: nn.Module) -> tuple[int, int]:
        return adapter_for(module).dims(module)

    assert dims(nn.Linear(5, 3)) == (6, 3)
    assert dims(nn.Linear(5, 3, bias=False)) == (5, 3)
    assert dims(nn.Conv2d(4, 6, 3, groups=2)) == (2 * 9 + 1, 6)
    assert isinstance(adapter_for(nn.Linear(1, 1)), LinearAdapter)
    assert isinstance(adapter_for(nn.Conv2d(1, 1, 3)), Conv2dAdapter)
    assert adapter_for(nn.Conv2d(1, 1, 3, padding=1, padding_mode="reflect")) is None
    assert adapter_for(nn.BatchNorm1d(3)) is None


class _PartOfTheBatch(nn.Module):
    """An expert on every third example and a layer on a buffer (no batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.expert = nn.Linear(4, 4), nn.Linear(4, 4)
        self.table_layer, self.head = nn.Linear(2, 4), nn.Linear(4, 3)
        self.register_buffer("table", torch.randn(1, 2))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.first(x))
        routed = torch.arange(x.shape[0]) % 3 == 0
        expert = torch.zeros_like(h).index_put((routed,), self.expert(h[routed]))
        return self.head(h + expert + self.table_layer(self.table))


def test_layers_on_part_of_the_batch_keep_their_own_examples() -> None:
    """The documented difference (layers guide): for a layer that sees `n` of the
    batch's `N` examples, curvlinops' factors are both `n / N` times ours; for the
    layers that see the whole batch they are equal."""
    torch.manual_seed(0)
    model = _PartOfTheBatch().double()
    X, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    optimizer = KFAC(model, T=1, lr=0.0, fallback="sgd")
    nn.functional.cross_entropy(model(X), y).backward()
    optimizer.step()
    model.zero_grad()
    inputs, gradients = curvlinops_factors(model, X, y, nn.CrossEntropyLoss(), "expand")
    seen = {"first": 6, "expert": 2, "table_layer": 1, "head": 6}
    for layer in optimizer.layers:
        state, ratio = optimizer.state[layer.weight], seen[layer.name] / 6
        assert_close(ratio * state["A.mat"], inputs[layer.name], layer.name)
        assert_close(ratio * state["G.mat"], gradients[layer.name], layer.name)
