"""Layer adapters: the registry, and a user-registered layer type end to end.

`Dense` stores its weight transposed (`kernel`, `[d_in, d_out]`, as Flax or Hugging
Face's `Conv1D` do). Registered through `DenseAdapter`, a model of `Dense` layers
must train exactly as the same model of `nn.Linear` layers with `W = kernelᵀ`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
import torch
from torch import Tensor, nn

from singd_curvlinops import KFAC, SINGD, SINGDLinearOperator
from singd_curvlinops.layers import (
    LayerAdapter,
    LinearAdapter,
    adapter_for,
    register_layer,
    supported_layers,
    unregister_layer,
)


class Dense(nn.Module):
    """`x @ kernel + bias` with `kernel` of shape `[d_in, d_out]`."""

    def __init__(self, d_in: int, d_out: int, bias: bool = True) -> None:
        super().__init__()
        self.kernel = nn.Parameter(torch.randn(d_in, d_out) / d_in**0.5)
        self.bias = nn.Parameter(torch.zeros(d_out)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        out = x @ self.kernel
        return out if self.bias is None else out + self.bias


class DenseAdapter(LayerAdapter):
    description = "Dense (kernel [d_in, d_out])"

    def matches(self, module: nn.Module) -> bool:
        return isinstance(module, Dense)

    def weight(self, module: nn.Module) -> nn.Parameter:
        return module.kernel

    def dims(self, module: nn.Module) -> tuple[int, int]:
        d_in, d_out = module.kernel.shape
        return d_in + int(module.bias is not None), d_out

    def to_matrix(self, tensors: Sequence[Tensor], params: tuple) -> Tensor:
        matrix = tensors[0].transpose(0, 1)  # [d_out, d_in, *extra]
        if len(params) == 1:
            return matrix
        return torch.cat([matrix, tensors[1].unsqueeze(1)], dim=1)

    def from_matrix(self, matrix: Tensor, params: tuple) -> list[Tensor]:
        d_in = params[0].shape[0]
        parts = [matrix[:, :d_in].transpose(0, 1)]
        if len(params) == 2:
            parts.append(matrix[:, d_in])
        return parts


@pytest.fixture
def dense_adapter() -> Iterator[DenseAdapter]:
    adapter = register_layer(DenseAdapter())
    yield adapter
    unregister_layer(adapter)


def models(bias: bool) -> tuple[nn.Module, nn.Module]:
    """A `Dense` network and the equal `nn.Linear` network (float64)."""
    torch.manual_seed(0)
    dense = nn.Sequential(Dense(6, 5, bias), nn.Tanh(), Dense(5, 3, bias=bias)).double()
    linear = nn.Sequential(
        nn.Linear(6, 5, bias), nn.Tanh(), nn.Linear(5, 3, bias=bias)
    ).double()
    with torch.no_grad():
        for d, lin in ((dense[0], linear[0]), (dense[2], linear[2])):
            lin.weight.copy_(d.kernel.T)
            if bias:
                lin.bias.copy_(d.bias)
    return dense, linear


def train(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        X = torch.randn(8, 4, 6, generator=generator, dtype=torch.float64)
        y = torch.randint(0, 3, (8,), generator=generator)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(X).mean(1), y).backward()
        optimizer.step()


OPTIMIZERS = {
    "singd-dense": lambda m: SINGD(m, lr=0.1, lr_cov=0.1, T=1, momentum=0.5),
    "singd-sparse-T2": lambda m: SINGD(
        m, lr=0.1, T=2, structures=("triltoeplitz", "block2diagonal")
    ),
    "ikfac-reduce": lambda m: SINGD(
        m, lr=0.1, T=1, kfac_like=True, kfac_approx="reduce"
    ),
    "kfac": lambda m: KFAC(m, lr=0.1, T=1, damping=0.1, weight_decay=0.01),
}


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("make", OPTIMIZERS.values(), ids=OPTIMIZERS)
def test_registered_layer_trains_as_the_equal_linear_layer(
    dense_adapter, make, bias
) -> None:
    dense, linear = models(bias)
    initial = [p.detach().clone() for p in linear.parameters()]
    dense_optimizer, linear_optimizer = make(dense), make(linear)
    assert [layer.adapter for layer in dense_optimizer.layers] == [dense_adapter] * 2
    train(dense, dense_optimizer)
    train(linear, linear_optimizer)
    for d, lin in ((dense[0], linear[0]), (dense[2], linear[2])):
        assert (d.kernel.T - lin.weight).abs().max() < 1e-12
        if bias:
            assert (d.bias - lin.bias).abs().max() < 1e-12
    for p, p0 in zip(linear.parameters(), initial, strict=True):
        assert (p - p0).abs().max() > 1e-3  # the runs are not vacuous
    # the preconditioner as an operator: the same matrix up to the transposition
    P_dense = SINGDLinearOperator(dense_optimizer)
    P_linear = SINGDLinearOperator(linear_optimizer)
    V = [torch.randn(*p.shape, 2, dtype=torch.float64) for p in linear.parameters()]
    V_dense = [v.transpose(0, 1) if v.ndim == 3 else v for v in V]
    for out_dense, out_linear in zip(P_dense @ V_dense, P_linear @ V, strict=True):
        expected = out_linear.transpose(0, 1) if out_linear.ndim == 3 else out_linear
        torch.testing.assert_close(out_dense, expected, rtol=1e-12, atol=1e-12)


def test_user_adapters_are_asked_first() -> None:
    class ScaledLinear(nn.Linear):
        pass

    class ScaledLinearAdapter(LinearAdapter):
        description = "ScaledLinear"

        def matches(self, module: nn.Module) -> bool:
            return isinstance(module, ScaledLinear)

    assert isinstance(adapter_for(ScaledLinear(2, 2)), LinearAdapter)
    adapter = register_layer(ScaledLinearAdapter())
    try:
        assert adapter_for(ScaledLinear(2, 2)) is adapter
        assert type(adapter_for(nn.Linear(2, 2))) is LinearAdapter
        assert supported_layers().startswith("ScaledLinear, torch.nn.Linear")
    finally:
        unregister_layer(adapter)
    assert type(adapter_for(ScaledLinear(2, 2))) is LinearAdapter


def test_unsupported_models_name_the_registered_layers(dense_adapter) -> None:
    with pytest.raises(ValueError, match=r"Dense \(kernel \[d_in, d_out\]\)"):
        SINGD(nn.Sequential(nn.ReLU()))


def test_registration_errors(dense_adapter) -> None:
    with pytest.raises(TypeError, match="adapter must be a LayerAdapter instance"):
        register_layer(DenseAdapter)
    with pytest.raises(ValueError, match="An adapter of class DenseAdapter"):
        register_layer(DenseAdapter())
    with pytest.raises(ValueError, match="An adapter of class LinearAdapter"):
        register_layer(LinearAdapter())

    class Nameless(DenseAdapter):
        description = ""

    with pytest.raises(ValueError, match=r"Nameless\.description must name"):
        register_layer(Nameless())
    with pytest.raises(ValueError, match="not a user-registered layer adapter"):
        unregister_layer(LinearAdapter())
