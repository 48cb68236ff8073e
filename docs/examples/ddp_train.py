"""Train a small CNN with SINGD on two CPU processes, its factor work sharded.

Run it from the repository root with

    torchrun --nproc_per_node 2 docs/examples/ddp_train.py

(add `--epochs 1` for a quick check, `--distribute replicate` to have every
process do all factor work, `--distribute owned` to keep each layer's factors on
its owner only, `--fsdp` to shard the model with FSDP2 instead of wrapping it in
DDP, `--hsdp 2` with `--nproc_per_node 4` to shard it with HSDP: two replicas
of two shards). Every process builds the same model, wraps it in
`DistributedDataParallel` and hands the wrapper to `SINGD` with
`distribute="shard"`: each layer's factor updates and preconditioning are done by
one owner process (the costliest layer's two factors by two), and one `all_gather`
per step shares the preconditioned gradients and the updated factors. A
`DistributedSampler` gives each process its own shard of a synthetic image data
set; DDP averages the gradients and SINGD all-reduces its Kronecker statistics once
per factor update, so all processes keep identical parameters and factors. Rank 0
prints which process owns which factors, the bytes SINGD's collectives move, and the
mean training loss of every epoch (over all processes).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from singd_curvlinops import SINGD
from singd_curvlinops.distributed import Shard, bytes_per_step, bytes_per_update

NUM_CLASSES = 4


def synthetic_images(num_examples: int = 512, seed: int = 0) -> TensorDataset:
    """Return noisy 1x12x12 images of one of `NUM_CLASSES` random templates.

    Every process draws the same data set; the sampler shards it.

    Args:
        num_examples: Number of images.
        seed: Seed of the generator.

    Returns:
        A data set of `(image, label)` pairs.
    """
    generator = torch.Generator().manual_seed(seed)
    templates = torch.randn(NUM_CLASSES, 1, 12, 12, generator=generator)
    labels = torch.randint(0, NUM_CLASSES, (num_examples,), generator=generator)
    noise = torch.randn(num_examples, 1, 12, 12, generator=generator)
    return TensorDataset(templates[labels] + 1.5 * noise, labels)


def small_cnn() -> nn.Module:
    """Return a two-convolution network (same initial weights on every rank).

    Returns:
        The model.
    """
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 3 * 3, NUM_CLASSES),
    )


def sharded(model: nn.Module, replicas: int = 1) -> nn.Module:
    """Shard the model with FSDP2: each convolution and linear layer, then the root.

    Args:
        model: The model.
        replicas: With more than one, HSDP: a 2-d mesh of `replicas` replicas,
            each sharded over `world_size / replicas` processes.

    Returns:
        It, sharded in place.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = None  # (FSDP2's default: a 1-d mesh over every process)
    if replicas > 1:
        shape = (replicas, dist.get_world_size() // replicas)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    for module in model:
        if isinstance(module, nn.Conv2d | nn.Linear):
            fully_shard(module, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def describe(optimizer: SINGD, model: nn.Module) -> None:
    """Print who owns which factors and the bytes of the collectives (rank 0).

    Args:
        optimizer: The optimizer.
        model: The wrapped model.
    """
    world_size, strategy = dist.get_world_size(), optimizer.distribution
    if isinstance(strategy, Shard):
        plan = strategy.assignments(
            optimizer.layers, optimizer.param_groups, optimizer.rule, world_size
        )
        for layer, assignment in plan.items():
            print(
                f"layer {layer.name}: K on rank {assignment.owners[0]}, "
                f"C on rank {assignment.owners[1]}"
            )
    update = bytes_per_step(optimizer, update=True)
    other = bytes_per_step(optimizer, update=False)
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(
        f"{world_size} processes, distribute={strategy!r}; SINGD's "
        f"statistics: bytes per update step: {bytes_per_update(optimizer)} (every "
        f"T={optimizer.defaults['T']} steps); all_gather: {update['gather']} bytes "
        f"on update steps, {other['gather']} on the others; FSDP2's blocks to and "
        f"from owners: {other['blocks']} bytes every step; the gradients: "
        f"{gradient_bytes} bytes every step (DDP's all-reduce or FSDP2's "
        "reduce-scatter)"
    )


def main() -> None:
    """Parse the arguments, train, and print the losses on rank 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument(
        "--distribute", choices=("shard", "replicate", "owned"), default="shard"
    )
    parser.add_argument("--fsdp", action="store_true", help="shard with FSDP2")
    parser.add_argument(
        "--hsdp", type=int, default=1, metavar="REPLICAS", help="shard with HSDP"
    )
    args = parser.parse_args()
    distribute = {"owned": Shard(factors="owned")}.get(args.distribute, args.distribute)

    dist.init_process_group("gloo")  # torchrun sets rank, world size and address
    rank, world_size = dist.get_rank(), dist.get_world_size()

    data = synthetic_images()
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)

    if args.fsdp or args.hsdp > 1:
        model = sharded(small_cnn(), args.hsdp)
    else:
        model = DistributedDataParallel(small_cnn())
    optimizer = SINGD(
        model,
        lr=0.05,
        momentum=0.9,
        lr_cov=0.05,
        T=5,
        structures=("dense", "diagonal"),
        distribute=distribute,
    )
    loss_function = nn.CrossEntropyLoss()

    if rank == 0:
        describe(optimizer, model)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle, the same on every rank
        totals = torch.zeros(2, dtype=torch.float64)  # loss sum, examples
        for X, y in loader:
            optimizer.zero_grad()
            loss = loss_function(model(X), y)
            loss.backward()
            optimizer.step()
            totals += torch.tensor([loss.item() * len(y), len(y)])
        dist.all_reduce(totals)
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: loss {totals[0] / totals[1]:.4f}")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
