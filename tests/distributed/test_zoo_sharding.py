"""Zoo models on two gloo ranks equal one process.

The language models under `Shard`: Llama's untied embedding and GPT-2's and
BERT's embeddings tied to their output layers, in every sharded form: under
`Shard(factors="owned")` an embedding's one-hot side keeps only its diagonal and
the owner projects each orientation of a tied weight (before 2026-12-02 Llama
failed in the backward pass and GPT-2 raised a `ValueError` there). timm's ViT
and torchvision's Swin under FSDP2 with a unit per block (before 2026-12-04 the
layers inside the units, and those in the root's, got no statistics), and the
language models so, with factors replicated and owned (before 2026-12-04 their
embeddings and GPT-2's `Conv1D` layers, FSDP2's column shards of `Γ`, raised a
`ValueError`; owned factors under FSDP2 did before 2026-12-05).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed.harness import spawn
from tests.distributed.jobs_zoo import (
    FSDP_LANGUAGE_MODELS,
    LANGUAGE_MODELS,
    STRATEGIES,
    VISION_MODELS,
    train_language_model,
    train_vision_model,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def w2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    directory = tmp_path_factory.mktemp("zoo")
    return spawn("tests.distributed.jobs_zoo:train_w2", 2, directory, timeout=60.0)


@pytest.mark.parametrize("distribute", STRATEGIES)
@pytest.mark.parametrize("name", LANGUAGE_MODELS)
def test_two_ranks_equal_one_process(
    w2: list[dict[str, Any]], name: str, distribute: str
) -> None:
    expected = train_language_model(name, "replicate")
    initial = train_language_model(name, "replicate", steps=0)
    for result in w2:
        actual = result[f"{name}/{distribute}"]
        assert len(actual) == len(expected) == len(initial)
        for p, q in zip(actual, expected, strict=True):
            assert (p - q).abs().max() <= 1e-10 * max(1.0, q.abs().max().item())
    moved = [(q - p).abs().max().item() for p, q in zip(initial, expected, strict=True)]
    assert min(moved) > 0 and max(moved) > 1e-3  # every parameter trains


@pytest.mark.parametrize(
    "name",
    list(VISION_MODELS)
    + [f"{name}/{form}" for name in FSDP_LANGUAGE_MODELS for form in STRATEGIES],
)
def test_fsdp2_blocks_equal_one_process(w2: list[dict[str, Any]], name: str) -> None:
    model = name.split("/")[0]
    if model in FSDP_LANGUAGE_MODELS:
        expected = train_language_model(model, "replicate")
        initial = train_language_model(model, "replicate", steps=0)
    else:
        expected, initial = train_vision_model(name), train_vision_model(name, steps=0)
    for result in w2:
        actual = result[f"{model}/fsdp" + name.removeprefix(model)]
        assert len(actual) == len(expected) == len(initial)
        for p, q in zip(actual, expected, strict=True):
            assert (p - q).abs().max() <= 1e-10 * max(1.0, q.abs().max().item())
    moved = [(q - p).abs().max().item() for p, q in zip(initial, expected, strict=True)]
    assert max(moved) > 1e-3
