"""Which processes the optimizer talks to: the default process group, all of it.

Every collective of the distribution strategies runs on the default process group
(`torch.distributed.init_process_group`): the statistics of all its processes are
combined as those of one batch. A model whose data parallelism spans fewer
processes — `DistributedDataParallel(..., process_group=subgroup)`, as in an
ensemble of independent replicas or a hybrid of data and model parallelism, or
FSDP2 on a device mesh over part of the processes — would have its statistics
mixed with those of processes that train other replicas or other layers: every
factor wrong, with no error (the shapes agree). `check_data_parallel` turns
that into a `ValueError` when the optimizer is built (the layers keep the
parameters they had then).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel

from singd_curvlinops.distributed.collectives import initialized, world_size


def check_data_parallel(model: Module) -> None:
    """Raise unless the model's data parallelism uses the whole default group.

    Args:
        model: The model handed to the optimizer (possibly wrapped).

    Raises:
        ValueError: If `model` is a `DistributedDataParallel` without a process
            group, or over a group that is not every process in rank order, or
            has a `DTensor` parameter on a mesh that is not (`_check_mesh`).
    """
    if isinstance(model, DistributedDataParallel):
        if not initialized():
            raise ValueError(
                "model is wrapped in DistributedDataParallel, but no "
                "torch.distributed process group is initialised (call "
                "init_process_group first)."
            )
        ranks = dist.get_process_group_ranks(model.process_group)
        if message := _partial(ranks, "model is a DistributedDataParallel"):
            raise ValueError(message)
    meshes: dict[tuple, str] = {}
    for name, parameter in model.named_parameters():
        _check_mesh(name, parameter)
        if isinstance(parameter, DTensor):
            meshes.setdefault(tuple(parameter.device_mesh.mesh.shape), name)
    if len(meshes) > 1:  # (the step's collectives run over one mesh's shards)
        (first, one), (second, other) = list(meshes.items())[:2]
        raise ValueError(
            f"Parameters {one!r} and {other!r} are DTensors on device meshes of "
            f"shapes {first} and {second}: the optimizer combines the shards of "
            "every layer over one mesh, so shard every unit on the same mesh."
        )


def _check_mesh(name: str, tensor: Tensor) -> None:
    """Raise if a `DTensor` lives on a mesh that is not every process in order.

    Args:
        name: The parameter's name, for the message.
        tensor: The parameter (plain tensors pass).

    Raises:
        ValueError: If its device mesh's ranks are not `0, ..., P - 1`.
    """
    if not isinstance(tensor, DTensor):
        return
    ranks = tensor.device_mesh.mesh.flatten().tolist()
    if message := _partial(ranks, f"Parameter {name!r} is a DTensor on a device mesh"):
        raise ValueError(message)


def _partial(ranks: list[int], what: str) -> str | None:
    """Return the error for a group that is not every process in order (or None).

    Args:
        ranks: The global ranks of a process group or mesh, in its order.
        what: The start of the message, naming the group's owner.

    Returns:
        The message naming the processes, or None if `ranks` are `0, ..., P - 1`.
    """
    world = world_size()
    if ranks == list(range(world)):
        return None
    return (
        f"{what} over the processes {ranks}: the optimizer combines statistics "
        "over the default process group, so its data parallelism must span all "
        f"{world} processes in rank order (a subgroup, or a mesh over part of "
        "them, is not supported)."
    )
