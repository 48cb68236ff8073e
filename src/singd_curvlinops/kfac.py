r"""`KFAC`: the KFAC baseline on SINGD's hooks, statistics and optimizer shell.

Per layer, dense Kronecker factors \(A\) (input side) and \(G\) (output side) are
exponential moving averages of the statistics \(U_K\), \(U_C\) of
`singd_curvlinops.statistics` (curvlinops' conventions; the first update takes the
statistics as they are):

\[
A \gets \beta A + (1 - \beta) U_K, \qquad G \gets \beta G + (1 - \beta) U_C,
\]

every `T` steps, together with the damped inverses \((A + \lambda I)^{-1}\) and
\((G + \lambda I)^{-1}\). Every step applies
\(\Delta = (G + \lambda I)^{-1} \Gamma (A + \lambda I)^{-1}\), weight decay and momentum
exactly as SINGD does. With one step, \(\beta\) irrelevant, no momentum and no weight
decay, this is \(-\)`lr` times curvlinops' `KFACInverseLinearOperator(kfac,
damping=(λ, λ))` applied to the gradient.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module, Parameter

from singd_curvlinops import statistics
from singd_curvlinops._hyperparameters import _check_number, check_group
from singd_curvlinops.optimizer import SINGD
from singd_curvlinops.structures import DenseMatrix, StructuredMatrix
from singd_curvlinops.structures._linalg import solve_dense


class KFAC(SINGD):
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

    Args:
        model: The network whose `Linear`, `Conv2d` and `GCNConv` layers are
            preconditioned.
        params: Parameters or parameter groups (default: all supported layers).
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
    """

    _IDENTITY_FACTORS = ()
    _FACTOR_SIDES = (("A", 0), ("G", 1))
    _FACTORS_ARE_SQUARE_ROOTS = False  # the cached factors are the inverses

    def __init__(
        self,
        model: Module,
        params: Iterable[Parameter] | Iterable[dict[str, Any]] | None = None,
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
    ) -> None:
        self._ema_decay_default = ema_decay
        super().__init__(
            model,
            params,
            lr=lr,
            momentum=momentum,
            damping=damping,
            weight_decay=weight_decay,
            T=T,
            loss_average=loss_average,
            kfac_approx=kfac_approx,
            warn_unsupported=warn_unsupported,
            preconditioner_dtype=preconditioner_dtype,
            init_grad_scale=init_grad_scale,
        )

    def _check_group(self, group: dict[str, Any]) -> None:
        """Validate KFAC's options; SINGD-only options are removed from the group.

        Args:
            group: The group's options.
        """
        for key in ("alpha1", "lr_cov", "kfac_like", "normalize_lr_cov"):
            group.pop(key, None)
        group["structures"] = ("dense", "dense")  # KFAC's factors are dense
        group.setdefault("ema_decay", self._ema_decay_default)
        check_group(group, with_singd=False)
        _check_number("ema_decay", group["ema_decay"], 0.0, 1.0)

    def _layer_state(self, module: Module) -> dict[str, Any]:
        """Return the layer's state; `"updates"` counts the factor updates so far.

        Args:
            module: A hooked layer.

        Returns:
            `self.state[weight]` of the layer's weight.
        """
        state = super()._layer_state(module)
        state.setdefault("updates", 0)
        return state

    def _statistics(
        self, module: Module, a: Tensor, g: Tensor
    ) -> tuple[StructuredMatrix, StructuredMatrix]:
        r"""Return the dense \(a^\top a\) and \(g^\top g\).

        Args:
            module: The layer.
            a: Input rows `[rows, d_K]`.
            g: Output-gradient rows `[rows, d_C]`.

        Returns:
            The two dense statistics.
        """
        return DenseMatrix.from_mat_inner(a.T), DenseMatrix.from_mat_inner(g.T)

    def _zero_statistics(
        self, module: Module
    ) -> tuple[StructuredMatrix, StructuredMatrix]:
        """Return dense zero statistics (data parallelism).

        Args:
            module: The layer.

        Returns:
            Zero matrices of the factors' dimensions and dtypes.
        """
        d_K, d_C = statistics.factor_dims(module)
        weight = statistics.layer_weight(module)
        dtype_K, dtype_C = self._factor_dtypes(self._group_of(weight), module)
        device = weight.device
        return (
            DenseMatrix.zeros(d_K, dtype=dtype_K, device=device),
            DenseMatrix.zeros(d_C, dtype=dtype_C, device=device),
        )

    def _preconditioner(self, module: Module) -> tuple:
        r"""Return the damped inverses, cached until the next factor update.

        Before the first update the preconditioner is the identity.

        Args:
            module: A hooked layer.

        Returns:
            `(A⁻¹, G⁻¹, A⁻¹, G⁻¹)` as dense matrices, in `precondition`'s layout.
        """
        cached = self._cache.get(module)
        if cached is None:
            state = self._layer_state(module)
            group = self._group_of(statistics.layer_weight(module))
            inverses = []
            for prefix in ("A", "G"):
                factor = state[f"{prefix}.mat"]
                if state["updates"] == 0:
                    inverse = torch.eye(
                        factor.shape[0], dtype=factor.dtype, device=factor.device
                    )
                else:
                    inverse = _damped_inverse(factor, group["damping"])
                inverses.append(DenseMatrix(inverse))
            cached = self._cache[module] = (*inverses, *inverses)
        return cached

    def _update_factors(
        self,
        group: dict[str, Any],
        name: str,
        module: Module,
        state: dict[str, Any],
        statistics_scale: float,
    ) -> None:
        """Average the new statistics into `A`, `G` and refresh the inverses.

        Args:
            group: The layer's parameter group.
            name: The layer's name.
            module: The layer.
            state: Its state.
            statistics_scale: Scale of the output gradients in the statistics.
        """
        taken = self._take_statistics(group, name, module, statistics_scale)
        if taken is None:
            return
        handed_over, U_K, U_C = taken
        if not handed_over:  # dense statistics collected by the hooks
            U_K, U_C = U_K.mat, U_C.mat
        beta = group["ema_decay"] if state["updates"] else 0.0
        for prefix, U in (("A", U_K), ("G", U_C)):
            factor = state[f"{prefix}.mat"]
            factor.mul_(beta).add_(U.to(factor.dtype), alpha=1.0 - beta)
        state["updates"] += 1
        self._cache.pop(module, None)


def _damped_inverse(factor: Tensor, damping: float) -> Tensor:
    r"""Return \((F + \lambda I)^{-1}\) by a linear solve (in at least float32).

    Args:
        factor: Symmetric positive semi-definite matrix \(F\).
        damping: \(\lambda\).

    Returns:
        The inverse, in `factor`'s dtype.

    Raises:
        ValueError: If \(F + \lambda I\) is singular (increase `damping`).
    """
    damped = factor.clone()
    damped.diagonal().add_(damping)
    eye = torch.eye(factor.shape[0], dtype=factor.dtype, device=factor.device)
    try:
        return solve_dense(damped, eye)
    except RuntimeError as error:
        raise ValueError(
            f"KFAC's damped factor is singular (damping={damping}); increase damping."
        ) from error
