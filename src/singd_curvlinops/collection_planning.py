"""How the optimizer shell answers its statistics collector for one layer.

`plan_collection` builds a due layer's `CollectionPlan`: the rule's projection
of the rows (with the current factors if the rule reads them), the owners'
projection under a sharded strategy, statistics as rows where they are fewer
than the factor's dimension (`distributed.gram_rows`), and the projection of a
tied weight's transposed use (`Layer.twin`); first it checks that the factors
are in the dtypes the layer computes in (`check_factor_dtypes`).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import torch
from torch import Tensor

from singd_curvlinops.collection_plan import CollectionPlan
from singd_curvlinops.distributed import DistributionStrategy, gram_rows, raw_gram
from singd_curvlinops.layers import Layer
from singd_curvlinops.preconditioner_cache import PreconditionerCache
from singd_curvlinops.rules import FactorRule


def plan_collection(
    layer: Layer,
    group: dict[str, Any],
    state: dict[str, Any],
    *,
    rule: FactorRule,
    distribution: DistributionStrategy,
    records: PreconditionerCache,
) -> CollectionPlan:
    """Return what to collect for a due layer's forward call.

    Args:
        layer: The layer, due at its next step.
        group: Its parameter group.
        state: Its state (`"grad_scale"`, the factors' dtypes checked).
        rule: The factor rule.
        distribution: The distribution strategy (owners' projections, rows).
        records: The optimizer's preconditioner records.

    Returns:
        The plan.

    Raises:
        ValueError: For a layer tied to a transposed use under
            `Shard(factors="owned")` with a rule whose owners do not project
            raw statistics (`raw_gram.projects_raw`); a factor dtype that
            differs from the state's (`check_factor_dtypes`).
    """
    options = layer.options(group)
    project = distribution.projection(layer, rule, options)
    transposed = None
    # owned factors: the twin's raw rows too, if owners project (SINGD, KFAC)
    raw_twin = project is not None and raw_gram.projects_raw(rule)
    if raw_twin and layer.twin is not None:
        twin_options = layer.twin.options(group)
        transposed = distribution.projection(layer.twin, rule, twin_options)
    if project is None:  # the rule's, with the current factors if it reads them
        reads = rule.reads_preconditioner
        record = records(layer, ()) if reads else None
        project = partial(rule.project, record, group=options)
        rows = distribution.keeps_rows(rule)  # owners form them
        if rows and gram_rows.applies(layer, rule, options):
            project = gram_rows.project_to_rows(
                record, project, shared_inputs=rule.per_example
            )
        if layer.twin is not None:
            flipped = None if record is None else record.transposed()
            twin_options = layer.twin.options(group)
            transposed = partial(rule.project, flipped, group=twin_options)
    if layer.twin is not None and transposed is None:
        raise ValueError(
            f"Layer {layer.name!r} is tied to a layer used transposed (an "
            "embedding tied to an output layer), which under "
            "distribute=Shard(factors='owned') only SINGD's and KFAC's rules "
            "support (their owners project each orientation)."
        )
    dtypes = layer.factor_dtypes(group)
    check_factor_dtypes(layer, state, dtypes, rule)
    return CollectionPlan(
        kfac_approx=group["kfac_approx"],
        loss_average=group["loss_average"],
        dtypes=dtypes,
        grad_scale=state["grad_scale"],
        project=project,
        project_transposed=transposed,
        per_example=rule.per_example,
    )


def check_factor_dtypes(
    layer: Layer,
    state: Mapping[str, Any],
    dtypes: tuple[torch.dtype, torch.dtype],
    rule: FactorRule,
) -> None:
    """Raise if a layer's factors are not in the dtypes it computes them in now.

    They follow the weight's dtype unless `preconditioner_dtype` fixes them, so a
    model cast after the optimizer was built (`model.double()`) no longer fits.

    Args:
        layer: The layer.
        state: Its state (a factor this rank does not keep is skipped).
        dtypes: `layer.factor_dtypes(group)`.
        rule: The optimizer's factor rule.

    Raises:
        ValueError: Naming the layer, both dtypes and the remedy.
    """
    for prefix, side in rule.factor_sides:
        stored = next((v for k, v in state.items() if k.startswith(f"{prefix}.")), None)
        if isinstance(stored, Tensor) and stored.dtype != dtypes[side]:
            raise ValueError(
                f"Layer {layer.name!r}: its factor {prefix} is {stored.dtype}, but "
                f"the layer computes in {dtypes[side]} now (its weight is "
                f"{layer.weight.dtype}): was the model cast after the optimizer was "
                "built? Build the optimizer after casting the model (or fix the "
                "factors' dtype with preconditioner_dtype)."
            )
