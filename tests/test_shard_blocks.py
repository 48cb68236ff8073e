"""The index arithmetic of FSDP2's blocks of `Γ` (`distributed.shards`).

FSDP2 splits a weight's first dimension as `torch.chunk` does; `shards.held`
must count each rank's slices the same way, including ranks left without any.
Cutting a matrix into the ranks' blocks (`own_block`), padding them
(`pad_share`) and putting them back together (`assemble`) must give the matrix
again, and `unpad` must undo the padding: the owner of owned factors under
FSDP2 gathers `Γ` and hands out `Δ` this way (`owner_blocks`). (The bias
column beside `Conv1D`'s shards needs `DTensor` parameters: the spawned tests
in `tests/distributed` cover it.)
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from singd_curvlinops.distributed.shards import (
    assemble,
    block_shape,
    held,
    own_block,
    pad_share,
    unpad,
)


def _layer(d_K: int, d_C: int, *, transposed: bool) -> SimpleNamespace:
    """A layer as the block functions read it: its dimensions and stored weight.

    Args:
        d_K: The input dimension (columns of `Γ`).
        d_C: The output dimension (rows of `Γ`).
        transposed: Whether the weight is stored `[d_K, d_C]` (an embedding's
            table): FSDP2 then shards `Γ`'s columns.

    Returns:
        The stand-in.
    """
    shape = (d_K, d_C) if transposed else (d_C, d_K)
    adapter = SimpleNamespace(transposed=transposed)
    return SimpleNamespace(
        dims=(d_K, d_C),
        weight=torch.empty(shape),
        params=(torch.empty(shape),),
        adapter=adapter,
        swapped=False,
        bias_only=False,
    )


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("slices", [1, 2, 5, 7, 9])
def test_held_slices_are_torch_chunks(slices: int, world: int) -> None:
    layer = _layer(4, slices, transposed=False)
    chunks = [len(c) for c in torch.arange(slices).chunk(world)]
    expected = chunks + [0] * (world - len(chunks))  # ranks left without slices
    assert [held(layer, r, world) for r in range(world)] == expected


@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "columns"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_blocks_padded_and_assembled_give_the_matrix(
    transposed: bool, world: int
) -> None:
    d_K, d_C = 5, 7  # 7 rows on 4 ranks: 2, 2, 2, 1; on 3: 3, 3, 1
    if transposed:
        d_K, d_C = 7, 5
    layer = _layer(d_K, d_C, transposed=transposed)
    full = torch.randn(d_C, d_K, dtype=torch.float64)
    padded = []
    for rank in range(world):
        mine = held(layer, rank, world)
        block = own_block(layer, full, rank, world, mine)
        assert block.shape == ((d_C, mine) if transposed else (mine, d_K))
        zeros = torch.zeros(block_shape(layer, world), dtype=full.dtype)
        padded.append(pad_share(block, layer, zeros))
        assert torch.equal(unpad(layer, padded[-1], mine), block)
    assert torch.equal(assemble(layer, padded), full)
