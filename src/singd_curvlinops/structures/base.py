r"""Abstract base class of the structured matrices that hold SINGD's factors.

A structured matrix of dimension \(d\) represents a \(d \times d\) matrix through a
few registered tensors (its *stored tensors*). Every structure in this package is a
matrix group, closed under products, so SINGD's factor update
\(K \gets K - \beta K m_K\) never leaves the structure (Lin et al., ICML 2024, Sec. 3).

Contract for subclasses:

- The represented matrix is a *linear* function of the stored tensors, and every
  stored entry is an entry of the matrix. Addition, scaling, in-place updates,
  all-reduce, device moves and `infinity_vector_norm` are therefore implemented once,
  here, on the stored tensors.
- A subclass must implement `from_dense` (the projection \(\Pi\) of a symmetric
  matrix onto the structure, with \(\Pi(I) = I\)), `to_dense` and
  `_matmul_structure` (the product of two matrices of the structure). Everything
  else has a dense fallback here that emits a `DenseFallbackWarning`. The built-in
  structures override every operation the optimizer uses (`dim`, `_zeros`, `_eye`,
  `_from_mat_inner`, `_matmat`, `_rmatmat`, `_solve`, `_rsolve`,
  `_from_inner_identity`, `_diag_add_inplace`, `average_trace`,
  `frobenius_norm`), and the tests assert that no fallback fires.
- The public methods validate their arguments and then call the private hooks
  (`eye` calls `_eye`, `K @ V` calls `_matmat`, ...), so a hook receives only valid
  arguments: dimensions in `[1, MAX_SIZE]`, floating-point dtypes, operands
  `[d, n]` (`n >= 0`) of the matrix's dtype and device, real scalars. Bad
  arguments raise `TypeError` (wrong kind) or `ValueError` (wrong value) naming
  the argument and what is allowed. On the hot path the valid case is tested in one
  cheap expression first; the detailed checks run only to explain a failure.
"""

from __future__ import annotations

import copy
import sys
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from numbers import Real
from typing import Any

import torch
import torch.distributed as dist
from torch import Size, Tensor

from singd_curvlinops.structures._checks import (
    FLOAT_DTYPES,
    REAL_DTYPES,
    check_device,
    check_dtype,
    check_float_tensor,
    check_operand,
    check_scalar,
    check_size,
    check_square,
)
from singd_curvlinops.structures._linalg import solve_dense

Scalar = Real | Tensor


class DenseFallbackWarning(UserWarning):
    """Warns that a structured matrix operation went through a dense matrix."""


