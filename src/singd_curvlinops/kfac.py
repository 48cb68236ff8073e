r"""`KFAC`: the KFAC baseline on the optimizer shell that `SINGD` uses.

Per layer, dense Kronecker factors \(A\) (input side) and \(G\) (output side) are
exponential moving averages of the statistics \(U_K\), \(U_C\) of
`singd_curvlinops.statistics` (curvlinops' conventions; the first update takes the
statistics as they are):

\[
A \gets \beta A + (1 - \beta) U_K, \qquad G \gets \beta G + (1 - \beta) U_C,
\]

every `T` steps, together with the damped inverses \((A + \lambda I)^{-1}\) and
\((G + \lambda I)^{-1}\) (`KFACRule`). Every step applies
\(\Delta = (G + \lambda I)^{-1} \Gamma (A + \lambda I)^{-1}\), weight decay and momentum
exactly as SINGD does. With one step, \(\beta\) irrelevant, no momentum and no weight
decay, this is \(-\)`lr` times curvlinops' `KFACInverseLinearOperator(kfac,
damping=(λ, λ))` applied to the gradient.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.nn import Module, Parameter

from singd_curvlinops.distributed import DistributionStrategy
from singd_curvlinops.rules import KFACRule
from singd_curvlinops.shell import KroneckerOptimizer
from singd_curvlinops.structure_policy import DEFAULT_MAX_DENSE_DIM


class KFAC(KroneckerOptimizer):
    r"""KFAC with exponentially averaged dense factors and damped inverses.

    | argument | symbol | meaning |
    |---|---|---|
    | `lr` | \(\beta_2\) | learning rate |
    | `momentum` | \(\alpha_2\) | momentum of the parameter update |
    | `damping` | \(\lambda\) | added to both factors before inverting |
    | `weight_decay` | \(\gamma\) | L2 weight decay, added to the natural gradient |
    | `T` | \(T\) | update factors and inverses every `T` steps |
    | `ema_decay` | \(\beta\) | exponential averaging of the factors |
    | `loss_average`, `kfac_approx` | — | as for `SINGD` |
    | `max_dense_dim` | — | factors over this dimension are diagonal |
    | `fallback`, `fallback_*`, `graft` | — | as for `SINGD` |

    Factors are dense up to dimension `max_dense_dim` and diagonal above (an
    embedding's input factor always). All options after `params` are keyword-only.

    Args:
        model: The network whose supported layers are preconditioned.
        params: Parameters or parameter groups (default: every trainable
            parameter; see `SINGD`).
        lr: Learning rate \(\ge 0\).
        momentum: Momentum in \([0, 1)\).
        damping: Damping \(\lambda \ge 0\) of both factors.
        weight_decay: Weight decay \(\ge 0\).
        T: Factor and inverse update interval, a positive int.
        loss_average: `None`, `"batch"` or `"batch+sequence"`.
        kfac_approx: `"expand"` or `"reduce"`.
        ema_decay: \(\beta \in [0, 1)\).
        warn_unsupported: Warn about parameters of unsupported layers.
        preconditioner_dtype: Dtypes of \(A\) and \(G\) (None: the parameter's).
        init_grad_scale: Expected gradient scale of the first step (AMP).
        max_dense_dim: Factors of larger dimension are diagonal (None: all dense).
        fallback: Rule of the parameters no layer owns (see `SINGD`).
        fallback_lr_ratio: The fallback's learning rate over `lr`.
        fallback_betas: AdamW's \((\beta_1, \beta_2)\) (fallback and grafting).
        fallback_eps: AdamW's \(\epsilon\).
        graft: None, `"adamw"` or `"sgd"` (see `SINGD`).
        distribute: How the ranks of a `torch.distributed` job share the factor
            work: `"replicate"` (each rank does all), `"shard"` (each layer's
            owner does it) or a strategy of `singd_curvlinops.distributed`.
    """

    _rule_type: type[KFACRule] = KFACRule

    def __init__(
        self,
        model: Module,
        params: Iterable[Parameter] | Iterable[dict[str, Any]] | None = None,
        *,
        lr: float = 0.001,
        momentum: float = 0.9,
        damping: float = 0.001,
        weight_decay: float = 0.0,
        T: int = 10,
        loss_average: str | None = "batch",
        kfac_approx: str = "expand",
        ema_decay: float = 0.95,
        warn_unsupported: bool = True,
        preconditioner_dtype: tuple[torch.dtype | None, torch.dtype | None] = (
            None,
            None,
        ),
        init_grad_scale: float = 1.0,
        max_dense_dim: int | None = DEFAULT_MAX_DENSE_DIM,
        fallback: str | None = "adamw",
        fallback_lr_ratio: float = 1.0,
        fallback_betas: tuple[float, float] = (0.9, 0.999),
        fallback_eps: float = 1e-8,
        graft: str | None = None,
        distribute: str | DistributionStrategy = "replicate",
    ) -> None:
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "damping": damping,
            "weight_decay": weight_decay,
            "T": T,
            "loss_average": loss_average,
            "structures": "auto",
            "kfac_approx": kfac_approx,
            "preconditioner_dtype": preconditioner_dtype,
            "ema_decay": ema_decay,
            "max_dense_dim": max_dense_dim,
            "fallback": fallback,
            "fallback_lr_ratio": fallback_lr_ratio,
            "fallback_betas": fallback_betas,
            "fallback_eps": fallback_eps,
            "graft": graft,
        }
        super().__init__(
            model,
            params,
            defaults,
            rule=self._rule_type(),
            warn_unsupported=warn_unsupported,
            init_grad_scale=init_grad_scale,
            distribute=distribute,
        )
