r"""How rules keep factors in a layer's state and turn rows into statistics.

A factor lives in the state as its structure's tensors under `"<prefix>.<name>"`
(`store_factor`, `load_factor`: the state stays a dictionary of tensors, as
`torch.optim` checkpoints expect); `project_rows` and `gram` form the statistics
\(\Pi(M^\top a^\top a M)\) and \(\Pi(a^\top a)\) from dense or one-hot rows,
`project_diagonal_gram` from the diagonal Gram matrix of one-hot rows, and
`project_structured_gram` from a Gram matrix kept in a (block-)diagonal factor's
structure.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from singd_curvlinops.statistics import SparseRows
from singd_curvlinops.structures import (
    BlockDiagonalMatrix,
    DiagonalMatrix,
    StructuredMatrix,
    get_structure,
)


def load_factor(state: dict[str, Any], prefix: str, name: str) -> StructuredMatrix:
    """Rebuild a structured factor from the state's `"<prefix>.<tensor>"` entries.

    Args:
        state: A layer's state.
        prefix: The factor's prefix, e.g. `"K"`.
        name: Its structure name.

    Returns:
        The structured matrix; its tensors are the state's tensors.
    """
    start = f"{prefix}."
    tensors = {k[len(start) :]: v for k, v in state.items() if k.startswith(start)}
    return get_structure(name).from_tensors(tensors)


def store_factor(state: dict[str, Any], prefix: str, matrix: StructuredMatrix) -> None:
    """Write a structured factor's tensors into the state as `"<prefix>.<tensor>"`.

    Args:
        state: A layer's state.
        prefix: The factor's prefix.
        matrix: The new value.
    """
    for key, tensor in matrix.named_tensors():
        state[f"{prefix}.{key}"] = tensor


def project_rows(
    M: StructuredMatrix, rows: Tensor | SparseRows, *, overwrite: bool
) -> StructuredMatrix:
    r"""Return \(\Pi(M^\top a^\top a M)\) from rows \(a\), `[rows, d]`.

    Sparse rows (`SparseRows`) need a diagonal \(M\) (the layer adapters make the
    factors of one-hot inputs diagonal): then the result is
    \(\mathrm{diag}(m^2 \odot \mathrm{diag}(a^\top a))\).

    Args:
        M: The factor \(K\) or \(C\).
        rows: Dense rows (overwritten if `overwrite`) or sparse rows.
        overwrite: Whether dense `rows` may be overwritten.

    Returns:
        The projection, in the structure of `M` (`_diagonal_of` raises a
        `ValueError` for sparse rows and a factor that is not diagonal).
    """
    if isinstance(rows, SparseRows):
        return project_diagonal_gram(M, rows.gram_diagonal())
    return M.from_inner_(rows.T) if overwrite else M.from_inner(rows.T)


def project_diagonal_gram(
    M: StructuredMatrix | None, diagonal: Tensor
) -> DiagonalMatrix:
    r"""Return \(\Pi(M^\top U M)\) for a diagonal \(U = \mathrm{diag}(u)\).

    One-hot rows (`SparseRows`) have such a Gram matrix \(U = a^\top a\), and
    the layer adapters make their factor diagonal: the result is
    \(\mathrm{diag}(m^2 \odot u)\); without a factor (KFAC's \(\Pi(U)\)) it
    is \(\mathrm{diag}(u)\).

    Args:
        M: A diagonal factor, or None.
        diagonal: \(u\), `[d]`.

    Returns:
        The projection.
    """
    if M is None:
        return DiagonalMatrix(diagonal)
    return DiagonalMatrix(_diagonal_of(M).square() * diagonal)


def project_structured_gram(
    M: StructuredMatrix | None, U: StructuredMatrix
) -> StructuredMatrix:
    r"""Return \(\Pi(M^\top U M)\) from \(U = \Pi(a^\top a)\) in the structure of \(M\).

    For a block-diagonal \(M\) (a diagonal one has blocks of one) the diagonal
    blocks of the product read only those of the Gram matrix,
    \((M^\top a^\top a M)_{ii} = M_i^\top (a^\top a)_{ii} M_i\), so the
    \(\Pi(a^\top a)\) of \(M\)'s structure (\(dB\) numbers) stands for
    \(a^\top a\) exactly. Without a factor (KFAC's \(\Pi(a^\top a)\)) it is
    \(U\) itself.

    Args:
        M: A diagonal factor, a block-diagonal one of \(U\)'s block size, or
            None.
        U: \(\Pi(a^\top a)\), diagonal or block-diagonal.

    Returns:
        The projection, in \(U\)'s structure (blocks made exactly symmetric,
        in \(M\)'s dtype).

    Raises:
        ValueError: If \(U\) is neither, or \(M\) has another structure.
    """
    if M is None:
        return U
    if isinstance(U, DiagonalMatrix):
        return project_diagonal_gram(M, U.diag)
    if isinstance(U, BlockDiagonalMatrix) and type(M) is type(U):
        products = [
            factor.mT @ gram.to(factor.dtype) @ factor
            for factor, gram in ((M.blocks, U.blocks), (M.last, U.last))
        ]
        return type(U)(*((P + P.mT) / 2 for P in products))
    raise ValueError(
        f"A Gram matrix kept as {type(U).__name__} needs a factor of its own "
        f"structure, got {type(M).__name__}."
    )


def gram(
    structure: type[StructuredMatrix], rows: Tensor | SparseRows
) -> StructuredMatrix:
    r"""Return \(\Pi(a^\top a)\) in a structure, from dense or sparse rows.

    Args:
        structure: The structure class.
        rows: `[rows, d]`.

    Returns:
        The projection.

    Raises:
        ValueError: For sparse rows and a structure that is not diagonal.
    """
    if isinstance(rows, SparseRows):
        if not issubclass(structure, DiagonalMatrix):
            raise ValueError(
                f"One-hot rows need a diagonal factor, got {structure.__name__}."
            )
        return project_diagonal_gram(None, rows.gram_diagonal())
    return structure.from_mat_inner(rows.T)


def _diagonal_of(M: StructuredMatrix) -> Tensor:
    """Return the diagonal of a diagonal factor.

    Args:
        M: The factor.

    Returns:
        Its diagonal.

    Raises:
        ValueError: If `M` is not diagonal.
    """
    if not isinstance(M, DiagonalMatrix):
        raise ValueError(
            f"One-hot rows need a diagonal factor, got {type(M).__name__}."
        )
    return M.diag
