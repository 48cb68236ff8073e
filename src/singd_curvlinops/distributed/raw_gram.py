r"""The raw statistics of `Shard(factors="owned")`, and their owner's projection.

Under `Shard(factors="owned")` no rank but the owner holds a layer's factors, so
the statistics hooks cannot form SINGD's \(\Pi(K^\top a^\top a K)\). They keep
the raw rows instead (`raw_statistics`: \(a\), \(\tilde g\) as `GramRows`,
which fold into \(a^\top a\) once they outnumber \(d\)); the ranks send them to
the owner (`owner_statistics`), and `statistics_on_owner` projects them with the
rule as one process would.

A side whose factor is diagonal or block-diagonal keeps \(\Pi(a^\top a)\) in
that structure instead (`kept_structures`): for \(K\) of that structure the
diagonal blocks of \(a^\top a\) are all that \(\Pi(K^\top a^\top a K)\)
reads (`project_structured_gram`), so \(dB\) numbers stand for it however
many rows there are (a convolution's rows outnumber \(d\) by far). One-hot rows
(an embedding's input, `SparseRows`) always keep their diagonal: a
vocabulary-sized \(V \times V\) matrix is never formed.

Rules other than SINGD's and KFAC's get the dense \(U_K\), \(U_C\) handed over
(`projects_raw`, `as_dense`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from singd_curvlinops.distributed.gram_rows import GramRows, Projection, as_structured
from singd_curvlinops.layers import Layer
from singd_curvlinops.rules import (
    FactorRule,
    FactorStatistics,
    KFACRule,
    Preconditioner,
    SINGDRule,
)
from singd_curvlinops.rules.factors import project_structured_gram
from singd_curvlinops.statistics import SparseRows
from singd_curvlinops.structures import (
    BlockDiagonalMatrix,
    DenseMatrix,
    DiagonalMatrix,
    StructuredMatrix,
    get_structure,
)


def kept_structures(
    layer: Layer, rule: FactorRule, group: Mapping[str, Any]
) -> tuple[str | None, str | None]:
    r"""Return per side the structure its raw statistics are kept in (None: rows).

    One-hot rows (an embedding's input) keep the diagonal of \(U = a^\top a\).
    Under SINGD or KFAC a side whose factor is `"diagonal"` or block-diagonal
    with blocks smaller than \(d\) keeps \(\Pi(U)\) in that structure: its
    projection reads only the diagonal blocks of \(U\)
    (`project_structured_gram`), so \(dB\) numbers stand for the
    \(d \times d\) matrix, or for the rows, of which a convolution has far more
    than \(d\). Other sides keep their rows (`GramRows`).

    Args:
        layer: The layer.
        rule: The factor rule.
        group: The layer's options.

    Returns:
        `(K, C)`: a structure name, or None.
    """
    names = rule.structures(group) if projects_raw(rule) else ("", "")
    return tuple(  # type: ignore[return-value]
        "diagonal" if one_hot else (name if _blockwise(name, dim) else None)
        for one_hot, name, dim in zip(
            layer.diagonal_sides, names, layer.dims, strict=True
        )
    )


def _blockwise(name: str, dim: int) -> bool:
    """Return whether a structure keeps only diagonal blocks smaller than `dim`.

    Args:
        name: A structure name, or `""` (none).
        dim: The side's dimension.

    Returns:
        True for `"diagonal"` and for block-diagonal structures with `B < dim`.
    """
    if not name:
        return False
    structure = get_structure(name)
    if issubclass(structure, DiagonalMatrix):
        return True
    return issubclass(structure, BlockDiagonalMatrix) and structure.BLOCK_DIM < dim


def raw_statistics(kept: tuple[str | None, str | None]) -> Projection:
    r"""Return the hooks' raw statistics \(a^\top a\), \(g^\top g\) (owned factors).

    Dense rows are kept as `GramRows`, except on a side with a kept structure
    (`kept_structures`): then \(\Pi(a^\top a)\) in it (one-hot rows,
    `SparseRows`, always keep their diagonal).

    Args:
        kept: Per side, the structure kept, or None.

    Returns:
        `(a, g) -> (statistics of a, statistics of g)`; `a` is the hooks'
        buffer (kept), `g` may be autograd's (copied if kept).
    """

    def project(a: Any, g: Any) -> tuple[Any, Any]:
        return _raw(a, kept[0], copy=False), _raw(g, kept[1], copy=True)

    return project


def _raw(rows: Any, structure: str | None, *, copy: bool) -> Any:
    """Return one side's raw statistics (see `raw_statistics`).

    Args:
        rows: Dense or one-hot rows.
        structure: The structure kept, or None.
        copy: Whether dense rows kept as `GramRows` must be copied.

    Returns:
        `GramRows`, or the projection of the rows' Gram matrix.
    """
    if isinstance(rows, SparseRows):
        return DiagonalMatrix(rows.gram_diagonal())
    if structure is not None:
        return get_structure(structure).from_mat_inner(rows.T)
    return GramRows(rows.clone() if copy else rows)


def raw_zeros(
    dims: tuple[int, int],
    dtypes: tuple[torch.dtype, torch.dtype],
    device: torch.device,
    kept: tuple[str | None, str | None],
) -> tuple[StructuredMatrix, StructuredMatrix]:
    """Return zero raw statistics, for a rank whose hooks saw no examples.

    Args:
        dims: `(d_K, d_C)`.
        dtypes: Their dtypes.
        device: Their device.
        kept: Per side, the structure kept, or None (`kept_structures`).

    Returns:
        Per side a zero matrix of the kept structure, or a `DenseMatrix`.
    """
    return tuple(  # type: ignore[return-value]
        (DenseMatrix if name is None else get_structure(name)).zeros(
            dim, dtype=dtype, device=device
        )
        for dim, dtype, name in zip(dims, dtypes, kept, strict=True)
    )


def in_kept_structure(matrix: Any) -> bool:
    r"""Return whether raw statistics are kept in a factor's structure.

    Args:
        matrix: A side's raw statistics.

    Returns:
        False for rows (`GramRows`) and dense \(U\), True otherwise.
    """
    return not isinstance(matrix, GramRows | DenseMatrix)


def projects_raw(rule: FactorRule) -> bool:
    r"""Return whether owners project raw statistics with the rule's projection.

    SINGD's and KFAC's statistics are Gram matrices, which their owners project
    from the raw rows as the hooks would (`statistics_on_owner`, each orientation
    of a tied weight apart); other rules get the dense \(U_K\), \(U_C\) handed
    over (`as_dense`).

    Args:
        rule: The factor rule.

    Returns:
        Whether `statistics_on_owner` serves it.
    """
    return type(rule) in (SINGDRule, KFACRule)


def as_dense(statistics: FactorStatistics | None) -> FactorStatistics | None:
    r"""Return collected dense statistics as handed-over dense \(U_K\), \(U_C\).

    Args:
        statistics: Collected dense statistics (or already handed over, or None).

    Returns:
        The same numbers, in the form rules project themselves.
    """
    if statistics is None or statistics.collected is None:
        return statistics
    return FactorStatistics(
        handed_over=tuple(as_structured(M).to_dense() for M in statistics.collected)
    )


def statistics_on_owner(
    stepper: Any, layer: Layer, raw: tuple[Any, Any]
) -> tuple[StructuredMatrix, StructuredMatrix]:
    r"""Return the owner's statistics of a layer from the raw rows of all ranks.

    Under `Shard(factors="owned")` the hooks keep the raw rows \(a\),
    \(\tilde g\) (no rank but the owner holds the factors); SINGD and KFAC
    (`projects_raw`) project the sides that arrived as rows here as their hooks
    would on one process (`project`: \(\Pi(K^\top R^\top R K)\) costs
    \(2 N d^2\) for \(N\) rows, against \(2 d^3\) for \(\Pi(K^\top U K)\)
    from the dense \(U = R^\top R\)), a side that arrived as \(U\) with
    `project_dense`, and a side kept in its factor's structure block by block
    (`project_structured_gram`).

    Args:
        stepper: The shell's `LayerStepper`.
        layer: A layer this rank owns.
        raw: One orientation's raw statistics after the exchange, in the
            layer's orientation.

    Returns:
        \((H_K, H_C)\) as the rule's hooks would form them.
    """
    rule = stepper.rule
    rows = [
        M.rows if isinstance(M, GramRows) and M.num_rows is not None else None
        for M in raw
    ]
    record = stepper.preconditioner(layer, ()) if rule.reads_preconditioner else None
    group = stepper.group(layer)
    projected: list[Any] = [None, None]
    present = next((R for R in rows if R is not None), None)
    if present is not None:
        stand_ins = [  # no rows for a side that arrived formed (projected below)
            present.new_zeros(0, dim) if R is None else R
            for R, dim in zip(rows, layer.dims, strict=True)
        ]
        projected = list(rule.project(record, *stand_ins, group=group))
    for side, R in enumerate(rows):
        if R is None:
            projected[side] = _project_formed(rule, record, raw[side], side, group)
    return projected[0], projected[1]


def _project_formed(
    rule: FactorRule,
    record: Preconditioner | None,
    matrix: Any,
    side: int,
    group: Mapping[str, Any],
) -> StructuredMatrix:
    r"""Project a side that arrived formed: in its factor's structure, or \(U\).

    Args:
        rule: SINGD's or KFAC's rule.
        record: The layer's factors (None for KFAC).
        matrix: The side's combined raw statistics: \(\Pi(a^\top a)\) in the
            factor's structure (`kept_structures`), or \(U\).
        side: 0 (\(K\)) or 1 (\(C\)).
        group: The layer's options.

    Returns:
        The side's statistics as the rule's hooks would form them.
    """
    if in_kept_structure(matrix):  # (no d x d matrix is formed)
        factor = None if record is None else (record.K, record.C)[side]
        return project_structured_gram(factor, matrix)
    U = as_structured(matrix).to_dense()
    return rule.project_dense(record, U, side, group=group)
