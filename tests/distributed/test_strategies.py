"""Distribution strategies in one process: options, side-wise updates, bytes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from singd_curvlinops import EKFAC, KFAC, SINGD, get_structure
from singd_curvlinops.distributed import (
    Replicate,
    Shard,
    bytes_per_step,
    bytes_per_update,
    resolve,
)
from singd_curvlinops.rules import FactorStatistics, KFACRule, SINGDRule
from singd_curvlinops.structures import structure_names

# every registered structure, families with parameters filled in
STRUCTURES = [
    name.replace("{B}", "3").replace("{K1}_{K2}", "2_3") for name in structure_names()
]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)).double()


def test_resolve_names_and_copies_strategies() -> None:
    assert type(resolve("replicate")) is Replicate
    assert repr(resolve("shard")) == "Shard(factors='replicated', share='directions')"
    owned = Shard(factors="owned")
    assert resolve(owned) is not owned and repr(resolve(owned)) == repr(owned)


@pytest.mark.parametrize(
    ("distribute", "error", "pattern"),
    [
        ("sharded", ValueError, "distribute must be 'replicate' or 'shard'"),
        (2, TypeError, "distribute must be 'replicate', 'shard' or a"),
    ],
)
def test_bad_distribute_raises(distribute: object, error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        SINGD(_model(), distribute=distribute)


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        ({"factors": "everywhere"}, "factors must be one of"),
        ({"share": "gradients"}, "share must be one of"),
        ({"share": "factors", "factors": "owned"}, "needs factors='replicated'"),
    ],
)
def test_bad_shard_options_raise(options: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        Shard(**options)


def test_ekfac_does_not_share_its_factors() -> None:
    """EKFAC's updates read every rank's per-example gradients, so every rank
    runs them (or contributes to its owner's): `share="factors"`, where owners
    send updated factors, does not apply; `"shard"` and owned factors do."""
    with pytest.raises(ValueError, match="no factors are shared"):
        EKFAC(_model(), distribute=Shard(share="factors"))
    for distribute in ("shard", Shard(factors="owned")):
        assert isinstance(EKFAC(_model(), distribute=distribute).distribution, Shard)


@pytest.mark.parametrize(
    "distribute", ["shard", Shard(factors="owned"), Shard(share="factors")]
)
@pytest.mark.parametrize("cls", [SINGD, KFAC])
def test_one_process_trains_identically_under_every_strategy(
    cls: type, distribute: object
) -> None:
    X, y = torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 3, (8,))
    trajectories = []
    for option in ("replicate", distribute):
        model = _model()
        optimizer = cls(model, lr=0.1, T=1, distribute=option)
        for _ in range(3):
            optimizer.zero_grad()
            F.cross_entropy(model(X), y).backward()
            optimizer.step()
        trajectories.append([p.detach() for p in model.parameters()])
    for a, b in zip(*trajectories, strict=True):
        assert torch.equal(a, b)


def _singd_group(structures: tuple[str, str], kfac_like: bool) -> dict:
    return {
        "structures": structures,
        "damping": 1e-2,
        "alpha1": 0.5,
        "lr_cov": 0.3,
        "kfac_like": kfac_like,
        "normalize_lr_cov": True,
        "T": 1,
    }


def _statistics(rule: SINGDRule, record: object, group: dict) -> FactorStatistics:
    generator = torch.Generator().manual_seed(1)
    a = torch.randn(7, record.K.dim, generator=generator, dtype=torch.float64)
    g = torch.randn(7, record.C.dim, generator=generator, dtype=torch.float64)
    return FactorStatistics(collected=rule.project(record, a, g, group=group))


@pytest.mark.parametrize("kfac_like", [False, True])
@pytest.mark.parametrize("structure", STRUCTURES)
def test_updating_the_sides_apart_equals_updating_them_together(
    structure: str, kfac_like: bool
) -> None:
    """What two owners compute from the same old factors equals one update."""
    rule, group = SINGDRule(), _singd_group((structure, "dense"), kfac_like)
    state = rule.init_state(group, (6, 4), (torch.float64,) * 2, "cpu")
    state["step"] = 0
    for _ in range(2):  # leave the identity and give the momenta a value
        record = rule.preconditioner(state, group)
        rule.update(state, group, _statistics(rule, record, group), record)
    states = {sides: copy.deepcopy(state) for sides in [(0, 1), (0,), (1,)]}
    for sides, copied in states.items():
        record = rule.preconditioner(copied, group, sides=())
        rule.update(
            copied, group, _statistics(rule, record, group), record, sides=sides
        )
    for key, expected in states[0, 1].items():
        side = 0 if key.startswith(("K.", "m_K.")) else 1
        if isinstance(expected, torch.Tensor) and expected.numel():
            torch.testing.assert_close(
                states[side,][key], expected, rtol=1e-13, atol=1e-14
            )
            assert not torch.equal(state[key], expected)  # the update did something


@pytest.mark.parametrize("structure", STRUCTURES)
def test_the_other_sides_trace_is_its_frobenius_norm(structure: str) -> None:
    r"""\(\bar{tr}(\Pi(C^\top C)) = \|C\|_F^2 / d\): each \(\Pi\) keeps the diagonal."""
    cls = get_structure(structure)
    for dim in (1, 2, 7, 16):
        generator = torch.Generator().manual_seed(dim)
        noise = torch.randn(dim, dim, generator=generator, dtype=torch.float64)
        C = cls.eye(dim, dtype=torch.float64) + cls.from_dense(noise + noise.T) * 0.3
        expected = C.from_inner().average_trace()
        torch.testing.assert_close(C.frobenius_norm().square() / dim, expected)


@pytest.mark.parametrize("rule", [SINGDRule(), KFACRule()])
def test_applying_the_sides_one_by_one_equals_applying_both(rule: object) -> None:
    group = {**_singd_group(("dense", "block2diagonal"), False), "ema_decay": 0.5}
    if isinstance(rule, KFACRule):
        group["structures"] = ("dense", "dense")
    state = rule.init_state(group, (6, 4), (torch.float64,) * 2, "cpu")
    state["step"] = 0
    record = rule.preconditioner(state, group)
    rule.update(state, group, _statistics(SINGDRule(), record, group), record)
    record = rule.preconditioner(state, group)
    grad = torch.randn(4, 6, dtype=torch.float64)
    expected = record.apply(grad)
    K_first = record.apply_side(1, record.apply_side(0, grad))
    C_first = record.apply_side(0, record.apply_side(1, grad))
    torch.testing.assert_close(K_first, expected, rtol=1e-13, atol=1e-14)
    torch.testing.assert_close(C_first, expected, rtol=1e-13, atol=1e-14)
    assert not torch.allclose(expected, grad)


def test_a_record_built_for_one_side_still_applies_both() -> None:
    rule = SINGDRule()
    group = {**_singd_group(("dense", "dense"), False), "T": 10}
    state = rule.init_state(group, (6, 4), (torch.float64,) * 2, "cpu")
    state["step"] = 0
    record = rule.preconditioner(state, group)
    rule.update(state, group, _statistics(rule, record, group), record)
    full, half = (
        rule.preconditioner(state, group),
        rule.preconditioner(state, group, sides=(0,)),
    )
    assert full.CCt is not None and half.CCt is None and half.KKt is not None
    grad = torch.randn(4, 6, dtype=torch.float64)
    torch.testing.assert_close(half.apply(grad), full.apply(grad))


def test_one_process_sends_nothing() -> None:
    optimizer = SINGD(_model(), distribute="shard")
    assert bytes_per_step(optimizer, update=True) == {
        "statistics": 0,
        "gather": 0,
        "relay": 0,
        "blocks": 0,
        "checks": 0,
    }


def test_bytes_per_step_of_shard_on_two_ranks() -> None:
    optimizer = SINGD(_model(), structures=("diagonal", "diagonal"), distribute="shard")
    plan = optimizer.distribution.assignments(
        optimizer.layers, optimizer.param_groups, optimizer.rule, 2
    )
    # on a plain step: each owner's directions and flags, and every rank's
    # verdict on the step's inputs (the step guard's, in the gather)
    shares = [1, 1]
    for layer, assignment in plan.items():
        shares[assignment.direction_owner] += layer.dims[0] * layer.dims[1] + 1
    plain = bytes_per_step(optimizer, update=False, world_size=2)
    assert plain == {
        "statistics": 0,
        "gather": 2 * max(shares) * 8,
        "relay": 0,  # (diagonal factors: no layer is split)
        "blocks": 0,  # (no FSDP2 shards)
        # the step check alone: every rank's configuration checksum, step count
        # and options' fingerprint, padded to the summary's 6 + 2P per layer
        "checks": (3 * 2 + 2 * (6 + 2 * 2)) * 8,
    }
    update = bytes_per_step(optimizer, update=True, world_size=2)
    assert update["statistics"] == bytes_per_update(optimizer, world_size=2)
    # at the head of the summary: the step check's numbers; and the agreement on
    # what the owners formed, a 32-bit integer per layer
    assert update["checks"] == 3 * 2 * 8 + 2 * 4
    assert update["gather"] > plain["gather"]  # the updated factors travel too
    owned = SINGD(
        _model(), structures=("dense", "dense"), distribute=Shard(factors="owned")
    )
    # dense statistics to the owners (rows unknown: counted as matrices), and
    # the summary all-reduce of 6 + 2P float64 per layer
    summary = 2 * (6 + 2 * 2) * 8
    assert (
        bytes_per_update(owned, world_size=2)
        == ((7 * 7 + 5 * 5) + (6 * 6 + 3 * 3)) * 8 + summary
    )
    # with 2 rows per rank (4 in all) the raw rows of the sides wider than 4
    # travel, 2 x d numbers each; the 3-dimensional side as its 3 x 3 entries
    rows = bytes_per_update(owned, world_size=2, rows=2)
    assert rows == (2 * (7 + 5 + 6) + 3 * 3) * 8 + summary
    # diagonal factors read only the diagonal of the raw statistics: d numbers,
    # never rows (before 2026-12-02: d x d)
    diagonal = SINGD(
        _model(), structures=("diagonal", "diagonal"), distribute=Shard(factors="owned")
    )
    for local in (None, 2):
        sent = bytes_per_update(diagonal, world_size=2, rows=local)
        assert sent == (7 + 5 + 6 + 3) * 8 + summary
    # block-diagonal factors read only the diagonal blocks: their stored entries,
    # never rows nor d x d (before 2026-12-02: d x d beyond d rows)
    blocks = SINGD(
        _model(),
        structures=("block3diagonal", "block2diagonal"),
        distribute=Shard(factors="owned"),
    )
    for local in (None, 2, 100):
        sent = bytes_per_update(blocks, world_size=2, rows=local)
        assert sent == ((2 * 9 + 1) + (2 * 4 + 1) + 2 * 9 + (4 + 1)) * 8 + summary


def test_kfacs_statistics_hooks_build_no_preconditioner(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """KFAC's statistics need no factors: no inverse in the forward pass."""
    calls = []
    original = KFACRule.preconditioner

    def counting(self: KFACRule, *args: object, **kwargs: object) -> object:
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(KFACRule, "preconditioner", counting)
    model = _model()
    optimizer = KFAC(model, T=1)
    X, y = torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 3, (8,))
    F.cross_entropy(model(X), y).backward()
    assert calls == [] and optimizer.curvature_pending is False
    optimizer.step()
    assert len(calls) == 2  # the step's, one per layer


def test_describe_options_compares_the_optimizers_options_only() -> None:
    from singd_curvlinops.distributed.collectives import fingerprint
    from singd_curvlinops.distributed.exchange import describe_options

    def schedule(step: int) -> float:
        return 0.1

    def described(**changes: object) -> str:
        optimizer = SINGD(_model(), lr_cov=schedule)
        optimizer.param_groups[0].update(changes)
        names = optimizer.distribution.options  # handed over by the optimizer
        assert names == tuple(optimizer.defaults)
        return describe_options(optimizer.param_groups, names)

    same = described()
    assert same == described()  # a callable by its name, not its address
    assert "lr_cov=" in same and "schedule" in same and " at 0x" not in same
    assert described(lr=2e-3) != same and described(damping=1e-2) != same
    assert described(lr=1e-3 + 1e-18) != same  # exact: one ulp apart differs
    assert described(lr=torch.tensor(1e-3, dtype=torch.float64)) == same
    assert described(initial_lr=5.0, device=torch.device("meta")) == same
    assert fingerprint(described(lr=2e-3)) != fingerprint(same) < 2**24
