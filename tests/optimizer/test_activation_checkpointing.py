"""Activation checkpointing: the optimizers take the same steps as without it.

`torch.utils.checkpoint` runs a block's forward pass again in the backward pass.
Non-reentrant checkpointing (PyTorch's default, Hugging Face's
`gradient_checkpointing_kwargs={"use_reentrant": False}`) keeps the first pass's
graph, so the statistics come from it and the recomputation's uses receive no
gradient; reentrant checkpointing runs the first pass without gradients (nothing
is collected) and the recomputation in a backward pass of its own, which computes
the parameters' gradients and so collects. Either way each layer gets the rows of
one pass, as without checkpointing, and the recomputation replays dropout.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from singd_curvlinops import EKFAC, KFAC, SINGD
from tests.models import zoo


class Blocks(nn.Module):
    """Two Transformer layers with dropout and an MLP, each optionally checkpointed."""

    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.reentrant = reentrant  # None: no checkpointing
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1, batch_first=True)
            for _ in range(2)
        )
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in [*self.blocks, self.mlp]:
            if self.reentrant is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(x.mean(1))


def _train(reentrant: bool | None, optimizer_class: type) -> list[torch.Tensor]:
    model = Blocks(reentrant).double()
    optimizer = optimizer_class(model, lr=0.05, T=1)
    generator = torch.Generator().manual_seed(1)
    torch.manual_seed(3)  # the dropout masks
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(4):
            # (reentrant checkpointing needs an input that requires gradients)
            X = torch.randn(4, 5, 8, generator=generator, dtype=torch.float64)
            y = torch.randint(0, 3, (4,), generator=generator)
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(X.requires_grad_()), y)
            loss.backward()
            optimizer.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("optimizer_class", [SINGD, KFAC, EKFAC])
@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_blocks_take_the_steps_of_the_plain_model(
    reentrant: bool, optimizer_class: type
) -> None:
    plain = _train(None, optimizer_class)
    checkpointed = _train(reentrant, optimizer_class)
    assert any(
        not torch.equal(p, q)
        for p, q in zip(plain, Blocks(None).double().parameters(), strict=True)
    )
    for p, q in zip(checkpointed, plain, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-12)


def _train_gpt2(reentrant: bool | None) -> tuple[list[torch.Tensor], int]:
    """Three SINGD steps of the zoo's GPT-2 (None: no checkpointing).

    Returns the parameters and how often the first block's first MLP layer ran.
    """
    torch.manual_seed(0)
    model, loss = zoo.gpt2()
    model.double().train()
    if reentrant is not None and hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": reentrant}
        )
    elif reentrant is not None:  # (transformers before its activation_* names)
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": reentrant}
        )
    calls = []
    # (Hugging Face checkpoints a block's `forward`: its children run again)
    model.transformer.h[0].mlp.c_fc.register_forward_hook(lambda *_: calls.append(1))
    optimizer = SINGD(model, lr=0.01, T=1)
    torch.manual_seed(5)  # the dropout masks
    for _ in range(3):
        optimizer.zero_grad()
        loss(model).backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()], len(calls)


@pytest.mark.parametrize("reentrant", [False, True])
def test_hugging_face_gradient_checkpointing_takes_the_same_steps(
    reentrant: bool,
) -> None:
    plain, plain_calls = _train_gpt2(None)
    checkpointed, calls = _train_gpt2(reentrant)
    assert (plain_calls, calls) == (3, 6)  # it runs again in each backward pass
    for p, q in zip(checkpointed, plain, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-12)
