"""Factor rules: how each optimizer keeps and updates a layer's Kronecker factors.

`SINGDRule` (SINGD and IKFAC) and `KFACRule` implement the `FactorRule` protocol;
the optimizer shell drives them without knowing which one it holds.
"""

from singd_curvlinops.rules.base import (
    FactorRule,
    FactorStatistics,
    Preconditioner,
)
from singd_curvlinops.rules.kfac import KFACRule
from singd_curvlinops.rules.singd import SINGDRule

__all__ = [
    "FactorRule",
    "FactorStatistics",
    "KFACRule",
    "Preconditioner",
    "SINGDRule",
]
