"""GCNConv layers are preconditioned as `nn.Linear` layers on the aggregated features.

A two-layer GCN and the same network written with a dense normalised adjacency Â
and `nn.Linear` layers on Â X must follow the same trajectory (float64) under SINGD
and KFAC, and give the same `SINGDLinearOperator`.
"""

from __future__ import annotations

import copy
import io
import subprocess
import sys
import warnings

import pytest
import torch
from torch import Tensor, nn
from torch_geometric.nn import GATConv, GCNConv, SAGEConv

from singd_curvlinops import KFAC, SINGD, SINGDLinearOperator
from singd_curvlinops.layers import GCNConvAdapter, adapter_for

NODES, D_IN, HIDDEN, CLASSES = 9, 5, 4, 3
TOL = 1e-10


def graph(weighted: bool) -> tuple[Tensor, Tensor | None]:
    """A directed graph without self-loops in which every node has in-edges."""
    generator = torch.Generator().manual_seed(1)
    ring = torch.arange(NODES)
    src = torch.cat([ring, torch.randint(0, NODES, (12,), generator=generator)])
    dst = torch.cat(
        [(ring + 1) % NODES, torch.randint(0, NODES, (12,), generator=generator)]
    )
    keep = src != dst
    edge_index = torch.stack([src[keep], dst[keep]])
    if not weighted:
        return edge_index, None
    weights = torch.rand(edge_index.shape[1], generator=generator, dtype=torch.float64)
    return edge_index, 0.5 + weights


def dense_adjacency(
    edge_index: Tensor,
    edge_weight: Tensor | None,
    *,
    add_self_loops: bool,
    improved: bool,
    normalize: bool,
) -> Tensor:
    """Â = D^{-1/2} (A + fill I) D^{-1/2} with A[target, source] = edge weight."""
    src, dst = edge_index
    if edge_weight is None:
        edge_weight = torch.ones(src.shape[0], dtype=torch.float64)
    A = torch.zeros(NODES, NODES, dtype=torch.float64)
    A.index_put_((dst, src), edge_weight, accumulate=True)
    if not normalize:
        return A
    if add_self_loops:
        A = A + (2.0 if improved else 1.0) * torch.eye(NODES, dtype=torch.float64)
    degree = A.sum(1)
    scale = torch.where(degree > 0, degree**-0.5, 0.0)
    return scale[:, None] * A * scale[None, :]


class GCN(nn.Module):
    def __init__(self, **conv_kwargs) -> None:
        super().__init__()
        self.conv1 = GCNConv(D_IN, HIDDEN, **conv_kwargs)
        self.conv2 = GCNConv(HIDDEN, CLASSES, **conv_kwargs)

    def forward(self, x: Tensor, adjacency: Tensor, edge_weight: Tensor | None):
        hidden = self.conv1(x, adjacency, edge_weight).relu()
        return self.conv2(hidden, edge_index=adjacency, edge_weight=edge_weight)


class DenseGCN(nn.Module):
    def __init__(self, gcn: GCN, A_hat: Tensor) -> None:
        super().__init__()
        bias = gcn.conv1.bias is not None
        self.lin1 = nn.Linear(D_IN, HIDDEN, bias=bias).double()
        self.lin2 = nn.Linear(HIDDEN, CLASSES, bias=bias).double()
        self.A_hat = A_hat
        with torch.no_grad():
            for lin, conv in ((self.lin1, gcn.conv1), (self.lin2, gcn.conv2)):
                lin.weight.copy_(conv.lin.weight)
                if bias:
                    lin.bias.copy_(conv.bias)

    def forward(self, x: Tensor) -> Tensor:
        hidden = self.lin1(self.A_hat @ x).relu()
        return self.lin2(self.A_hat @ hidden)


def problem(weighted: bool = False, sparse: bool = False, **conv_kwargs):
    """GCN, its dense twin and the closures computing each one's loss."""
    torch.manual_seed(0)
    gcn = GCN(**conv_kwargs).double()
    edge_index, edge_weight = graph(weighted)
    A_hat = dense_adjacency(
        edge_index,
        edge_weight,
        add_self_loops=conv_kwargs.get("add_self_loops", True),
        improved=conv_kwargs.get("improved", False),
        normalize=conv_kwargs.get("normalize", True),
    )
    dense = DenseGCN(gcn, A_hat)
    x = torch.randn(NODES, D_IN, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (NODES,))
    train = torch.arange(NODES) % 3 != 0  # a loss on some nodes, as in practice
    adjacency = edge_index
    if sparse:  # transposed adjacency adj_t[target, source], as PyG expects
        values = torch.ones(edge_index.shape[1], dtype=torch.float64)
        if weighted:
            values = edge_weight
        adjacency = torch.sparse_coo_tensor(
            edge_index.flip(0), values, (NODES, NODES)
        ).to_sparse_csr()
        edge_weight = None

    def gcn_loss(adjacency=adjacency, edge_weight=edge_weight) -> Tensor:
        out = gcn(x, adjacency, edge_weight)
        return nn.functional.cross_entropy(out[train], y[train])

    def dense_loss() -> Tensor:
        return nn.functional.cross_entropy(dense(x)[train], y[train])

    return gcn, dense, gcn_loss, dense_loss


