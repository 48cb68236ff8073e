"""A preconditioner applied to a gradient split into row or column blocks.

FSDP2 gives each rank a block of `Γ`'s rows (or columns); `distributed.shards`
has each rank compute its block's half product (`shard_half`), gathers them, and
finishes `Δ` from the whole (`shard_finish`), or finishes a block of columns
alone where the input side is diagonal (`shard_columns`). For the records of
SINGD, KFAC and EKFAC, after a few updates, each route must give `apply`'s
`P_C Γ P_K` (EKFAC: `Q_C [(Q_Cᵀ Γ Q_K) ⊙ D] Q_Kᵀ`) to rounding.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from singd_curvlinops import EKFAC, KFAC, SINGD

OPTIMIZERS = {"singd": SINGD, "kfac": KFAC, "ekfac": EKFAC}
BLOCKS = (3, 3, 1)  # uneven, as FSDP2's last shard


def record_after_updates(name: str, first: nn.Module) -> tuple[object, torch.Tensor]:
    """The first layer's preconditioner after three updates, and a gradient."""
    torch.manual_seed(0)
    model = nn.Sequential(first, nn.Flatten(), nn.Tanh(), nn.Linear(7, 3)).double()
    optimizer = OPTIMIZERS[name](model, lr=0.01, T=1, damping=0.1)
    for seed in range(3):
        generator = torch.Generator().manual_seed(seed)
        if isinstance(first, nn.Embedding):
            X = torch.randint(0, 7, (12, 1), generator=generator)
        else:
            X = torch.randn(12, 5, dtype=torch.float64, generator=generator)
        y = torch.randint(0, 3, (12,), generator=generator)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(X), y).backward()
        optimizer.step()
    d_K, d_C = optimizer.layers[0].dims
    gradient = torch.randn(d_C, d_K, dtype=torch.float64)
    return optimizer.preconditioner(model[0]), gradient


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_row_and_column_blocks_give_the_whole_product(name: str) -> None:
    record, gradient = record_after_updates(name, nn.Linear(5, 7))
    expected = record.apply(gradient.clone())
    rows = [record.shard_half(0, b.clone()) for b in gradient.split(BLOCKS)]
    by_rows = record.shard_finish(0, torch.cat(rows))
    columns = gradient.split((2, 2, 2), dim=1)  # d_K = 6: five inputs and a bias
    halves = [record.shard_half(1, block.clone()) for block in columns]
    by_columns = record.shard_finish(1, torch.cat(halves, dim=1))
    for result in (by_rows, by_columns):
        torch.testing.assert_close(result, expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_columns_of_a_diagonal_input_side_finish_alone(name: str) -> None:
    """An embedding's one-hot side is diagonal: each block of columns alone."""
    record, gradient = record_after_updates(name, nn.Embedding(7, 7))
    expected = record.apply(gradient.clone())
    first = 0
    for block in gradient.split(BLOCKS, dim=1):
        columns = slice(first, first + block.shape[1])
        result = record.shard_columns(block.clone(), columns)
        torch.testing.assert_close(result, expected[:, columns], rtol=1e-12, atol=1e-14)
        first = columns.stop
