import pytest
import torch
from torch import Tensor

from singd_curvlinops.structures import HierarchicalMatrix, hierarchical
from tests.structures._suite import StructureSuite


class _HierarchicalSuite(StructureSuite):
    K1: int
    K2: int
    DIMS = (1, 2, 3, 4, 5, 6, 7, 11, 40)

    def project(self, sym: Tensor) -> Tensor:
        dim = sym.shape[0]
        # the reference's fill priority: top-left corner, bottom-right corner, core
        k1 = dim if dim <= self.K1 else self.K1
        k2 = 0 if dim <= self.K1 else min(dim - self.K1, self.K2)
        core = range(k1, dim - k2)
        bottom = range(dim - k2, dim)
        out = torch.zeros_like(sym)
        for i in range(dim):
            for j in range(dim):
                if (i < k1 and j < k1) or (i in bottom and j in bottom):
                    out[i, j] = sym[i, j]
                elif i < k1 <= j or (i in bottom and j in core):
                    out[i, j] = sym[i, j] + sym[j, i]
                elif i == j and i in core:
                    out[i, i] = sym[i, i]
        return out


class TestHierarchical3_2(_HierarchicalSuite):
    NAME, K1, K2 = "hierarchical3_2", 3, 2


class TestHierarchical15_15(_HierarchicalSuite):
    NAME, K1, K2 = "hierarchical15_15", 15, 15
    DIMS = (1, 14, 15, 16, 29, 30, 31, 47)


class TestHierarchical0_3(_HierarchicalSuite):
    NAME, K1, K2 = "hierarchical0_3", 0, 3


class TestHierarchical2_0(_HierarchicalSuite):
    NAME, K1, K2 = "hierarchical2_0", 2, 0


def test_fill_priority() -> None:
    H = hierarchical(3, 2)
    assert [t.shape[0] for t in H.eye(2).tensors()] == [2, 2, 0, 0, 0]
    assert [tuple(t.shape) for t in H.eye(4).tensors()] == [
        (3, 3),
        (3, 1),
        (0,),
        (1, 0),
        (1, 1),
    ]
    assert [tuple(t.shape) for t in H.eye(8).tensors()] == [
        (3, 3),
        (3, 5),
        (3,),
        (2, 3),
        (2, 2),
    ]


def test_invalid_blocks_and_sizes_raise() -> None:
    with pytest.raises(TypeError, match="template"):
        HierarchicalMatrix(
            *[torch.zeros(1, 1)] * 2, torch.zeros(0), *[torch.zeros(0, 0)] * 2
        )
    H = hierarchical(2, 2)
    with pytest.raises(ValueError, match="Invalid block shapes"):
        H(
            torch.zeros(1, 1),
            torch.zeros(1, 3),
            torch.zeros(1),
            torch.zeros(1, 1),
            torch.zeros(1, 1),
        )
    with pytest.raises(ValueError, match="K2"):
        hierarchical(2, -1)
