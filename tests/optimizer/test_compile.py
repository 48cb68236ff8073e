"""`torch.compile(model)` trained with SINGD: hooks fire, trajectory equals eager."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import fx, nn

from singd_curvlinops import SINGD


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, stride=2, padding=1),
        nn.ReLU(inplace=True),
        nn.Flatten(),
        nn.Linear(3 * 4 * 4, 5),
        nn.Tanh(),
        nn.Linear(5, 3),
    ).double()


# Before PyTorch 2.12, Dynamo compiles no graph of a model whose forward hooks
# are `torch.compiler.disable`d (the guide's `torch.compile` page says so).
COMPILES_AROUND_HOOKS = torch.__version__ >= (2, 12)  # (a TorchVersion)


class GraphCount:
    """A `torch.compile` backend that counts the graphs Dynamo hands it.

    It runs each graph as traced. Counting here, rather than through Dynamo's
    internal counters, keeps the test meaningful on every supported PyTorch.
    """

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, graph: fx.GraphModule, example_inputs: list) -> Callable:
        self.graphs += 1
        return graph.forward


def train(
    net: nn.Module,
    compiled: bool,
    steps: int,
    backend: str | Callable = "inductor",
    **config,
) -> SINGD:
    optimizer = SINGD(net, lr=0.1, lr_cov=0.1, alpha1=0.5, **config)
    forward = torch.compile(net, backend=backend) if compiled else net
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        X = torch.randn(8, 2, 8, 8, generator=generator, dtype=torch.float64)
        y = torch.randint(0, 3, (8,), generator=generator)
        optimizer.zero_grad()
        nn.functional.cross_entropy(forward(X), y).backward()
        optimizer.step()
    return optimizer


CONFIGS = {
    "dense-diagonal-T3": {"structures": ("dense", "diagonal"), "T": 3},
    "IKFAC-sparse-T1": {
        "structures": ("block2diagonal", "triltoeplitz"),
        "T": 1,
        "kfac_like": True,
    },
}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS)
def test_compiled_model_follows_the_eager_trajectory(config: dict) -> None:
    torch._dynamo.reset()
    eager_net, compiled_net = model(), model()
    eager = train(eager_net, compiled=False, steps=6, **config)
    compiled = train(compiled_net, compiled=True, steps=6, **config)

    for p_eager, p_compiled in zip(
        eager_net.parameters(), compiled_net.parameters(), strict=True
    ):
        torch.testing.assert_close(p_compiled, p_eager, rtol=1e-10, atol=1e-12)
    # The hooks fired under compilation: the factors left their initial identity
    # and equal the eager run's factors.
    initial_net = model()
    initial = SINGD(initial_net, **config)
    for name in ("0.weight", "3.weight", "5.weight"):
        state = compiled.state[compiled_net.get_parameter(name)]
        reference = eager.state[eager_net.get_parameter(name)]
        start = initial.state[initial_net.get_parameter(name)]
        for side in ("K.", "C."):
            keys = [key for key in state if key.startswith(side)]
            assert any(not torch.allclose(state[key], start[key]) for key in keys)
            for key in keys:
                torch.testing.assert_close(
                    state[key], reference[key], rtol=1e-10, atol=1e-14
                )
        assert state["step"] == 6


def test_hooks_do_not_recompile_the_model_per_step() -> None:
    torch._dynamo.reset()
    count = GraphCount()
    net = model()
    optimizer = train(
        net, True, steps=3, backend=count, structures=("dense", "dense"), T=3
    )
    graphs_after_first_period = count.graphs
    if COMPILES_AROUND_HOOKS:
        assert graphs_after_first_period > 0
    else:  # the guide's limitation: the hooked model runs eagerly
        assert graphs_after_first_period == 0

    forward = torch.compile(net, backend=count)
    X = torch.randn(8, 2, 8, 8, dtype=torch.float64)
    for _ in range(6):
        optimizer.zero_grad()
        forward(X).square().sum().backward()
        optimizer.step()
    assert count.graphs == graphs_after_first_period


def test_fullgraph_compilation_reports_the_hook_graph_break() -> None:
    torch._dynamo.reset()
    net = model()
    optimizer = SINGD(net)  # held: a dropped optimizer takes its hooks off
    compiled = torch.compile(net, fullgraph=True)
    x = torch.randn(2, 2, 8, 8, dtype=torch.float64)
    # (every PyTorch names the hook; the wording around it changes by version)
    with pytest.raises(Exception, match=r"ModuleHook\.__call__"):
        compiled(x)
    optimizer.remove_hooks()  # without the hooks the model is one graph
    torch._dynamo.reset()
    assert torch.compile(net, fullgraph=True)(x).shape[0] == 2


def transformer() -> nn.Module:
    """Two `nn.TransformerEncoderLayer`s: `nn.MultiheadAttention` under a capture."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    return nn.Sequential(
        nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
        nn.Flatten(),
        nn.Linear(8 * 5, 3),
    ).double()


def train_transformer(net: nn.Module, backend: str | Callable | None) -> SINGD:
    optimizer = SINGD(net, lr=0.1, lr_cov=0.1, T=3)
    forward = net if backend is None else torch.compile(net, backend=backend)
    generator = torch.Generator().manual_seed(1)
    for _ in range(6):
        X = torch.randn(4, 5, 8, generator=generator, dtype=torch.float64)
        y = torch.randint(0, 3, (4,), generator=generator)
        optimizer.zero_grad()
        nn.functional.cross_entropy(forward(X), y).backward()
        optimizer.step()
    return optimizer


@pytest.mark.parametrize("backend", ["inductor", "count"])
def test_compiled_attention_follows_the_eager_trajectory(backend: str) -> None:
    """The attention's capture (a torch function mode) under Dynamo.

    Its exposed products run eagerly (`torch.compiler.disable`): traced into a
    graph, the hooked projections were extra outputs of the graph that the loss
    did not reach, and their gradient hooks received None.
    """
    torch._dynamo.reset()
    count = GraphCount()
    eager_net, compiled_net = transformer(), transformer()
    train_transformer(eager_net, None)
    train_transformer(compiled_net, count if backend == "count" else backend)
    for p, q in zip(compiled_net.parameters(), eager_net.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-14)
    assert torch._C._len_torch_function_stack() == 0
    if backend == "count" and COMPILES_AROUND_HOOKS:
        graphs = count.graphs
        train_transformer(compiled_net, count)  # the same graphs serve again
        assert 0 < graphs == count.graphs