def train_both(optimizers, losses, steps: int) -> None:
    """Step both optimizers; their parameters must agree after every step."""
    for step in range(steps):
        for optimizer, loss in zip(optimizers, losses, strict=True):
            optimizer.zero_grad()
            loss().backward()
            optimizer.step()
        params = [
            [p for g in opt.param_groups for p in g["params"]] for opt in optimizers
        ]
        for p, q in zip(*params, strict=True):
            error = (p - q).abs().max().item()
            assert error < TOL, f"step {step}: parameter mismatch {error:.2e}"


CONV_CASES = {
    "default": {},
    "cached": {"cached": True},
    "no-self-loops": {"add_self_loops": False},
    "cached-no-self-loops": {"cached": True, "add_self_loops": False},
    "weighted": {"weighted": True},
    "cached-weighted": {"weighted": True, "cached": True},
    "weighted-no-self-loops": {"weighted": True, "add_self_loops": False},
    "improved-weighted": {"improved": True, "weighted": True},
    "no-bias": {"bias": False},
    "unnormalized": {"normalize": False},
    "sparse": {"sparse": True, "weighted": True},
    "sparse-cached": {"sparse": True, "cached": True},
}
OPTIMIZER_CASES = {
    "dense-T1": {"structures": ("dense", "dense"), "T": 1},
    "diagonal-T3": {"structures": ("diagonal", "diagonal"), "T": 3},
    "sparse-T2": {"structures": ("triltoeplitz", "block2diagonal"), "T": 2},
    "ikfac-sum-loss": {"kfac_like": True, "alpha1": 0.0, "loss_average": None},
}


def singd(model: nn.Module, **kwargs) -> SINGD:
    options = {"lr": 0.1, "lr_cov": 0.2, "damping": 0.01, "T": 1} | kwargs
    return SINGD(model, **options)


@pytest.mark.parametrize("conv", CONV_CASES.values(), ids=CONV_CASES.keys())
def test_singd_gcn_equals_linear_on_aggregated_features(conv: dict) -> None:
    gcn, dense, gcn_loss, dense_loss = problem(**conv)
    train_both([singd(gcn), singd(dense)], [gcn_loss, dense_loss], steps=5)


@pytest.mark.parametrize("sparse", [False, True], ids=["edge_index", "sparse"])
def test_a_cached_gcn_is_preconditioned_with_the_adjacency_it_applies(
    sparse: bool,
) -> None:
    """With `cached=True` a layer applies the normalised adjacency of its first
    graph to every later one; the statistics must use that cache, too."""
    gcn, dense, gcn_loss, dense_loss = problem(sparse=sparse, cached=True)
    with torch.no_grad():
        gcn_loss()  # fills the caches from the first graph (the dense twin's)
    edge_index = graph(weighted=False)[0][:, ::2]  # another graph
    other = edge_index
    if sparse:
        values = torch.ones(edge_index.shape[1], dtype=torch.float64)
        other = torch.sparse_coo_tensor(
            edge_index.flip(0), values, (NODES, NODES)
        ).to_sparse_csr()
    train_both(
        [singd(gcn), singd(dense)], [lambda: gcn_loss(other, None), dense_loss], 3
    )


@pytest.mark.parametrize("options", OPTIMIZER_CASES.values(), ids=OPTIMIZER_CASES)
def test_singd_gcn_equals_linear_for_structures(options: dict) -> None:
    gcn, dense, gcn_loss, dense_loss = problem(weighted=True, cached=True)
    optimizers = [singd(gcn, **options), singd(dense, **options)]
    train_both(optimizers, [gcn_loss, dense_loss], steps=6)


@pytest.mark.parametrize("conv", [{}, {"weighted": True, "bias": False}], ids=str)
def test_kfac_gcn_equals_linear(conv: dict) -> None:
    gcn, dense, gcn_loss, dense_loss = problem(**conv)
    optimizers = [KFAC(m, lr=0.1, damping=0.01, T=2) for m in (gcn, dense)]
    train_both(optimizers, [gcn_loss, dense_loss], steps=5)


