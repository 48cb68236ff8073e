"""`all_reduce` averages or sums the stored tensors over two gloo processes."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from singd_curvlinops.structures import get_structure

NAMES = [
    "dense",
    "diagonal",
    "block3diagonal",
    "hierarchical2_2",
    "triltoeplitz",
    "triutopleftdiag",
]
DIM = 7


def rank_matrix(name: str, rank: int):
    generator = torch.Generator().manual_seed(rank)
    X = torch.randn(DIM, 3, generator=generator, dtype=torch.float64)
    return get_structure(name).from_mat_inner(X)


def _worker(rank: int, world_size: int, port: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        for name in NAMES:
            for op in ("avg", "sum"):
                K = rank_matrix(name, rank)
                assert K.all_reduce(op=op) is K
                results[(rank, name, op)] = K.to_dense()
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_all_reduce_two_processes() -> None:
    world_size = 2
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(world_size, free_port(), results), nprocs=world_size)
        results = dict(results)
    for name in NAMES:
        total = sum(rank_matrix(name, rank).to_dense() for rank in range(world_size))
        for rank in range(world_size):
            assert torch.allclose(results[(rank, name, "sum")], total, rtol=1e-14)
            assert torch.allclose(
                results[(rank, name, "avg")], total / world_size, rtol=1e-14
            )
