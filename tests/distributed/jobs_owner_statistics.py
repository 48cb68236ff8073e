r"""What the ranks of the owner-reduction tests run (`test_owner_statistics`).

Three ranks hold different statistics of five layers; `reduce_to_owners` must
leave on each side's owner what `all_reduce_statistics` leaves on every rank. The
last layer's statistics are kept as rows (`GramRows`, two per rank): its \(K\)
(dimension 9, six rows in all) travels as rows, its \(C\) (dimension 4) as a
dense matrix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from singd_curvlinops import get_structure
from singd_curvlinops.distributed import all_reduce_statistics
from singd_curvlinops.distributed.gram_rows import GramRows, as_structured
from singd_curvlinops.distributed.owner_statistics import reduce_to_owners

# per layer: structures of K and C, dims, owners of K and C (rank 2 owns nothing)
LAYERS = [
    (("dense", "dense"), (7, 5), (0, 1)),  # split: the owners need the traces
    (("diagonal", "dense"), (4, 6), (1, 1)),  # whole on rank 1
    (("dense", "block3diagonal"), (6, 9), (1, 0)),  # split the other way round
    (("dense", "diagonal"), (3, 2), (0, 0)),  # no statistics on any rank
    (("dense", "dense"), (9, 4), (0, 1)),  # rows: K as rows, C formed densely
]
ROWS = 4  # the layer kept as rows


def _statistics(
    rank: int, poison: bool, rows: bool = False
) -> list[tuple[Any, Any, int]]:
    generator = torch.Generator().manual_seed(10 + rank)
    statistics = []
    for index, (structures, dims, _) in enumerate(LAYERS):
        pair = []
        for name, dim in zip(structures, dims, strict=True):
            height = 2 if index == ROWS else dim + 2
            X = torch.randn(height, dim, generator=generator, dtype=torch.float64)
            if rows and index == ROWS:
                pair.append(GramRows(X))
            else:
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
    actual = _statistics(rank, poison=False, rows=True)
    results["totals"], kept, results["agreed"] = reduce_to_owners(actual, owners)
    for index, ((E_K, E_C, _), (A_K, A_C)) in enumerate(
        zip(expected, kept, strict=True)
    ):
        for side, (E, A) in enumerate(((E_K, A_K), (E_C, A_C))):
            results[f"expected/{index}/{side}"] = E.to_dense()
            results[f"actual/{index}/{side}"] = as_structured(A).to_dense()
            results[f"expected_trace/{index}/{side}"] = E.average_trace()
            results[f"actual_trace/{index}/{side}"] = A.average_trace()
    poisoned_statistics = _statistics(rank, poison=True, rows=True)
    _, poisoned, results["poisoned_agreed"] = reduce_to_owners(
        poisoned_statistics, owners
    )
    results["finite"] = [
        bool(
            torch.isfinite(
                torch.cat([t.reshape(-1) for t in (*K.tensors(), *C.tensors())])
            ).all()
        )
        for K, C in poisoned
    ]
