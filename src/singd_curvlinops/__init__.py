"""SINGD, the structured inverse-free natural gradient optimizer, on curvlinops.

Public API: the optimizers `SINGD` (and IKFAC through `kfac_like=True`) and the
`KFAC` and `EKFAC` baselines, `SINGDLinearOperator` (the preconditioner as a
curvlinops linear operator), the structured matrices of
`singd_curvlinops.structures`, the layer adapters of `singd_curvlinops.layers`
(`LayerAdapter`, `register_layer`) and the fallback rules for the parameters that
no layer owns (`FallbackRule`, `register_fallback`).
"""

from singd_curvlinops.ekfac import EKFAC
from singd_curvlinops.kfac import KFAC
from singd_curvlinops.layers import LayerAdapter, register_layer
from singd_curvlinops.linear_operator import SINGDLinearOperator
from singd_curvlinops.optimizer import SINGD
from singd_curvlinops.rules.fallback import FallbackRule, register_fallback
from singd_curvlinops.structures import (
    StructuredMatrix,
    get_structure,
    register_structure,
)

__all__ = [
    "EKFAC",
    "KFAC",
    "SINGD",
    "FallbackRule",
    "LayerAdapter",
    "SINGDLinearOperator",
    "StructuredMatrix",
    "get_structure",
    "register_fallback",
    "register_layer",
    "register_structure",
]
__version__ = "0.1.0.dev0"
