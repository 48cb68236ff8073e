"""Learning-rate grafting: each layer's step has the norm of the grafted optimizer's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from singd_curvlinops import KFAC, SINGD


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _step(model, optimizer, seed):
    generator = torch.Generator().manual_seed(seed)
    X = torch.randn(8, 4, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (8,), generator=generator)
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(X), y).backward()
    grads = {id(p): p.grad.clone() for p in model.parameters()}
    before = {id(p): p.clone() for p in model.parameters()}
    optimizer.step()
    return grads, before


def _layer_matrix(layer, tensors):
    return layer.to_matrix([tensors[id(p)] for p in layer.params])


@pytest.mark.parametrize("start", [1, 3], ids=["from-the-start", "switched-on"])
@pytest.mark.parametrize("graft", ["sgd", "adamw"])
@pytest.mark.parametrize("cls", [SINGD, KFAC])
def test_each_layer_step_has_the_grafted_norm(cls, graft, start) -> None:
    """Switched on later, AdamW grafting counts its own steps (before: the layer's).

    Its bias correction then used the layer's step count: up to 42% off here, and
    `sqrt(10)` times the norm long after a start past step 1000.
    """
    model = _model()
    lr, betas, eps = 0.05, (0.9, 0.99), 1e-8
    optimizer = cls(
        model,
        lr=lr,
        momentum=0.0,
        T=1,
        graft=graft if start == 1 else None,
        fallback_betas=betas,
        fallback_eps=eps,
    )
    for step in range(1, start):
        _step(model, optimizer, step + 100)
    optimizer.param_groups[0]["graft"] = graft
    moments = {}
    for step in range(1, 4):
        grads, before = _step(model, optimizer, step)
        for layer in optimizer.layers:
            G = _layer_matrix(layer, grads)
            if graft == "sgd":
                target = torch.linalg.vector_norm(G)
            else:  # AdamW's bias-corrected direction, kept here independently
                m, v = moments.get(
                    layer.name, (torch.zeros_like(G), torch.zeros_like(G))
                )
                m, v = (
                    betas[0] * m + (1 - betas[0]) * G,
                    betas[1] * v + (1 - betas[1]) * G**2,
                )
                moments[layer.name] = (m, v)
                direction = (m / (1 - betas[0] ** step)) / (
                    (v / (1 - betas[1] ** step)).sqrt() + eps
                )
                target = torch.linalg.vector_norm(direction)
            change = _layer_matrix(
                layer, {id(p): before[id(p)] - p for p in layer.params}
            )
            torch.testing.assert_close(
                torch.linalg.vector_norm(change), lr * target, rtol=1e-10, atol=0
            )


def test_grafting_keeps_the_direction() -> None:
    """The grafted step is a positive multiple of the ungrafted one, per layer."""
    model, twin = _model(), _model()
    grafted = SINGD(model, lr=0.05, momentum=0.0, T=1, graft="sgd")
    plain = SINGD(twin, lr=0.05, momentum=0.0, T=1)
    _, before = _step(model, grafted, 0)
    _step(twin, plain, 0)
    for layer, twin_layer in zip(grafted.layers, plain.layers, strict=True):
        a = _layer_matrix(layer, {id(p): before[id(p)] - p for p in layer.params})
        start = dict(
            zip(
                (id(p) for p in twin_layer.params),
                (before[id(p)] for p in layer.params),
                strict=True,
            )
        )
        b = _layer_matrix(
            twin_layer, {id(p): start[id(p)] - p for p in twin_layer.params}
        )
        cosine = (a * b).sum() / (a.norm() * b.norm())
        torch.testing.assert_close(cosine, torch.tensor(1.0, dtype=cosine.dtype))
