"""A factor rule written from scratch drives the optimizer shell (the extension point).

The life cycle page names "another factor update: a `FactorRule` subclass, a front
door passing `rule=` to the shell". This test writes one that none of the built-in
rules resembles: diagonal factors \\(A\\), \\(G\\) (exponential averages of the
statistics' diagonals) and the preconditioned gradient
\\((G + \\lambda)^{-1/4}\\, \\Gamma\\, (A + \\lambda)^{-1/4}\\), a diagonal
Shampoo. The shell must hand it the statistics that KFAC gets, apply its
preconditioner as it says, and checkpoint its state.
"""

from __future__ import annotations

import copy
import io

import torch
from torch import nn

from singd_curvlinops import KFAC
from singd_curvlinops._hyperparameters import check_common, check_number
from singd_curvlinops.rules import FactorRule, Preconditioner
from singd_curvlinops.rules.factors import load_factor, store_factor
from singd_curvlinops.shell import KroneckerOptimizer
from singd_curvlinops.structures import DiagonalMatrix
from tests.layers._helpers import train_without_warnings

DAMPING = 1e-3


class DiagonalRootRule(FactorRule):
    """Diagonal `A`, `G`; the preconditioner's sides are `(F + damping)^(-1/4)`."""

    factor_sides = (("A", 0), ("G", 1))
    reads_preconditioner = False
    preconditioner_options = ("damping",)

    def check_group(self, group):
        check_common(group)
        check_number("ema_decay", group["ema_decay"], 0.0, 1.0)

    def structures(self, group):
        return ("diagonal", "diagonal")

    def init_state(self, group, dims, dtypes, device):
        state = {}
        for prefix, side in self.factor_sides:
            zeros = DiagonalMatrix.zeros(dims[side], dtype=dtypes[side], device=device)
            store_factor(state, prefix, zeros)
        return state

    def project(self, preconditioner, a, g, *, group):
        return DiagonalMatrix((a * a).sum(0)), DiagonalMatrix((g * g).sum(0))

    def update(self, state, group, statistics, preconditioner, *, sides=(0, 1)):
        beta = group["ema_decay"]
        for (prefix, side), U in zip(
            self.factor_sides, statistics.collected, strict=True
        ):
            if side in sides:
                factor = load_factor(state, prefix, "diagonal")
                factor.mul_(beta).add_(U.to(factor.dtype), alpha=1.0 - beta)

    def preconditioner(self, state, group, *, sides=(0, 1)):
        roots = [
            DiagonalMatrix(
                (load_factor(state, prefix, "diagonal").tensors()[0] + group["damping"])
                ** -0.25
            )
            for prefix, _ in self.factor_sides
        ]
        return Preconditioner(*roots, square_roots=False)


class DiagonalRoot(KroneckerOptimizer):
    """The front door: the group options every Kronecker optimizer has, and ours."""

    def __init__(self, model, params=None, *, lr=0.1, ema_decay=0.0, T=1):
        defaults = {
            "lr": lr,
            "momentum": 0.0,
            "damping": DAMPING,
            "weight_decay": 0.0,
            "T": T,
            "loss_average": "batch",
            "structures": "auto",
            "kfac_approx": "expand",
            "preconditioner_dtype": None,
            "ema_decay": ema_decay,
            "max_dense_dim": None,
            "fallback": "adamw",
            "fallback_lr_ratio": 1.0,
            "fallback_betas": (0.9, 0.999),
            "fallback_eps": 1e-8,
            "graft": None,
        }
        super().__init__(
            model,
            params,
            defaults,
            rule=DiagonalRootRule(),
            warn_unsupported=True,
            init_grad_scale=2.0**16,
        )


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3)
    ).double()


def _batch(step: int):
    generator = torch.Generator().manual_seed(step)
    X = torch.randn(16, 5, generator=generator, dtype=torch.float64)
    return X, torch.randint(0, 3, (16,), generator=generator)


def _backward(model, optimizer, step: int) -> None:
    optimizer.zero_grad()
    X, y = _batch(step)
    nn.functional.cross_entropy(model(X), y).backward()


def test_the_rule_gets_kfacs_statistics_and_its_step_is_applied() -> None:
    model, twin = _model(), _model()
    ours, kfac = DiagonalRoot(model), KFAC(twin, damping=DAMPING)
    _backward(model, ours, 0)
    _backward(twin, kfac, 0)
    layer = model[3]
    grad = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], dim=1)
    before = torch.cat([layer.weight, layer.bias[:, None]], dim=1).detach().clone()
    ours.step()
    kfac.step()

    state, reference = ours.state[layer.weight], kfac.state[twin[3].weight]
    A, G = state["A.diag"], state["G.diag"]  # the first update: the statistics
    torch.testing.assert_close(A, reference["A.mat"].diagonal(), rtol=1e-12, atol=0)
    torch.testing.assert_close(G, reference["G.mat"].diagonal(), rtol=1e-12, atol=0)
    direction = (G + DAMPING)[:, None] ** -0.25 * grad * (A + DAMPING) ** -0.25
    after = torch.cat([layer.weight, layer.bias[:, None]], dim=1).detach()
    torch.testing.assert_close(after, before - 0.1 * direction, rtol=0, atol=1e-14)


def test_the_rule_trains_and_its_checkpoint_continues_the_run() -> None:
    model = _model()
    optimizer = DiagonalRoot(model, ema_decay=0.9, T=2)
    X, y = _batch(0)
    losses = train_without_warnings(model, optimizer, X, y, steps=20)
    assert losses[-1] < 0.9 * losses[0]

    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    twin = copy.deepcopy(model)
    resumed = DiagonalRoot(twin, ema_decay=0.9, T=2)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    for step in range(3):
        for net, opt in ((model, optimizer), (twin, resumed)):
            _backward(net, opt, step)
            opt.step()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)
