"""The benchmark's models, their fixed mini-batches, and one training step.

Every workload is seeded, runs in float32 on the CPU, and is trained with the mean
cross-entropy over all its targets. `vit` and `gpt` are whole models: besides
their Kronecker layers they hold parameters that the fallback rule trains (norms,
positional embeddings, the class token); `vit` needs `timm`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

MODELS = ("mlp", "cnn", "seq", "vit", "gpt")


@dataclass
class Workload:
    """A model with its fixed mini-batch.

    Attributes:
        name: One of `MODELS`.
        model: The network (float32, seeded initial weights).
        inputs: The mini-batch's inputs.
        targets: The class labels, one per example (and token for `"seq"`).
        loss_average: SINGD's `loss_average` that matches the mean loss.
    """

    name: str
    model: nn.Module
    inputs: Tensor
    targets: Tensor
    loss_average: str


def build_workload(name: str, seed: int = 0) -> Workload:
    """Build a model and a fixed mini-batch with seeded weights and data.

    Args:
        name: `"mlp"` (784-512-512-10, batch 128), `"cnn"` (three 3x3 convolutions
            with stride 2 on 3x32x32 images, 3-16-32-64 channels, then a linear
            layer 1024-10, batch 64), `"seq"` (per-token MLP 256-256-256-10 on
            `[16, 64, 256]` tokens), `"vit"` (timm's `vit_tiny_patch16_224` at
            `img_size=32`, `patch_size=4`, 10 classes, batch 32) or `"gpt"`
            (`CausalTransformer`: 2 pre-norm blocks of width 128, 4 heads,
            vocabulary 512, tied embedding, next-token loss on `[16, 64]` tokens).
        seed: Seed of the weights and the data.

    Returns:
        The workload.

    Raises:
        ValueError: If `name` is unknown.
    """
    torch.manual_seed(seed)
    if name == "mlp":
        model = nn.Sequential(
            nn.Linear(784, 512),
            nn.ReLU(),
            nn.Linear(512, 512),
            nn.ReLU(),
            nn.Linear(512, 10),
        )
        inputs, targets = torch.randn(128, 784), torch.randint(10, (128,))
        return Workload(name, model, inputs, targets, "batch")
    if name == "cnn":
        # Stride 2 throughout keeps the linear layer's K at 1025 (stride 1 in the
        # first layer makes it 4097: seconds per dense factor update on a CPU).
        model = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(64 * 4 * 4, 10),
        )
        inputs, targets = torch.randn(64, 3, 32, 32), torch.randint(10, (64,))
        return Workload(name, model, inputs, targets, "batch")
    if name == "seq":
        model = nn.Sequential(
            nn.Linear(256, 256),
            nn.ReLU(),
            nn.Linear(256, 256),
            nn.ReLU(),
            nn.Linear(256, 10),
        )
        inputs, targets = torch.randn(16, 64, 256), torch.randint(10, (16, 64))
        return Workload(name, model, inputs, targets, "batch+sequence")
    if name in ("vit", "gpt"):
        return _whole_model_workload(name)
    raise ValueError(f"Unknown model {name!r}; choose from {', '.join(MODELS)}.")


def _whole_model_workload(name: str) -> Workload:
    """Build the `vit` or `gpt` workload (seeded by the caller).

    Args:
        name: `"vit"` or `"gpt"`.

    Returns:
        The workload.
    """
    if name == "vit":
        model = _vit()
        inputs, targets = torch.randn(32, 3, 32, 32), torch.randint(10, (32,))
        return Workload(name, model, inputs, targets, "batch")
    model = CausalTransformer()
    tokens = torch.randint(model.vocabulary, (16, 65))
    return Workload(name, model, tokens[:, :-1], tokens[:, 1:], "batch+sequence")


def _vit() -> nn.Module:
    """Return timm's ViT-Tiny for 32x32 images (patches of 4x4, 10 classes).

    Returns:
        The model, randomly initialised.

    Raises:
        ImportError: If timm is not installed.
    """
    try:
        import timm
    except ImportError as error:
        raise ImportError("The vit workload needs timm: pip install timm.") from error
    return timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=32,
        patch_size=4,
        num_classes=10,
    )


class CausalTransformer(nn.Module):
    """A small GPT: token and position embeddings, pre-norm blocks, tied read-out.

    Args:
        vocabulary: Number of tokens.
        width: Model width.
        layers: Number of blocks (`nn.TransformerEncoderLayer` with a causal mask).
        heads: Attention heads.
        length: Longest sequence.
    """

    def __init__(
        self,
        vocabulary: int = 512,
        width: int = 128,
        layers: int = 2,
        heads: int = 4,
        length: int = 64,
    ) -> None:
        super().__init__()
        self.vocabulary = vocabulary
        self.embed = nn.Embedding(vocabulary, width)
        self.position = nn.Parameter(torch.zeros(length, width))
        nn.init.normal_(self.position, std=0.02)
        block = nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocabulary, bias=False)
        self.head.weight = self.embed.weight  # tied, as in GPT-2

    def forward(self, tokens: Tensor) -> Tensor:
        """Return next-token logits.

        Args:
            tokens: `[batch, length]`.

        Returns:
            `[batch, length, vocabulary]`.
        """
        length = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(length)
        hidden = self.embed(tokens) + self.position[:length]
        hidden = self.blocks(hidden, mask=mask, is_causal=True)
        return self.head(self.norm(hidden))


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, inputs: Tensor, targets: Tensor
) -> Tensor:
    """Run one training step: zero_grad, forward, backward, step.

    Args:
        model: The network.
        optimizer: Its optimizer.
        inputs: The mini-batch's inputs.
        targets: Class labels; the loss is the mean cross-entropy over all of them.

    Returns:
        The loss (detached).
    """
    optimizer.zero_grad(set_to_none=True)
    logits = model(inputs)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    optimizer.step()
    return loss.detach()


def evaluate_loss(model: nn.Module, inputs: Tensor, targets: Tensor) -> float:
    """Return the mean cross-entropy on the batch without gradients (no hooks fire).

    Args:
        model: The network.
        inputs: The mini-batch's inputs.
        targets: Class labels.

    Returns:
        The loss.
    """
    with torch.no_grad():
        logits = model(inputs)
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        ).item()
