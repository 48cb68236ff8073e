"""The relay's messages pair up by order as well as by tag (`distributed.relay`).

gloo matches point-to-point messages by tag, NCCL by their order between two
ranks. Both ranks of a plan with a split layer and helpers in both directions
are simulated without processes: every `isend` and `irecv` is recorded, the
sends in the order the engine makes them (`send` and `ship` during the updates,
layer by layer, then `help`). Per pair of ranks the receives must be posted in
the order of the sends, with the same tags and sizes.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from singd_curvlinops.distributed import relay as relay_module
from singd_curvlinops.distributed.assignment import Assignment
from singd_curvlinops.rules.factors import store_factor
from singd_curvlinops.structures import DenseMatrix

DIMS = {"split": (5, 4), "helped_by_1": (6, 3), "helped_by_0": (4, 7)}
PLAN = {  # two ranks: a layer split by sides, and a helper in each direction
    "split": Assignment((0, 1), anchor=0),
    "helped_by_1": Assignment((0, 0), anchor=0, helper=1),
    "helped_by_0": Assignment((1, 1), anchor=1, helper=0),
}


class _Work:
    def wait(self) -> None:
        """Nothing to wait for."""


class _Layer:
    """What the relay reads of a layer (hashable, as layers are)."""

    def __init__(self, name: str, dims: tuple[int, int]) -> None:
        self.name, self.dims = name, dims
        self.weight = torch.zeros(dims[1], dims[0])

    def factor_dtypes(self, group: dict) -> tuple[torch.dtype, torch.dtype]:
        return torch.float64, torch.float64


def _layers() -> list[_Layer]:
    return [_Layer(name, dims) for name, dims in DIMS.items()]


def _stepper(layers: list[_Layer]) -> SimpleNamespace:
    state = {}
    for layer in layers:
        entries: dict = {}
        store_factor(entries, "K", DenseMatrix(torch.eye(layer.dims[0])))
        store_factor(entries, "C", DenseMatrix(torch.eye(layer.dims[1])))
        state[layer.weight] = entries
    record = SimpleNamespace(apply_side=lambda side, grad, overwrite: grad)
    return SimpleNamespace(
        state=state,
        gradient=lambda layer: torch.ones(layer.dims[1], layer.dims[0]),
        settle_factors=lambda: None,
        preconditioner=lambda layer, sides: record,
        group=lambda layer: {},
    )


def _messages(me: int, monkeypatch) -> list[tuple[str, int, int, int]]:
    """Run one rank's relay; return its `(kind, peer, tag, numel)` in order."""
    recorded = []

    def irecv(tensor, src, tag):
        recorded.append(("recv", src, tag, tensor.numel()))
        return _Work()

    def isend(tensor, dst, tag):
        recorded.append(("send", dst, tag, tensor.numel()))
        return _Work()

    monkeypatch.setattr(relay_module.dist, "irecv", irecv)
    monkeypatch.setattr(relay_module.dist, "isend", isend)
    layers = _layers()
    plan = {layer: PLAN[layer.name] for layer in layers}
    relay = relay_module.Relay(
        _stepper(layers), plan, layers, layers, torch.float64, me
    )
    for layer in layers:  # the engine's update loop, then the helpers
        relay.ship(layer)
        relay.send(layer)
    for layer in layers:
        relay.help(layer)
    relay.finish()
    return recorded


def test_receives_are_posted_in_the_order_of_the_sends(monkeypatch) -> None:
    messages = {me: _messages(me, monkeypatch) for me in (0, 1)}
    for sender, receiver in ((0, 1), (1, 0)):
        sent = [m[2:] for m in messages[sender] if m[:2] == ("send", receiver)]
        posted = [m[2:] for m in messages[receiver] if m[:2] == ("recv", sender)]
        assert sent and sent == posted
    kinds = {m[0] for ms in messages.values() for m in ms}
    assert kinds == {"send", "recv"}
    # every layer sends a half product, and each helped layer a factor
    assert sum(m[0] == "send" for ms in messages.values() for m in ms) == 5
