"""What the ranks of the owner-reduction tests run (`test_owner_statistics`).

Three ranks hold different statistics of four layers; `reduce_to_owners` must
leave on each side's owner what `all_reduce_statistics` leaves on every rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from singd_curvlinops import get_structure
from singd_curvlinops.distributed import all_reduce_statistics
from singd_curvlinops.distributed.owner_statistics import reduce_to_owners

# per layer: structures of K and C, dims, owners of K and C (rank 2 owns nothing)
LAYERS = [
    (("dense", "dense"), (7, 5), (0, 1)),  # split: the owners need the traces
    (("diagonal", "dense"), (4, 6), (1, 1)),  # whole on rank 1
    (("dense", "block3diagonal"), (6, 9), (1, 0)),  # split the other way round
    (("dense", "diagonal"), (3, 2), (0, 0)),  # no statistics on any rank
]


def _statistics(rank: int, poison: bool) -> list[tuple[Any, Any, int]]:
    generator = torch.Generator().manual_seed(10 + rank)
    statistics = []
    for index, (structures, dims, _) in enumerate(LAYERS):
        pair = []
        for name, dim in zip(structures, dims, strict=True):
            X = torch.randn(dim + 2, dim, generator=generator, dtype=torch.float64)
            pair.append(get_structure(name).from_dense(X.T @ X))
        count = 0 if index == 3 else (0 if (rank, index) == (2, 1) else 3 + rank)
        if count == 0:
            pair = [M.mul_(0.0) for M in pair]
        if poison and (rank, index) == (2, 2):
            pair[1].tensors()[0].view(-1)[0] = float("inf")
        statistics.append((pair[0], pair[1], count))
    return statistics


def reduce_w3(results: dict[str, Any], out: Path) -> None:
    rank = dist.get_rank()
    owners = [owner for *_, owner in LAYERS]
    expected = _statistics(rank, poison=False)
    results["expected_totals"] = all_reduce_statistics(expected)
    actual = _statistics(rank, poison=False)
    results["totals"] = reduce_to_owners(actual, owners)
    for index, ((E_K, E_C, _), (A_K, A_C, _)) in enumerate(
        zip(expected, actual, strict=True)
    ):
        for side, (E, A) in enumerate(((E_K, A_K), (E_C, A_C))):
            results[f"expected/{index}/{side}"] = E.to_dense()
            results[f"actual/{index}/{side}"] = A.to_dense()
            results[f"expected_trace/{index}/{side}"] = E.average_trace()
            results[f"actual_trace/{index}/{side}"] = A.average_trace()
    poisoned = _statistics(rank, poison=True)
    reduce_to_owners(poisoned, owners)
    results["finite"] = [
        bool(
            torch.isfinite(
                torch.cat([t.reshape(-1) for t in (*K.tensors(), *C.tensors())])
            ).all()
        )
        for K, C, _ in poisoned
    ]
