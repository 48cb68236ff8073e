"""Tied weights: one layer with the statistics of all its uses, updated once per step.

Uses in the layer's orientation concatenate along the weight-sharing dimension, as
curvlinops' main branch treats tied weights; an embedding tied to an output layer
(opposite orientations) combines the two orientations' factors by their partial
traces (`pending.kronecker_sum`). Each definition is checked against dense float64
sums over the uses' rows.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from singd_curvlinops import KFAC, SINGD
from tests.layers._helpers import expand_factors, kfac_factors

N, S, D = 4, 3, 5


def _ones(t):
    return torch.cat([t, torch.ones_like(t[..., :1])], -1)


class Reused(nn.Module):
    """One Linear applied twice: an RNN-like weight sharing in one forward pass."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.head = nn.Linear(D, 2)

    def forward(self, x, keep=None):
        h1 = self.lin(x)
        u = torch.tanh(h1)
        h2 = self.lin(u)
        if keep is not None:
            keep += [(x, h1), (u, h2)]
            h1.retain_grad(), h2.retain_grad()
        return self.head(h2).mean(1)


class Shared(nn.Module):
    """Two Linear modules that share their weight, each with its own bias."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)
        self.b.weight = self.a.weight
        self.head = nn.Linear(D, 2)

    def forward(self, x, keep=None):
        h1 = self.a(x)
        u = torch.tanh(h1)
        h2 = self.b(u)
        if keep is not None:
            keep += [(x, h1), (u, h2)]
            h1.retain_grad(), h2.retain_grad()
        return self.head(h2).mean(1)


def _data():
    return torch.randn(N, S, D, dtype=torch.float64), torch.randint(0, 2, (N,))


def _uses(model, X, y):
    keep = []
    nn.functional.cross_entropy(model(X, keep), y).backward()
    model.zero_grad()
    return keep


def _first_kfac_factors(model, X, y):
    optimizer = KFAC(model, T=1)
    nn.functional.cross_entropy(model(X), y).backward()
    optimizer.step()
    return optimizer


def _assert_factors(optimizer, layer, inputs, gradients) -> None:
    """The layer's KFAC factors are the dense sums over the uses' rows."""
    expected = expand_factors(inputs, gradients, N)
    for actual, wanted in zip(kfac_factors(optimizer, layer), expected, strict=True):
        torch.testing.assert_close(actual, wanted, rtol=1e-12, atol=1e-15)


def test_module_called_twice_concatenates_its_uses() -> None:
    torch.manual_seed(0)
    model = Reused().double()
    X, y = _data()
    uses = _uses(model, X, y)
    optimizer = _first_kfac_factors(model, X, y)
    layer = optimizer.layers[0]
    assert layer.name == "lin" and layer.dims == (D + 1, D)
    inputs = [_ones(x) for x, _ in uses]
    _assert_factors(optimizer, layer, inputs, [h.grad for _, h in uses])


def test_shared_weight_with_own_biases() -> None:
    """The weight is one layer (no bias column); each bias is a bias-only layer."""
    torch.manual_seed(0)
    model = Shared().double()
    X, y = _data()
    uses = _uses(model, X, y)
    optimizer = _first_kfac_factors(model, X, y)
    layers = {layer.name: layer for layer in optimizer.layers}
    assert set(layers) == {"a", "a.bias", "b.bias", "head"}
    assert [site.name for site in layers["a"].sites] == ["a", "b"]
    _assert_factors(
        optimizer, layers["a"], [x for x, _ in uses], [h.grad for _, h in uses]
    )
    for name, (x, h) in zip(("a.bias", "b.bias"), uses, strict=True):
        ones = torch.ones(*x.shape[:-1], 1, dtype=x.dtype)
        _assert_factors(optimizer, layers[name], [ones], [h.grad])


@pytest.mark.parametrize("other_bias", ["frozen", "absent"])
def test_shared_weight_with_one_trained_bias(other_bias: str) -> None:
    """`a`'s bias is the layer's: `b`'s rows end in a zero (a zeroed or an
    appended column), since `b` does not add that bias."""
    torch.manual_seed(0)
    model = Shared().double()
    if other_bias == "frozen":
        model.b.bias.requires_grad_(False)
    else:
        model.b.bias = None
    X, y = _data()
    (x1, h1), (x2, h2) = _uses(model, X, y)
    optimizer = _first_kfac_factors(model, X, y)
    layers = {layer.name: layer for layer in optimizer.layers}
    assert set(layers) == {"a", "head"}
    assert layers["a"].dims == (D + 1, D)
    assert [site.name for site in layers["a"].sites] == ["a", "b"]
    zeros = torch.zeros(*x2.shape[:-1], 1, dtype=x2.dtype)
    inputs = [_ones(x1), torch.cat([x2, zeros], -1)]
    _assert_factors(optimizer, layers["a"], inputs, [h1.grad, h2.grad])


def test_bias_shared_by_two_weights_is_a_layer_of_its_own() -> None:
    """A bias that two weights add joins neither: it is a bias-only layer of both
    sites, and each weight a layer without bias."""
    torch.manual_seed(0)
    model = Shared().double()
    model.b.weight = nn.Parameter(model.a.weight.detach().clone().mul_(0.5))
    model.b.bias = model.a.bias
    X, y = _data()
    (x1, h1), (x2, h2) = _uses(model, X, y)
    optimizer = _first_kfac_factors(model, X, y)
    layers = {layer.name: layer for layer in optimizer.layers}
    assert set(layers) == {"a", "a.bias", "b", "head"}
    assert layers["a"].dims == layers["b"].dims == (D, D)
    assert [site.name for site in layers["a.bias"].sites] == ["a", "b"]
    ones = torch.ones(*x1.shape[:-1], 1, dtype=x1.dtype)
    _assert_factors(optimizer, layers["a"], [x1], [h1.grad])
    _assert_factors(optimizer, layers["b"], [x2], [h2.grad])
    _assert_factors(optimizer, layers["a.bias"], [ones, ones], [h1.grad, h2.grad])


class TiedLM(nn.Module):
    """GPT-2's tying: the token embedding is the output layer's weight."""

    def __init__(self, vocabulary: int = 7) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocabulary, D)
        self.mix = nn.Linear(D, D)
        self.head = nn.Linear(D, vocabulary, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens, keep=None):
        e = self.emb(tokens)
        h = torch.tanh(self.mix(e))
        logits = self.head(h)
        if keep is not None:
            e.retain_grad(), logits.retain_grad()
            keep += [e, h, logits]
        return logits


def test_embedding_tied_to_output_layer_combines_both_orientations() -> None:
    torch.manual_seed(0)
    model = TiedLM().double()
    V = model.emb.num_embeddings
    tokens = torch.randint(0, V, (N, S))

    def loss(logits):
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()) * S

    keep = []
    loss(model(tokens, keep)).backward()
    e, h, logits = keep
    model.zero_grad()
    onehot = nn.functional.one_hot(tokens, V).double()
    # use 1, the lookup (the layer's orientation [D, V]): X on the V side
    X1, Y1 = expand_factors([onehot], [e.grad], N)
    # use 2, the output layer (transposed): its input side D, output side V
    A2, G2 = expand_factors([h.detach()], [logits.grad], N)
    X1, X2, Y2 = torch.diag(torch.diagonal(X1)), torch.diag(torch.diagonal(G2)), A2
    t = [Y.diagonal().mean() for Y in (Y1, Y2)]
    r = [X.diagonal().mean() for X in (X1, X2)]
    T, tau = sum(t), r[0] * t[0] + r[1] * t[1]
    X_expected = (t[0] * X1 + t[1] * X2) / T
    Y_expected = T * (r[0] * Y1 + r[1] * Y2) / tau

    optimizer = KFAC(model, T=1)
    loss(model(tokens)).backward()
    optimizer.step()
    layer = optimizer.layers[0]
    assert layer.name == "emb" and [s.name for s in layer.sites] == ["emb", "head"]
    assert layer.dims == (V, D) and layer.twin is not None
    X, Y = kfac_factors(optimizer, layer)
    torch.testing.assert_close(X, X_expected, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(Y, Y_expected, rtol=1e-12, atol=1e-15)
    # the partial traces of the combination are those of X1 ⊗ Y1 + X2 ⊗ Y2
    torch.testing.assert_close(Y.diagonal().mean() * X, t[0] * X1 + t[1] * X2)
    torch.testing.assert_close(X.diagonal().mean() * Y, r[0] * Y1 + r[1] * Y2)


@pytest.mark.parametrize("model_cls", [Reused, Shared, TiedLM])
def test_tied_weight_is_updated_once_per_step_and_every_bias_trains(model_cls) -> None:
    """With factors frozen at the identity (lr_cov=0), one step is -lr * gradient."""
    torch.manual_seed(0)
    model = model_cls().double()
    optimizer = SINGD(model, lr=0.1, lr_cov=0.0, momentum=0.0, fallback=None)
    if model_cls is TiedLM:
        tokens = torch.randint(0, 7, (N, S))
        out = model(tokens).flatten(0, 1)
        loss = nn.functional.cross_entropy(out, tokens.flatten())
    else:
        X, y = _data()
        loss = nn.functional.cross_entropy(model(X), y)
    loss.backward()
    before = {name: (p.clone(), p.grad.clone()) for name, p in model.named_parameters()}
    owners = [p for layer in optimizer.layers for p in layer.params]
    assert len(owners) == len({id(p) for p in owners}) == len(before)
    optimizer.step()
    for name, param in model.named_parameters():
        value, grad = before[name]
        torch.testing.assert_close(param, value - 0.1 * grad, rtol=0, atol=1e-15)
        assert not torch.equal(param, value), name
