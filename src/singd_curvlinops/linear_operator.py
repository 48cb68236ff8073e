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
solves \(K^{-\top} K^{-1}\) (no dense inverse of a sparse factor). For `EKFAC`, a
block is \((Q_C \otimes Q_K) \operatorname{diag}(D) (Q_C \otimes Q_K)^\top\) with
\(D = 1 / (E + \lambda)\), and its inverse divides by \(D\) instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from singd_curvlinops._curvlinops import PyTorchLinearOperator, check_version
from singd_curvlinops.layers import Layer
from singd_curvlinops.rules import EigenbasisPreconditioner
from singd_curvlinops.structures import StructuredMatrix


class SINGDLinearOperator(PyTorchLinearOperator):
    r"""The preconditioner \(P\) of a `SINGD` optimizer, frozen at construction.

    For the `KFAC` baseline, \(P = (G + \lambda I)^{-1} \otimes (A + \lambda I)^{-1}\);
    for `EKFAC`, \(P = (Q_G \otimes Q_A) \operatorname{diag}(E + \lambda)^{-1}
    (Q_G \otimes Q_A)^\top\).

    Args:
        optimizer: A `SINGD`, `KFAC` or `EKFAC` optimizer. Its factors are copied,
            so later optimizer steps do not change the operator.

    Raises:
        TypeError: If `optimizer` is another optimizer.

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
        check_version()
        if not callable(getattr(optimizer, "preconditioner", None)):
            raise TypeError(
                "optimizer must be a SINGD, KFAC or EKFAC optimizer, got "
                f"{type(optimizer).__name__}."
            )
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self._params = params
        self._inverse = False
        self._blocks: list[_Block] = []
        position = {p: i for i, p in enumerate(params)}
        for layer in optimizer.layers:
            if layer.weight not in position:
                continue
            preconditioner = optimizer.preconditioner(layer)
            eigenvalues = None
            if isinstance(preconditioner, EigenbasisPreconditioner):
                eigenvalues = preconditioner.inverse_eigenvalues.clone()
            self._blocks.append(
                _Block(
                    indices=[position[p] for p in layer.params],
                    layer=layer,
                    K=preconditioner.K.clone(),
                    C=preconditioner.C.clone(),
                    square_roots=preconditioner.square_roots,
                    inverse_eigenvalues=eigenvalues,
                )
            )
        shapes = [tuple(p.shape) for p in params]
        super().__init__(shapes, shapes)

    @property
    def params(self) -> list[Tensor]:
        """The parameters in the operator's order: that of the optimizer's groups.

        With `params=None` the optimizer's groups hold the layers' parameters first
        and the fallback parameters after them, which is not `model.parameters()`'s
        order when a fallback parameter comes first: order tensor lists (and
        curvlinops operators to compare with) by this list.
        """
        return list(self._params)

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

    def _apply_side(
        self, factor: StructuredMatrix, V: Tensor, square_roots: bool
    ) -> Tensor:
        r"""Apply \(F F^\top\) (or \(F\), or their inverses) to the columns of `V`.

        Args:
            factor: \(K\) or \(C\).
            V: Matrix `[d, n]`.
            square_roots: Whether the side is \(F F^\top\) (SINGD) or \(F\) (KFAC).

        Returns:
            \(F F^\top V\), or \(F^{-\top} F^{-1} V\) for the inverse.
        """
        V = V.to(factor.dtype)
        if not square_roots:  # KFAC: the factor is the side's matrix itself
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
        for block in self._blocks:
            M = block.layer.to_matrix([X[i] for i in block.indices])
            if block.inverse_eigenvalues is None:
                M = self._apply_kronecker(block, M)
            else:
                M = self._apply_eigenbasis(block, M)
            M = M.to(X[block.indices[0]].dtype)
            for i, part in zip(block.indices, block.layer.from_matrix(M), strict=True):
                out[i] = part
        return out

    def _apply_kronecker(self, block: _Block, M: Tensor) -> Tensor:
        """Apply a Kronecker block (or its inverse) to columns `M`, `[d_C, d_K, n]`.

        Args:
            block: The layer's block.
            M: The columns in the layer's matrix layout.

        Returns:
            Tensor of `M`'s shape.
        """
        d_C, d_K, num = M.shape
        # right factor: M K Kᵀ, i.e. K Kᵀ on the d_K axis of every (row, column)
        right = self._apply_side(
            block.K, M.permute(1, 0, 2).reshape(d_K, -1), block.square_roots
        )
        M = right.reshape(d_K, d_C, num).permute(1, 0, 2)
        left = self._apply_side(block.C, M.reshape(d_C, -1), block.square_roots)
        return left.reshape(d_C, d_K, num)

    def _apply_eigenbasis(self, block: _Block, M: Tensor) -> Tensor:
        r"""Apply an EKFAC block (or its inverse) to columns `M`, `[d_C, d_K, n]`.

        Args:
            block: The layer's block (`K`, `C` hold the bases \(Q_K\), \(Q_C\)).
            M: The columns in the layer's matrix layout.

        Returns:
            \(Q_C [(Q_C^\top M Q_K) \odot D] Q_K^\top\) per column, with \(D\)
            replaced by \(1 / D\) for the inverse.
        """
        # (a diagonal factor's basis is the identity, stored as a diagonal matrix)
        Q_K, Q_C = block.K.to_dense(), block.C.to_dense()
        D = block.inverse_eigenvalues
        dtype = torch.promote_types(D.dtype, Q_K.dtype)
        Q_K, Q_C = Q_K.to(dtype), Q_C.to(dtype)
        rotated = torch.einsum("ci,cjn,jk->ikn", Q_C, M.to(dtype), Q_K)
        rotated = rotated / D[..., None] if self._inverse else rotated * D[..., None]
        return torch.einsum("ci,ikn,jk->cjn", Q_C, rotated, Q_K)


@dataclass(frozen=True)
class _Block:
    r"""One layer's diagonal block of the operator, with copies of its factors.

    Attributes:
        indices: Positions of the layer's parameters in the operator's order.
        layer: The layer (for its adapter's matrix layout).
        K: Copy of the input-side factor.
        C: Copy of the output-side factor.
        square_roots: Whether the block is \(C C^\top \otimes K K^\top\) (else
            \(C \otimes K\)).
        inverse_eigenvalues: EKFAC's \(D\) (then `K`, `C` are its eigenbases), or
            None for a Kronecker block.
    """

    indices: list[int]
    layer: Layer
    K: StructuredMatrix
    C: StructuredMatrix
    square_roots: bool
    inverse_eigenvalues: Tensor | None = None
