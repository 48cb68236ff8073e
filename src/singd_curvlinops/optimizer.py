r"""`SINGD`: structured inverse-free natural gradient descent for `torch.optim`.

The front door of SINGD and IKFAC: the options of Lin et al. (ICML 2024) on the
shared optimizer shell (`singd_curvlinops.shell`) with `SINGDRule`. All per-layer
state lives in `self.state[weight]` as plain tensors (`"K.<name>"`, `"C.<name>"`,
`"m_K.<name>"`, `"m_C.<name>"`) plus the layer's step counter, so that
`state_dict()` is complete and loads with `torch.load(..., weights_only=True)`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.nn import Module, Parameter

from singd_curvlinops.distributed import DistributionStrategy
from singd_curvlinops.rules import SINGDRule
from singd_curvlinops.shell import KroneckerOptimizer


class SINGD(KroneckerOptimizer):
    r"""Structured inverse-free natural gradient descent (Lin et al., ICML 2024).

    Preconditions the weight (and bias) of every supported layer (`Linear`,
    `Conv2d`, `torch_geometric.nn.GCNConv` and those added with `register_layer`)
    by \(C C^\top \otimes K K^\top\) with structured factors updated inverse-free on
    the empirical Fisher's KFAC statistics (as curvlinops defines them), and
    applies momentum and weight decay as SGD does. Call it like any optimizer:
    `loss.backward(); optimizer.step()`.

    | argument | symbol | meaning |
    |---|---|---|
    | `lr` | \(\beta_2\) | learning rate of the parameters |
    | `momentum` | \(\alpha_2\) | momentum of the parameter update |
    | `damping` | \(\lambda\) | damping of the factor update |
    | `alpha1` | \(\alpha_1\) | Riemannian momentum of the factors |
    | `weight_decay` | \(\gamma\) | L2 weight decay, added to the natural gradient |
    | `T` | \(T\) | update the factors every `T` steps |
    | `lr_cov` | \(\beta_1\) | factor learning rate; a float or a function of the step |
    | `structures` | — | structure names of \((K, C)\), see `get_structure` |
    | `kfac_approx` | — | `"expand"` or `"reduce"` for weight-sharing layers |
    | `loss_average` | — | `None` (sum loss), `"batch"`, `"batch+sequence"` |
    | `kfac_like` | — | IKFAC update (no trace coupling of \(K\) and \(C\)) |
    | `normalize_lr_cov` | — | normalise \(\beta_1\) by the largest momentum entry |
    | `preconditioner_dtype` | — | dtypes of \((K, C)\); `None`: the parameter's |
    | `init_grad_scale` | — | gradient scale of the first step under AMP |
    | `distribute` | — | `"replicate"` or `"shard"` the factor work over ranks |

    `alpha1=None` (the default) means 0.5 for SINGD and 0 for IKFAC
    (`kfac_like=True`): `SINGD(model, kfac_like=True)` is the paper's IKFAC. An
    explicit `alpha1 > 0` with `kfac_like=True` is honoured, a hybrid of IKFAC's
    update with Riemannian momentum.

    Every option except `init_grad_scale`, `warn_unsupported` and `distribute`
    can be set per parameter group. All options after `params` are keyword-only.

    Args:
        model: The network whose supported layers are preconditioned.
        params: Parameters or parameter groups; default: the parameters of all
            supported layers of `model` (others are left out, with a warning).
        lr: Learning rate \(\beta_2 \ge 0\).
        momentum: Momentum \(\alpha_2 \in [0, 1)\).
        damping: Damping \(\lambda \ge 0\).
        alpha1: Riemannian momentum \(\alpha_1 \in [0, 1)\), or None for the
            default of the update (0.5 SINGD, 0 IKFAC).
        weight_decay: Weight decay \(\gamma \ge 0\).
        T: Factor update interval, a positive int.
        loss_average: How the loss averages its terms (see `statistics`).
        lr_cov: Factor learning rate \(\beta_1 \ge 0\) or a function `step -> float`.
        structures: Structure names of \(K\) and \(C\).
        kfac_approx: `"expand"` or `"reduce"`.
        warn_unsupported: Warn about parameters of unsupported layers.
        kfac_like: Use the IKFAC update.
        preconditioner_dtype: Dtypes of \(K\) and \(C\) (`None`: the parameter's).
        init_grad_scale: Expected gradient scale of the first step (AMP).
        normalize_lr_cov: Normalise \(\beta_1\) (see `update`).
        distribute: How the ranks of a `torch.distributed` job share the factor
            work: `"replicate"` (each rank does all), `"shard"` (each layer's
            owner does it) or a strategy of `singd_curvlinops.distributed`.
    """

    def __init__(
        self,
        model: Module,
        params: Iterable[Parameter] | Iterable[dict[str, Any]] | None = None,
        *,
        lr: float = 0.001,
        momentum: float = 0.9,
        damping: float = 0.001,
        alpha1: float | None = None,
        weight_decay: float = 0.0,
        T: int = 10,
        loss_average: str | None = "batch",
        lr_cov: float | Callable[[int], float] = 1e-2,
        structures: tuple[str, str] = ("dense", "dense"),
        kfac_approx: str = "expand",
        warn_unsupported: bool = True,
        kfac_like: bool = False,
        preconditioner_dtype: tuple[torch.dtype | None, torch.dtype | None] = (
            None,
            None,
        ),
        init_grad_scale: float = 1.0,
        normalize_lr_cov: bool = False,
        distribute: str | DistributionStrategy = "replicate",
    ) -> None:
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "damping": damping,
            "alpha1": alpha1,
            "weight_decay": weight_decay,
            "T": T,
            "loss_average": loss_average,
            "lr_cov": lr_cov,
            "structures": structures,
            "kfac_approx": kfac_approx,
            "kfac_like": kfac_like,
            "preconditioner_dtype": preconditioner_dtype,
            "normalize_lr_cov": normalize_lr_cov,
        }
        super().__init__(
            model,
            params,
            defaults,
            rule=SINGDRule(),
            warn_unsupported=warn_unsupported,
            init_grad_scale=init_grad_scale,
            distribute=distribute,
        )
