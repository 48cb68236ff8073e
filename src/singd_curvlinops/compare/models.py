r"""The comparison's networks: every parameter is in a preconditioned layer.

SINGD, IKFAC and KFAC precondition `Linear`, `Conv2d` and `GCNConv` layers. The
transformers here are written with these layers only, so that every optimizer of
the comparison trains the same parameters with its own rule, and no second
optimizer for left-over parameters (embeddings, layer-norm gains) blurs the
comparison:

- layer normalisation without a learned gain and bias (`elementwise_affine=False`);
- fixed sinusoidal position codes instead of learned position embeddings;
- the token embedding of the language model as a bias-free `Linear` on one-hot
  codes (the same function as `nn.Embedding`, with a preconditioned weight);
- classification from the mean over the ViT's tokens instead of a class token.

Attention is `torch.nn.functional.scaled_dot_product_attention` on the output of
one `Linear` for queries, keys and values.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F


def sinusoidal_codes(positions: int, dim: int) -> Tensor:
    r"""Return the sinusoidal position codes of Vaswani et al. (2017).

    Args:
        positions: Number of positions.
        dim: Code dimension (even).

    Returns:
        `[positions, dim]`: \(\sin(p \omega_k)\) in even and \(\cos(p \omega_k)\) in
        odd columns, \(\omega_k = 10000^{-2k/d}\).
    """
    position = torch.arange(positions, dtype=torch.float32)[:, None]
    frequency = torch.exp(torch.arange(0, dim, 2) * (-math.log(10000.0) / dim))
    codes = torch.zeros(positions, dim)
    codes[:, 0::2] = torch.sin(position * frequency)
    codes[:, 1::2] = torch.cos(position * frequency)
    return codes


class Block(nn.Module):
    """A pre-norm transformer block: attention and a GELU MLP, both residual.

    Args:
        dim: Token dimension.
        heads: Attention heads (dividing `dim`).
        hidden: Width of the MLP.
        causal: Mask attention to earlier positions.
    """

    def __init__(self, dim: int, heads: int, hidden: int, causal: bool) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the block.

        Args:
            x: Tokens `[batch, length, dim]`.

        Returns:
            Tokens of the same shape.
        """
        batch, length, dim = x.shape
        qkv = self.qkv(F.layer_norm(x, (dim,)))
        # "b l (three h d) -> three b h l d"
        q, k, v = qkv.view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.out(attention.transpose(1, 2).reshape(batch, length, dim))
        return x + self.down(F.gelu(self.up(F.layer_norm(x, (dim,)))))


class VisionTransformer(nn.Module):
    """A small ViT for 8×8 images: 2×2 patches, mean pooling, a linear head.

    Args:
        dim: Token dimension.
        depth: Number of blocks.
        heads: Attention heads.
        classes: Number of classes.
        patch: Patch side length.
        image: Image side length.
    """

    def __init__(
        self,
        dim: int = 32,
        depth: int = 2,
        heads: int = 4,
        classes: int = 10,
        patch: int = 2,
        image: int = 8,
    ) -> None:
        super().__init__()
        self.patch = patch
        self.embed = nn.Linear(patch * patch, dim)
        self.register_buffer("codes", sinusoidal_codes((image // patch) ** 2, dim))
        self.blocks = nn.Sequential(
            *(Block(dim, heads, 2 * dim, causal=False) for _ in range(depth))
        )
        self.head = nn.Linear(dim, classes)

    def forward(self, images: Tensor) -> Tensor:
        """Classify images.

        Args:
            images: `[batch, 1, image, image]`.

        Returns:
            Logits `[batch, classes]`.
        """
        p = self.patch
        # "b 1 (h p1) (w p2) -> b (h w) (p1 p2)"
        patches = F.unfold(images, kernel_size=p, stride=p).transpose(1, 2)
        tokens = self.blocks(self.embed(patches) + self.codes)
        return self.head(F.layer_norm(tokens, tokens.shape[-1:]).mean(1))


class CharTransformer(nn.Module):
    """A causal character-level transformer language model.

    Args:
        vocabulary: Number of symbols.
        context: Longest input sequence.
        dim: Token dimension.
        depth: Number of blocks.
        heads: Attention heads.
    """

    def __init__(
        self,
        vocabulary: int,
        context: int = 64,
        dim: int = 64,
        depth: int = 2,
        heads: int = 4,
    ) -> None:
        super().__init__()
        self.vocabulary = vocabulary
        self.embed = nn.Linear(vocabulary, dim, bias=False)  # on one-hot codes
        self.register_buffer("codes", sinusoidal_codes(context, dim))
        self.blocks = nn.Sequential(
            *(Block(dim, heads, 2 * dim, causal=True) for _ in range(depth))
        )
        self.head = nn.Linear(dim, vocabulary)

    def forward(self, tokens: Tensor) -> Tensor:
        """Predict the next symbol at every position.

        Args:
            tokens: Symbol codes `[batch, length]`, `length <= context`.

        Returns:
            Logits `[batch, length, vocabulary]`.
        """
        one_hot = F.one_hot(tokens, self.vocabulary).to(self.embed.weight.dtype)
        x = self.embed(one_hot) + self.codes[: tokens.shape[1]]
        x = self.blocks(x)
        return self.head(F.layer_norm(x, x.shape[-1:]))


class GCN(nn.Module):
    """Two graph convolutions (`torch_geometric.nn.GCNConv`) with a ReLU between.

    Args:
        features: Input feature dimension.
        hidden: Hidden dimension.
        classes: Number of classes.
    """

    def __init__(self, features: int, hidden: int, classes: int) -> None:
        super().__init__()
        from torch_geometric.nn import GCNConv

        self.conv1 = GCNConv(features, hidden, cached=True)
        self.conv2 = GCNConv(hidden, classes, cached=True)

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        """Return the class scores of every node.

        Args:
            x: Node features `[nodes, features]`.
            edge_index: Edges `[2, edges]`.

        Returns:
            Scores `[nodes, classes]`.
        """
        return self.conv2(self.conv1(x, edge_index).relu(), edge_index)


def mlp(sizes: tuple[int, ...]) -> nn.Sequential:
    """Return a tanh MLP with the given layer sizes.

    Args:
        sizes: `(inputs, hidden..., outputs)`.

    Returns:
        Linear layers with tanh in between.
    """
    layers: list[nn.Module] = []
    for d_in, d_out in zip(sizes[:-1], sizes[1:], strict=True):
        layers += [nn.Linear(d_in, d_out), nn.Tanh()]
    return nn.Sequential(*layers[:-1])
