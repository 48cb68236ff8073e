"""Which backward passes of a forward call give the layers their statistics.

Only a backward pass that computes a layer's parameter gradients does (`backward()`,
or `autograd.grad` for the parameters), and only the first such pass of a forward
call (`hooks.UsePasses`); a later one is named in a warning if it accumulates into
`.grad`. Before 2026-12-02 every pass that reached a layer's output added its rows:
a gradient penalty's `autograd.grad` w.r.t. the inputs was counted as a second
pass, without a warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from curvlinops import FisherType, KFACLinearOperator
from torch import Tensor, nn

from singd_curvlinops import KFAC
from singd_curvlinops.hooks import UsePasses

Passes = Callable[[nn.Sequential, Tensor, Tensor], None]


def _loss(net: nn.Sequential, X: Tensor, y: Tensor) -> Tensor:
    return nn.functional.cross_entropy(net(X), y)


def plain(net: nn.Sequential, X: Tensor, y: Tensor) -> None:
    _loss(net, X, y).backward()


def penalty_on_the_inputs(net: nn.Sequential, X: Tensor, y: Tensor) -> None:
    """A gradient penalty (WGAN-GP, R1): its `autograd.grad` w.r.t. the inputs
    runs through every layer's output but computes no parameter gradient."""
    loss = _loss(net, X, y)
    (grad_X,) = torch.autograd.grad(loss, X, create_graph=True)
    (loss + 0.0 * grad_X.square().sum()).backward()


def gradient_of_a_hidden_output(net: nn.Sequential, X: Tensor, y: Tensor) -> None:
    hidden = net[0](X)
    loss = nn.functional.cross_entropy(net[2](net[1](hidden)), y)
    torch.autograd.grad(loss, hidden, retain_graph=True)
    loss.backward()


def backward_for_the_inputs_first(net: nn.Sequential, X: Tensor, y: Tensor) -> None:
    loss = _loss(net, X, y)
    loss.backward(inputs=[X], retain_graph=True)
    loss.backward()


def functional_gradients(net: nn.Sequential, X: Tensor, y: Tensor) -> None:
    """A training loop that assigns `autograd.grad`'s parameter gradients."""
    params = list(net.parameters())
    grads = torch.autograd.grad(_loss(net, X, y), params)
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad


def parameter_gradients_twice(net: nn.Sequential, X: Tensor, y: Tensor) -> None:
    """As curvlinops' Monte-Carlo samples: `autograd.grad` for the parameters in
    several passes of one forward pass (the first one is kept, unnamed)."""
    loss, params = _loss(net, X, y), list(net.parameters())
    first = torch.autograd.grad(loss, params, retain_graph=True)
    torch.autograd.grad(2.0 * loss, params)
    for param, grad in zip(params, first, strict=True):
        param.grad = grad


def penalty_on_the_parameter_gradients(
    net: nn.Sequential, X: Tensor, y: Tensor
) -> None:
    """`autograd.grad(..., create_graph=True)` for the parameters: the training
    pass differentiates its result again, and collects."""
    loss, params = _loss(net, X, y), list(net.parameters())
    grads = torch.autograd.grad(loss, params, create_graph=True)
    (loss + 0.0 * sum(grad.square().sum() for grad in grads)).backward()


def backward_split_over_the_parameters(
    net: nn.Sequential, X: Tensor, y: Tensor
) -> None:
    """Weights in one pass, biases in another: no gradient is computed twice."""
    loss = _loss(net, X, y)
    weights = [m.weight for m in net if isinstance(m, nn.Linear)]
    loss.backward(inputs=weights, retain_graph=True)
    loss.backward(inputs=[m.bias for m in net if isinstance(m, nn.Linear)])


def twice(net: nn.Sequential, X: Tensor, y: Tensor) -> None:
    loss = _loss(net, X, y)
    loss.backward(retain_graph=True)
    loss.backward()


