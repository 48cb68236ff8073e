"""Bad arguments raise clear errors from this package, and leave the matrix as it was.

Every public operation of every structure family is called with the wrong kind of
argument (`TypeError`) or a wrong value (`ValueError`); each message must name the
argument and what is allowed.
"""

import re
from fractions import Fraction
from numbers import Real

import numpy as np
import pytest
import torch

from singd_curvlinops.structures import get_structure

ONE_PER_FAMILY = [
    "dense",
    "diagonal",
    "block3diagonal",
    "hierarchical2_1",
    "triltoeplitz",
    "triutoeplitz",
    "trilbottomrightdiag",
    "triltopleftdiag",
    "triubottomrightdiag",
    "triutopleftdiag",
]
DIM = 4

PAIRS = [
    ("diagonal", 4, "dense", 4),
    ("block2diagonal", 4, "block3diagonal", 4),
    ("hierarchical1_1", 4, "hierarchical2_1", 4),
    ("triltoeplitz", 4, "triutoeplitz", 4),
    ("trilbottomrightdiag", 4, "triubottomrightdiag", 4),
    ("dense", 3, "dense", 4),
    ("triltoeplitz", 5, "triltoeplitz", 4),
]


def generic(name: str, dtype: torch.dtype = torch.float64):
    """A generic invertible element (a product of two projections, shifted)."""
    cls = get_structure(name)
    S1, S2 = torch.randn(2, DIM, DIM, dtype=torch.float64)
    K = cls.from_dense(S1 + S1.T) @ cls.from_dense(S2 + S2.T)
    K.mul_(0.1 / K.infinity_vector_norm().item()).diag_add_(1.0)
    return K.to(dtype)


def unchanged(K, before) -> bool:
    return all(
        torch.equal(a, b) for a, b in zip(K.tensors(), before.tensors(), strict=True)
    )


# ------------------------------------------------------------- two structures
@pytest.mark.parametrize("first, dim1, second, dim2", PAIRS)
@pytest.mark.parametrize("operation", ["add", "add_", "sub", "matmul"])
def test_mixing_structures_names_both_operands(first, dim1, second, dim2, operation):
    A = get_structure(first).eye(dim1)
    B = get_structure(second).eye(dim2)
    apply = {
        "add": lambda: A + B,
        "add_": lambda: A.add_(B),
        "sub": lambda: A - B,
        "matmul": lambda: A @ B,
    }[operation]
    with pytest.raises(ValueError) as info:
        apply()
    assert re.escape(repr(A)) and repr(A) in str(info.value)
    assert repr(B) in str(info.value)
    assert torch.equal(A.to_dense(), torch.eye(dim1)), "failed operation changed A"


def test_mixing_dtypes_raises():
    A = get_structure("diagonal").eye(3)
    B = get_structure("diagonal").eye(3, dtype=torch.float64)
    with pytest.raises(ValueError, match="dtypes differ"):
        A.add_(B)


@pytest.mark.parametrize("name", ONE_PER_FAMILY)
def test_mixing_devices_raises(name):
    """The meta device stands in for a GPU: no data, but a device of its own."""
    cls = get_structure(name)
    K, K_meta = cls.eye(DIM), cls.eye(DIM, device="meta")
    assert K_meta.device == torch.device("meta")
    for apply in (lambda: K.add_(K_meta), lambda: K @ K_meta, lambda: K - K_meta):
        with pytest.raises(ValueError, match="the devices differ"):
            apply()
    assert torch.equal(K.to_dense(), torch.eye(DIM))


# ------------------------------------------------------------- dense operands
@pytest.mark.parametrize("name", ONE_PER_FAMILY)
def test_bad_dense_operands(name):
    K = generic(name)
    before = K.clone()
    operations = [
        ("other", K.__matmul__),
        ("mat", K.rmatmat),
        ("mat", K.solve),
        ("mat", K.rsolve),
        ("mat", K.matmat_),
        ("X", K.from_inner),
        ("X", K.from_inner_),
    ]
    for argument, apply in operations:
        with pytest.raises(ValueError, match=rf"{argument} must have shape .*d = 4"):
            apply(torch.ones(5, 2, dtype=torch.float64))
        with pytest.raises(
            ValueError, match=rf"{argument} must have shape .*\(4, 2, 1\)"
        ):
            apply(torch.ones(4, 2, 1, dtype=torch.float64))  # a 3-D operand
        with pytest.raises(ValueError, match=rf"{argument} must have shape .*\(\)"):
            apply(torch.tensor(1.0, dtype=torch.float64))
        with pytest.raises(
            ValueError, match=rf"{argument} must have the matrix's dtype"
        ):
            apply(torch.ones(4, 2, dtype=torch.float32))
        with pytest.raises(
            ValueError,
            match=rf"{argument} must be on the matrix's device cpu, got meta",
        ):
            apply(torch.ones(4, 2, dtype=torch.float64, device="meta"))
        for integer in (torch.int64, torch.int32, torch.bool, torch.complex128):
            with pytest.raises(
                TypeError, match=rf"{argument} must have a floating-point dtype"
            ):
                apply(torch.ones(4, 2, dtype=integer))
        if argument != "other":  # `@` leaves other types to Python (below)
            with pytest.raises(TypeError, match=rf"{argument} must be a torch.Tensor"):
                apply(np.ones((4, 2)))
    for matrix_only in (K.matmat_, K.from_inner, K.from_inner_):
        with pytest.raises(ValueError, match=r"must have shape \[d, n\] with d = 4"):
            matrix_only(torch.ones(4, dtype=torch.float64))
    for other in ([1.0, 2.0, 3.0, 4.0], np.ones((4, 2)), np.ones(4)):
        with pytest.raises(TypeError, match="unsupported operand|does not support"):
            K @ other
        with pytest.raises(TypeError, match="unsupported operand|does not support"):
            other @ K
    assert unchanged(K, before)


