r"""Statistics that owners form, checked before a step changes anything.

One process checks the statistics its hooks form, such as
\(H_K = \Pi(K^\top a^\top a K)\), before the step changes anything, and skips the
step as a whole if one is not finite (`singd_curvlinops.guard`). Under `Shard`
each side's statistics reach only its owner (`owner_statistics`): the
exchange's probe finds every rank's part finite, but the owner forms their sum
(\(R^\top R\) of all ranks' rows), and under `Shard(factors="owned")` also
the projection with its factors (`raw_gram.statistics_on_owner`), which can
overflow although the parts did not (rows of about \(10^{19}\) in float32, or
a huge factor). So the owners check what they formed before the first update,
and one all-reduce (a minimum) makes the verdict every rank's:

- `agreed`, in the exchange: per layer, whether the probe and the owners'
  combined statistics are finite (`PendingStatistics.agreed_finite`);
- `take`, in the owned form's step: the owners form their layers' statistics
  first (each orientation of tied weights apart, then combined as the hooks
  combine them on one process); the step's inputs verdict takes whether all
  are finite (`StepGuard.require`). The layers split by column blocks check
  theirs in `columns.update`, from the gathered numbers.

Every rank then skips such a step as a whole, as one process does, instead of
discarding the owners' factor updates and stepping with the previous factors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from singd_curvlinops.bounds import finite
from singd_curvlinops.distributed.collectives import agree, rank
from singd_curvlinops.distributed.raw_gram import (
    as_dense,
    projects_raw,
    statistics_on_owner,
)
from singd_curvlinops.layers import Layer
from singd_curvlinops.rules import FactorStatistics


def take(
    stepper: Any,
    layers: Sequence[Layer],
    owns: Callable[[Layer], bool],
    *,
    form: bool,
) -> dict[Layer, FactorStatistics | None]:
    """Take the due layers' statistics; form and check those this rank owns.

    A collective if `form` (every rank, the same layers).

    Args:
        stepper: The shell's `LayerStepper`.
        layers: The due layers (same order on every rank).
        owns: Whether this rank updates a side of the layer.
        form: Whether owners form the statistics from raw rows (the owned
            form); then the ranks agree on their finiteness.

    Returns:
        Per layer, its statistics (formed where this rank owns it), or None.
    """
    taken, formed = {}, []
    for layer in layers:
        owner = form and owns(layer)
        if owner and projects_raw(stepper.rule):  # each orientation, then combined
            project = partial(statistics_on_owner, stepper, layer)
            statistics = stepper.take(layer, project)
        else:
            statistics = stepper.take(layer)
            if owner:  # other rules project dense U themselves
                statistics = as_dense(statistics)
        if owner and statistics is not None:
            formed.append(statistics)
        taken[layer] = statistics
    if form and layers:
        guard = stepper.guard
        ok = finite([t for s in formed for t in _tensors(s)], guard.device)
        guard.require(agree(ok.reshape(1)).reshape(()))
    return taken


def agreed(
    combined: Sequence[tuple[Any, Any]],
    owners: Sequence[tuple[int, int]],
    probes: Sequence[bool],
) -> list[bool]:
    """Return per layer whether every rank's statistics and their sum are finite.

    A collective: every rank, the same layers.

    Args:
        combined: Per layer, `(H_K, H_C)` from `owner_statistics.reduce_to_owners`
            (the combined statistics on the owner of each side).
        owners: Per layer, the owners of `K` and `C`.
        probes: Per layer, the probe's verdict (every rank's part finite).

    Returns:
        Per layer, the same on every rank.
    """
    me, flags = rank(), []
    for (H_K, H_C), (owner_K, owner_C), probe in zip(
        combined, owners, probes, strict=True
    ):
        mine = [M for M, owner in ((H_K, owner_K), (H_C, owner_C)) if owner == me]
        flags.append(finite([t for M in mine for t in M.tensors()], H_K.device) & probe)
    return agree(torch.stack(flags)).tolist()


def _tensors(statistics: FactorStatistics) -> list:
    """Return the tensors of formed statistics (projected or dense).

    Args:
        statistics: From `statistics_on_owner`.

    Returns:
        Their tensors.
    """
    if statistics.collected is not None:
        H_K, H_C = statistics.collected
        return H_K.tensors() + H_C.tensors()
    return list(statistics.handed_over or ())