def test_linear_operator_gcn_equals_linear() -> None:
    gcn, dense, gcn_loss, dense_loss = problem(weighted=True)
    structures = ("dense", "diagonal")
    optimizers = [singd(m, structures=structures) for m in (gcn, dense)]
    train_both(optimizers, [gcn_loss, dense_loss], steps=3)
    # a GCNConv registers its bias before `lin.weight`; the optimizer puts weight first
    names = [n for n, _ in gcn.named_parameters()]
    assert names == ["conv1.bias", "conv1.lin.weight", "conv2.bias", "conv2.lin.weight"]
    order = [p.shape for p in optimizers[0].param_groups[0]["params"]]
    assert order == [(HIDDEN, D_IN), (HIDDEN,), (CLASSES, HIDDEN), (CLASSES,)]
    P, Q = (SINGDLinearOperator(opt) for opt in optimizers)
    eye = torch.eye(P.shape[0], dtype=torch.float64)
    P_dense = P @ eye
    assert (P_dense - eye).abs().max() > 1e-3  # the factors have moved
    assert (P_dense - Q @ eye).abs().max() < TOL
    assert (P.inverse() @ P_dense - eye).abs().max() < 1e-8


def test_checkpoint_round_trip() -> None:
    gcn, _, gcn_loss, _ = problem(weighted=True)
    optimizer = singd(gcn, T=2)
    for _ in range(3):
        optimizer.zero_grad()
        gcn_loss().backward()
        optimizer.step()
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    twin = copy.deepcopy(gcn)
    resumed = singd(twin, T=2)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    saved = optimizer.state[gcn.conv1.lin.weight]
    loaded = resumed.state[twin.conv1.lin.weight]
    assert saved.keys() == loaded.keys()
    assert (saved["K.mat"] - torch.eye(D_IN + 1)).abs().max() > 1e-3
    for key, value in saved.items():
        assert torch.equal(torch.as_tensor(loaded[key]), torch.as_tensor(value)), key


def test_factor_dims_and_support() -> None:
    for bias, d_K in ((True, D_IN + 1), (False, D_IN)):
        layer = GCNConv(D_IN, HIDDEN, bias=bias)
        adapter = adapter_for(layer)
        assert isinstance(adapter, GCNConvAdapter)
        assert adapter.dims(layer) == (d_K, HIDDEN)
    lazy = GCNConv(-1, HIDDEN)
    assert adapter_for(lazy) is None
    edge_index, _ = graph(weighted=False)
    lazy(torch.randn(NODES, D_IN), edge_index)  # materialises the weight
    assert isinstance(adapter_for(lazy), GCNConvAdapter)


def test_no_warning_for_gcn_parameters() -> None:
    gcn, *_ = problem()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer = SINGD(gcn)
    assert len(optimizer.param_groups[0]["params"]) == 4


class MixedGNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gcn = GCNConv(D_IN, HIDDEN)
        self.sage = SAGEConv(HIDDEN, HIDDEN)
        self.gat = GATConv(HIDDEN, CLASSES)

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        hidden = self.sage(self.gcn(x, edge_index).relu(), edge_index).relu()
        return self.gat(hidden, edge_index)


def test_other_pyg_layers_warn_by_name() -> None:
    model = MixedGNN()
    with pytest.warns(UserWarning, match="unsupported layers") as record:
        optimizer = SINGD(model, fallback=None)  # the default trains them (AdamW)
    (message,) = [str(w.message) for w in record]
    for name, _ in model.sage.named_parameters(prefix="sage"):
        assert name in message
    for name, _ in model.gat.named_parameters(prefix="gat"):
        assert name in message
    assert "gcn." not in message
    assert set(optimizer.param_groups[0]["params"]) == set(model.gcn.parameters())
    edge_index, _ = graph(weighted=False)
    x = torch.randn(NODES, D_IN)
    before = {n: p.clone() for n, p in model.named_parameters()}
    model(x, edge_index).square().sum().backward()
    optimizer.step()
    for name, param in model.named_parameters():
        trained = name.startswith("gcn.")
        assert torch.equal(param, before[name]) != trained, name


def test_torch_geometric_stays_optional() -> None:
    """Without torch_geometric (import blocked), the package imports and trains."""
    script = (
        "import sys; sys.modules['torch_geometric'] = None\n"
        "import torch\n"
        "from singd_curvlinops import SINGD\n"
        "model = torch.nn.Linear(3, 2)\n"
        "optimizer = SINGD(model, T=1)\n"
        "model(torch.randn(4, 3)).square().sum().backward()\n"
        "optimizer.step()\n"
        "assert sys.modules['torch_geometric'] is None\n"
        "print('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.parametrize("aggr", ["max", "min"])
def test_a_gcn_with_a_nonlinear_aggregation_is_no_layer(aggr) -> None:
    """Max/min aggregation is no linear map of `Â X` (before: wrong statistics)."""
    assert adapter_for(GCNConv(3, 4, aggr=aggr)) is None
    assert isinstance(adapter_for(GCNConv(3, 4, aggr="mean")), GCNConvAdapter)
    assert isinstance(adapter_for(GCNConv(3, 4)), GCNConvAdapter)
