r"""SINGD's preconditioner as a curvlinops `PyTorchLinearOperator`.

Per layer, SINGD preconditions the joint weight-and-bias matrix
\(M = [W\; b] \in \mathbb{R}^{d_C \times d_K}\) (a convolution's weight flattened
to `[C_out, C_in / groups * k1 * k2]`) by \(M \mapsto C C^\top M K K^\top\), i.e. by
\(P = C C^\top \otimes K K^\top\) in curvlinops' Kronecker order (row-major
flattening, output side first). `SINGDLinearOperator` is the block-diagonal operator
with these blocks, in curvlinops' tensor-list format and in the optimizer's parameter
order, so that `@`, `.to_scipy()`, `.adjoint()` and curvlinops' estimators apply to
it. Its `inverse()` is the curvature \(P^{-1}\) that SINGD implicitly uses,
\((C C^\top)^{-1} \otimes (K K^\top)^{-1}\), applied through the structures' own
solves \(K^{-\top} K^{-1}\) (no dense inverse of a sparse factor).
"""

from __future__ import annotations

import torch
from curvlinops._torch_base import PyTorchLinearOperator
from torch import Tensor

from singd_curvlinops import statistics
from singd_curvlinops.structures import StructuredMatrix


class SINGDLinearOperator(PyTorchLinearOperator):
    r"""The preconditioner \(P\) of a `SINGD` optimizer, frozen at construction.

    For the `KFAC` baseline, \(P = (G + \lambda I)^{-1} \otimes (A + \lambda I)^{-1}\).

    Args:
        optimizer: A `SINGD` or `KFAC` optimizer. Its factors are copied, so later
            optimizer steps do not change the operator.

    Examples:
        >>> import torch
        >>> from singd_curvlinops import SINGD
        >>> model = torch.nn.Linear(3, 2)
        >>> P = SINGDLinearOperator(SINGD(model))
        >>> P.shape  # identity factors at the start: P = I
        (8, 8)
    """

    SELF_ADJOINT = True

    def __init__(self, optimizer: torch.optim.Optimizer):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self._params = params
        self._inverse = False
        self._square_roots = optimizer._FACTORS_ARE_SQUARE_ROOTS
        self._blocks: list[tuple[list[int], StructuredMatrix, StructuredMatrix]] = []
        position = {p: i for i, p in enumerate(params)}
        for weight, (_, module) in optimizer._layers.items():
            if weight not in position:
                continue
            K, C = (M.clone() for M in optimizer._preconditioner(module)[:2])
            indices = [position[p] for p in statistics.layer_params(module)]
            self._blocks.append((indices, K, C))
        shapes = [tuple(p.shape) for p in params]
        super().__init__(shapes, shapes)

    @property
    def device(self) -> torch.device:
        """Device of the parameters."""
        return self._params[0].device

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the parameters."""
        return self._params[0].dtype

    def inverse(self) -> SINGDLinearOperator:
        r"""Return \(P^{-1}\), the curvature approximation SINGD implies.

        Returns:
            An operator applying \((C C^\top)^{-1} \otimes (K K^\top)^{-1}\) by
            structured solves.
        """
        inverse = object.__new__(SINGDLinearOperator)
        inverse.__dict__.update(self.__dict__)
        inverse._inverse = not self._inverse
        return inverse

    def _apply_side(self, factor: StructuredMatrix, V: Tensor) -> Tensor:
        r"""Apply \(F F^\top\) (or its inverse) to the columns of `V`.

        Args:
            factor: \(K\) or \(C\).
            V: Matrix `[d, n]`.

        Returns:
            \(F F^\top V\), or \(F^{-\top} F^{-1} V\) for the inverse.
        """
        V = V.to(factor.dtype)
        if not self._square_roots:  # KFAC: the factor is the side's matrix itself
            return factor.solve(V) if self._inverse else factor @ V
        if self._inverse:
            return factor.rsolve(factor.solve(V))
        return factor @ factor.rmatmat(V)

    def _matmat(self, X: list[Tensor]) -> list[Tensor]:
        """Apply the block-diagonal operator to tensor-list columns.

        Args:
            X: Tensors of shape `[*param.shape, n]` in parameter order.

        Returns:
            Tensors of the same shapes.
        """
        out = [x.clone() for x in X]  # parameters outside any layer: identity
        for indices, K, C in self._blocks:
            weight, num = X[indices[0]], X[indices[0]].shape[-1]
            d_out = weight.shape[0]
            M = weight.reshape(d_out, -1, num)  # [d_out, d_in, n]
            d_in = M.shape[1]
            if len(indices) == 2:
                M = torch.cat([M, X[indices[1]].unsqueeze(1)], dim=1)
            d_K = M.shape[1]
            # right factor: M K Kᵀ, i.e. K Kᵀ on the d_K axis of every (row, column)
            right = self._apply_side(K, M.permute(1, 0, 2).reshape(d_K, -1))
            M = right.reshape(d_K, d_out, num).permute(1, 0, 2)
            left = self._apply_side(C, M.reshape(d_out, -1)).reshape(d_out, d_K, num)
            left = left.to(weight.dtype)
            out[indices[0]] = left[:, :d_in].reshape_as(weight)
            if len(indices) == 2:
                out[indices[1]] = left[:, -1]
        return out
