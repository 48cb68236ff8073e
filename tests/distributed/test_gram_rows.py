"""Statistics kept as rows (`distributed.gram_rows`) against dense algebra.

`GramRows` must represent \\(D + B^\\top B\\) through every operation the
accumulation of statistics applies (`pending`), and `project_to_rows` must give
the rule's statistics (SINGD: \\(K^\\top a^\\top a K\\), KFAC: \\(a^\\top a\\)).
"""

from __future__ import annotations

import pytest
import torch

from singd_curvlinops.distributed.gram_rows import (
    GramRows,
    as_structured,
    project_to_rows,
)
from singd_curvlinops.pending import PendingStatistics
from singd_curvlinops.rules import (
    KFACRule,
    Preconditioner,
    SINGDRule,
)
from singd_curvlinops.structures import DenseMatrix
from tests.distributed.matrices import close, random_rows


def test_scaling_and_adding_follow_the_gram_matrices() -> None:
    B, E = random_rows(2, 6, 0), random_rows(3, 6, 1)
    H = GramRows(B.clone()).mul_(0.5).add_(GramRows(E.clone()), alpha=2.0)
    expected = 0.5 * B.T @ B + 2.0 * E.T @ E
    assert H.num_rows == 5  # still rows: fewer than the dimension
    assert close(H.dense().mat, expected)
    assert close(H.average_trace(), expected.trace() / 6)


def test_more_rows_than_the_dimension_fold_into_a_dense_part() -> None:
    B, E = random_rows(4, 5, 2), random_rows(3, 5, 3)
    H = GramRows(B.clone()).add_(GramRows(E.clone()), alpha=0.25)
    assert H.num_rows is None and H.rows.shape[0] == 0
    expected = B.T @ B + 0.25 * E.T @ E
    assert close(H.dense().mat, expected)
    # a folded matrix keeps adding and scaling correctly
    H.add_(GramRows(B[:1].clone()), alpha=3.0).mul_(2.0)
    expected = 2.0 * (expected + 3.0 * B[:1].T @ B[:1])
    assert close(as_structured(H).mat, expected)
    assert close(H.average_trace(), expected.trace() / 5)


def test_adding_leaves_the_other_statistics_unchanged() -> None:
    B, E = random_rows(2, 4, 9), random_rows(6, 4, 10)  # E has more rows than d: folded
    rows, folded = GramRows(B.clone()), GramRows(E.clone())
    before = folded.dense_part.clone()
    first = random_rows(1, 4, 11)
    H = GramRows(first.clone()).add_(rows, alpha=4.0).add_(folded, alpha=0.5)
    assert torch.equal(rows.rows, B)
    assert torch.equal(folded.dense_part, before)
    expected = first.T @ first + 4.0 * B.T @ B + 0.5 * E.T @ E
    assert close(H.dense().mat, expected)


def test_pending_accumulation_of_rows_equals_dense_accumulation() -> None:
    uses = [(random_rows(n, 7, seed), n) for seed, n in enumerate((2, 3, 1))]
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
    assert close(as_structured(rows.H_K).mat, dense.H_K.mat)
    assert close(as_structured(rows.H_C).mat, dense.H_C.mat)


@pytest.mark.parametrize("rule", [SINGDRule(), KFACRule()], ids=["singd", "kfac"])
def test_rows_give_the_rules_statistics(rule: object) -> None:
    a, g = random_rows(3, 6, 4), random_rows(3, 4, 5)
    K = DenseMatrix(random_rows(6, 6, 6))
    C = DenseMatrix(random_rows(4, 4, 7))
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
        assert close(kept.dense().mat, reference.to_dense())


def test_misuse_raises() -> None:
    H = GramRows(random_rows(2, 3, 8))
    with pytest.raises(ValueError, match="c >= 0"):
        H.mul_(-1.0)
    with pytest.raises(TypeError, match="only add GramRows"):
        H.add_(DenseMatrix.eye(3, dtype=torch.float64))
