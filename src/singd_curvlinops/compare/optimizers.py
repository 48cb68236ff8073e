"""The comparison's optimizers: names, search spaces, fixed options, construction.

A name is `FAMILY` or `FAMILY:STRUCTURE` (`singd:diagonal`, `ikfac`, `kfac`,
`ekfac`, `adamw`, `sgd`, `soap`). Each family is one `Family` entry of `FAMILIES`:
its label, search space, fixed options, factory, and whether it takes part in the
bfloat16 comparison. Adding a baseline is adding an entry.

Searched (log scale), and fixed:

- `singd[:S]`: `lr` [3e-3, 0.3], `damping` [1e-3, 0.3], `lr_cov` [3e-3, 0.3];
  `momentum=0.9, alpha1=0.5, T=5`, both factors in structure `S` (default dense).
- `ikfac[:S]`: as SINGD, with `kfac_like=True` and the default `alpha1=None`,
  which means no Riemannian momentum: the paper's IKFAC.
- `kfac`: `lr` [3e-3, 0.3], `damping` [1e-2, 1]; `momentum=0.9, ema_decay=0.95,
  T=5`.
- `ekfac`: `lr` [3e-3, 0.3], `damping` [3e-2, 3]; fixed as KFAC.
- `adamw`: `lr` [3e-4, 3e-2], `weight_decay` [1e-4, 0.1]; `betas=(0.9, 0.999)`.
- `sgd`: `lr` [1e-2, 1]; `momentum=0.9`.
- `soap`: `lr` [3e-4, 3e-2], `weight_decay` [1e-4, 0.1];
  `precondition_frequency=5`, pytorch-optimizer's other defaults.

Every optimizer runs under the same learning-rate schedule (`warmup_cosine`):
linear warm-up over the first 5% of the steps, then cosine decay to zero. SOAP
(Vyas et al., 2024: Adam in the eigenbasis of Shampoo's preconditioner) is the
Shampoo-family baseline, from the `pytorch-optimizer` package (extra `compare`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from singd_curvlinops.compare.search import Dimension
from singd_curvlinops.ekfac import EKFAC
from singd_curvlinops.kfac import KFAC
from singd_curvlinops.optimizer import SINGD
from singd_curvlinops.structures import get_structure

WARMUP_FRACTION = 0.05
_FACTOR_SPACE = (
    Dimension("lr", 3e-3, 0.3),
    Dimension("damping", 1e-3, 0.3),
    Dimension("lr_cov", 3e-3, 0.3),
)
_ADAM_SPACE = (Dimension("lr", 3e-4, 3e-2), Dimension("weight_decay", 1e-4, 0.1))
# Factory: (model, options, loss_average, factor dtype or None) -> optimizer
Factory = Callable[[nn.Module, dict[str, Any], str, "torch.dtype | None"], Any]


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: one per family
class Family:
    """An optimizer family of the comparison.

    Attributes:
        label: Table label, e.g. `"SINGD"`.
        space: The searched hyperparameters.
        fixed: Options that are not searched.
        build: Constructs the optimizer from the model, the searched and fixed
            options, the workload's `loss_average` and the factors' dtype (None:
            the parameters').
        structured: Whether the name takes a structure (`singd:diagonal`).
        bf16_precisions: Its runs in the bfloat16 comparison (`--bf16`), as
            `compare.trial.Precision` values; empty: not part of it.
        requires: Importable modules it needs beyond the core package.
    """

    label: str
    space: tuple[Dimension, ...]
    fixed: dict[str, Any]
    build: Factory
    structured: bool = False
    bf16_precisions: tuple[str, ...] = ()
    requires: tuple[str, ...] = field(default_factory=tuple)


def _singd(
    model: nn.Module,
    options: dict[str, Any],
    loss_average: str,
    factor_dtype: torch.dtype | None,
) -> SINGD:
    """Construct `SINGD` (or IKFAC, with `kfac_like=True` among the options).

    Args:
        model: The network.
        options: Searched and fixed options, with `structure`.
        loss_average: The workload's `loss_average`.
        factor_dtype: Dtype of both factors, or None.

    Returns:
        The optimizer.
    """
    options = dict(options)
    structure = options.pop("structure")
    return SINGD(
        model,
        structures=(structure, structure),
        loss_average=loss_average,
        preconditioner_dtype=(factor_dtype, factor_dtype),
        **options,
    )


def _kfac(
    optimizer: type[KFAC],
    model: nn.Module,
    options: dict[str, Any],
    loss_average: str,
    factor_dtype: torch.dtype | None,
) -> KFAC:
    """Construct the `KFAC` or the `EKFAC` baseline (bind `optimizer` first).

    Args:
        optimizer: `KFAC` or `EKFAC`.
        model: The network.
        options: Searched and fixed options.
        loss_average: The workload's `loss_average`.
        factor_dtype: Dtype of both factors and their damped inverses (EKFAC:
            eigenbases), or None.

    Returns:
        The optimizer.
    """
    return optimizer(
        model,
        loss_average=loss_average,
        preconditioner_dtype=(factor_dtype, factor_dtype),
        **options,
    )


def _first_order(load: Callable[[], type[torch.optim.Optimizer]]) -> Factory:
    """Return the factory of a first-order optimizer over all parameters.

    Such an optimizer takes `model.parameters()` and its options; the workload's
    `loss_average` and the factor dtype do not concern it.

    Args:
        load: Returns the optimizer class (imported when first built, so that an
            optional package is needed only by the runs that use it).

    Returns:
        The factory.
    """

    def build(
        model: nn.Module,
        options: dict[str, Any],
        loss_average: str,
        factor_dtype: torch.dtype | None,
    ) -> torch.optim.Optimizer:
        del loss_average, factor_dtype  # a first-order optimizer has neither
        return load()(model.parameters(), **options)

    return build


def _soap_class() -> type[torch.optim.Optimizer]:
    """Import pytorch-optimizer's `SOAP` (extra `compare`).

    Returns:
        The class.
    """
    from pytorch_optimizer import SOAP

    return SOAP


_KFAC_FAMILY = {"momentum": 0.9, "T": 5}
FAMILIES: dict[str, Family] = {
    "singd": Family(
        label="SINGD",
        space=_FACTOR_SPACE,
        fixed={**_KFAC_FAMILY, "alpha1": 0.5},
        build=_singd,
        structured=True,
        bf16_precisions=("bf16",),
    ),
    "ikfac": Family(
        label="IKFAC",
        space=_FACTOR_SPACE,
        fixed={**_KFAC_FAMILY, "kfac_like": True},  # alpha1 None: 0, the paper's
        build=_singd,
        structured=True,
        bf16_precisions=("bf16",),
    ),
    "kfac": Family(
        label="KFAC",
        # KFAC inverts (F + λI): below λ = 1e-2 the steps along small eigenvalues
        # blow up (digits-cnn: chance accuracy at λ = 1e-2, lr = 3e-3; 0.976 at
        # λ = 0.3, lr = 0.03), so its damping interval sits higher than SINGD's
        space=(Dimension("lr", 3e-3, 0.3), Dimension("damping", 1e-2, 1.0)),
        fixed={**_KFAC_FAMILY, "ema_decay": 0.95},
        build=partial(_kfac, KFAC),
        # bfloat16 factors and inverses, and float32 ones (the usual remedy)
        bf16_precisions=("bf16", "bf16-fp32-factors"),
    ),
    "ekfac": Family(
        label="EKFAC",
        # λ is added to the corrected eigenvalues. A probe before the study
        # (digits-cnn, lr = 0.03): chance accuracy at λ <= 0.03, 0.976 at λ = 0.1,
        # 0.971 at 1, 0.907 at 3; so KFAC's two decades, shifted up threefold
        space=(Dimension("lr", 3e-3, 0.3), Dimension("damping", 3e-2, 3.0)),
        fixed={**_KFAC_FAMILY, "ema_decay": 0.95},
        build=partial(_kfac, EKFAC),
    ),
    "adamw": Family(
        label="AdamW",
        space=_ADAM_SPACE,
        fixed={"betas": (0.9, 0.999)},
        build=_first_order(lambda: torch.optim.AdamW),
    ),
    "sgd": Family(
        label="SGD",
        space=(Dimension("lr", 1e-2, 1.0),),
        fixed={"momentum": 0.9},
        build=_first_order(lambda: torch.optim.SGD),
    ),
    "soap": Family(
        label="SOAP",
        space=_ADAM_SPACE,
        fixed={"precondition_frequency": 5},
        build=_first_order(_soap_class),
        requires=("pytorch_optimizer",),
    ),
}
DEFAULT_OPTIMIZERS = (
    "singd:dense",
    "singd:diagonal",
    "singd:triltoeplitz",
    "ikfac",
    "kfac",
    "ekfac",
    "adamw",
    "sgd",
    "soap",
)


@dataclass(frozen=True)
class OptimizerSpec:
    """A named optimizer of the comparison.

    Attributes:
        name: Canonical name, e.g. `"singd:diagonal"`, `"ikfac"` or `"soap"`.
        family: Its `Family`.
        structure: Structure of both factors (structured families), else None.
    """

    name: str
    family: Family
    structure: str | None = None

    @property
    def label(self) -> str:
        """The table label, e.g. `"SINGD (diagonal)"` or `"IKFAC"`.

        Returns:
            The label; IKFAC with dense factors is plain `"IKFAC"`.
        """
        label = self.family.label
        if self.structure is None or (label == "IKFAC" and self.structure == "dense"):
            return label
        return f"{label} ({self.structure})"

    @property
    def fixed(self) -> dict[str, Any]:
        """The fixed options, with the structure for structured families.

        Returns:
            A new dictionary.
        """
        fixed = dict(self.family.fixed)
        if self.structure is not None:
            fixed["structure"] = self.structure
        return fixed

    def build(
        self,
        model: nn.Module,
        params: dict[str, float],
        loss_average: str,
        factor_dtype: torch.dtype | None = None,
    ) -> torch.optim.Optimizer:
        """Construct the optimizer for `model` at a point of its search space.

        Args:
            model: The network.
            params: Values of the searched hyperparameters.
            loss_average: The workload's `loss_average`.
            factor_dtype: Dtype of the Kronecker factors (families with factors).

        Returns:
            The optimizer.
        """
        return self.family.build(
            model, {**self.fixed, **params}, loss_average, factor_dtype
        )


def _syntax() -> str:
    """Return the accepted names for error messages.

    Returns:
        E.g. `"singd[:STRUCTURE], ikfac[:STRUCTURE], kfac, adamw, sgd, soap"`.
    """
    return ", ".join(
        f"{name}[:STRUCTURE]" if family.structured else name
        for name, family in FAMILIES.items()
    )


def parse_optimizer(name: str) -> OptimizerSpec:
    """Parse `FAMILY` or `FAMILY:STRUCTURE` (family case-insensitive).

    Args:
        name: E.g. `"singd:diagonal"`.

    Returns:
        The specification; structured families default to `dense`.

    Raises:
        ValueError: If the family is unknown, a structure is given to a family
            without factors, or the structure is unknown.
    """
    family_name, _, structure = name.strip().partition(":")
    family_name, structure = family_name.strip().lower(), structure.strip()
    family = FAMILIES.get(family_name)
    if family is None:
        raise ValueError(
            f"unknown optimizer {name.strip()!r}; choose from {_syntax()}."
        )
    if not family.structured:
        if structure:
            raise ValueError(f"{family_name} takes no structure, got {name.strip()!r}.")
        return OptimizerSpec(family_name, family)
    structure = structure or "dense"
    get_structure(structure)  # raises ValueError listing the valid names
    return OptimizerSpec(f"{family_name}:{structure}", family, structure)


def warmup_cosine(
    optimizer: torch.optim.Optimizer, steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    r"""Return the comparison's schedule: linear warm-up, then cosine decay to zero.

    The learning rate of step \(t = 0, 1, \dots\) is the optimizer's `lr` times
    \(\min(1, (t + 1) / w) \cdot \tfrac12 (1 + \cos(\pi t / n))\) with \(n\) =
    `steps` and \(w = \lceil 0.05 n \rceil\) warm-up steps.

    Args:
        optimizer: The optimizer (every parameter group is scheduled).
        steps: The step budget \(n\).

    Returns:
        The scheduler; call `step()` after every `optimizer.step()`.
    """
    warmup = math.ceil(WARMUP_FRACTION * steps)

    def factor(step: int) -> float:
        """Return the learning-rate factor of a step.

        Args:
            step: Steps taken so far.

        Returns:
            The factor in `[0, 1]`.
        """
        return (
            min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))
        )

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
