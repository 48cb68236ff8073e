"""A helper applies a shipped factor as one process applies that side (`relay`).

Under `Shard(factors="owned")` a helper receives one factor \\(F\\) of a layer
it does not own and applies \\(F F^\\top\\) to the gradient. Its half product must
be what `SINGDRule.preconditioner` gives on one process, bit for bit: \\(F F^\\top\\)
formed once where one use pays for it (the layer's smaller side), else
\\(F (F^\\top \\cdot)\\). One helper rank is simulated without processes: its
`irecv` of the factor is filled in, its `isend` of the half product recorded.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from singd_curvlinops.distributed import relay as relay_module
from singd_curvlinops.distributed.assignment import Assignment
from singd_curvlinops.rules import SINGDRule
from singd_curvlinops.rules.factors import store_factor
from singd_curvlinops.rules.singd import caches_for_one_use
from singd_curvlinops.structures import DenseMatrix

DIMS = (13, 7)  # (d_K, d_C): C is the smaller side


class _Work:
    def wait(self) -> None:
        """Nothing to wait for."""


class _Layer:
    """What the relay reads of a layer (hashable, as layers are)."""

    name = "helped"
    dims = DIMS

    def __init__(self) -> None:
        self.weight = torch.zeros(DIMS[1], DIMS[0])

    def factor_dtypes(self, group: dict) -> tuple[torch.dtype, torch.dtype]:
        return torch.float64, torch.float64


def _helper_half_product(
    anchor: int, factor: torch.Tensor, grad: torch.Tensor, monkeypatch
) -> torch.Tensor:
    """Run rank 1 as the helper of a layer owned by rank 0; return its message."""
    sent = []

    def irecv(tensor, src, tag):  # the helper's one receive: the shipped factor
        assert src == 0
        tensor.copy_(factor.reshape(-1))
        return _Work()

    def isend(tensor, dst, tag):
        assert dst == 0
        sent.append(tensor.clone())
        return _Work()

    monkeypatch.setattr(relay_module.dist, "irecv", irecv)
    monkeypatch.setattr(relay_module.dist, "isend", isend)
    layer = _Layer()
    stepper = SimpleNamespace(gradient=lambda layer: grad.clone(), group=lambda _: {})
    plan = {layer: Assignment((0, 0), anchor, helper=1)}
    relay = relay_module.Relay(stepper, plan, [layer], [layer], torch.float64, 1)
    relay.help(layer)
    relay.finish()
    (message,) = sent
    assert message[-1] == 1.0  # the flag: the helper had a gradient
    return message[:-1].view(DIMS[1], DIMS[0])


@pytest.mark.parametrize("anchor", [0, 1], ids=["helps_with_C", "helps_with_K"])
def test_the_half_product_is_one_process_s_side_bit_for_bit(
    anchor: int, monkeypatch
) -> None:
    torch.manual_seed(anchor)
    d_K, d_C = DIMS
    K, C = torch.randn(d_K, d_K), torch.randn(d_C, d_C)
    grad = torch.randn(d_C, d_K)
    side = 1 - anchor
    state: dict = {}
    store_factor(state, "K", DenseMatrix(K.double()))
    store_factor(state, "C", DenseMatrix(C.double()))
    group = {"structures": ("dense", "dense"), "T": 1}
    record = SINGDRule().preconditioner(state, group, sides=(side,))
    expected = record.apply_side(side, grad.double().clone())
    helped = _helper_half_product(
        anchor, (K, C)[side].double(), grad.double(), monkeypatch
    )
    assert torch.equal(helped, expected)
    # the smaller side's product is formed (one product on the gradient after it)
    dim, other = DIMS[side], DIMS[anchor]
    assert caches_for_one_use(dim * dim, dim, other) == (side == 1)
    assert (record.CCt is not None) == (side == 1) and record.KKt is None
