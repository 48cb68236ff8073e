"""Point-to-point messages stage through the CPU where the backend is gloo.

Gloo's `send`/`recv` take CPU tensors only (a CUDA tensor's address reaches the
socket and fails with "Bad address"); its collectives take CUDA tensors. The
relay of split layers therefore keeps its messages on the CPU where the process
group runs gloo for the weights' device. The CUDA run itself is checked on a GPU
machine (docs/pages/guide/data_parallel.md); here, the decision.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from singd_curvlinops.distributed import relay
from singd_curvlinops.distributed.relay import message_device, sends_on

CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ("cpu:gloo,cuda:gloo", False),  # init_process_group("gloo")
        ("gloo", False),  # one name for every device type
        ("cuda:nccl", True),  # init_process_group("nccl")
        ("cpu:gloo,cuda:nccl", True),  # the mixed backend
        ("cpu:gloo, cuda:NCCL", True),
        ("cpu:gloo", True),  # no backend named for CUDA: not gloo's limit
    ],
)
def test_cuda_tensors_are_sent_where_the_backend_is_not_gloo(
    config: str, expected: bool
) -> None:
    assert sends_on(CUDA, config) is expected


@pytest.mark.parametrize("config", ["cpu:gloo,cuda:gloo", "cuda:nccl", "gloo"])
def test_cpu_tensors_are_always_sent_in_place(config: str) -> None:
    assert sends_on(torch.device("cpu"), config)


@pytest.mark.parametrize(
    ("config", "expected"),
    [("cpu:gloo,meta:gloo", torch.device("cpu")), ("meta:nccl", torch.device("meta"))],
)
def test_a_layers_messages_follow_the_groups_backend(
    monkeypatch: pytest.MonkeyPatch, config: str, expected: torch.device
) -> None:
    """`message_device` reads the process group's backend for the weight's device."""
    monkeypatch.setattr(relay.dist, "get_backend_config", lambda: config)
    layer = SimpleNamespace(weight=torch.empty(3, 4, device="meta"))
    assert message_device(layer) == expected