class StructuredMatrix(ABC):
    r"""A \(d \times d\) matrix stored through the parameters of its structure.

    Subclasses register their stored tensors with `register_tensor` in `__init__`.
    Operators follow `torch.Tensor`: `K @ V` multiplies a tensor `V` of shape
    `[d]` or `[d, n]` (or a structure of the same class and dimension), `K + L`
    adds, `K * s` scales, and the in-place methods return `self` so calls chain.

    Every public method checks its arguments and raises `TypeError` for one of the
    wrong kind (not a tensor, an integer or complex tensor or dtype, a vector where
    a scalar belongs) and `ValueError` for a wrong value (a shape, dtype or device
    that does not match the matrix, a dimension out of range); the message names the
    argument and what is allowed, and a failed in-place method leaves the matrix
    unchanged. Operands may have zero columns.
    """

    # NumPy must not broadcast its arrays over a matrix (`ndarray * K` would build an
    # object array of matrices): its operators return NotImplemented, so Python
    # raises a TypeError, and `K * numpy_scalar` is handled by `__mul__`.
    __array_ufunc__ = None

    def __init__(self) -> None:
        """Start with an empty tensor registry."""
        self._tensor_names: list[str] = []

    # ------------------------------------------------------------------ registry
    def register_tensor(self, tensor: Tensor, name: str) -> None:
        """Store `tensor` as part of the matrix under the attribute `name`.

        All stored tensors of a matrix share one floating-point dtype and one device.

        Args:
            tensor: A parameter tensor of the structure.
            name: Attribute name under which the tensor becomes available.

        Raises:
            ValueError: If `name` is already in use, or `tensor`'s dtype or device
                differs from that of the tensors registered before.
        """
        names = self._tensor_names
        if names:  # every result of an operation passes here: test cheaply first
            first = getattr(self, names[0])
            if not (
                isinstance(tensor, Tensor)
                and tensor.dtype is first.dtype  # dtypes are singletons
                and ((tensor.is_cpu and first.is_cpu) or tensor.device == first.device)
            ):
                check_float_tensor(tensor, name)
                raise ValueError(
                    f"The tensor {name!r} ({tensor.dtype}, {tensor.device}) must have "
                    f"the dtype and device of {names[0]!r} "
                    f"({first.dtype}, {first.device})."
                )
        elif not (isinstance(tensor, Tensor) and tensor.dtype in FLOAT_DTYPES):
            check_float_tensor(tensor, name)  # raises; later tensors match this one
        if name in names or hasattr(self, name):
            raise ValueError(f"Tensor name {name!r} is already in use.")
        setattr(self, name, tensor)
        self._tensor_names.append(name)

    def named_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """Yield the stored tensors with their names, in registration order.

        Yields:
            Pairs `(name, tensor)`.
        """
        for name in self._tensor_names:
            yield name, getattr(self, name)

    def tensors(self) -> list[Tensor]:
        """Return the stored tensors in registration order.

        Returns:
            The list of stored tensors.
        """
        return [tensor for _, tensor in self.named_tensors()]

    def _map_tensors(self, fn: Callable[[Tensor], Tensor]) -> StructuredMatrix:
        """Return a copy of `self` whose stored tensors are `fn(tensor)`.

        Args:
            fn: Function applied to every stored tensor.

        Returns:
            A new matrix of the same class.
        """
        new = copy.copy(self)
        for name, tensor in self.named_tensors():
            setattr(new, name, fn(tensor))
        new._tensor_names = list(self._tensor_names)
        return new

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor]) -> StructuredMatrix:
        """Rebuild a matrix from its stored tensors, as yielded by `named_tensors`.

        Used to restore optimizer state; the tensors are used as given (no copy) and
        their shapes are not validated here.

        Args:
            tensors: Map from tensor name to tensor, in registration order.

        Returns:
            The matrix.
        """
        matrix = cls.__new__(cls)
        StructuredMatrix.__init__(matrix)
        for name, tensor in tensors.items():
            matrix.register_tensor(tensor, name)
        return matrix

    # ---------------------------------------------------------------- properties
    @property
    def dim(self) -> int:
        r"""Dimension \(d\) of the represented square matrix."""
        self._warn_dense_fallback("dim")
        return self.to_dense().shape[0]

    @property
    def shape(self) -> Size:
        """Shape `[d, d]` of the represented matrix."""
        return Size((self.dim, self.dim))

    @property
    def dtype(self) -> torch.dtype:
        """Data type of the stored tensors."""
        return getattr(self, self._tensor_names[0]).dtype

    @property
    def device(self) -> torch.device:
        """Device of the stored tensors."""
        return getattr(self, self._tensor_names[0]).device

    def numel(self) -> int:
        """Return the number of stored entries (what memory and communication cost).

        Returns:
            The total number of elements of the stored tensors.
        """
        return sum(tensor.numel() for tensor in self.tensors())

    def __repr__(self) -> str:
        """Name the class, dimension, data type and device.

        Returns:
            A short description, e.g. `DiagonalMatrix(dim=3, dtype=torch.float32)`.
        """
        return (
            f"{type(self).__name__}(dim={self.dim}, dtype={self.dtype}, "
            f"device={self.device})"
        )

    def to(self, *args: Any, **kwargs: Any) -> StructuredMatrix:
        """Move or cast the stored tensors, with the signature of `Tensor.to`.

        Args:
            *args: Positional arguments of `torch.Tensor.to` (device or dtype).
            **kwargs: Keyword arguments of `torch.Tensor.to`.

        Returns:
            A matrix of the same class (`self` is left unchanged).

        Raises:
            TypeError: If the target dtype is not floating-point.
        """
        moved = self._map_tensors(lambda tensor: tensor.to(*args, **kwargs))
        if moved.dtype not in FLOAT_DTYPES:
            raise TypeError(
                f"A structured matrix must keep a floating-point dtype, got "
                f"{moved.dtype} from to({', '.join(map(repr, args))}"
                f"{', ' if args and kwargs else ''}"
                f"{', '.join(f'{k}={v!r}' for k, v in kwargs.items())})."
            )
        return moved

    def clone(self) -> StructuredMatrix:
        """Return a copy that shares no memory with `self`.

        Returns:
            The copied matrix.
        """
        return self._map_tensors(torch.clone)

    # ------------------------------------------------------------- constructors
    @classmethod
    @abstractmethod
    def from_dense(cls, sym_mat: Tensor) -> StructuredMatrix:
        r"""Project a dense symmetric matrix onto the structure, \(\Pi(S)\).

        Entries whose mirror image lies outside the structure are folded onto the
        stored entry (off-diagonal entries of triangular parts are doubled), so that
        \(\langle \Pi(S), M \rangle\) matches the SINGD paper's projection map.

        Args:
            sym_mat: Symmetric matrix of shape `[d, d]`. Symmetry is not checked.

        Returns:
            The projected structured matrix. It shares no memory with `sym_mat`.
        """

    @abstractmethod
    def to_dense(self) -> Tensor:
        """Return the represented matrix as a dense tensor.

        Returns:
            Tensor of shape `[d, d]`.
        """

    @classmethod
    def zeros(
        cls,
        dim: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> StructuredMatrix:
        r"""Return the zero matrix of dimension `dim`.

        Args:
            dim: Dimension \(d\), an int in `[1, MAX_SIZE]` (\(2^{31} - 1\)).
            dtype: `torch.float16`, `bfloat16`, `float32` or `float64`; default:
                `torch.get_default_dtype()`.
            device: Device; default: the CPU.

        Returns:
            The zero matrix.
        """
        check_size(dim, "dim", 1)
        check_dtype(dtype)
        check_device(device)
        return cls._zeros(dim, dtype, device)

    @classmethod
    def eye(
        cls,
        dim: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> StructuredMatrix:
        r"""Return the identity matrix of dimension `dim`.

        Args:
            dim: Dimension \(d\), an int in `[1, MAX_SIZE]` (\(2^{31} - 1\)).
            dtype: `torch.float16`, `bfloat16`, `float32` or `float64`; default:
                `torch.get_default_dtype()`.
            device: Device; default: the CPU.

        Returns:
            The identity matrix.
        """
        check_size(dim, "dim", 1)
        check_dtype(dtype)
        check_device(device)
        return cls._eye(dim, dtype, device)

    @classmethod
    def _zeros(
        cls, dim: int, dtype: torch.dtype | None, device: torch.device | str | None
    ) -> StructuredMatrix:
        """Return the zero matrix for validated arguments (see `zeros`).

        Args:
            dim: Dimension.
            dtype: Floating-point dtype or None.
            device: Device or None.

        Returns:
            The zero matrix.
        """
        cls._warn_dense_fallback("zeros")
        return cls.from_dense(torch.zeros(dim, dim, dtype=dtype, device=device))

    @classmethod
    def _eye(
        cls, dim: int, dtype: torch.dtype | None, device: torch.device | str | None
    ) -> StructuredMatrix:
        """Return the identity matrix for validated arguments (see `eye`).

        Args:
            dim: Dimension.
            dtype: Floating-point dtype or None.
            device: Device or None.

        Returns:
            The identity matrix.
        """
        cls._warn_dense_fallback("eye")
        return cls.from_dense(torch.eye(dim, dtype=dtype, device=device))

    @classmethod
    def from_mat_inner(cls, X: Tensor) -> StructuredMatrix:
        r"""Return \(\Pi(X X^\top)\).

        Args:
            X: Floating-point matrix of shape `[d, n]` with `d >= 1` and `n >= 0`
                (no columns: the zero matrix).

        Returns:
            The projection of \(X X^\top\) onto the structure, in `X`'s dtype and
            on its device.
        """
        check_operand(X, None, None, None, "X", matrix_only=True)
        return cls._from_mat_inner(X)

    @classmethod
    def _from_mat_inner(cls, X: Tensor) -> StructuredMatrix:
        r"""Return \(\Pi(X X^\top)\) for a validated `X` (see `from_mat_inner`).

        Args:
            X: Matrix of shape `[d, n]`.

        Returns:
            The projected matrix.
        """
        cls._warn_dense_fallback("from_mat_inner")
        return cls.from_dense(X @ X.T)

    # ----------------------------------------------------------------- products
    def __matmul__(self, other: Tensor | StructuredMatrix) -> Tensor | StructuredMatrix:
        """Multiply with a tensor `[d]`/`[d, n]` or a structure of the same class.

        Args:
            other: Tensor or structured matrix of the same class and dimension.

        Returns:
            `K @ V` as a tensor, or `K @ L` as a structured matrix.
        """
        if isinstance(other, StructuredMatrix):
            _check_same_structure(self, other, "multiply")
            return self._matmul_structure(other)
        if not isinstance(other, Tensor):
            return NotImplemented
        V = self._check_operand(other, "other")
        return _on_columns(self._matmat, V)

    def matmat_(self, mat: Tensor) -> Tensor:
        r"""Return \(K V\) for a matrix `mat` \(= V\) the caller no longer needs.

        Structures that can multiply in place (diagonal) overwrite `mat` and return
        it, which saves allocating a result as large as `mat`; the others return a
        new tensor, exactly as `K @ mat` does. Either way, do not use `mat` after
        the call, only the returned tensor.

        Args:
            mat: Matrix of shape `[d, n]`.

        Returns:
            \(K V\), shape `[d, n]`: `mat` itself or a new tensor.
        """
        V = self._check_operand(mat, "mat", matrix_only=True)
        return self._matmat_inplace(V)

    def _matmat_inplace(self, V: Tensor) -> Tensor:
        r"""Return \(K V\), overwriting `V` where the structure allows it.

        Args:
            V: Validated matrix of shape `[d, n]`.

        Returns:
            \(K V\) (by default a new tensor).
        """
        return self._matmat(V)

    def rmatmat(self, mat: Tensor) -> Tensor:
        r"""Return \(K^\top V\) for a tensor `mat` \(= V\) of shape `[d]` or `[d, n]`.

        Args:
            mat: Tensor of shape `[d]` or `[d, n]`.

        Returns:
            Tensor with the shape of `mat`.
        """
        V = self._check_operand(mat, "mat")
        return _on_columns(self._rmatmat, V)

    def solve(self, mat: Tensor) -> Tensor:
        r"""Return \(K^{-1} V\) for a tensor `mat` \(= V\), shape `[d]` or `[d, n]`.

        The built-in structures solve through their structure (division,
        substitution, batched LU solves of dense blocks, FFT convolution), at about
        the cost of a product; no inverse matrix is formed. \(K\) must be
        invertible; this is not checked, since a check would synchronise with the
        host.

        Args:
            mat: Tensor of shape `[d]` or `[d, n]`.

        Returns:
            Tensor with the shape of `mat`.
        """
        V = self._check_operand(mat, "mat")
        return _on_columns(self._solve, V)

    def rsolve(self, mat: Tensor) -> Tensor:
        r"""Return \(K^{-\top} V\) for a tensor `mat` \(= V\), shape `[d]` or `[d, n]`.

        Together with `solve` this applies \((K K^\top)^{-1} = K^{-\top} K^{-1}\)
        without forming a dense inverse. \(K\) must be invertible (not checked).

        Args:
            mat: Tensor of shape `[d]` or `[d, n]`.

        Returns:
            Tensor with the shape of `mat`.
        """
        V = self._check_operand(mat, "mat")
        return _on_columns(self._rsolve, V)

    def _matmat(self, V: Tensor) -> Tensor:
        """Return `self @ V` for a validated `V` of shape `[d, n]`.

        Args:
            V: Matrix of shape `[d, n]`.

        Returns:
            Matrix of shape `[d, n]`.
        """
        self._warn_dense_fallback("__matmul__")
        return self.to_dense() @ V

    def _rmatmat(self, V: Tensor) -> Tensor:
        """Return `self.T @ V` for a validated `V` of shape `[d, n]`.

        Args:
            V: Matrix of shape `[d, n]`.

        Returns:
            Matrix of shape `[d, n]`.
        """
        self._warn_dense_fallback("rmatmat")
        return self.to_dense().T @ V

    def _solve(self, V: Tensor) -> Tensor:
        """Return `self⁻¹ @ V` for a validated `V` of shape `[d, n]`.

        Args:
            V: Matrix of shape `[d, n]`.

        Returns:
            Matrix of shape `[d, n]`.
        """
        self._warn_dense_fallback("solve")
        return solve_dense(self.to_dense(), V)

    def _rsolve(self, V: Tensor) -> Tensor:
        """Return `self⁻ᵀ @ V` for a validated `V` of shape `[d, n]`.

        Args:
            V: Matrix of shape `[d, n]`.

        Returns:
            Matrix of shape `[d, n]`.
        """
        self._warn_dense_fallback("rsolve")
        return solve_dense(self.to_dense(), V, transpose=True)

    @abstractmethod
    def _matmul_structure(self, other: StructuredMatrix) -> StructuredMatrix:
        """Return `self @ other` for a validated structure of the same class.

        The product stays in the structure because every structure is a matrix
        group. It has no generic dense fallback: a non-symmetric dense product
        cannot be mapped back through the projection `from_dense`.

        Args:
            other: Structured matrix of the same class and dimension.

        Returns:
            The product, in the structure.
        """

    def from_inner(self, X: Tensor | None = None) -> StructuredMatrix:
        r"""Return \(\Pi(K^\top X X^\top K)\), or \(\Pi(K^\top K)\) if `X` is None.

        Args:
            X: Optional matrix of shape `[d, n]`.

        Returns:
            The projected matrix.
        """
        if X is None:
            return self._from_inner_identity()
        X = self._check_operand(X, "X", matrix_only=True)
        return self._from_inner(X)

    def from_inner_(self, X: Tensor) -> StructuredMatrix:
        r"""Return \(\Pi(K^\top X X^\top K)\) for an `X` the caller no longer needs.

        Structures that can work in place (diagonal: the squares of `X`) overwrite
        `X`, which saves a temporary as large as `X`; the others compute
        `from_inner(X)` and leave it untouched. Do not use `X` after the call.

        Args:
            X: Matrix of shape `[d, n]`.

        Returns:
            The projected matrix.
        """
        X = self._check_operand(X, "X", matrix_only=True)
        return self._from_inner_inplace(X)

    def _from_inner_inplace(self, X: Tensor) -> StructuredMatrix:
        r"""Return \(\Pi(K^\top X X^\top K)\), overwriting `X` where that saves memory.

        Args:
            X: Validated matrix of shape `[d, n]`.

        Returns:
            The projected matrix (by default `_from_inner(X)`).
        """
        return self._from_inner(X)

    def _from_inner(self, X: Tensor) -> StructuredMatrix:
        r"""Return \(\Pi(K^\top X X^\top K) = \Pi(S S^\top)\) with \(S = K^\top X\).

        Args:
            X: Validated matrix of shape `[d, n]`.

        Returns:
            The projected matrix.
        """
        return self._from_mat_inner(self._rmatmat(X))

    def _from_inner_identity(self) -> StructuredMatrix:
        r"""Return \(\Pi(K^\top K)\).

        Returns:
            The projected matrix.
        """
        self._warn_dense_fallback("from_inner")
        dense = self.to_dense()
        return self.from_dense(dense.T @ dense)

    def outer_self(self) -> StructuredMatrix | None:
        r"""Return \(K K^\top\) if it lies in the structure, else None.

        The optimizer applies \(K K^\top\) at every step but changes \(K\) only
        every `T` steps; where the product stays in the structure (dense, diagonal,
        block-diagonal) it is formed once per update and applied as one matrix.

        Returns:
            The symmetric product, or None for structures not closed under it.
        """
        return None

    # --------------------------------------------------------------- arithmetic
    def __add__(self, other: StructuredMatrix) -> StructuredMatrix:
        """Add a structure of the same class and dimension.

        Args:
            other: The summand.

        Returns:
            The sum, a new matrix.
        """
        if not isinstance(other, StructuredMatrix):
            return NotImplemented
        _check_same_structure(self, other, "add")
        return self.clone().add_(other)

    def __sub__(self, other: StructuredMatrix) -> StructuredMatrix:
        """Subtract a structure of the same class and dimension.

        Args:
            other: The subtrahend.

        Returns:
            The difference, a new matrix.
        """
        if not isinstance(other, StructuredMatrix):
            return NotImplemented
        _check_same_structure(self, other, "subtract")
        return self.clone().add_(other, alpha=-1.0)

    def __mul__(self, scalar: Scalar) -> StructuredMatrix:
        """Multiply by a scalar (a real number or a 0-d real tensor).

        Args:
            scalar: The factor.

        Returns:
            The scaled matrix, a new matrix.
        """
        if not isinstance(scalar, (Real, Tensor)):
            return NotImplemented
        self._check_scalar(scalar, "scalar")
        return self._map_tensors(lambda tensor: tensor * scalar)

    __rmul__ = __mul__

    def __neg__(self) -> StructuredMatrix:
        """Negate.

        Returns:
            The negated matrix, a new matrix.
        """
        return self._map_tensors(torch.neg)

    def add_(self, other: StructuredMatrix, alpha: Scalar = 1.0) -> StructuredMatrix:
        """Add `alpha * other` in place.

        Args:
            other: Structure of the same class, dimension, dtype and device.
            alpha: Real scalar factor (a number, or a 0-d tensor on the CPU or the
                matrix's device, which stays there: no host synchronisation).

        Returns:
            `self`.
        """
        _check_same_structure(self, other, "add")
        self._check_scalar(alpha, "alpha")
        if isinstance(alpha, Tensor):
            torch._foreach_add_(
                self.tensors(), torch._foreach_mul(other.tensors(), alpha)
            )
        else:
            torch._foreach_add_(self.tensors(), other.tensors(), alpha=alpha)
        return self

    def mul_(self, value: Scalar) -> StructuredMatrix:
        """Multiply by a scalar in place.

        Args:
            value: Real scalar factor (a number, or a 0-d tensor on the CPU or the
                matrix's device).

        Returns:
            `self`.
        """
        self._check_scalar(value, "value")
        for tensor in self.tensors():
            tensor.mul_(value)
        return self

    def diag_add_(self, value: Scalar) -> StructuredMatrix:
        r"""Add `value` to every diagonal entry in place, \(K \gets K + v I\).

        Only a scalar is accepted: a vector added to the diagonal would take most
        structures out of their set (a Toeplitz matrix has one value per diagonal).

        Args:
            value: Real scalar (a number, or a 0-d tensor on the CPU or the
                matrix's device).

        Returns:
            `self`.
        """
        self._check_scalar(value, "value")
        return self._diag_add_inplace(value)

    def _diag_add_inplace(self, value: Scalar) -> StructuredMatrix:
        """Add a validated scalar `value` to every diagonal entry in place.

        Args:
            value: Real scalar (a number or a 0-d tensor).

        Returns:
            `self`.
        """
        self._warn_dense_fallback("diag_add_")
        eye = self.from_dense(torch.eye(self.dim, dtype=self.dtype, device=self.device))
        return self.add_(eye, alpha=value)

    # -------------------------------------------------------------------- norms
    def average_trace(self) -> Tensor:
        r"""Return \(\bar{\mathrm{tr}}(K) = \sum_i K_{ii} / d\) (divide before summing).

        Returns:
            A 0-d tensor.
        """
        self._warn_dense_fallback("average_trace")
        return (self.to_dense().diagonal() / self.dim).sum()

    def infinity_vector_norm(self) -> Tensor:
        r"""Return the largest absolute stored entry, \(\max_{ij} |K_{ij}|\).

        Returns:
            A 0-d tensor (no host synchronisation).
        """
        maxima = [tensor.abs().max() for tensor in self.tensors() if tensor.numel()]
        return torch.stack(maxima).max()

    def frobenius_norm(self) -> Tensor:
        r"""Return \(\|K\|_F\).

        Returns:
            A 0-d tensor.
        """
        self._warn_dense_fallback("frobenius_norm")
        return torch.linalg.matrix_norm(self.to_dense())

    # -------------------------------------------------------------- distributed
    def all_reduce(
        self, op: str = "avg", group: dist.ProcessGroup | None = None
    ) -> StructuredMatrix:
        """Sum or average the stored tensors over all processes, in place.

        Only the stored tensors travel (a diagonal matrix sends `d` numbers), packed
        into one buffer so that a single collective call is made. Averaging is a sum
        followed by a division, which every backend (gloo included) supports.

        Args:
            op: `"sum"` or `"avg"`.
            group: Process group; default: the default group.

        Returns:
            `self`.

        Raises:
            ValueError: If `op` is not `"sum"` or `"avg"`.
            RuntimeError: If `torch.distributed` is not initialised.
        """
        if op not in ("sum", "avg"):
            raise ValueError(f"op must be 'sum' or 'avg', got {op!r}.")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "all_reduce needs an initialised torch.distributed process group."
            )
        tensors = self.tensors()
        buffer = torch.cat([tensor.reshape(-1) for tensor in tensors])
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)
        if op == "avg":
            buffer.div_(dist.get_world_size(group))
        for tensor, chunk in zip(
            tensors, buffer.split([t.numel() for t in tensors]), strict=True
        ):
            tensor.copy_(chunk.view_as(tensor))
        return self

    # ------------------------------------------------------------------ helpers
    def _check_operand(
        self, mat: Tensor, name: str, matrix_only: bool = False
    ) -> Tensor:
        """Validate a dense operand: `[d]` or `[d, n]`, the matrix's dtype and device.

        The valid case is tested in one expression (this runs on every product);
        only a failing operand goes through the detailed checks.

        Args:
            mat: Candidate operand.
            name: Argument name used in error messages.
            matrix_only: Accept only matrices `[d, n]`.

        Returns:
            `mat`.
        """
        stored = getattr(self, self._tensor_names[0])
        if (
            type(mat) is Tensor
            and mat.dtype == stored.dtype
            and mat.device == stored.device
            and (mat.ndim == 2 or (mat.ndim == 1 and not matrix_only))
            and mat.shape[0] == self.dim
        ):
            return mat
        return check_operand(
            mat, self.dim, stored.dtype, stored.device, name, matrix_only
        )

    def _check_scalar(self, value: object, name: str) -> None:
        """Validate a scalar argument (a float or a 0-d tensor passes at once).

        Args:
            value: Candidate scalar.
            name: Argument name used in error messages.
        """
        if type(value) is float or (
            type(value) is Tensor
            and value.ndim == 0
            and value.dtype in REAL_DTYPES
            and (value.is_cpu or value.device == self.device)
        ):
            return
        check_scalar(value, name, self.device)

    @classmethod
    def _warn_dense_fallback(cls, method: str) -> None:
        """Warn that `method` of `cls` goes through a dense matrix.

        The warning names the first caller outside this package's structures (the
        public method and its hook sit at different depths).

        Args:
            method: Name of the method that falls back.
        """
        frame, level = sys._getframe(1), 2
        inside = f"{__package__}."
        while frame.f_back and frame.f_globals.get("__name__", "").startswith(inside):
            frame, level = frame.f_back, level + 1
        warnings.warn(
            f"{cls.__name__}.{method} falls back to a dense matrix; implement it "
            "using the structure to save time and memory.",
            DenseFallbackWarning,
            stacklevel=level,
        )

    @staticmethod
    def _check_square(sym_mat: Tensor) -> Tensor:
        """Validate the argument of `from_dense`.

        Args:
            sym_mat: Candidate square matrix.

        Returns:
            `sym_mat`.
        """
        return check_square(sym_mat, "sym_mat")


