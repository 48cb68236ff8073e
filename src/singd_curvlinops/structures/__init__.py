"""Structured matrices for SINGD's Kronecker factors and their momenta.

Every structure is a matrix group with a projection `from_dense` of symmetric
matrices onto it; see `StructuredMatrix` for the interface and `get_structure` for
the names.
"""

from singd_curvlinops.structures.base import DenseFallbackWarning, StructuredMatrix
from singd_curvlinops.structures.block_diagonal import (
    BlockDiagonalMatrix,
    block_diagonal,
)
from singd_curvlinops.structures.dense import DenseMatrix
from singd_curvlinops.structures.diagonal import DiagonalMatrix
from singd_curvlinops.structures.hierarchical import HierarchicalMatrix, hierarchical
from singd_curvlinops.structures.registry import (
    get_structure,
    register_structure,
    structure_names,
    unregister_structure,
)
from singd_curvlinops.structures.toeplitz import TrilToeplitzMatrix, TriuToeplitzMatrix
from singd_curvlinops.structures.triangular import (
    TrilBottomRightDiagonalMatrix,
    TrilTopLeftDiagonalMatrix,
    TriuBottomRightDiagonalMatrix,
    TriuTopLeftDiagonalMatrix,
)

__all__ = [
    "BlockDiagonalMatrix",
    "DenseFallbackWarning",
    "DenseMatrix",
    "DiagonalMatrix",
    "HierarchicalMatrix",
    "StructuredMatrix",
    "TrilBottomRightDiagonalMatrix",
    "TrilToeplitzMatrix",
    "TrilTopLeftDiagonalMatrix",
    "TriuBottomRightDiagonalMatrix",
    "TriuToeplitzMatrix",
    "TriuTopLeftDiagonalMatrix",
    "block_diagonal",
    "get_structure",
    "hierarchical",
    "register_structure",
    "structure_names",
    "unregister_structure",
]
