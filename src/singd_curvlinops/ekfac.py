r"""`EKFAC`: eigenvalue-corrected KFAC on the optimizer shell that `SINGD` uses.

EKFAC (George et al., NeurIPS 2018) preconditions in KFAC's Kronecker-factored
eigenbasis, with the eigenvalues replaced by the second moments of the per-example
gradients in that basis (`rules.ekfac`). Every `T` steps the factors \(A\), \(G\)
are averaged as KFAC averages them, their eigenbases \(Q_A\), \(Q_G\) recomputed,
and the corrected eigenvalues \(E\) of the pass averaged in; every step applies

\[
\Delta = Q_G \left[\bigl(Q_G^\top \Gamma Q_A\bigr) \oslash (E + \lambda)\right]
Q_A^\top,
\]

weight decay and momentum exactly as `KFAC` and `SINGD` do. With one step, no
momentum and no weight decay, this is \(-\)`lr` times curvlinops'
`KFACInverseLinearOperator(EKFACLinearOperator(...), damping=λ,
use_exact_damping=True)` applied to the gradient (empirical Fisher).
"""

from __future__ import annotations

from typing import Any

from singd_curvlinops.kfac import KFAC
from singd_curvlinops.rules import EKFACRule


class EKFAC(KFAC):
    r"""Eigenvalue-corrected KFAC: KFAC's eigenbasis, per-example eigenvalues.

    The options are `KFAC`'s; `ema_decay` also averages the corrected eigenvalues,
    and `damping` \(\lambda\) is added to them (not to the factors).

    | argument | symbol | meaning |
    |---|---|---|
    | `lr` | \(\beta_2\) | learning rate |
    | `momentum` | \(\alpha_2\) | momentum of the parameter update |
    | `damping` | \(\lambda\) | added to the corrected eigenvalues |
    | `weight_decay` | \(\gamma\) | L2 weight decay, added to the natural gradient |
    | `T` | \(T\) | update factors, eigenbases and eigenvalues every `T` steps |
    | `ema_decay` | \(\beta\) | exponential averaging of factors and eigenvalues |
    | `loss_average`, `kfac_approx` | — | as for `SINGD` |

    On a factor update the layers' rows of the whole pass are kept until `step`
    (about the memory of the layers' inputs and output gradients), because the
    eigenbasis that the per-example gradients are projected onto is known only
    then. Data parallelism all-reduces the projected sums in a second collective
    per layer (`singd_curvlinops.distributed`; factor updates on every rank,
    also under FSDP2; with `distribute="shard"` each layer's owner
    preconditions it). `set_curvature` is not supported.

    All options after `params` are keyword-only.

    Args:
        model: The network whose supported layers are preconditioned.
        params: Parameters or parameter groups (default: all supported layers).
        lr: Learning rate \(\ge 0\).
        momentum: Momentum in \([0, 1)\).
        damping: Damping \(\lambda \ge 0\) of the corrected eigenvalues.
        weight_decay: Weight decay \(\ge 0\).
        T: Update interval of factors, eigenbases and eigenvalues, a positive int.
        loss_average: `None`, `"batch"` or `"batch+sequence"`.
        kfac_approx: `"expand"` or `"reduce"` (for \(A\), \(G\) only).
        ema_decay: \(\beta \in [0, 1)\).
        warn_unsupported: Warn about parameters of unsupported layers.
        preconditioner_dtype: Dtypes of the input- and output-side factors and
            eigenbases (None: the parameter's); the eigenvalues take the wider one.
        init_grad_scale: Expected gradient scale of the first step (AMP).
    """

    _rule_type = EKFACRule

    def set_curvature(self, kfac: Any) -> None:
        """Refuse: EKFAC's eigenvalues need the training pass's per-example gradients.

        Args:
            kfac: Any value.

        Raises:
            TypeError: Always.
        """
        raise TypeError(
            "EKFAC does not support set_curvature: its corrected eigenvalues come "
            "from the per-example gradients of the training pass, which a KFAC "
            "operator does not carry. Use KFAC or SINGD to train on an operator's "
            "factors."
        )
