"""Small models of every built-in layer type, with batches of any size (also 0)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch_geometric.nn import GCNConv
from transformers.pytorch_utils import Conv1D


class _Attention(nn.Module):
    """Self-attention and a read-out."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(4, 2, batch_first=batch_first)
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.attention(x, x, x, need_weights=False)[0])


class _Graph(nn.Module):
    """Two graph convolutions."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = GCNConv(3, 5)
        self.conv2 = GCNConv(5, 2)

    def forward(self, x: Tensor, edges: Tensor) -> Tensor:
        return self.conv2(self.conv1(x, edges).relu(), edges)


def _graph(n: int) -> tuple[Tensor, Tensor]:
    edges = torch.randint(0, max(n, 1), (2, 3 * n))
    return torch.randn(n, 3), edges


# name: (model, inputs of a batch of n examples)
CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[int], tuple]]] = {
    "linear-sequence": (
        lambda: nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)),
        lambda n: (torch.randn(n, 5, 3),),
    ),
    "conv2d": (
        lambda: nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Flatten(1)),
        lambda n: (torch.randn(n, 2, 4, 4),),
    ),
    "embedding": (
        lambda: nn.Sequential(nn.Embedding(7, 3), nn.Linear(3, 2)),
        lambda n: (torch.randint(0, 7, (n, 5)),),
    ),
    "attention-batch-first": (
        lambda: _Attention(batch_first=True),
        lambda n: (torch.randn(n, 5, 4),),
    ),
    "attention-sequence-first": (
        lambda: _Attention(batch_first=False),
        lambda n: (torch.randn(5, n, 4),),
    ),
    "hf-conv1d": (
        lambda: nn.Sequential(Conv1D(4, 3), nn.Tanh(), Conv1D(2, 4)),
        lambda n: (torch.randn(n, 5, 3),),
    ),
    "gcn": (_Graph, _graph),
}
