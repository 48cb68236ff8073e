"""Write `legacy_checkpoints.pt`: checkpoints of the optimizer before the redesign.

Run once at commit a43adae (the last commit before the optimizer was split into a
shell, layer adapters and factor rules, issue 12) with
`python tests/optimizer/data/make_legacy_checkpoints.py`. Per configuration the file
holds the model's and the optimizer's `state_dict()` after three steps and the
model's parameters after two more, so that `test_legacy_checkpoint.py` proves that
a checkpoint of that version loads and continues to the same parameters.
"""

import copy
from pathlib import Path

import torch
from torch import Tensor, nn

from singd_curvlinops import KFAC, SINGD

OUT = Path(__file__).with_name("legacy_checkpoints.pt")
# name -> (optimizer class, options, parameter dtype)
CONFIGURATIONS = {
    "singd-dense": (SINGD, {"T": 2, "lr": 0.05, "lr_cov": 0.05}, torch.float64),
    "singd-sparse": (
        SINGD,
        {"T": 2, "lr": 0.05, "structures": ("triltoeplitz", "diagonal")},
        torch.float64,
    ),
    "ikfac-block": (
        SINGD,
        {"kfac_like": True, "structures": ("block3diagonal", "hierarchical2_2")},
        torch.float64,
    ),
    "kfac": (KFAC, {"T": 2, "lr": 0.05, "damping": 0.1}, torch.float64),
    "singd-bf16-f32-factors": (
        SINGD,
        {"T": 1, "preconditioner_dtype": (torch.float32, torch.float32)},
        torch.bfloat16,
    ),
}


def make_model(dtype: torch.dtype) -> nn.Module:
    """Conv2d -> Linear -> Linear, seeded."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(48, 5),
        nn.ReLU(),
        nn.Linear(5, 4),
    ).to(dtype)


def batches(num: int, dtype: torch.dtype) -> list[tuple[Tensor, Tensor]]:
    """Seeded mini-batches of 8 images `[2, 4, 4]` with 4 classes."""
    generator = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(8, 2, 4, 4, generator=generator).to(dtype),
            torch.randint(0, 4, (8,), generator=generator),
        )
        for _ in range(num)
    ]


def train(model: nn.Module, optimizer: torch.optim.Optimizer, data: list) -> None:
    """One step per mini-batch."""
    for X, y in data:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(X).float(), y).backward()
        optimizer.step()


def main() -> None:
    """Write the file."""
    records = {}
    for name, (cls, options, dtype) in CONFIGURATIONS.items():
        model = make_model(dtype)
        optimizer = cls(model, **options)
        data = batches(5, dtype)
        train(model, optimizer, data[:3])
        checkpoint = {
            "model": {k: v.clone() for k, v in model.state_dict().items()},
            "optimizer": copy.deepcopy(optimizer.state_dict()),
        }
        train(model, optimizer, data[3:])
        checkpoint["final"] = {k: v.clone() for k, v in model.state_dict().items()}
        records[name] = checkpoint
    torch.save(records, OUT)


if __name__ == "__main__":
    main()
