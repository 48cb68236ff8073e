import torch
from torch import nn

from singd_curvlinops import KFAC, SINGD
from singd_curvlinops.bench.memory import (
    cache_bytes,
    peak_allocated_bytes,
    state_bytes,
)

FLOAT = 4  # bytes


def test_peak_counts_tensors_alive_at_the_same_time():
    def work():
        a = torch.empty(1000, 1000)
        b = torch.empty(500, 500)
        del a
        c = torch.empty(250, 250)
        return b, c

    assert peak_allocated_bytes(work) == FLOAT * (1000 * 1000 + 500 * 500)


def test_peak_ignores_memory_allocated_before_the_call():
    holder = [torch.empty(1000, 1000)]

    def work():
        holder.clear()  # frees 4 MB that the profiler never saw allocated
        return torch.empty(100)

    assert peak_allocated_bytes(work) == FLOAT * 100
    assert peak_allocated_bytes(lambda: None) == 0


def train(optimizer_factory, steps=2):
    model = nn.Sequential(nn.Linear(3, 2))  # K: 3 + 1 (bias), C: 2
    optimizer = optimizer_factory(model)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(8, 3)).square().sum().backward()
        optimizer.step()
    return optimizer


def test_state_of_sgd_is_its_momentum_buffers():
    optimizer = train(lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
    assert state_bytes(optimizer) == FLOAT * (6 + 2)
    assert cache_bytes(optimizer) == 0


def test_state_of_diagonal_singd_is_four_diagonals_and_the_momentum():
    optimizer = train(lambda m: SINGD(m, structures=("diagonal", "diagonal"), T=1))
    # K, m_K (4 entries each), C, m_C (2 each), momentum buffers (6 + 2)
    assert state_bytes(optimizer) == FLOAT * (2 * 4 + 2 * 2 + 6 + 2)


def test_kfac_state_and_cached_inverses():
    optimizer = train(lambda m: KFAC(m, T=1))
    # A (4 x 4), G (2 x 2), momentum buffers; the inverses are the cache
    assert state_bytes(optimizer) == FLOAT * (16 + 4 + 6 + 2)
    assert cache_bytes(optimizer) == FLOAT * (16 + 4)


def test_shared_tensors_are_counted_once():
    optimizer = train(lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
    first, second = optimizer.state.values()
    second["alias"] = first["momentum_buffer"]
    assert state_bytes(optimizer) == FLOAT * (6 + 2)
