"""One SINGD in the Hugging Face `Trainer`: `optimizers=(SINGD(model, ...), None)`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import transformers
from torch.utils.data import Dataset

from singd_curvlinops import SINGD

pytestmark = pytest.mark.slow
os.environ.setdefault("HF_HUB_OFFLINE", "1")


class Tokens(Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(1, 64, (16, 8), generator=generator)
        self.labels = torch.randint(0, 3, (16,), generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.tokens[index], "labels": self.labels[index]}


def test_hf_trainer_trains_with_one_singd(tmp_path: Path) -> None:
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=8,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    initial = {n: p.clone() for n, p in model.named_parameters()}
    optimizer = SINGD(model, lr=0.01, T=2)
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=12,
        per_device_train_batch_size=8,
        learning_rate=0.01,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        max_grad_norm=1.0,
    )
    trainer = transformers.Trainer(
        model=model,
        args=arguments,
        train_dataset=Tokens(),
        optimizers=(optimizer, None),
    )
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 12
    assert sum(losses[-3:]) < sum(losses[:3])
    for name, param in model.named_parameters():
        assert not torch.equal(param, initial[name]), name
    # the Trainer's linear schedule scales SINGD's and the fallback's lr together
    assert optimizer.param_groups[0]["lr"] == 0.0
    assert optimizer.state[model.classifier.weight]["step"] == 12
