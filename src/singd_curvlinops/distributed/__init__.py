r"""Data parallelism and sharded factor work on `torch.distributed`.

- `exchange`: the statistics all-reduce of every factor update (the semantics of
  \(P\) processes equal to one on the concatenated batch).
- `strategy`: `Replicate` (every rank does all factor work) and the hooks of
  every strategy; `shard`: `Shard` (owners do it, one `all_gather` per step
  shares it); chosen with `distribute=`.
- `assignment`: the per-structure cost model and the balanced assignment.
- `engine`: one step of a sharded strategy, `layout`: what its `all_gather`
  holds; `ownership`: factors kept by owners only; `fsdp`: FSDP2's sharded layers
  (rows or columns of Γ), `shards`: their part in the engine's step.
- `owner_statistics`: `Shard`'s statistics exchange, each side reduced to its
  owner in one all-to-all; `summary`: the all-reduce before it (counts,
  traces, rows, and the step check at its head).
- `communication`: the bytes each of them sends; `buffers`: the message
  buffers every strategy keeps between steps.
- `collectives`: the checks that turn misuse into errors on every rank;
  `groups`: the check that the model's data parallelism spans the default group.

See the user guide's *Data parallelism* page.
"""

from singd_curvlinops.distributed.assignment import Assignment, LayerCost, assign
from singd_curvlinops.distributed.collectives import (
    check_same_configuration,
    initialized,
    rank,
    world_size,
)
from singd_curvlinops.distributed.communication import bytes_per_step, bytes_per_update
from singd_curvlinops.distributed.exchange import (
    StatisticsExchange,
    all_reduce_statistics,
)
from singd_curvlinops.distributed.groups import check_data_parallel
from singd_curvlinops.distributed.resolution import resolve
from singd_curvlinops.distributed.shard import Shard
from singd_curvlinops.distributed.strategy import DistributionStrategy, Replicate

__all__ = [
    "Assignment",
    "DistributionStrategy",
    "LayerCost",
    "Replicate",
    "Shard",
    "StatisticsExchange",
    "all_reduce_statistics",
    "assign",
    "bytes_per_step",
    "bytes_per_update",
    "check_data_parallel",
    "check_same_configuration",
    "initialized",
    "rank",
    "resolve",
    "world_size",
]
