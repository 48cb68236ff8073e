"""One SINGD in PyTorch Lightning's automatic optimisation.

`configure_optimizers` returns `SINGD(self, ...)`; Lightning calls
`optimizer.step(closure)` every second batch (`accumulate_grad_batches=2`), clips
the gradients in the closure (`gradient_clip_val`), runs in `bf16-mixed`
precision, and resumes from a `ModelCheckpoint` with the losses of an
uninterrupted run.
"""

from __future__ import annotations

import logging
from pathlib import Path

import lightning.pytorch as lightning
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from singd_curvlinops import SINGD

pytestmark = pytest.mark.slow
VOCABULARY, WIDTH, SEQUENCE = 20, 8, 5


class TokenClassifier(lightning.LightningModule):
    """Embedding, self-attention, LayerNorm (the fallback) and a read-out."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCABULARY, WIDTH)
        self.attention = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, 3)
        self.losses: list[float] = []

    def forward(self, tokens):
        h = self.embed(tokens)
        h = self.norm(h + self.attention(h, h, h, need_weights=False)[0])
        return self.head(h.mean(1))

    def training_step(self, batch, index):
        tokens, y = batch
        loss = nn.functional.cross_entropy(self(tokens).float(), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return SINGD(self, lr=0.05, T=2, structures=("dense", "diagonal"))


def _loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCABULARY, (32, SEQUENCE), generator=generator)
    y = torch.randint(0, 3, (32,), generator=generator)
    return DataLoader(TensorDataset(tokens, y), batch_size=4)


def _trainer(tmp_path: Path, epochs: int, checkpoint: ModelCheckpoint | None = None):
    return lightning.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        precision="bf16-mixed",
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=checkpoint is not None,
        callbacks=[checkpoint] if checkpoint is not None else [],
        default_root_dir=tmp_path,
    )


def test_lightning_trains_and_resumes_with_the_same_losses(tmp_path: Path) -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    full = TokenClassifier()
    initial = {n: p.clone() for n, p in full.named_parameters()}
    _trainer(tmp_path / "full", 4).fit(full, _loader())
    assert len(full.losses) == 4 * 8
    assert sum(full.losses[-8:]) < sum(full.losses[:8])
    for name, param in full.named_parameters():
        assert not torch.equal(param, initial[name]), name
    optimizer = full.trainer.optimizers[0]
    assert isinstance(optimizer, SINGD) and optimizer.fallback_params
    assert optimizer.state[full.head.weight]["step"] == 4 * 8 // 2

    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    first = TokenClassifier()
    _trainer(tmp_path / "first", 2, checkpoint).fit(first, _loader())
    resumed = TokenClassifier()
    _trainer(tmp_path / "resumed", 4).fit(
        resumed, _loader(), ckpt_path=tmp_path / "ckpt" / "last.ckpt"
    )
    assert first.losses == full.losses[:16]
    assert resumed.losses == full.losses[16:]
    for p, q in zip(resumed.parameters(), full.parameters(), strict=True):
        assert torch.equal(p, q)


class _Recording(TokenClassifier):
    """Keeps every optimizer that Lightning asks for (as a notebook's history would)."""

    def __init__(self) -> None:
        super().__init__()
        self.built: list[SINGD] = []

    def configure_optimizers(self):
        self.built.append(super().configure_optimizers())
        return self.built[-1]


def _hook_count(model: torch.nn.Module) -> int:
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()
    )


def test_lr_find_then_fit_leaves_one_optimizer_collecting(tmp_path: Path) -> None:
    """`Tuner.lr_find` builds an optimizer, `fit` another on the same model: the
    later one takes the hooks over, the earlier one collects nothing more."""
    from lightning.pytorch.tuner import Tuner

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    model = _Recording()
    finder = Tuner(_trainer(tmp_path, 1)).lr_find(
        model, train_dataloaders=_loader(), num_training=6, update_attr=False
    )
    assert finder is not None and len(finder.results["lr"]) > 0
    after_lr_find = _hook_count(model)
    assert after_lr_find == 4  # one optimizer: forward hooks + attention's pre-hook
    model.losses.clear()
    _trainer(tmp_path / "fit", 1).fit(model, _loader())
    assert len(model.built) == 2 and _hook_count(model) == after_lr_find
    tuned, fitted = model.built
    assert not tuned._collector.pending  # collected nothing during fit
    assert fitted.state[model.head.weight]["step"] == 8 // 2
    assert all(torch.isfinite(torch.tensor(model.losses)))
    with pytest.raises(RuntimeError, match="took over layer"):
        tuned.step()
