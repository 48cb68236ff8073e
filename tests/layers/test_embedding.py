"""`nn.Embedding`: exact diagonal input factor (token counts), no V x V anywhere."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from singd_curvlinops import KFAC, SINGD
from tests.layers._helpers import LargestTensor, kfac_factors

V, E, N, S = 11, 5, 4, 6


class Lookup(nn.Module):
    def __init__(self, padding_idx: int | None) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, E, padding_idx=padding_idx)
        self.head = nn.Linear(E, 3)

    def forward(self, tokens):
        return self.head(torch.tanh(self.emb(tokens))).mean(1)


def _data():
    tokens = torch.randint(0, V, (N, S))
    tokens[0, :3] = 2  # repeated tokens and (with padding_idx=2) padding
    return tokens, torch.randint(0, 3, (N,))


def _brute_force(model: Lookup, tokens, y, approx: str):
    """Dense float64 KFAC factors of the embedding as a linear layer on one-hots."""
    out = model.emb(tokens)
    out.retain_grad()
    nn.functional.cross_entropy(model.head(torch.tanh(out)).mean(1), y).backward()
    onehot = nn.functional.one_hot(tokens, V).double()
    if model.emb.padding_idx is not None:
        onehot[tokens == model.emb.padding_idx] = 0.0  # the frozen row
    g = out.grad
    if approx == "expand":
        A = torch.einsum("nsi,nsj->ij", onehot, onehot) / (N * S)
        G = N * torch.einsum("nsi,nsj->ij", g, g)
    else:
        h, g_sum = onehot.mean(1), g.sum(1)
        A = h.T @ h / N
        G = N * g_sum.T @ g_sum
    return A, G


@pytest.mark.parametrize("padding_idx", [None, 2])
@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_embedding_factors_equal_brute_force(padding_idx, approx) -> None:
    torch.manual_seed(0)
    model = Lookup(padding_idx).double()
    tokens, y = _data()
    A_true, G_true = _brute_force(model, tokens, y, approx)
    model.zero_grad()
    optimizer = KFAC(model, T=1, kfac_approx=approx)
    nn.functional.cross_entropy(model(tokens), y).backward()
    optimizer.step()
    layer = optimizer.layers[0]
    assert layer.name == "emb" and layer.dims == (V, E)
    assert layer.structures == ("diagonal", "dense")
    A, G = kfac_factors(optimizer, layer)
    if approx == "expand":  # exactly diagonal: the token counts
        assert torch.equal(A_true, torch.diag(torch.diagonal(A_true)))
    torch.testing.assert_close(
        A, torch.diag(torch.diagonal(A_true)), rtol=1e-12, atol=0
    )
    torch.testing.assert_close(G, G_true, rtol=1e-12, atol=1e-15)
    if padding_idx is not None:
        assert A[padding_idx, padding_idx] == 0.0


@pytest.mark.parametrize("structures", [("dense", "dense"), ("triltoeplitz", "dense")])
def test_input_side_is_always_diagonal(structures) -> None:
    model = Lookup(None)
    optimizer = SINGD(model, structures=structures)
    assert optimizer.layers[0].structures == ("diagonal", "dense")
    assert "K.diag" in optimizer.state[model.emb.weight]


def test_singd_diagonal_update_uses_counts() -> None:
    """With K = C = I, the first SINGD update's H_K is diag(counts) / (N S)."""
    torch.manual_seed(0)
    model = Lookup(None).double()
    tokens, y = _data()
    optimizer = SINGD(model, T=1, kfac_like=True, lr_cov=0.5, damping=0.0)
    nn.functional.cross_entropy(model(tokens), y).backward()
    optimizer.step()
    counts = torch.bincount(tokens.flatten(), minlength=V).double() / (N * S)
    K = optimizer.state[model.emb.weight]["K.diag"]
    # IKFAC, no damping, no momentum: m_K = ½(H_K − I), K ← K − β K m_K at K = I
    torch.testing.assert_close(K, 1.0 - 0.5 * 0.5 * (counts - 1.0))


def test_padding_row_never_changes() -> None:
    model = Lookup(2)
    optimizer = SINGD(model, T=1, lr=0.1, weight_decay=0.0)
    before = model.emb.weight[2].clone()
    tokens, y = _data()
    for _ in range(3):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(tokens), y).backward()
        optimizer.step()
    assert torch.equal(model.emb.weight[2], before)


@pytest.mark.parametrize("optimizer_cls", [SINGD, KFAC])
def test_large_vocabulary_allocates_no_vocabulary_square(
    optimizer_cls, one_thread
) -> None:
    """V = 50,000 with a tied output layer: no tensor near V x V = 2.5e9 elements."""
    vocabulary, width = 50_000, 8

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocabulary, width)
            self.head = nn.Linear(width, vocabulary, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, tokens):
            return self.head(self.emb(tokens))

    model = Tied()
    tokens = torch.randint(0, vocabulary, (2, 4))
    recorder = LargestTensor()
    with recorder:
        optimizer = optimizer_cls(model, T=1)
        for _ in range(2):
            optimizer.zero_grad()
            logits = model(tokens)
            nn.functional.cross_entropy(
                logits.flatten(0, 1), tokens.flatten()
            ).backward()
            optimizer.step()
    assert (
        recorder.largest <= 2 * vocabulary * width
    )  # the table's size (and its AdamW state)
    (layer,) = optimizer.layers
    assert layer.dims == (vocabulary, width)
    assert layer.structures[0] == "diagonal"
