"""The owned form's raw statistics (`distributed.raw_gram`) against the hooks'.

Under `Shard(factors="owned")` the hooks keep raw rows, or \\(\\Pi(a^\\top a)\\) in a
(block-)diagonal side's structure; the owner's projection must equal what the
rule's hooks form on one process.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from singd_curvlinops.distributed.gram_rows import GramRows
from singd_curvlinops.distributed.raw_gram import (
    kept_structures,
    raw_statistics,
    raw_zeros,
    statistics_on_owner,
)
from singd_curvlinops.rules import KFACRule, Preconditioner, SINGDRule
from singd_curvlinops.statistics import SparseRows
from singd_curvlinops.structures import DenseMatrix, DiagonalMatrix, block_diagonal
from tests.distributed.matrices import close, random_rows


@pytest.mark.parametrize("rule", [SINGDRule(), KFACRule()], ids=["singd", "kfac"])
@pytest.mark.parametrize("dense_side", [0, 1])
def test_owners_project_a_side_of_rows_and_a_dense_side(
    rule: object, dense_side: int
) -> None:
    """One side as rows, the other folded dense: as one process projects them."""
    a, g = random_rows(3, 6, 9), random_rows(3, 4, 10)
    K, C = DenseMatrix(random_rows(6, 6, 11)), DenseMatrix(random_rows(4, 4, 12))
    group = {"structures": ("dense", "dense")}
    record = Preconditioner(K, C, square_roots=True)
    expected = rule.project(
        record if rule.reads_preconditioner else None, a.clone(), g.clone(), group=group
    )
    raw = [GramRows(a.clone()), GramRows(g.clone())]
    more = (a, g)[dense_side]
    raw[dense_side].add_(GramRows(torch.cat([more] * 3)))  # 12 rows: folded
    raw[dense_side].mul_(0.25)  # (the same Gram matrix, now dense)
    assert raw[dense_side].num_rows is None and raw[1 - dense_side].num_rows == 3
    stepper = SimpleNamespace(
        rule=rule, preconditioner=lambda layer, sides: record, group=lambda _: group
    )
    layer = SimpleNamespace(dims=(6, 4))
    owned = statistics_on_owner(stepper, layer, tuple(raw))
    for kept, reference in zip(owned, expected, strict=True):
        assert close(kept.to_dense(), reference.to_dense())


@pytest.mark.parametrize("rule", [SINGDRule(), KFACRule()], ids=["singd", "kfac"])
def test_owners_project_one_hot_and_diagonal_sides_from_their_diagonals(
    rule: object,
) -> None:
    """An embedding's one-hot input side and a `"diagonal"` output side keep only
    their Gram matrices' diagonals, and the owner's projection equals the hooks'
    on one process (no `V x V` matrix is formed on the way)."""
    vocabulary, width = 7, 4
    tokens = torch.tensor([0, 3, 3, 6, 1])
    a = SparseRows(
        tokens, torch.full((5,), 0.5, dtype=torch.float64), vocabulary, num_rows=5
    )
    g = random_rows(5, width, 13)
    group = {"structures": ("diagonal", "diagonal")}
    K = DiagonalMatrix(random_rows(1, vocabulary, 14)[0])
    C = DiagonalMatrix(random_rows(1, width, 15)[0])
    record = (
        Preconditioner(K, C, square_roots=True) if rule.reads_preconditioner else None
    )
    expected = rule.project(record, a, g.clone(), group=group)
    layer = SimpleNamespace(dims=(vocabulary, width), diagonal_sides=(True, False))
    kept = kept_structures(layer, rule, group)
    assert kept == ("diagonal", "diagonal")  # one-hot, and a diagonal factor
    g_before = g.clone()
    raw = raw_statistics(kept)(a, g)
    assert torch.equal(g, g_before)
    assert [type(M) for M in raw] == [DiagonalMatrix, DiagonalMatrix]
    assert [M.numel() for M in raw] == [vocabulary, width]
    zeros = raw_zeros(layer.dims, (torch.float64,) * 2, torch.device("cpu"), kept)
    for M, zero in zip(raw, zeros, strict=True):  # (an idle rank's, same layout)
        assert type(zero) is type(M) and zero.numel() == M.numel()
        M.add_(zero)
    stepper = SimpleNamespace(
        rule=rule,
        preconditioner=lambda layer, sides: record,
        group=lambda _: group,
    )
    owned = statistics_on_owner(stepper, layer, tuple(raw))
    for projected, reference in zip(owned, expected, strict=True):
        assert isinstance(projected, DiagonalMatrix)
        assert close(projected.to_dense(), reference.to_dense())


@pytest.mark.parametrize("rule", [SINGDRule(), KFACRule()], ids=["singd", "kfac"])
def test_owners_project_block_diagonal_sides_from_their_diagonal_blocks(
    rule: object,
) -> None:
    """A block-diagonal side keeps the diagonal blocks of `aᵀa` (`d B` numbers, not
    `d²`, however many rows: before 2026-12-02 rows beyond `d` folded into a
    `d x d` matrix), and the owner's projection equals the hooks' on one process;
    the last block is smaller than `B`, and the rows outnumber `d`."""
    Block3, Block2 = block_diagonal(3), block_diagonal(2)
    group = {"structures": ("block3diagonal", "block2diagonal")}
    a, g = random_rows(20, 8, 18), random_rows(20, 5, 19)
    K = Block3.from_dense(random_rows(8, 8, 20))
    C = Block2.from_dense(random_rows(5, 5, 21))
    record = (
        Preconditioner(K, C, square_roots=True) if rule.reads_preconditioner else None
    )
    expected = rule.project(record, a.clone(), g.clone(), group=group)
    layer = SimpleNamespace(dims=(8, 5), diagonal_sides=(False, False))
    kept = kept_structures(layer, rule, group)
    assert kept == ("block3diagonal", "block2diagonal")
    raw = raw_statistics(kept)(a.clone(), g)
    assert [type(M) for M in raw] == [Block3, Block2]
    assert [M.numel() for M in raw] == [2 * 9 + 4, 2 * 4 + 1]
    # accumulated as the pending statistics are: scaled, and zeros added
    zeros = raw_zeros(layer.dims, (torch.float64,) * 2, torch.device("cpu"), kept)
    for M, zero in zip(raw, zeros, strict=True):
        assert type(zero) is type(M)
        M.mul_(2.0).add_(zero)
    stepper = SimpleNamespace(
        rule=rule, preconditioner=lambda layer, sides: record, group=lambda _: group
    )
    owned = statistics_on_owner(stepper, layer, tuple(raw))
    for projected, reference in zip(owned, expected, strict=True):
        assert type(projected) is type(reference)
        assert close(projected.to_dense(), 2.0 * reference.to_dense())


def test_dense_sides_keep_their_rows_unless_their_factor_is_blockwise() -> None:
    layer = SimpleNamespace(dims=(6, 4), diagonal_sides=(False, False))
    dense = {"structures": ("dense", "dense")}
    assert kept_structures(layer, SINGDRule(), dense) == (None, None)
    mixed = {"structures": ("dense", "diagonal")}
    assert kept_structures(layer, KFACRule(), mixed) == (None, "diagonal")
    # blocks as wide as the side are its dense matrix: rows are no larger
    wide = {"structures": ("block6diagonal", "block3diagonal")}
    assert kept_structures(layer, SINGDRule(), wide) == (None, "block3diagonal")
    # other sparse structures read more than diagonal blocks
    toeplitz = {"structures": ("triltoeplitz", "triutoeplitz")}
    assert kept_structures(layer, SINGDRule(), toeplitz) == (None, None)
    a, g = random_rows(3, 6, 16), random_rows(3, 4, 17)
    H_K, H_C = raw_statistics((None, "diagonal"))(a, g)
    assert isinstance(H_K, GramRows) and H_K.rows is a  # the hooks' buffer, kept
    assert close(H_C.to_dense(), torch.diag(torch.diag(g.T @ g)))
