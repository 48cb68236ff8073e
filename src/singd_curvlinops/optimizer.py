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
from singd_curvlinops.structure_policy import DEFAULT_MAX_DENSE_DIM


class SINGD(KroneckerOptimizer):
    r"""Structured inverse-free natural gradient descent (Lin et al., ICML 2024).

    Preconditions the weight (and bias) of every supported layer (`Linear`,
    `Conv2d`, `Embedding`, `MultiheadAttention`'s projections, Hugging Face's
    `Conv1D`, `torch_geometric.nn.GCNConv` and those added with `register_layer`;
    tied weights once, with the statistics of all their uses) by
    \(C C^\top \otimes K K^\top\) with structured factors updated inverse-free on
    the empirical Fisher's KFAC statistics (as curvlinops defines them), and
    applies momentum and weight decay as SGD does. Every other trainable parameter
    (norms, positional embeddings, ...) is trained by the group's `fallback` rule,
    AdamW by default: one optimizer trains the whole model. Call it like any
    optimizer: `loss.backward(); optimizer.step()`.

    | argument | symbol | meaning |
    |---|---|---|
    | `lr` | \(\beta_2\) | learning rate of the parameters |
    | `momentum` | \(\alpha_2\) | momentum of the parameter update |
    | `damping` | \(\lambda\) | damping of the factor update |
    | `alpha1` | \(\alpha_1\) | Riemannian momentum of the factors |
    | `weight_decay` | \(\gamma\) | L2 weight decay, added to the natural gradient |
    | `T` | \(T\) | update the factors every `T` steps |
    | `lr_cov` | \(\beta_1\) | factor learning rate; a float or a function of the step |
    | `structures` | — | `"auto"`, a pair `(K, C)` of structure names, or a callable |
    | `max_dense_dim` | — | memory budget: `max_dense_dim**2` numbers per factor |
    | `kfac_approx` | — | `"expand"` or `"reduce"` for weight-sharing layers |
    | `loss_average` | — | `None` (sum loss), `"batch"`, `"batch+sequence"` |
    | `kfac_like` | — | IKFAC update (no trace coupling of \(K\) and \(C\)) |
    | `normalize_lr_cov` | — | normalise \(\beta_1\) by the largest momentum entry |
    | `preconditioner_dtype` | — | dtypes of \((K, C)\); `None`: the parameter's |
    | `init_grad_scale` | — | gradient scale of the first step under AMP |
    | `fallback` | — | `"adamw"`, `"sgd"` or None: rule of the other parameters |
    | `fallback_lr_ratio` | — | the fallback's learning rate over `lr` |
    | `fallback_betas`, `_eps` | — | AdamW's \((\beta_1, \beta_2)\), \(\epsilon\) |
    | `graft` | — | None, `"adamw"`, `"sgd"`: per layer, that optimizer's step norm |
    | `distribute` | — | `"replicate"` or `"shard"` the factor work over ranks |

    `alpha1=None` (the default) means 0.5 for SINGD and 0 for IKFAC
    (`kfac_like=True`): `SINGD(model, kfac_like=True)` is the paper's IKFAC. An
    explicit `alpha1 > 0` with `kfac_like=True` is honoured, a hybrid of IKFAC's
    update with Riemannian momentum.

    Every option except `init_grad_scale`, `warn_unsupported` and `distribute`
    can be set per parameter group; a layer's factor options are those of its
    weight's group, its parameters' `lr`, `momentum` and `weight_decay` their own
    groups'. All options after `params` are keyword-only. See the guide pages
    "Layers", "Fallback and grafting", "Structures" and "Data parallelism" for the
    policies and their defaults.

    Args:
        model: The network whose supported layers are preconditioned.
        params: Parameters or parameter groups; default: every trainable
            parameter of `model` (with `fallback=None`: those of the supported
            layers; the others are left out, with a warning).
        lr: Learning rate \(\beta_2 \ge 0\).
        momentum: Momentum \(\alpha_2 \in [0, 1)\).
        damping: Damping \(\lambda \ge 0\).
        alpha1: Riemannian momentum \(\alpha_1 \in [0, 1)\), or None for the
            default of the update (0.5 SINGD, 0 IKFAC).
        weight_decay: Weight decay \(\gamma \ge 0\).
        T: Factor update interval, a positive int.
        loss_average: How the loss averages its terms (see `statistics`).
        lr_cov: Factor learning rate \(\beta_1 \ge 0\) or a function `step -> float`.
        structures: `"auto"` (dense up to `max_dense_dim`, diagonal above), a pair
            of structure names of \(K\) and \(C\), or a callable
            `(layer_name, (d_K, d_C)) -> (K, C)`.
        kfac_approx: `"expand"` or `"reduce"`.
        warn_unsupported: Warn about parameters of unsupported layers.
        kfac_like: Use the IKFAC update.
        preconditioner_dtype: Dtypes of \(K\) and \(C\) (`None`: the parameter's).
        init_grad_scale: Expected gradient scale of the first step (AMP).
        normalize_lr_cov: Normalise \(\beta_1\) (see `update`).
        max_dense_dim: Memory budget per factor (`max_dense_dim**2` stored
            numbers; None: no limit).
        fallback: Rule of the parameters no layer owns: `"adamw"`, `"sgd"` or
            None (left out, with a warning).
        fallback_lr_ratio: The fallback's learning rate over `lr` (\(\ge 0\)).
        fallback_betas: AdamW's \((\beta_1, \beta_2)\) (fallback and grafting).
        fallback_eps: AdamW's \(\epsilon \ge 0\).
        graft: None, `"adamw"` or `"sgd"`: rescale each layer's direction to the
            norm of that optimizer's.
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
        structures: str | tuple[str, str] | Callable = "auto",
        kfac_approx: str = "expand",
        warn_unsupported: bool = True,
        kfac_like: bool = False,
        preconditioner_dtype: tuple[torch.dtype | None, torch.dtype | None] = (
            None,
            None,
        ),
        init_grad_scale: float = 1.0,
        normalize_lr_cov: bool = False,
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
            rule=SINGDRule(),
            warn_unsupported=warn_unsupported,
            init_grad_scale=init_grad_scale,
            distribute=distribute,
        )
