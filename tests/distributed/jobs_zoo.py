"""What the spawned ranks of `test_zoo_sharding.py` run: the zoo's language models.

Every rank trains on the zoo's whole fixed batch (the concatenation of equal
batches has the same mean loss and statistics as one of them), so two ranks
must end where one process does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from singd_curvlinops import SINGD
from tests.distributed.harness import params, strategy
from tests.models.zoo import MODELS

# an untied embedding (Llama), one tied to the output layer (GPT-2), BERT's
LANGUAGE_MODELS = ("llama", "gpt2", "bert")
STRATEGIES = ("shard", "owned")
STEPS = 2


def train_language_model(
    name: str, distribute: str, steps: int = STEPS
) -> list[Tensor]:
    """Train a zoo model in float64 (dropout off); one process without a group."""
    torch.manual_seed(0)
    model, loss_of = MODELS[name]()
    model = model.double().eval()  # (eval: no dropout, the ranks draw alike)
    net = (
        DistributedDataParallel(model) if torch.distributed.is_initialized() else model
    )
    optimizer = SINGD(
        net, lr=0.05, T=1, max_dense_dim=1024, distribute=strategy(distribute)
    )
    for _ in range(steps):
        optimizer.zero_grad()
        loss_of(net).backward()
        optimizer.step()
    return params(model)


def train_w2(results: dict[str, Any], out: Path) -> None:
    for name in LANGUAGE_MODELS:
        for distribute in STRATEGIES:
            results[f"{name}/{distribute}"] = train_language_model(name, distribute)
