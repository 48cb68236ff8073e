"""Projections and constructors agree with the reference release `singd==0.0.5`.

The reference's sparse structures refuse float64, so the comparison runs in float32.
"""

import warnings

import pytest
import torch
from singd.structures.blockdiagonal import BlockDiagonalMatrixTemplate
from singd.structures.dense import DenseMatrix
from singd.structures.diagonal import DiagonalMatrix
from singd.structures.hierarchical import HierarchicalMatrixTemplate
from singd.structures.trilbottomrightdiag import TrilBottomRightDiagonalMatrix
from singd.structures.triltoeplitz import TrilToeplitzMatrix
from singd.structures.triltopleftdiag import TrilTopLeftDiagonalMatrix
from singd.structures.triubottomrightdiag import TriuBottomRightDiagonalMatrix
from singd.structures.triutoeplitz import TriuToeplitzMatrix
from singd.structures.triutopleftdiag import TriuTopLeftDiagonalMatrix

from singd_curvlinops.structures import get_structure
from tests.structures._suite import assert_close, random_symmetric


def reference_block(block_dim: int) -> type:
    return type("RefBlock", (BlockDiagonalMatrixTemplate,), {"BLOCK_DIM": block_dim})


def reference_hierarchical(K1: int, K2: int) -> type:
    return type("RefHier", (HierarchicalMatrixTemplate,), {"MAX_K1": K1, "MAX_K2": K2})


REFERENCE = {
    "dense": DenseMatrix,
    "diagonal": DiagonalMatrix,
    "block3diagonal": reference_block(3),
    "block30diagonal": reference_block(30),
    "block7diagonal": reference_block(7),
    "hierarchical15_15": reference_hierarchical(15, 15),
    "hierarchical3_2": reference_hierarchical(3, 2),
    "hierarchical4_1": reference_hierarchical(4, 1),
    "triltoeplitz": TrilToeplitzMatrix,
    "triutoeplitz": TriuToeplitzMatrix,
    "trilbottomrightdiag": TrilBottomRightDiagonalMatrix,
    "triltopleftdiag": TrilTopLeftDiagonalMatrix,
    "triubottomrightdiag": TriuBottomRightDiagonalMatrix,
    "triutopleftdiag": TriuTopLeftDiagonalMatrix,
}
DIMS = [1, 2, 3, 4, 6, 7, 16, 29, 31, 45, 64]
RTOL = 1e-6


@pytest.fixture(autouse=True)
def _quiet_reference():
    """The reference warns whenever it falls back to dense algebra."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Calling naive implementation")
        yield


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("name", REFERENCE)
def test_from_dense_matches_reference(name: str, dim: int) -> None:
    S = random_symmetric(dim, torch.float32)
    ours = get_structure(name).from_dense(S).to_dense()
    reference = REFERENCE[name].from_dense(S).to_dense()
    assert_close(ours, reference, rtol=RTOL)


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("name", REFERENCE)
def test_from_mat_inner_eye_zeros_match_reference(name: str, dim: int) -> None:
    X = torch.randn(dim, 5)
    ours, reference = get_structure(name), REFERENCE[name]
    assert_close(
        ours.from_mat_inner(X).to_dense(),
        reference.from_mat_inner(X).to_dense(),
        rtol=RTOL,
    )
    assert torch.equal(ours.eye(dim).to_dense(), reference.eye(dim).to_dense())
    assert torch.equal(ours.zeros(dim).to_dense(), reference.zeros(dim).to_dense())


def test_reference_block_diagonal_transposes_wrongly() -> None:
    """Documented discrepancy: the reference's block-diagonal `rmatmat` and
    `from_inner` compute `K @ X` and `K Kᵀ` instead of `Kᵀ X` and `Kᵀ K`, which is
    wrong once the blocks are not symmetric (after the first factor update). Ours
    follows the dense algebra."""
    S1, S2 = random_symmetric(6, torch.float32), random_symmetric(6, torch.float32)
    X = torch.randn(6, 4)
    ref = REFERENCE["block3diagonal"]
    ref_K = ref.from_dense(S1) @ ref.from_dense(S2)
    ours = get_structure("block3diagonal")
    K = ours.from_dense(S1) @ ours.from_dense(S2)
    K_dense = K.to_dense()
    assert_close(ref_K.to_dense(), K_dense, rtol=RTOL)
    assert_close(K.rmatmat(X), K_dense.T @ X, rtol=RTOL)
    assert_close(
        K.from_inner().to_dense(),
        ours.from_dense(K_dense.T @ K_dense).to_dense(),
        rtol=RTOL,
    )
    ref_error = torch.linalg.vector_norm(ref_K.rmatmat(X) - K_dense.T @ X)
    assert ref_error > 0.1 * torch.linalg.vector_norm(K_dense.T @ X)
