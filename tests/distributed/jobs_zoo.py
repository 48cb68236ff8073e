"""What the spawned ranks of `test_zoo_sharding.py` run: zoo models on two ranks.

The language models under DDP and `Shard`; the language models, timm's ViT and
torchvision's Swin under FSDP2 with every Transformer block a unit of its own
(the usual wrapping; the embeddings, the patch embedding and the head are in the
root's unit). Every rank trains on
the zoo's whole fixed batch (the concatenation of equal batches has the same
mean loss and statistics as one of them), so two ranks must end where one
process does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from singd_curvlinops import SINGD
from tests.distributed.harness import params, strategy
from tests.models.zoo import MODELS

# an untied embedding (Llama), one tied to the output layer (GPT-2), BERT's
LANGUAGE_MODELS = ("llama", "gpt2", "bert")
# before 2026-12-04 every layer inside an FSDP2 unit got no statistics
VISION_MODELS = ("vit_tiny", "swin")
STRATEGIES = ("shard", "owned")
# under FSDP2 (their embeddings, and GPT-2's Conv1D layers, are column shards of
# Γ: before 2026-12-04 a ValueError), with both forms of `STRATEGIES` (owned
# factors before 2026-12-05: a ValueError)
FSDP_LANGUAGE_MODELS = ("llama", "gpt2", "bert")
STEPS = 2


def train_language_model(
    name: str, distribute: str, steps: int = STEPS, *, fsdp: bool = False
) -> list[Tensor]:
    """Train a zoo model in float64 (dropout off); one process without a group.

    In a process group the model is wrapped in DDP, or in FSDP2 with a unit per
    block (`fsdp`).
    """
    torch.manual_seed(0)
    model, loss_of = MODELS[name]()
    model = model.double().eval()  # (eval: no dropout, the ranks draw alike)
    net = model
    if torch.distributed.is_initialized():
        net = sharded_by_blocks(model) if fsdp else DistributedDataParallel(model)
    optimizer = SINGD(
        net, lr=0.05, T=1, max_dense_dim=1024, distribute=strategy(distribute)
    )
    for _ in range(steps):
        optimizer.zero_grad()
        loss_of(net).backward()
        optimizer.step()
    return params(model)


def sharded_by_blocks(model: nn.Module) -> nn.Module:
    """Shard every Transformer block as an FSDP2 unit, then the root.

    The blocks: timm's ViT's, torchvision's Swin's, Llama's, GPT-2's and BERT's
    (GPT-2's tied embedding and output layer share the root's unit, as FSDP2
    requires of a shared parameter).
    """
    from timm.models.vision_transformer import Block
    from torchvision.models.swin_transformer import SwinTransformerBlock
    from transformers.models.bert.modeling_bert import BertLayer
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    kinds = (Block, SwinTransformerBlock, BertLayer, GPT2Block, LlamaDecoderLayer)
    for block in [module for module in model.modules() if isinstance(module, kinds)]:
        fully_shard(block)
    return fully_shard(model)


def train_vision_model(name: str, steps: int = STEPS) -> list[Tensor]:
    """Train a zoo vision model in float64 (eval: no dropout or stochastic depth),
    its blocks FSDP2 units in a process group; one process without a group."""
    torch.manual_seed(0)
    model, loss_of = MODELS[name]()
    model = model.double().eval()
    model.register_forward_pre_hook(lambda _, args: tuple(a.double() for a in args))
    net = sharded_by_blocks(model) if torch.distributed.is_initialized() else model
    optimizer = SINGD(net, lr=0.05, T=1)
    for _ in range(steps):
        optimizer.zero_grad()
        loss_of(net).backward()
        optimizer.step()
    return params(model)


def train_w2(results: dict[str, Any], out: Path) -> None:
    for name in LANGUAGE_MODELS:
        for distribute in STRATEGIES:
            results[f"{name}/{distribute}"] = train_language_model(name, distribute)
    for name in FSDP_LANGUAGE_MODELS:
        for distribute in STRATEGIES:
            trained = train_language_model(name, distribute, fsdp=True)
            results[f"{name}/fsdp/{distribute}"] = trained
    for name in VISION_MODELS:
        results[f"{name}/fsdp"] = train_vision_model(name)
