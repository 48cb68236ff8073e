"""`optimizer.describe()`: rules, structures, counts and state bytes at a glance."""

from __future__ import annotations

import torch
from torch import nn

from singd_curvlinops import KFAC, SINGD


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(10, 4),
        nn.LayerNorm(4),
        nn.Linear(4, 3),
        nn.Linear(3, 3, bias=False),
    )


def test_rows_counts_and_bytes() -> None:
    model = _model()
    optimizer = SINGD(model, structures=("dense", "diagonal"), kfac_like=True)
    summary = optimizer.describe()
    rows = {row.name: row for row in summary.rows}
    assert set(rows) == {"0", "2", "3", "1.weight", "1.bias"}
    assert rows["0"].structures == "diagonal, diagonal"  # one-hot input side
    assert rows["2"].rule == "IKFAC" and rows["2"].dims == "5 x 3"
    assert rows["1.bias"].rule == "AdamW fallback" and rows["1.bias"].numel == 4
    assert summary.numel == sum(p.numel() for p in model.parameters())
    assert summary.preconditioned_numel == 40 + 15 + 9
    expected = sum(
        t.numel() * t.element_size()
        for state in optimizer.state.values()
        for t in state.values()
        if torch.is_tensor(t)
    )
    assert summary.state_bytes == expected
    # K.mat (5 x 5), C.diag (3), their momenta, momentum buffers (12 + 3), float32
    assert rows["2"].state_bytes == (2 * (25 + 3) + 15) * 4
    text = str(summary)
    assert text.splitlines()[0] == summary.headline()
    assert "SINGD preconditions 88.9% of 72 parameters (3 layers)" in text  # 64 / 72
    assert "AdamW fallback: 2 tensors" in text


def test_kfac_and_tied_layers_are_named() -> None:
    model = _model()
    model[3] = nn.Linear(4, 10, bias=False)
    model[3].weight = model[0].weight
    model = nn.Sequential(*model[:3], nn.Linear(3, 4), model[3])
    summary = KFAC(model).describe()
    rows = {row.name.split(" ")[0]: row for row in summary.rows}
    assert rows["0"].name == "0 (tied: 4)" and rows["0"].rule == "KFAC"


def test_a_tied_layer_named_after_its_biased_use_lists_the_other() -> None:
    """The layer takes its name from the use that adds the bias (here the head)."""
    torch.manual_seed(0)
    embedding, head = nn.Embedding(10, 4), nn.Linear(4, 10)
    head.weight = embedding.weight
    model = nn.Sequential(embedding, nn.Tanh(), head)
    rows = [row.name for row in SINGD(model).describe().rows]
    assert rows == ["2 (tied: 0)"]
