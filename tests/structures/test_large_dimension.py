"""Every non-dense structure handles d = 200,000 without forming a d x d matrix.

A dense intermediate would need 320 GB (float64) and fail. The results are checked
through identities that hold exactly and are cheap to evaluate at this size.
"""

import pytest
import torch

from singd_curvlinops.structures import get_structure

DIM = 200_000
NON_DENSE = [
    "diagonal",
    "block30diagonal",
    "hierarchical15_15",
    "triltoeplitz",
    "triutoeplitz",
    "trilbottomrightdiag",
    "triltopleftdiag",
    "triubottomrightdiag",
    "triutopleftdiag",
]


@pytest.mark.slow
@pytest.mark.parametrize("name", NON_DENSE)
def test_operations_at_200k(name: str) -> None:
    cls = get_structure(name)
    X = torch.randn(DIM, 8, dtype=torch.float64) / DIM**0.5
    V, U = (
        torch.randn(DIM, 3, dtype=torch.float64),
        torch.randn(DIM, 3, dtype=torch.float64),
    )

    K = cls.eye(DIM, dtype=torch.float64)
    # (exact up to FFT round-off for the Toeplitz structures)
    assert torch.allclose(K @ V, V, rtol=0, atol=1e-12)
    assert torch.allclose(K.rmatmat(V), V, rtol=0, atol=1e-12)

    K.add_(cls.from_mat_inner(X), alpha=0.5)  # a generic element of the structure
    H = K.from_inner(X)
    KV, KtU = K @ V, K.rmatmat(U)

    # stored size scales with d, not d²
    for matrix in (K, H):
        assert matrix.numel() <= 31 * DIM
    # adjoint identity <U, K V> = <Kᵀ U, V>
    assert torch.allclose(U.T @ KV, KtU.T @ V, rtol=1e-9, atol=1e-9)
    # average trace of Π(Kᵀ X Xᵀ K) is ||Kᵀ X||_F² / d for every projection here
    KtX = K.rmatmat(X)
    assert torch.allclose(H.average_trace(), KtX.square().sum() / DIM, rtol=1e-9)
    assert torch.isfinite(H.frobenius_norm())
    # solves invert the products: K (K⁻¹ V) = V and Kᵀ (K⁻ᵀ V) = V
    assert torch.allclose(K @ K.solve(V), V, rtol=0, atol=1e-9)
    assert torch.allclose(K.rmatmat(K.rsolve(V)), V, rtol=0, atol=1e-9)
