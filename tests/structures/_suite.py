"""One test suite for every structure: each operation against dense linear algebra.

A structure's test class names the structure and supplies `project`, a loop-based
dense implementation of its projection written independently of the package. The
suite then checks every operation in float64 against the same computation on dense
matrices, and in every float dtype against float64 with dtype-dependent tolerances.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import Tensor

from singd_curvlinops.structures import (
    DenseFallbackWarning,
    StructuredMatrix,
    get_structure,
)

FLOAT64_RTOL = 1e-12
SOLVE_RTOL = 1e-10  # solves lose a factor of the condition number (here <= 42)
DTYPE_RTOL = {
    torch.float64: 1e-12,
    torch.float32: 2e-5,
    torch.bfloat16: 4e-2,
    torch.float16: 5e-3,
}


def assert_close(
    actual: Tensor, expected: Tensor, rtol: float = FLOAT64_RTOL, scale: float = 0.0
) -> None:
    """Compare relative to the norm of `expected` (or to `scale`), print the worst."""
    actual, expected = actual.to(torch.float64), expected.to(torch.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = max(scale, torch.linalg.vector_norm(expected).item(), 1e-300)
    error = torch.linalg.vector_norm(actual - expected).item()
    if error > rtol * scale:
        worst = (actual - expected).abs().argmax()
        print(
            "worst entry",
            worst.item(),
            actual.flatten()[worst],
            expected.flatten()[worst],
        )
    assert error <= rtol * scale, f"relative error {error / scale:.3e} > {rtol:.1e}"


def random_symmetric(dim: int, dtype: torch.dtype = torch.float64) -> Tensor:
    A = torch.randn(dim, dim, dtype=torch.float64)
    return (A + A.T).to(dtype)


class StructureSuite:
    """Checks shared by all structures; subclasses set `NAME` and `project`."""

    NAME: str
    DIMS: tuple[int, ...] = (1, 2, 3, 5, 8, 17, 32, 41)

    def project(self, sym: Tensor) -> Tensor:
        """Loop-based dense projection of a symmetric float64 matrix."""
        raise NotImplementedError

    @property
    def cls(self) -> type[StructuredMatrix]:
        return get_structure(self.NAME)

    def random_element(self, dim: int) -> tuple[StructuredMatrix, Tensor]:
        """A generic (non-symmetric) element and its dense reference.

        The product of two projections is a general element of the group; its dense
        reference is the product of the loop-based projections.
        """
        S1, S2 = random_symmetric(dim), random_symmetric(dim)
        K = self.cls.from_dense(S1) @ self.cls.from_dense(S2)
        return K, self.project(S1) @ self.project(S2)

    def invertible_element(
        self, dim: int, margin: float = 0.05
    ) -> tuple[StructuredMatrix, Tensor]:
        """A generic element, scaled and shifted to be strictly diagonally dominant.

        After scaling to largest absolute row sum 1 and adding `(1 + margin) I`, every
        row has |K_ii| - sum_{j != i} |K_ij| >= margin, so ||K^-1||_inf <= 1 / margin
        and the condition number is at most (2 + margin) / margin.
        """
        K, K_dense = self.random_element(dim)
        scale = 1.0 / K_dense.abs().sum(1).max().item()
        K.mul_(scale).diag_add_(1.0 + margin)
        eye = torch.eye(dim, dtype=K_dense.dtype)
        return K, scale * K_dense + (1.0 + margin) * eye

    # ------------------------------------------------------------- float64 ops
    def test_from_dense_is_projection(self, dim: int) -> None:
        S = random_symmetric(dim)
        K = self.cls.from_dense(S)
        assert isinstance(K, self.cls)
        assert K.shape == (dim, dim) and K.dim == dim
        assert_close(K.to_dense(), self.project(S))

    def test_from_dense_does_not_alias_input(self, dim: int) -> None:
        S = random_symmetric(dim)
        before = S.clone()
        self.cls.from_dense(S).mul_(3.0).diag_add_(1.0)
        assert torch.equal(S, before)

    def test_projection_keeps_identity(self, dim: int) -> None:
        eye = torch.eye(dim, dtype=torch.float64)
        assert torch.equal(self.cls.from_dense(eye).to_dense(), eye)
        assert torch.equal(self.project(eye), eye)

    def test_eye_and_zeros(self, dim: int) -> None:
        eye = self.cls.eye(dim, dtype=torch.float64)
        zeros = self.cls.zeros(dim, dtype=torch.float32)
        assert torch.equal(eye.to_dense(), torch.eye(dim, dtype=torch.float64))
        assert torch.equal(zeros.to_dense(), torch.zeros(dim, dim))
        assert eye.dtype == torch.float64 and zeros.dtype == torch.float32
        assert eye.device == torch.device("cpu")

    @pytest.mark.parametrize("num_cols", [1, 4, 100])
    def test_from_mat_inner(self, dim: int, num_cols: int) -> None:
        X = torch.randn(dim, num_cols, dtype=torch.float64)
        assert_close(self.cls.from_mat_inner(X).to_dense(), self.project(X @ X.T))

    def test_matmul_tensor(self, dim: int) -> None:
        K, K_dense = self.random_element(dim)
        V, v = (
            torch.randn(dim, 3, dtype=torch.float64),
            torch.randn(dim, dtype=torch.float64),
        )
        assert_close(K @ V, K_dense @ V)
        assert_close(K @ v, K_dense @ v)

    IN_PLACE_MATMAT = False  # whether `matmat_` and `from_inner_` overwrite operands

    def test_matmat_(self, dim: int) -> None:
        K, K_dense = self.random_element(dim)
        V = torch.randn(dim, 4, dtype=torch.float64)
        for operand in (V.clone(), V.T.clone().T):  # row- and column-major
            result = K.matmat_(operand)
            assert_close(result, K_dense @ V)
            assert (result.data_ptr() == operand.data_ptr()) == self.IN_PLACE_MATMAT
        with pytest.raises(ValueError, match="mat must have shape"):
            K.matmat_(V[:, 0])

    def test_from_inner_(self, dim: int) -> None:
        K, _ = self.random_element(dim)
        X = torch.randn(dim, 6, dtype=torch.float64)
        overwritten = X.clone()
        assert_close(K.from_inner_(overwritten).to_dense(), K.from_inner(X).to_dense())
        assert torch.equal(overwritten, X) != self.IN_PLACE_MATMAT
        with pytest.raises(ValueError, match="X must have shape"):
            K.from_inner_(X[:, 0])

    @pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
    def test_operands_without_columns(self, dim: int, dtype: torch.dtype) -> None:
        """`[d, 0]` operands: empty products, zero projections (Toeplitz FFT failed)."""
        K = self.invertible_element(dim)[0].to(dtype)
        E = torch.zeros(dim, 0, dtype=dtype)
        for result in (K @ E, K.rmatmat(E), K.solve(E), K.rsolve(E), K.matmat_(E)):
            assert result.shape == (dim, 0) and result.dtype == dtype
        zero = torch.zeros(dim, dim, dtype=dtype)
        for H in (K.from_inner(E), K.from_inner_(E), self.cls.from_mat_inner(E)):
            assert type(H) is self.cls and H.dtype == dtype
            assert torch.equal(H.to_dense(), zero)

    def test_rmatmat(self, dim: int) -> None:
        K, K_dense = self.random_element(dim)
        V, v = (
            torch.randn(dim, 3, dtype=torch.float64),
            torch.randn(dim, dtype=torch.float64),
        )
        assert_close(K.rmatmat(V), K_dense.T @ V)
        assert_close(K.rmatmat(v), K_dense.T @ v)

    def test_solve(self, dim: int) -> None:
        K, K_dense = self.invertible_element(dim)
        V, v = (
            torch.randn(dim, 3, dtype=torch.float64),
            torch.randn(dim, dtype=torch.float64),
        )
        V_before = V.clone()
        assert_close(K.solve(V), torch.linalg.solve(K_dense, V), SOLVE_RTOL)
        assert_close(K.solve(v), torch.linalg.solve(K_dense, v), SOLVE_RTOL)
        assert torch.equal(V, V_before)
        assert_close(K.to_dense(), K_dense)  # K is left unchanged

    def test_rsolve(self, dim: int) -> None:
        K, K_dense = self.invertible_element(dim)
        V, v = (
            torch.randn(dim, 3, dtype=torch.float64),
            torch.randn(dim, dtype=torch.float64),
        )
        V_before = V.clone()
        assert_close(K.rsolve(V), torch.linalg.solve(K_dense.T, V), SOLVE_RTOL)
        assert_close(K.rsolve(v), torch.linalg.solve(K_dense.T, v), SOLVE_RTOL)
        assert torch.equal(V, V_before)
        assert_close(K.to_dense(), K_dense)

    def test_matmul_structure_stays_in_structure(self, dim: int) -> None:
        (K1, K1_dense), (K2, K2_dense) = (
            self.random_element(dim),
            self.random_element(dim),
        )
        product = K1 @ K2
        assert type(product) is self.cls
        assert_close(product.to_dense(), K1_dense @ K2_dense)

    def test_outer_self(self, dim: int) -> None:
        K, K_dense = self.random_element(dim)
        outer = K.outer_self()
        if self.NAME in ("dense", "diagonal") or self.NAME.startswith("block"):
            assert type(outer) is self.cls
            assert_close(outer.to_dense(), K_dense @ K_dense.T)
        else:  # K Kᵀ leaves the structure
            assert outer is None

    @pytest.mark.parametrize("num_cols", [1, 5, 100])
    def test_from_inner(self, dim: int, num_cols: int) -> None:
        K, K_dense = self.random_element(dim)
        X = torch.randn(dim, num_cols, dtype=torch.float64)
        expected = self.project(K_dense.T @ X @ X.T @ K_dense)
        assert_close(K.from_inner(X).to_dense(), expected)

    def test_from_inner_identity(self, dim: int) -> None:
        K, K_dense = self.random_element(dim)
        assert_close(K.from_inner().to_dense(), self.project(K_dense.T @ K_dense))

    def test_arithmetic(self, dim: int) -> None:
        (K1, K1_dense), (K2, K2_dense) = (
            self.random_element(dim),
            self.random_element(dim),
        )
        assert_close((K1 + K2).to_dense(), K1_dense + K2_dense)
        assert_close((K1 - K2).to_dense(), K1_dense - K2_dense)
        assert_close((K1 * 2.5).to_dense(), 2.5 * K1_dense)
        assert_close((0.5 * K1).to_dense(), 0.5 * K1_dense)
        assert_close(
            (K1 * torch.tensor(3.0, dtype=torch.float64)).to_dense(), 3 * K1_dense
        )
        assert_close((-K1).to_dense(), -K1_dense)
        # out-of-place operations leave their operands untouched
        assert_close(K1.to_dense(), K1_dense)

    def test_in_place_updates_chain(self, dim: int) -> None:
        (K1, K1_dense), (K2, K2_dense) = (
            self.random_element(dim),
            self.random_element(dim),
        )
        alpha = torch.tensor(-0.3, dtype=torch.float64)
        result = K1.add_(K2, alpha=0.7).mul_(2.0).diag_add_(1.5).add_(K2, alpha=alpha)
        assert result is K1
        expected = (
            2.0 * (K1_dense + 0.7 * K2_dense) + 1.5 * torch.eye(dim) - 0.3 * K2_dense
        )
        assert_close(K1.to_dense(), expected)
        K1.mul_(torch.tensor(0.5, dtype=torch.float64)).diag_add_(torch.tensor(2.0))
        assert_close(K1.to_dense(), 0.5 * expected + 2.0 * torch.eye(dim))

    def test_reductions(self, dim: int) -> None:
        K, K_dense = self.random_element(dim)
        assert_close(K.average_trace(), K_dense.trace() / dim)
        assert_close(K.frobenius_norm(), torch.linalg.matrix_norm(K_dense))
        assert_close(K.infinity_vector_norm(), K_dense.abs().max())
        for value in (K.average_trace(), K.frobenius_norm(), K.infinity_vector_norm()):
            assert isinstance(value, Tensor) and value.ndim == 0

    def test_average_trace_stays_finite_in_half_precision(self, dim: int) -> None:
        K = self.cls.eye(dim, dtype=torch.float16).mul_(60000.0)
        assert torch.isfinite(K.average_trace())
        assert K.average_trace().item() == pytest.approx(60000.0, rel=1e-3)

    def test_tensor_registry_to_and_clone(self, dim: int) -> None:
        K, K_dense = self.random_element(dim)
        names = [name for name, _ in K.named_tensors()]
        assert len(names) == len(set(names)) == len(K.tensors())
        assert all(t is getattr(K, n) for n, t in K.named_tensors())
        if self.NAME != "dense":
            assert K.numel() <= max(dim * 35, 3), "stores more than its structure"
        single = K.to(torch.float32)
        assert single.dtype == torch.float32 and K.dtype == torch.float64
        assert_close(single.to_dense(), K_dense, rtol=1e-6)
        copy = K.clone()
        copy.mul_(0.0)
        assert_close(K.to_dense(), K_dense)
        assert repr(K).startswith(f"{self.cls.__name__}(dim={dim}")

    def test_no_dense_fallback(self, dim: int) -> None:
        K, _ = self.random_element(dim)
        A, _ = self.invertible_element(dim)
        X = torch.randn(dim, 3, dtype=torch.float64)
        with warnings.catch_warnings():
            warnings.simplefilter("error", DenseFallbackWarning)
            self.cls.eye(dim, dtype=torch.float64)
            self.cls.zeros(dim, dtype=torch.float64)
            self.cls.from_mat_inner(X)
            K @ X, K.rmatmat(X), K @ K, K.from_inner(X), K.from_inner()
            K + K, K * 2.0, K.add_(K.clone(), alpha=0.5).mul_(0.5).diag_add_(0.1)
            K.average_trace(), K.frobenius_norm(), K.infinity_vector_norm(), K.dim
            A.solve(X), A.rsolve(X), A.solve(X[:, 0]), A.rsolve(X[:, 0])

    # ------------------------------------------------------------------ dtypes
    @pytest.mark.parametrize(
        "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str
    )
    def test_every_float_dtype(self, dim: int, dtype: torch.dtype) -> None:
        rtol = DTYPE_RTOL[dtype]
        K64, _ = self.random_element(dim)
        K64.mul_(1.0 / max(K64.infinity_vector_norm().item(), 1e-3))
        K = K64.to(dtype)
        K64 = K.to(torch.float64)  # compare against the rounded operand
        X = torch.randn(dim, 4, dtype=dtype)
        X64 = X.to(torch.float64)
        S = random_symmetric(dim, dtype)
        checks = [
            (self.cls.from_dense(S), self.cls.from_dense(S.to(torch.float64))),
            (self.cls.from_mat_inner(X), self.cls.from_mat_inner(X64)),
            (K.from_inner(X), K64.from_inner(X64)),
            (K.from_inner(), K64.from_inner()),
            (K @ K, K64 @ K64),
            (K + K * 0.5, K64 + K64 * 0.5),
            (self.cls.eye(dim, dtype=dtype), self.cls.eye(dim, dtype=torch.float64)),
        ]
        for low, high in checks:
            assert low.dtype == dtype and all(t.dtype == dtype for t in low.tensors())
            assert_close(low.to_dense(), high.to_dense(), rtol=rtol)
        A = self.invertible_element(dim, margin=1.0)[0].to(dtype)  # cond(A) <= 3
        A64 = A.to(torch.float64)
        for low, high in [
            (K @ X, K64 @ X64),
            (K.rmatmat(X), K64.rmatmat(X64)),
            (A.solve(X), A64.solve(X64)),
            (A.rsolve(X), A64.rsolve(X64)),
        ]:
            assert low.dtype == dtype
            assert_close(low, high, rtol=rtol)
        # the trace may cancel: measure its error against the mean absolute diagonal
        diagonal_scale = K64.to_dense().diagonal().abs().mean().item()
        assert K.average_trace().dtype == dtype
        assert_close(K.average_trace(), K64.average_trace(), rtol, diagonal_scale)
        for low, high in [
            (K.frobenius_norm(), K64.frobenius_norm()),
            (K.infinity_vector_norm(), K64.infinity_vector_norm()),
        ]:
            assert low.dtype == dtype
            assert_close(low, high, rtol=rtol)