@pytest.mark.parametrize("name", ONE_PER_FAMILY)
def test_bad_operands_of_from_mat_inner(name):
    cls = get_structure(name)
    with pytest.raises(ValueError, match=r"X must have shape \[d, n\] with d >= 1"):
        cls.from_mat_inner(torch.ones(4, 2, 2))
    with pytest.raises(ValueError, match=r"X must have shape \[d, n\] with d >= 1"):
        cls.from_mat_inner(torch.ones(4))
    with pytest.raises(ValueError, match="X must have at least one row"):
        cls.from_mat_inner(torch.ones(0, 3))
    for dtype in (torch.int64, torch.uint8, torch.bool, torch.complex64):
        with pytest.raises(TypeError, match="X must have a floating-point dtype"):
            cls.from_mat_inner(torch.ones(4, 2, dtype=dtype))
    with pytest.raises(TypeError, match="X must be a torch.Tensor, got list"):
        cls.from_mat_inner([[1.0, 2.0]])


# -------------------------------------------------------------------- scalars
BAD_SCALARS = [
    (torch.ones(DIM, dtype=torch.float64), TypeError, r"shape \(4,\)"),
    (torch.ones(1, dtype=torch.float64), TypeError, r"shape \(1,\)"),
    (torch.ones(1, 1), TypeError, r"shape \(1, 1\)"),
    (torch.tensor(True), TypeError, "dtype torch.bool"),
    (torch.tensor(1j), TypeError, "dtype torch.complex64"),
    (True, TypeError, "got bool"),
    (1j, TypeError, "got complex"),
    ("1.0", TypeError, "got str"),
    (Fraction(1, 2), TypeError, "got Fraction"),
    (None, TypeError, "got NoneType"),
    (np.ones(DIM), TypeError, "got ndarray"),
    (10**30, ValueError, "does not fit into int64: pass it as a float"),
    (torch.tensor(2.0, device="meta"), ValueError, "on the CPU or on the matrix's"),
]


@pytest.mark.parametrize("name", ONE_PER_FAMILY)
@pytest.mark.parametrize(
    "value, error, message", BAD_SCALARS, ids=[str(i) for i in range(len(BAD_SCALARS))]
)
def test_bad_scalars(name, value, error, message):
    """`diag_add_` with a vector used to add it to the diagonal of dense matrices."""
    K = generic(name)
    before = K.clone()
    for argument, apply in [
        ("value", K.diag_add_),
        ("value", K.mul_),
        ("alpha", lambda v: K.add_(before, alpha=v)),
    ]:
        with pytest.raises(error, match=f"{argument} must be a real number.*{message}"):
            apply(value)
    if isinstance(value, (Real, torch.Tensor)):
        with pytest.raises(error, match=f"scalar must be a real number.*{message}"):
            K * value
    else:  # `*` leaves other types to Python, which raises a TypeError
        with pytest.raises(TypeError):
            K * value
    assert unchanged(K, before)


@pytest.mark.parametrize("name", ONE_PER_FAMILY)
def test_good_scalars(name):
    """Numbers and 0-d real tensors of any dtype on the CPU scale and shift alike."""
    K = generic(name)
    expected = 2.0 * K.to_dense() + 3.0 * torch.eye(DIM, dtype=torch.float64)
    for two, three in [
        (2, 3),
        (2.0, 3.0),
        (torch.tensor(2), torch.tensor(3, dtype=torch.int8)),
        (torch.tensor(2.0, dtype=torch.float16), torch.tensor(3.0)),
        (np.float32(2.0), np.int64(3)),  # NumPy scalars, as torch takes them
    ]:
        result = K.clone().mul_(two).diag_add_(three)
        assert result.dtype == torch.float64
        assert torch.allclose(result.to_dense(), expected)
        assert torch.allclose((K * two).to_dense(), 2.0 * K.to_dense())
        assert torch.allclose(K.clone().add_(K, alpha=two).to_dense(), 3 * K.to_dense())


