"""Accumulation of a layer's statistics over uses, passes and orientations."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from singd_curvlinops import KFAC
from singd_curvlinops.pending import kronecker_sum
from singd_curvlinops.structures import DenseMatrix, DiagonalMatrix


def _spd(dim: int) -> torch.Tensor:
    X = torch.randn(dim, 2 * dim, dtype=torch.float64)
    return X @ X.T / dim


def test_kronecker_sum_matches_both_partial_traces() -> None:
    torch.manual_seed(0)
    terms = [(_spd(4), _spd(3)) for _ in range(3)]
    terms[1] = (terms[1][0] * 1e3, terms[1][1] * 1e-4)  # scales of another kind
    X, Y = kronecker_sum(
        [(DenseMatrix(a.clone()), DenseMatrix(b.clone())) for a, b in terms]
    )
    F = sum(torch.kron(b, a) for a, b in terms)  # output side first
    # partial traces of F over each side, averaged as SINGD's tr̄ does
    over_output = F.reshape(3, 4, 3, 4).diagonal(dim1=0, dim2=2).mean(-1)
    over_input = F.reshape(3, 4, 3, 4).diagonal(dim1=1, dim2=3).mean(-1)
    torch.testing.assert_close(Y.mat.diagonal().mean() * X.mat, over_output)
    torch.testing.assert_close(X.mat.diagonal().mean() * Y.mat, over_input)
    # invariant to how a term splits its scale between its sides
    scaled = [
        (a * 5.0, b / 5.0) if i == 0 else (a, b) for i, (a, b) in enumerate(terms)
    ]
    X2, Y2 = kronecker_sum([(DenseMatrix(a), DenseMatrix(b)) for a, b in scaled])
    torch.testing.assert_close(torch.kron(Y2.mat, X2.mat), torch.kron(Y.mat, X.mat))


def test_kronecker_sum_of_one_term_is_the_term() -> None:
    X, Y = DiagonalMatrix(torch.rand(3)), DenseMatrix(_spd(2))
    assert kronecker_sum([(X, Y)]) == (X, Y)


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x))).sum(-1)


@pytest.mark.parametrize("micro_batches", [2, 4])
def test_uses_per_pass_and_micro_batches_equal_one_pass(micro_batches) -> None:
    """Each micro-batch's backward pass holds two uses; accumulating the passes
    equals one pass over the concatenated batch."""
    torch.manual_seed(0)
    X = torch.randn(8, 3, dtype=torch.float64)
    factors = []
    for chunks in (1, micro_batches):
        torch.manual_seed(1)
        model = Twice().double()
        optimizer = KFAC(model, T=1)
        for part in X.chunk(chunks):
            (model(part).square().mean() / chunks).backward()
        optimizer.step()
        factors.append(optimizer.state[model.lin.weight])
    for key in ("A.mat", "G.mat"):
        torch.testing.assert_close(
            factors[0][key], factors[1][key], rtol=1e-12, atol=1e-15
        )
