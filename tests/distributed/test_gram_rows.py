"""Statistics kept as rows (`distributed.gram_rows`) against dense algebra.

`GramRows` must represent \\(D + B^\\top B\\) through every operation the
accumulation of statistics applies (`pending`), and `project_to_rows` must give
the rule's statistics (SINGD: \\(K^\\top a^\\top a K\\), KFAC: \\(a^\\top a\\)).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from singd_curvlinops.distributed.gram_rows import (
    GramRows,
    as_structured,
    diagonal_statistics,
    project_to_rows,
    raw_statistics,
    raw_zeros,
    statistics_on_owner,
)
from singd_curvlinops.pending import PendingStatistics
from singd_curvlinops.rules import (
    KFACRule,
    Preconditioner,
    SINGDRule,
)
from singd_curvlinops.statistics import SparseRows
from singd_curvlinops.structures import DenseMatrix, DiagonalMatrix

TOLERANCE = 1e-12


def _rows(n: int, d: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=generator, dtype=torch.float64)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    return torch.allclose(actual, expected, rtol=TOLERANCE, atol=TOLERANCE)


def test_scaling_and_adding_follow_the_gram_matrices() -> None:
    B, E = _rows(2, 6, 0), _rows(3, 6, 1)
    H = GramRows(B.clone()).mul_(0.5).add_(GramRows(E.clone()), alpha=2.0)
    expected = 0.5 * B.T @ B + 2.0 * E.T @ E
    assert H.num_rows == 5  # still rows: fewer than the dimension
    assert _close(H.dense().mat, expected)
    assert _close(H.average_trace(), expected.trace() / 6)


def test_more_rows_than_the_dimension_fold_into_a_dense_part() -> None:
    B, E = _rows(4, 5, 2), _rows(3, 5, 3)
    H = GramRows(B.clone()).add_(GramRows(E.clone()), alpha=0.25)
    assert H.num_rows is None and H.rows.shape[0] == 0
    expected = B.T @ B + 0.25 * E.T @ E
    assert _close(H.dense().mat, expected)
    # a folded matrix keeps adding and scaling correctly
    H.add_(GramRows(B[:1].clone()), alpha=3.0).mul_(2.0)
    expected = 2.0 * (expected + 3.0 * B[:1].T @ B[:1])
    assert _close(as_structured(H).mat, expected)
    assert _close(H.average_trace(), expected.trace() / 5)


def test_adding_leaves_the_other_statistics_unchanged() -> None:
    B, E = _rows(2, 4, 9), _rows(6, 4, 10)  # E has more rows than d: folded
    rows, folded = GramRows(B.clone()), GramRows(E.clone())
    before = folded.dense_part.clone()
    H = GramRows(_rows(1, 4, 11)).add_(rows, alpha=4.0).add_(folded, alpha=0.5)
    assert torch.equal(rows.rows, B)
    assert torch.equal(folded.dense_part, before)
    expected = _rows(1, 4, 11).T @ _rows(1, 4, 11) + 4.0 * B.T @ B + 0.5 * E.T @ E
    assert _close(H.dense().mat, expected)


def test_pending_accumulation_of_rows_equals_dense_accumulation() -> None:
    uses = [(_rows(n, 7, seed), n) for seed, n in enumerate((2, 3, 1))]
    records = []
    for kind in (GramRows, DenseMatrix):
        record = None
        for pass_id, (B, n) in enumerate(uses):
            H = GramRows(B.clone()) if kind is GramRows else DenseMatrix(B.T @ B)
            G = GramRows(B.clone()) if kind is GramRows else DenseMatrix(B.T @ B)
            if record is None:
                record = PendingStatistics.open(
                    H, G, rows=n, examples=n, grad_scale=1.0, pass_id=pass_id // 2
                )
            else:
                record.add(H, G, rows=n, examples=n, pass_id=pass_id // 2)
        record.close()
        records.append(record)
    rows, dense = records
    assert rows.num_examples == dense.num_examples
    assert _close(as_structured(rows.H_K).mat, dense.H_K.mat)
    assert _close(as_structured(rows.H_C).mat, dense.H_C.mat)


@pytest.mark.parametrize("rule", [SINGDRule(), KFACRule()], ids=["singd", "kfac"])
def test_rows_give_the_rules_statistics(rule: object) -> None:
    a, g = _rows(3, 6, 4), _rows(3, 4, 5)
    K = DenseMatrix(_rows(6, 6, 6))
    C = DenseMatrix(_rows(4, 4, 7))
    group = {"structures": ("dense", "dense")}
    record = (
        Preconditioner(K, C, square_roots=True) if rule.reads_preconditioner else None
    )
    expected = rule.project(record, a.clone(), g.clone(), group=group)
    fallback = lambda a, g: pytest.fail("dense rows need no fallback")  # noqa: E731
    g_before = g.clone()
    actual = project_to_rows(record, fallback)(a.clone(), g)
    assert torch.equal(g, g_before)  # autograd's gradient rows are left intact
    for kept, reference in zip(actual, expected, strict=True):
        assert isinstance(kept, GramRows)
        assert _close(kept.dense().mat, reference.to_dense())


@pytest.mark.parametrize("rule", [SINGDRule(), KFACRule()], ids=["singd", "kfac"])
@pytest.mark.parametrize("dense_side", [0, 1])
def test_owners_project_a_side_of_rows_and_a_dense_side(
    rule: object, dense_side: int
) -> None:
    """One side as rows, the other folded dense: as one process projects them."""
    a, g = _rows(3, 6, 9), _rows(3, 4, 10)
    K, C = DenseMatrix(_rows(6, 6, 11)), DenseMatrix(_rows(4, 4, 12))
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
        assert _close(kept.to_dense(), reference.to_dense())


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
    g = _rows(5, width, 13)
    group = {"structures": ("diagonal", "diagonal")}
    K = DiagonalMatrix(_rows(1, vocabulary, 14)[0])
    C = DiagonalMatrix(_rows(1, width, 15)[0])
    record = (
        Preconditioner(K, C, square_roots=True) if rule.reads_preconditioner else None
    )
    expected = rule.project(record, a, g.clone(), group=group)
    layer = SimpleNamespace(dims=(vocabulary, width), diagonal_sides=(True, False))
    diagonal = diagonal_statistics(layer, rule, group)
    assert diagonal == (True, True)  # one-hot, and a diagonal factor
    g_before = g.clone()
    raw = raw_statistics(diagonal)(a, g)
    assert torch.equal(g, g_before)
    assert [type(M) for M in raw] == [DiagonalMatrix, DiagonalMatrix]
    assert [M.numel() for M in raw] == [vocabulary, width]
    zeros = raw_zeros(layer.dims, (torch.float64,) * 2, torch.device("cpu"), diagonal)
    for M, zero in zip(raw, zeros, strict=True):  # (an idle rank's, same layout)
        assert type(zero) is type(M) and zero.numel() == M.numel()
        M.add_(zero)
    stepper = SimpleNamespace(
        rule=rule,
        preconditioner=lambda layer, sides: record,
        group=lambda _: group,
    )
    owned = statistics_on_owner(stepper, layer, tuple(raw))
    for kept, reference in zip(owned, expected, strict=True):
        assert isinstance(kept, DiagonalMatrix)
        assert _close(kept.to_dense(), reference.to_dense())


def test_dense_sides_keep_their_rows_unless_their_factor_is_diagonal() -> None:
    layer = SimpleNamespace(dims=(6, 4), diagonal_sides=(False, False))
    dense = {"structures": ("dense", "dense")}
    assert diagonal_statistics(layer, SINGDRule(), dense) == (False, False)
    mixed = {"structures": ("dense", "diagonal")}
    assert diagonal_statistics(layer, KFACRule(), mixed) == (False, True)
    a, g = _rows(3, 6, 16), _rows(3, 4, 17)
    H_K, H_C = raw_statistics((False, True))(a, g)
    assert isinstance(H_K, GramRows) and H_K.rows is a  # the hooks' buffer, kept
    assert _close(H_C.to_dense(), torch.diag(torch.diag(g.T @ g)))


def test_misuse_raises() -> None:
    H = GramRows(_rows(2, 3, 8))
    with pytest.raises(ValueError, match="c >= 0"):
        H.mul_(-1.0)
    with pytest.raises(TypeError, match="only add GramRows"):
        H.add_(DenseMatrix.eye(3, dtype=torch.float64))