def test_undefined_operators_raise_type_errors():
    """Including NumPy arrays, which would otherwise broadcast over the matrix."""
    K = get_structure("diagonal").eye(3)
    for apply in (
        lambda: K * K,
        lambda: K + 1.0,
        lambda: np.ones(3) * K,
        lambda: np.ones(3) + K,
        lambda: torch.ones(3) @ K,
    ):
        with pytest.raises(TypeError):  # Python's or NumPy's message
            apply()
    with pytest.raises(TypeError, match="structured matrix"):
        K.add_(torch.eye(3))


# ------------------------------------------------------------- constructors
@pytest.mark.parametrize("name", ONE_PER_FAMILY)
def test_eye_and_zeros_reject_bad_dims_dtypes_and_devices(name):
    cls = get_structure(name)
    for make in (cls.eye, cls.zeros):
        for dtype in (torch.int64, torch.bool, torch.complex64, torch.float8_e4m3fn):
            with pytest.raises(
                TypeError, match=f"dtype must be torch.float16.*{dtype}"
            ):
                make(3, dtype=dtype)
        with pytest.raises(TypeError, match="dtype must be .* got 'float32'"):
            make(3, dtype="float32")
        with pytest.raises(ValueError, match="device must be a torch.device.*'gpu'"):
            make(3, device="gpu")
        with pytest.raises(
            ValueError, match=r"dim must be in \[1, 2147483647\], got 0"
        ):
            make(0)
        with pytest.raises(
            ValueError, match=r"dim must be in \[1, 2147483647\], got 1"
        ):
            make(10**20)
        for dim in (2.0, True, np.int64(3), "3"):
            with pytest.raises(TypeError, match="dim must be an int"):
                make(dim)
        assert make(3, dtype=torch.bfloat16, device=torch.device("cpu")).dim == 3


@pytest.mark.parametrize(
    "name", ["dense", "diagonal", "block2diagonal", "hierarchical2_2", "triltoeplitz"]
)
def test_bad_from_dense_arguments(name):
    cls = get_structure(name)
    with pytest.raises(ValueError, match=r"square matrix \[d, d\] with d >= 1"):
        cls.from_dense(torch.ones(3, 4))
    with pytest.raises(ValueError, match="square matrix"):
        cls.from_dense(torch.ones(3))
    with pytest.raises(ValueError, match="square matrix"):
        cls.from_dense(torch.ones(3, 3, 3))
    with pytest.raises(ValueError, match="square matrix"):
        cls.from_dense(torch.ones(0, 0))
    for dtype in (torch.int32, torch.int64, torch.complex128):
        with pytest.raises(TypeError, match="sym_mat must have a floating-point dtype"):
            cls.from_dense(torch.ones(3, 3, dtype=dtype))
    with pytest.raises(TypeError, match="sym_mat must be a torch.Tensor"):
        cls.from_dense([[1.0]])


@pytest.mark.parametrize("name", ONE_PER_FAMILY)
def test_stored_tensors_are_float_of_one_dtype_and_device(name):
    """Constructors and `from_tensors` (the checkpoint path) validate the tensors."""
    cls = get_structure(name)
    K = generic(name)
    tensors = dict(K.named_tensors())
    first = next(iter(tensors))
    as_int = {**tensors, first: tensors[first].to(torch.int64)}
    with pytest.raises(TypeError, match=f"{first} must have a floating-point dtype"):
        cls.from_tensors(as_int)
    with pytest.raises(TypeError, match=f"{first} must have a floating-point dtype"):
        cls(*as_int.values())
    if len(tensors) > 1:
        last = list(tensors)[-1]
        mixed = {**tensors, last: tensors[last].to(torch.float32)}
        with pytest.raises(ValueError, match=f"{last!r} .* must have the dtype"):
            cls.from_tensors(mixed)
        with pytest.raises(ValueError, match=f"{last!r} .* and device of"):
            cls(*{**tensors, last: tensors[last].to("meta")}.values())
    with pytest.raises(TypeError, match=f"{first} must be a torch.Tensor"):
        cls.from_tensors({**tensors, first: [1.0]})
    assert torch.equal(cls.from_tensors(tensors).to_dense(), K.to_dense())


@pytest.mark.parametrize("name", ONE_PER_FAMILY)
def test_to_keeps_a_floating_point_dtype(name):
    K = generic(name)
    for dtype in (torch.int64, torch.bool, torch.complex128):
        with pytest.raises(TypeError, match=f"floating-point dtype, got {dtype}"):
            K.to(dtype)
    assert K.to(torch.float32).dtype == torch.float32 and K.dtype == torch.float64
    assert K.to("meta").device == torch.device("meta")


def test_all_reduce_without_process_group_raises():
    with pytest.raises(RuntimeError, match="process group"):
        get_structure("diagonal").eye(3).all_reduce()
    with pytest.raises(ValueError, match="'sum' or 'avg'"):
        get_structure("diagonal").eye(3).all_reduce(op="max")