def _on_columns(hook: Callable[[Tensor], Tensor], V: Tensor) -> Tensor:
    """Apply a hook for matrices `[d, n]` to a vector `[d]` or a matrix.

    Args:
        hook: Function of a matrix of shape `[d, n]`.
        V: Validated tensor of shape `[d]` or `[d, n]`.

    Returns:
        `hook(V)`, with the shape of `V`.
    """
    if V.ndim == 1:
        return hook(V.unsqueeze(1)).squeeze(1)
    return hook(V)


def _check_same_structure(
    first: StructuredMatrix, second: object, operation: str
) -> None:
    """Check that two operands have the same class, dimension, dtype and device.

    Args:
        first: Left operand.
        second: Right operand.
        operation: Verb used in the error message, e.g. `"add"`.

    Raises:
        TypeError: If `second` is not a structured matrix.
        ValueError: If class, dimension, data type or device differ.
    """
    if type(first) is type(second):
        # all stored tensors of a matrix share dtype and device: compare the first
        mine = getattr(first, first._tensor_names[0])
        theirs = getattr(second, second._tensor_names[0])
        if (
            mine.dtype == theirs.dtype
            and mine.device == theirs.device
            and first.dim == second.dim
        ):
            return  # the fast path of every step
    if not isinstance(second, StructuredMatrix):
        raise TypeError(
            f"Cannot {operation} {first!r} and {type(second).__name__}: "
            "expected a structured matrix of the same class."
        )
    if type(first) is not type(second):
        reason = "the structures differ"
    elif first.dim != second.dim:
        reason = "the dimensions differ"
    elif first.dtype != second.dtype:
        reason = "the dtypes differ"
    else:
        reason = "the devices differ"
    raise ValueError(f"Cannot {operation} {first!r} and {second!r}: {reason}.")
