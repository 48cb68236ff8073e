"""Small, randomly initialised models of the architectures users train (no downloads).

Each entry builds a model and a fixed synthetic batch, and returns the loss of
the batch (a mean over examples, the `loss_average="batch"` convention).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import Tensor, nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only, never a download

BATCH, SEQUENCE, VOCABULARY, CLASSES = 4, 8, 64, 5

Problem = tuple[nn.Module, Callable[[nn.Module], Tensor]]


def _images(channels: int = 3, size: int = 32, batch: int = 8) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(batch, channels, size, size, generator=generator)
    return X, torch.randint(0, CLASSES, (batch,), generator=generator)


def _tokens() -> Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(1, VOCABULARY, (BATCH, SEQUENCE), generator=generator)


def _classifier(model: nn.Module, X: Tensor, y: Tensor) -> Problem:
    return model, lambda net: nn.functional.cross_entropy(net(X), y)


def resnet18() -> Problem:
    from torchvision.models import resnet18

    return _classifier(resnet18(num_classes=CLASSES), *_images())


def mobilenet_v3_small() -> Problem:
    from torchvision.models import mobilenet_v3_small

    return _classifier(mobilenet_v3_small(num_classes=CLASSES), *_images())


def vit_tiny() -> Problem:
    import timm

    model = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=32,
        patch_size=4,
        num_classes=CLASSES,
    )
    return _classifier(model, *_images())


def swin() -> Problem:
    """torchvision's Swin in `swin_t`'s layout at a quarter of its width, with
    windows of 4 (shifted ones on the first stage's 8 x 8 patches). (Swin V2's
    attention is tested in `tests/layers/test_window_attention.py`.)"""
    from torchvision.models.swin_transformer import SwinTransformer

    model = SwinTransformer(
        patch_size=[4, 4],
        embed_dim=24,
        depths=[2, 2, 6, 2],
        num_heads=[3, 6, 12, 24],
        window_size=[4, 4],
        stochastic_depth_prob=0.2,
        num_classes=CLASSES,
    )
    return _classifier(model, *_images())


def convnext_atto() -> Problem:
    import timm

    model = timm.create_model("convnext_atto", pretrained=False, num_classes=CLASSES)
    return _classifier(model, *_images())


class EncoderClassifier(nn.Module):
    """Token embedding, positions, `nn.TransformerEncoder`, mean pooling, read-out."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCABULARY, width, padding_idx=0)
        self.position = nn.Parameter(torch.zeros(SEQUENCE, width))
        layer = nn.TransformerEncoderLayer(
            width, 4, dim_feedforward=64, dropout=0.1, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(width, CLASSES)

    def forward(self, tokens: Tensor) -> Tensor:
        hidden = self.encoder(self.embed(tokens) + self.position)
        return self.head(hidden.mean(1))


def transformer_encoder() -> Problem:
    tokens = _tokens()
    y = torch.randint(0, CLASSES, (BATCH,), generator=torch.Generator().manual_seed(1))
    return _classifier(EncoderClassifier(), tokens, y)


def _causal_lm(model: nn.Module) -> Problem:
    tokens = _tokens()
    return model, lambda net: net(input_ids=tokens, labels=tokens).loss


def llama() -> Problem:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCABULARY,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQUENCE,
    )
    return _causal_lm(LlamaForCausalLM(config))


def gpt2() -> Problem:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCABULARY,
        n_positions=SEQUENCE,
        n_embd=32,
        n_layer=2,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
    )
    return _causal_lm(GPT2LMHeadModel(config))


def bert() -> Problem:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=VOCABULARY,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=SEQUENCE,
        num_labels=CLASSES,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = BertForSequenceClassification(config)
    tokens = _tokens()
    y = torch.randint(0, CLASSES, (BATCH,), generator=torch.Generator().manual_seed(1))
    return model, lambda net: net(input_ids=tokens, labels=y).loss


MODELS: dict[str, Callable[[], Problem]] = {
    "resnet18": resnet18,
    "mobilenet_v3_small": mobilenet_v3_small,
    "vit_tiny": vit_tiny,
    "convnext_atto": convnext_atto,
    "swin": swin,
    "transformer_encoder": transformer_encoder,
    "llama": llama,
    "gpt2": gpt2,
    "bert": bert,
}
