"""`SINGDLinearOperator` equals its dense matrix in every input format."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from curvlinops import hutchinson_diag, hutchinson_trace
from torch import Tensor, nn

from singd_curvlinops import SINGD, SINGDLinearOperator


def trained(structures: tuple[str, str], steps: int = 3) -> tuple[nn.Module, SINGD]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(3 * 16, 4, bias=False),
        nn.ReLU(),
        nn.Linear(4, 3),
    ).double()
    optimizer = SINGD(model, structures=structures, T=1, lr=0.05, lr_cov=0.3)
    X = torch.randn(6, 2, 4, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (6,))
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(X), y).backward()
        optimizer.step()
    return model, optimizer


def dense_reference(model: nn.Module, optimizer: SINGD) -> Tensor:
    """Block-diagonal C Cᵀ ⊗ K Kᵀ in parameter order (weights, then bias)."""
    params = list(model.parameters())
    offsets = np.cumsum([0] + [p.numel() for p in params])
    index = {p: i for i, p in enumerate(params)}
    matrix = torch.zeros(offsets[-1], offsets[-1], dtype=torch.float64)
    for module in (model[0], model[3], model[5]):
        preconditioner = optimizer.preconditioner(module)
        K, C = preconditioner.K.to_dense(), preconditioner.C.to_dense()
        block = torch.kron(C @ C.T, K @ K.T)  # joint [W b], row-major
        d_out, d_K = C.shape[0], K.shape[0]
        # position of joint entry (i, j) in the concatenated parameter vector
        w = index[module.weight]
        joint = torch.empty(d_out, d_K, dtype=torch.long)
        d_in = module.weight[0].numel()
        joint[:, :d_in] = offsets[w] + torch.arange(d_out * d_in).reshape(d_out, d_in)
        if module.bias is not None:
            joint[:, -1] = offsets[index[module.bias]] + torch.arange(d_out)
        positions = joint.flatten()
        matrix[positions.unsqueeze(1), positions.unsqueeze(0)] = block
    return matrix


STRUCTURES = [
    ("dense", "dense"),
    ("diagonal", "triltoeplitz"),
    ("block3diagonal", "hierarchical1_1"),
    ("triutopleftdiag", "triutoeplitz"),
]


@pytest.mark.parametrize("structures", STRUCTURES, ids=str)
def test_matches_dense_matrix_in_every_format(structures) -> None:
    model, optimizer = trained(structures)
    P = SINGDLinearOperator(optimizer)
    expected = dense_reference(model, optimizer)
    n = expected.shape[0]
    assert P.shape == (n, n)
    V = torch.randn(n, 5, dtype=torch.float64)
    assert torch.allclose(P @ V, expected @ V, rtol=1e-12, atol=1e-12)
    assert torch.allclose(P @ V[:, 0], expected @ V[:, 0], rtol=1e-12, atol=1e-12)
    shapes = [p.shape for p in model.parameters()]
    V_list = [
        t.reshape(*s, 5)
        for t, s in zip(V.split([s.numel() for s in shapes]), shapes, strict=True)
    ]
    out_list = P @ V_list
    expected_cols = expected @ V
    assert torch.allclose(
        torch.cat([t.reshape(-1, 5) for t in out_list]),
        expected_cols,
        rtol=1e-12,
        atol=1e-12,
    )
    v_list = [t[..., 0] for t in V_list]
    assert torch.allclose(
        torch.cat([t.flatten() for t in P @ v_list]),
        expected_cols[:, 0],
        rtol=1e-12,
        atol=1e-12,
    )
    scipy_dense = P.to_scipy() @ np.eye(n)
    assert np.allclose(scipy_dense, expected.numpy(), rtol=1e-12, atol=1e-12)
    assert P.adjoint() is P and np.allclose(scipy_dense, scipy_dense.T, atol=1e-12)


def test_is_a_snapshot_of_the_preconditioner() -> None:
    model, optimizer = trained(("dense", "dense"))
    P = SINGDLinearOperator(optimizer)
    before = P.to_scipy() @ np.eye(P.shape[0])
    X, y = torch.randn(6, 2, 4, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(X), y).backward()
    optimizer.step()
    assert np.array_equal(P.to_scipy() @ np.eye(P.shape[0]), before)
    after = SINGDLinearOperator(optimizer).to_scipy() @ np.eye(P.shape[0])
    assert not np.allclose(after, before)


def test_curvlinops_estimators_run_on_it() -> None:
    model, optimizer = trained(("diagonal", "dense"))
    P = SINGDLinearOperator(optimizer)
    expected = dense_reference(model, optimizer)
    torch.manual_seed(0)
    trace = hutchinson_trace(P, num_matvecs=250)
    assert abs(trace.item() - expected.trace().item()) < 0.1 * expected.trace().item()
    diag = hutchinson_diag(P, num_matvecs=250)
    error = (diag - expected.diagonal()).norm() / expected.diagonal().norm()
    assert error < 0.2


def test_identity_before_training() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    P = SINGDLinearOperator(SINGD(model))
    V = torch.randn(8, 2)
    assert torch.equal(P @ V, V)


@pytest.mark.parametrize("structures", STRUCTURES, ids=str)
def test_inverse_uses_structured_solves(structures) -> None:
    model, optimizer = trained(structures)
    P = SINGDLinearOperator(optimizer)
    expected = torch.linalg.inv(dense_reference(model, optimizer))
    n = expected.shape[0]
    inverse = P.inverse()
    V = torch.randn(n, 3, dtype=torch.float64)
    assert torch.allclose(inverse @ V, expected @ V, rtol=1e-9, atol=1e-9)
    assert torch.allclose(inverse @ (P @ V), V, rtol=1e-9, atol=1e-9)
    assert inverse.inverse() @ V is not None
    assert torch.allclose(inverse.inverse() @ V, P @ V, rtol=1e-12, atol=1e-12)


def test_params_give_the_order_of_the_optimizer_groups() -> None:
    """A fallback parameter before the layers: `P.params`, not the model's order.

    The layers' parameters come first in the default groups; a gradient list in
    `model.parameters()` order would be permuted without an error.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    model.double()
    optimizer = SINGD(model, lr=0.1, T=1, lr_cov=0.5)
    X = torch.randn(8, 4, dtype=torch.float64)
    for _ in range(2):
        optimizer.zero_grad()
        model(X).square().sum().backward()
        optimizer.step()
    P = SINGDLinearOperator(optimizer)
    grouped = [p for group in optimizer.param_groups for p in group["params"]]
    assert all(p is q for p, q in zip(P.params, grouped, strict=True))
    assert P.params[0] is not next(model.parameters())
    direction = P @ [p.grad for p in P.params]
    for layer in optimizer.layers:
        expected = optimizer.preconditioner(layer).apply(
            torch.cat([layer.weight.grad, layer.params[1].grad[:, None]], 1)
        )
        index = next(i for i, p in enumerate(P.params) if p is layer.weight)
        torch.testing.assert_close(direction[index], expected[:, :-1])
        torch.testing.assert_close(direction[index + 1], expected[:, -1])
    for index in (4, 5):  # the LayerNorm's: identity
        assert torch.equal(direction[index], P.params[index].grad)


def test_another_optimizer_is_refused() -> None:
    model = nn.Linear(3, 2)
    with pytest.raises(TypeError, match="SINGD, KFAC or EKFAC optimizer, got SGD"):
        SINGDLinearOperator(torch.optim.SGD(model.parameters(), lr=0.1))
