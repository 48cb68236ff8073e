"""Factor rules: how each optimizer keeps and updates a layer's Kronecker factors.

`SINGDRule` (SINGD and IKFAC), `KFACRule` and `EKFACRule` implement the
`FactorRule` protocol; the optimizer shell drives them without knowing which one it
holds.
"""

from singd_curvlinops.rules.base import FactorRule
from singd_curvlinops.rules.ekfac import EigenbasisPreconditioner, EKFACRule
from singd_curvlinops.rules.kfac import KFACRule
from singd_curvlinops.rules.records import FactorStatistics, Preconditioner
from singd_curvlinops.rules.singd import SINGDRule

__all__ = [
    "EKFACRule",
    "EigenbasisPreconditioner",
    "FactorRule",
    "FactorStatistics",
    "KFACRule",
    "Preconditioner",
    "SINGDRule",
]
