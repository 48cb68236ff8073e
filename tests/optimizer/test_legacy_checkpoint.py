"""A checkpoint written before the optimizer redesign (issue 12) loads and continues.

`data/legacy_checkpoints.pt` was written by `data/make_legacy_checkpoints.py` at
commit a43adae; loading it into today's optimizer and taking the same two steps
must give the parameters that version reached.
"""

from pathlib import Path

import pytest
import torch

from tests.optimizer.data.make_legacy_checkpoints import (
    CONFIGURATIONS,
    batches,
    make_model,
    train,
)

FILE = Path(__file__).parent / "data" / "legacy_checkpoints.pt"


@pytest.fixture(scope="module")
def records() -> dict:
    return torch.load(FILE, weights_only=True)


@pytest.mark.parametrize("name", sorted(CONFIGURATIONS))
def test_legacy_checkpoint_continues_identically(name: str, records: dict) -> None:
    cls, options, dtype = CONFIGURATIONS[name]
    record = records[name]
    model = make_model(dtype)
    optimizer = cls(model, **options)
    model.load_state_dict(record["model"])
    optimizer.load_state_dict(record["optimizer"])
    train(model, optimizer, batches(5, dtype)[3:])
    for key, expected in record["final"].items():
        torch.testing.assert_close(
            model.state_dict()[key], expected, rtol=0, atol=1e-12, msg=key
        )
