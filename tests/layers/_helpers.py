"""Shared pieces of the layer tests: brute-force KFAC factors and a size recorder."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from tests.test_statistics import curvlinops_factors


def kfac_factors(optimizer: Any, layer: Any) -> tuple[Tensor, Tensor]:
    """Return a KFAC optimizer's dense `(A, G)` of a layer after one update (T=1).

    The first update takes the statistics as they are: `A = U_K`, `G = U_C`.
    """
    state = optimizer.state[layer.weight]
    A = state["A.mat"] if "A.mat" in state else torch.diag(state["A.diag"])
    G = state["G.mat"] if "G.mat" in state else torch.diag(state["G.diag"])
    return A, G


def curvlinops_layer_factors(
    model: nn.Module,
    X: Tensor,
    y: Tensor,
    approx: str,
    skip: frozenset[int] = frozenset(),
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """curvlinops' `(input, gradient)` covariances of the model's layers, by name.

    The layers are its `Linear` and `Conv2d` modules (curvlinops' layer types; a
    cross-entropy loss, empirical Fisher), except those whose `id` is in `skip`.
    """
    params = [
        p
        for m in model.modules()
        if isinstance(m, (nn.Linear, nn.Conv2d)) and id(m) not in skip
        for p in m.parameters()
    ]
    return curvlinops_factors(model, X, y, nn.CrossEntropyLoss(), approx, params)


def train_without_warnings(
    model: nn.Module, optimizer: Any, X: Tensor, y: Tensor, steps: int
) -> list[float]:
    """Take `steps` cross-entropy steps on `(X, y)`, any warning an error.

    (No "received no statistics", nothing.) Returns the losses.
    """
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(steps):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(X), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return losses


def assert_keys_trained(
    optimizer: Any, qkv: nn.Module, name: str, before: Tensor, losses: list[float]
) -> None:
    """Check float32 training of a packed `qkv` whose padded keys are normalised.

    The loss falls; the key rows of `qkv.weight` (its middle third) moved by at
    least a tenth of the query's or value's largest change from `before`; and
    under KFAC the output factor of the layer `name` has no entry of the padded
    keys' `1/eps` size (below 1e6).
    """
    assert losses[-1] < losses[0]
    moved = (qkv.weight.detach() - before).abs().unflatten(0, (3, -1))
    query, key, value = (part.max().item() for part in moved)
    assert key > 0.1 * min(query, value)
    if type(optimizer).__name__ == "KFAC":
        layer = next(x for x in optimizer.layers if x.name == name)
        _, G = kfac_factors(optimizer, layer)
        assert G.abs().max() < 1e6


def expand_factors(
    inputs: list[Tensor], grads: list[Tensor], num_examples: int
) -> tuple[Tensor, Tensor]:
    """Brute-force curvlinops expand factors of a linear layer with several uses.

    Each use contributes rows `[N, S_u, d]` (inputs with their bias column) and
    output gradients `[N, S_u, d_out]` of a mean-over-the-batch loss; the rows of
    all uses concatenate along the weight-sharing dimension.
    """
    rows = sum(x.shape[1] for x in inputs)
    A = sum(torch.einsum("nsi,nsj->ij", x, x) for x in inputs) / (num_examples * rows)
    G = num_examples * sum(torch.einsum("nsi,nsj->ij", g, g) for g in grads)
    return A, G


def collected_as_unmodified(
    optimizer: Any, model: nn.Module, reference: nn.Module, X: Tensor, y: Tensor
) -> set[str]:
    """Check that a collecting pass changes neither outputs, gradients nor draws.

    `optimizer` collects `model`'s statistics in this pass (its adapters may
    expose a module's products during its call, `layers.capture`); `reference`
    is an unmodified copy.
    Both run with the same seed; their losses and gradients must agree to 1e-12
    and the random generator must end where it ends without the optimizer.

    Returns:
        The names of `model`'s layers whose statistics are pending afterwards.
    """
    results, states = [], []
    for net in (model, reference):
        torch.manual_seed(2)  # the same dropout masks
        loss = nn.functional.cross_entropy(net(X), y)
        results.append((loss, torch.autograd.grad(loss, list(net.parameters()))))
        states.append(torch.get_rng_state())
    (loss, grads), (loss_ref, grads_ref) = results
    torch.testing.assert_close(loss, loss_ref, rtol=0, atol=1e-12)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-12)
    assert states[0].equal(states[1]), "a collecting pass must draw no extra numbers"
    return {layer.name for layer in optimizer._collector._pending}


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an operation returns
    (tensors on the meta device hold no memory and are not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: PLW3201
        out = func(*args, **(kwargs or {}))
        for tensor in torch.utils._pytree.tree_leaves(out):
            if isinstance(tensor, Tensor) and tensor.device.type != "meta":
                self.largest = max(self.largest, tensor.numel())
        return out
