"""Whole models in one optimizer: every trainable parameter trains, no warning.

For each architecture of `zoo` (random initialisation, synthetic batches) and each
optimizer configuration: the first step changes every parameter with
`requires_grad` (none is left out silently), no warning is emitted with the
defaults, and 20 steps on the fixed batch lower the loss.

"dense" is `structures="auto"` with `max_dense_dim=1024`: dense factors up to
dimension 1024, diagonal above (ResNet-18's 2,305- and 4,609-dimensional input
factors would make a dense factor update take seconds on the 2 CI cores; the
models' other factors are all dense).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from singd_curvlinops import EKFAC, KFAC, SINGD
from tests.models.zoo import MODELS

pytestmark = pytest.mark.slow

STEPS = 20
CONFIGURATIONS = {
    "SINGD-dense": (SINGD, {"max_dense_dim": 1024}),
    "SINGD-diagonal": (SINGD, {"structures": ("diagonal", "diagonal")}),
    "IKFAC": (SINGD, {"kfac_like": True, "max_dense_dim": 1024}),
    "KFAC": (KFAC, {"damping": 0.1, "max_dense_dim": 1024}),
    "EKFAC": (EKFAC, {"damping": 0.1, "max_dense_dim": 1024}),
}


@pytest.mark.parametrize("configuration", sorted(CONFIGURATIONS))
@pytest.mark.parametrize("name", list(MODELS))
def test_one_optimizer_trains_the_whole_model(name, configuration) -> None:
    torch.manual_seed(0)
    model, loss_of = MODELS[name]()
    cls, options = CONFIGURATIONS[configuration]
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer = cls(model, lr=1e-3, T=10, **options)
        losses = []
        for step in range(STEPS):
            optimizer.zero_grad()
            loss = loss_of(model)
            loss.backward()
            if step == 0:
                before = {n: p.detach().clone() for n, p in trainable.items()}
            optimizer.step()
            if step == 0:
                unchanged = [
                    n for n, p in trainable.items() if torch.equal(p, before[n])
                ]
                assert not unchanged, f"not trained by the first step: {unchanged}"
            losses.append(loss.item())
    ours = [
        str(w.message)
        for w in caught
        if "singd_curvlinops" in w.filename
        or any(
            word in str(w.message) for word in ("SINGD", "KFAC", "Layer '", "fallback")
        )
    ]
    assert not ours, ours
    covered = {id(p) for layer in optimizer.layers for p in layer.params}
    covered |= {id(p) for p in optimizer.fallback_params}
    assert covered == {id(p) for p in trainable.values()}
    assert losses[-1] < 0.98 * losses[0], losses
