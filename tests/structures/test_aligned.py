"""Dense float32 products written into padded rows: same entries, aligned rows."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from singd_curvlinops import SINGD
from singd_curvlinops.structures import DenseMatrix
from singd_curvlinops.structures._aligned import matmul_into_aligned_rows

PADDED_WIDTHS = [513, 785, 1025]


def _is_padded(result: torch.Tensor) -> bool:
    """Whether `result` is a view of rows padded to a multiple of 16 entries."""
    return (
        result.stride(1) == 1
        and result.stride(0) % 16 == 0
        and (result.stride(0) > result.shape[1])
    )


@pytest.mark.parametrize("width", PADDED_WIDTHS)
@pytest.mark.parametrize("transposed", [False, True], ids=["AB", "AtB"])
def test_padded_product_is_bit_identical(width: int, transposed: bool) -> None:
    """The padded float32 product has exactly the entries of `A @ B`."""
    torch.manual_seed(width)
    A = torch.randn(width, width)
    B = torch.randn(width, width)
    left = A.T if transposed else A
    result = matmul_into_aligned_rows(left, B)
    assert _is_padded(result)
    assert result.shape == (width, width)
    assert torch.equal(result, left @ B)


@pytest.mark.parametrize(
    ("dtype", "width", "reason"),
    [
        (torch.float64, 785, "float64 gains nothing and differs in the last bits"),
        (torch.float32, 300, "narrower than 512 columns"),
        (torch.float32, 512, "rows already a multiple of 64 bytes"),
    ],
)
def test_other_products_stay_contiguous(
    dtype: torch.dtype, width: int, reason: str
) -> None:
    """Where padding does not pay off, the result is the plain contiguous product."""
    A = torch.randn(width, width, dtype=dtype)
    result = matmul_into_aligned_rows(A, A)
    assert result.is_contiguous(), reason
    assert torch.equal(result, A @ A)


def test_products_that_autograd_tracks_stay_plain() -> None:
    """`torch.mm(out=...)` does not support autograd: such operands take `@`."""
    A = torch.randn(513, 513, requires_grad=True)
    result = matmul_into_aligned_rows(A, A.detach())
    assert result.is_contiguous()
    result.sum().backward()
    assert A.grad is not None


def test_dense_factor_products_are_padded_and_exact() -> None:
    r"""\(K^\top K\) and \(K M\) of a 785-dimensional factor: padded, exact."""
    torch.manual_seed(0)
    K, M = DenseMatrix(torch.randn(785, 785)), DenseMatrix(torch.randn(785, 785))
    KtK, KM = K.from_inner(), K @ M
    assert _is_padded(KtK.mat) and _is_padded(KM.mat)
    assert torch.equal(KtK.mat, K.mat.T @ K.mat)
    assert torch.equal(KM.mat, K.mat @ M.mat)


def test_optimizer_state_stays_contiguous() -> None:
    """Padded products are temporaries: the stored factors and momenta stay dense.

    A padded view in the state would make `state_dict()` save its padding.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 300), nn.Tanh(), nn.Linear(300, 10))
    optimizer = SINGD(model, lr=1e-3, lr_cov=1e-2, damping=1e-3, alpha1=0.5)
    inputs, targets = torch.randn(16, 784), torch.randint(0, 10, (16,))
    for _ in range(2):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
    factors = {
        (index, key): value
        for index in (0, 2)
        for key, value in optimizer.state[model[index].weight].items()
        if key in {"K.mat", "m_K.mat", "C.mat", "m_C.mat"}
    }
    assert len(factors) == 8
    assert factors[0, "K.mat"].shape == (785, 785)
    assert factors[2, "K.mat"].shape == (301, 301)
    for key, value in factors.items():
        assert value.is_contiguous(), key
