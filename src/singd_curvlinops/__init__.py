"""SINGD, the structured inverse-free natural gradient optimizer, on curvlinops.

The package is built up issue by issue; today it provides the structured matrices
(`singd_curvlinops.structures`) in which SINGD's Kronecker factors live.
"""

from singd_curvlinops.linear_operator import SINGDLinearOperator
from singd_curvlinops.optimizer import SINGD
from singd_curvlinops.structures import (
    StructuredMatrix,
    get_structure,
    register_structure,
)

__all__ = [
    "SINGD",
    "SINGDLinearOperator",
    "StructuredMatrix",
    "get_structure",
    "register_structure",
]
__version__ = "0.1.0.dev0"
