"""Structure names, families and user registration."""

import pytest
import torch
from torch import Tensor

from singd_curvlinops.structures import (
    DenseFallbackWarning,
    DiagonalMatrix,
    StructuredMatrix,
    block_diagonal,
    get_structure,
    hierarchical,
    register_structure,
    structure_names,
    unregister_structure,
)

FIXED = [
    "dense",
    "diagonal",
    "triltoeplitz",
    "triutoeplitz",
    "trilbottomrightdiag",
    "triltopleftdiag",
    "triubottomrightdiag",
    "triutopleftdiag",
]


@pytest.mark.parametrize("name", FIXED)
def test_fixed_names(name):
    cls = get_structure(name)
    assert issubclass(cls, StructuredMatrix)
    assert name in structure_names()


def test_families_any_size():
    assert get_structure("block30diagonal") is block_diagonal(30)
    assert get_structure("block1000diagonal").BLOCK_DIM == 1000
    assert get_structure("hierarchical15_15") is hierarchical(15, 15)
    H = get_structure("hierarchical7_0")
    assert (H.MAX_K1, H.MAX_K2) == (7, 0)


@pytest.mark.parametrize(
    "name",
    ["Dense", "blockdiagonal", "hierarchical15", "toeplitz", "", "block\u0663diagonal"],
)
def test_unknown_names_list_the_valid_ones(name):
    """Sizes are ASCII digits: int() would read "\u0663" (Arabic-Indic) as 3."""
    with pytest.raises(ValueError, match="Valid names: .*dense.*block\\{B\\}diagonal"):
        get_structure(name)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("block0diagonal", r"B must be in \[1, 2147483647\], got 0\."),
        ("block2147483648diagonal", r"B must be in \[1, 2147483647\], got 2147483648"),
        ("block" + "1" * 21 + "diagonal", "B must be in .*, got 21 digits"),
        ("block" + "9" * 5000 + "diagonal", r"B must be in .*, got 5000 digits\."),
        (
            "hierarchical1_" + "1" * 20,
            r"K2 must be in \[0, 2147483647\], got 20 digits",
        ),
        ("hierarchical4294967296_1", "K1 must be in .*, got 4294967296"),
        ("block030diagonal", "write B without leading zeros"),
        ("hierarchical00_1", "write K1 without leading zeros"),
    ],
)
def test_absurd_family_sizes_fail_the_name_check(name, message):
    """They used to pass it and overflow later, inside torch."""
    with pytest.raises(ValueError, match=f"Unknown structure .*; {message}"):
        get_structure(name)


def test_largest_family_sizes_work():
    Block = get_structure("block2147483647diagonal")
    assert Block.BLOCK_DIM == 2**31 - 1
    assert torch.equal(Block.eye(3).to_dense(), torch.eye(3))
    H = get_structure("hierarchical2147483647_0")
    assert torch.equal((H.eye(3) @ torch.ones(3)), torch.ones(3))
    with pytest.raises(ValueError, match="block_dim must be in"):
        block_diagonal(2**31)


def test_family_sizes_of_other_types_are_rejected_after_valid_ones():
    """1.0 and True hash like 1: the class cache must not answer before the check."""
    assert hierarchical(1, 2) is hierarchical(1, 2)
    assert block_diagonal(1) is block_diagonal(1)
    for K1 in (1.0, True):
        with pytest.raises(TypeError, match="K1 must be an int"):
            hierarchical(K1, 2)
    for B in (1.0, True, "1"):
        with pytest.raises(TypeError, match="block_dim must be an int"):
            block_diagonal(B)


def test_name_must_be_a_string():
    with pytest.raises(TypeError, match="str"):
        get_structure(DiagonalMatrix)


class ScaledIdentity(StructuredMatrix):
    """A minimal user structure: required methods only, dense fallbacks elsewhere."""

    def __init__(self, scale: Tensor, dim: int) -> None:
        super().__init__()
        self.register_tensor(scale, "scale")
        self._size = dim

    @property
    def dim(self) -> int:
        return self._size

    @classmethod
    def from_dense(cls, sym_mat: Tensor) -> "ScaledIdentity":
        return cls(sym_mat.diagonal().mean(), sym_mat.shape[0])

    def to_dense(self) -> Tensor:
        return self.scale * torch.eye(self._size, dtype=self.scale.dtype)

    def _matmul_structure(self, other: "ScaledIdentity") -> "ScaledIdentity":
        return ScaledIdentity(self.scale * other.scale, self._size)


def test_register_user_structure_with_dense_fallbacks():
    register_structure("scaledidentity", ScaledIdentity)
    try:
        cls = get_structure("scaledidentity")
        assert cls is ScaledIdentity and "scaledidentity" in structure_names()
        with pytest.warns(DenseFallbackWarning, match="ScaledIdentity.eye") as caught:
            K = cls.eye(3, dtype=torch.float64)
        assert caught[0].filename == __file__  # the caller, not the package
        with pytest.warns(DenseFallbackWarning, match="diag_add_") as caught:
            K.clone().diag_add_(1.0)
        assert caught[0].filename == __file__
        with pytest.warns(DenseFallbackWarning):
            X = torch.randn(3, 2, dtype=torch.float64)
            H = K.from_inner(X)
        assert torch.allclose(
            H.to_dense(), (X.square().sum() / 3) * torch.eye(3, dtype=torch.float64)
        )
        with pytest.warns(DenseFallbackWarning):
            assert torch.allclose(
                (K * 2.0).diag_add_(1.0).average_trace(),
                torch.tensor(3.0, dtype=torch.float64),
            )
        assert torch.allclose((K @ K).to_dense(), torch.eye(3, dtype=torch.float64))
        V = torch.randn(3, 2, dtype=torch.float64)
        with pytest.warns(DenseFallbackWarning, match="ScaledIdentity.solve"):
            assert torch.allclose((K * 2.0).solve(V), V / 2)
        with pytest.warns(DenseFallbackWarning, match="ScaledIdentity.rsolve"):
            assert torch.allclose((K * 4.0).rsolve(V[:, 0]), V[:, 0] / 4)
    finally:
        unregister_structure("scaledidentity")
    with pytest.raises(ValueError, match="Unknown structure"):
        get_structure("scaledidentity")


@pytest.mark.parametrize("name", ["dense", "block5diagonal", "hierarchical1_2"])
def test_register_name_clash(name):
    with pytest.raises(ValueError, match="already taken"):
        register_structure(name, ScaledIdentity)


def test_register_clash_with_user_name_and_bad_class():
    register_structure("mine", ScaledIdentity)
    try:
        with pytest.raises(ValueError, match="already taken by ScaledIdentity"):
            register_structure("mine", DiagonalMatrix)
    finally:
        unregister_structure("mine")
    with pytest.raises(TypeError, match="StructuredMatrix subclass"):
        register_structure("other", dict)
    with pytest.raises(ValueError, match="not a user-registered"):
        unregister_structure("dense")