def parameter_gradients_then_backward(net: nn.Sequential, X: Tensor, y: Tensor) -> None:
    """Parameter gradients taken for logging before the training backward."""
    loss = _loss(net, X, y)
    torch.autograd.grad(loss, list(net.parameters()), retain_graph=True)
    loss.backward()


def factors_after(passes: Passes) -> tuple[list[Tensor], list[str]]:
    """KFAC's factors after one step with statistics from `passes`, and warnings."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    optimizer = KFAC(net, T=1, lr=0.0)
    generator = torch.Generator().manual_seed(1)
    X = torch.randn(8, 4, dtype=torch.float64, generator=generator)
    y = torch.randint(0, 3, (8,), generator=generator)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        passes(net, X.requires_grad_(), y)
        optimizer.step()
    factors = []
    for layer in optimizer.layers:
        record = optimizer.preconditioner(layer)
        factors += [record.K.to_dense(), record.C.to_dense()]
    return factors, [str(w.message) for w in caught]


@pytest.mark.parametrize(
    "passes",
    [
        penalty_on_the_inputs,
        gradient_of_a_hidden_output,
        backward_for_the_inputs_first,
        functional_gradients,
        parameter_gradients_twice,
        penalty_on_the_parameter_gradients,
        backward_split_over_the_parameters,
    ],
)
def test_passes_without_parameter_gradients_add_nothing(passes: Passes) -> None:
    expected, _ = factors_after(plain)
    factors, messages = factors_after(passes)
    assert messages == []
    for factor, reference in zip(factors, expected, strict=True):
        torch.testing.assert_close(factor, reference, rtol=1e-13, atol=0)


@pytest.mark.parametrize("passes", [twice, parameter_gradients_then_backward])
def test_a_second_pass_with_parameter_gradients_is_named_and_left_out(
    passes: Passes,
) -> None:
    expected, _ = factors_after(plain)
    factors, messages = factors_after(passes)
    for factor, reference in zip(factors, expected, strict=True):
        torch.testing.assert_close(factor, reference, rtol=1e-13, atol=0)
    repeated = [m for m in messages if "two backward passes" in m]
    assert len(repeated) == 2  # once per layer
    assert "layer '0'" in repeated[0] + repeated[1]
    assert "layer '2'" in repeated[0] + repeated[1]
    assert "sum them and call backward() once" in repeated[0]


def test_curvlinops_monte_carlo_samples_on_a_hooked_model_warn_nothing() -> None:
    """curvlinops' `KFACLinearOperator` runs its samples through the model that
    the optimizer hooks; `set_curvature` and `zero_grad()` make them irrelevant."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    KFAC(net, T=1)
    X, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        KFACLinearOperator(
            net,
            nn.CrossEntropyLoss(),
            list(net.parameters()),
            [(X, y)],
            fisher_type=FisherType.MC,
            mc_samples=3,
            separate_weight_and_bias=False,
            check_deterministic=False,
        ).compute_kronecker_factors()
    assert not [w for w in caught if "backward passes" in str(w.message)]


def test_a_penalty_reaches_the_statistics_through_the_training_pass() -> None:
    """With a nonzero penalty, the training pass's output gradients carry it."""
    expected, _ = factors_after(plain)

    def penalised(net: nn.Sequential, X: Tensor, y: Tensor) -> None:
        loss = _loss(net, X, y)
        (grad_X,) = torch.autograd.grad(loss, X, create_graph=True)
        (loss + 10.0 * grad_X.square().sum()).backward()

    factors, messages = factors_after(penalised)
    assert messages == []
    K_0, C_0 = factors[:2]
    torch.testing.assert_close(K_0, expected[0], rtol=1e-13, atol=0)  # inputs
    assert not torch.allclose(C_0, expected[1], rtol=1e-3, atol=0)


def test_without_gradient_nodes_every_pass_collects() -> None:
    """FSDP2's row shards (`gradient_nodes` gives none): as before 2026-12-02."""
    passes = UsePasses(())
    assert [passes.decide() for _ in range(3)] == ["collect"] * 3
