"""SINGD, the structured inverse-free natural gradient optimizer, on curvlinops.

Public API: the optimizers `SINGD` (and IKFAC through `kfac_like=True`) and the
`KFAC` baseline, `SINGDLinearOperator` (the preconditioner as a curvlinops linear
operator), and the structured matrices of `singd_curvlinops.structures`.
"""

from singd_curvlinops.kfac import KFAC
from singd_curvlinops.linear_operator import SINGDLinearOperator
from singd_curvlinops.optimizer import SINGD
from singd_curvlinops.structures import (
    StructuredMatrix,
    get_structure,
    register_structure,
)

__all__ = [
    "KFAC",
    "SINGD",
    "SINGDLinearOperator",
    "StructuredMatrix",
    "get_structure",
    "register_structure",
]
__version__ = "0.1.0.dev0"
