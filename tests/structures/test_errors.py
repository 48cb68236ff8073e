"""Bad operands raise clear errors that name both operands."""

import re

import pytest
import torch

from singd_curvlinops.structures import get_structure

PAIRS = [
    ("diagonal", 4, "dense", 4),
    ("block2diagonal", 4, "block3diagonal", 4),
    ("hierarchical1_1", 4, "hierarchical2_1", 4),
    ("triltoeplitz", 4, "triutoeplitz", 4),
    ("trilbottomrightdiag", 4, "triubottomrightdiag", 4),
    ("dense", 3, "dense", 4),
    ("triltoeplitz", 5, "triltoeplitz", 4),
]


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


@pytest.mark.parametrize(
    "name", ["dense", "diagonal", "block2diagonal", "triutoeplitz"]
)
def test_bad_dense_operands(name):
    K = get_structure(name).eye(4)
    with pytest.raises(ValueError, match=r"shape \[d\] or \[d, n\] with d = 4"):
        K @ torch.ones(5, 2)
    with pytest.raises(ValueError, match=r"shape \[d\] or \[d, n\] with d = 4"):
        K.rmatmat(torch.ones(4, 2, 1))
    with pytest.raises(ValueError, match="dtype"):
        K @ torch.ones(4, dtype=torch.float64)
    with pytest.raises(TypeError, match="floating-point"):
        K @ torch.ones(4, dtype=torch.int64)
    for solve in (K.solve, K.rsolve):
        with pytest.raises(ValueError, match=r"shape \[d\] or \[d, n\] with d = 4"):
            solve(torch.ones(5, 2))
        with pytest.raises(ValueError, match="dtype"):
            solve(torch.ones(4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\[d, n\]"):
        K.from_inner(torch.ones(4))
    with pytest.raises(TypeError, match="structured matrix"):
        K.add_(torch.eye(4))
    with pytest.raises(TypeError, match="alpha"):
        K.add_(K.clone(), alpha=torch.ones(2))
    with pytest.raises(TypeError, match="value"):
        K.mul_(torch.ones(4))
    with pytest.raises(TypeError):
        K * K
    with pytest.raises(TypeError):
        K + 1.0


@pytest.mark.parametrize(
    "name", ["dense", "diagonal", "block2diagonal", "hierarchical2_2"]
)
def test_bad_constructor_arguments(name):
    cls = get_structure(name)
    with pytest.raises(ValueError, match="square matrix"):
        cls.from_dense(torch.ones(3, 4))
    with pytest.raises(ValueError, match="square matrix"):
        cls.from_dense(torch.ones(3))
    with pytest.raises(TypeError, match="floating-point"):
        cls.from_dense(torch.ones(3, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="dim must be >= 1"):
        cls.eye(0)
    with pytest.raises(TypeError, match="dim must be an int"):
        cls.zeros(2.5)


def test_all_reduce_without_process_group_raises():
    with pytest.raises(RuntimeError, match="process group"):
        get_structure("diagonal").eye(3).all_reduce()
    with pytest.raises(ValueError, match="'sum' or 'avg'"):
        get_structure("diagonal").eye(3).all_reduce(op="max")
