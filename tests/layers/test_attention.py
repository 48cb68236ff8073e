"""`nn.MultiheadAttention`: unchanged outputs and gradients, exact factors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from singd_curvlinops import KFAC, SINGD
from tests.layers._helpers import expand_factors, kfac_factors

E, HEADS, B, L, S = 6, 2, 3, 4, 5


class Block(nn.Module):
    """Attention on (query, key, value) followed by a linear read-out."""

    def __init__(self, mode: str, **options) -> None:
        super().__init__()
        self.mode = mode
        self.attn = nn.MultiheadAttention(E, HEADS, **options)
        self.head = nn.Linear(E, 2)

    def forward(self, x, memory, **kwargs):
        key = value = x if self.mode == "self" else memory
        if self.mode == "all":
            value = memory.flip(-2)
        out, weights = self.attn(x, key, value, **kwargs)
        result = self.head(out).sum()
        return result if weights is None else result + weights.square().sum()


def _inputs(batch_first: bool, kdim: int = E):
    x = torch.randn(B, L, E, dtype=torch.float64)
    memory = torch.randn(B, S, kdim, dtype=torch.float64)
    if not batch_first:
        x, memory = x.transpose(0, 1), memory.transpose(0, 1)
    return x.requires_grad_(), memory.requires_grad_()


CASES = {
    "self": ("self", {}),
    "self-seq-first": ("self", {"batch_first": False}),
    "cross": ("cross", {}),
    "all-distinct": ("all", {}),
    "kdim": ("cross", {"kdim": 3, "vdim": 3}),
    "kdim-seq-first-no-bias": (
        "all",
        {"kdim": 3, "vdim": 3, "bias": False, "batch_first": False},
    ),
    "bias-kv-zero-attn": ("self", {"add_bias_kv": True, "add_zero_attn": True}),
    "dropout": ("self", {"dropout": 0.5}),
}


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("case", sorted(CASES))
def test_outputs_and_gradients_equal_the_unmodified_module(case, need_weights) -> None:
    mode, options = CASES[case]
    options = {"batch_first": True, **options}
    torch.manual_seed(0)
    model = Block(mode, **options).double()
    reference = copy.deepcopy(model)
    optimizer = SINGD(model, T=1)  # collects in every pass
    x, memory = _inputs(options["batch_first"], options.get("kdim", E))
    mask = torch.zeros(B, L if mode == "self" else S, dtype=torch.bool)
    mask[0, -1] = True
    kwargs = {"need_weights": need_weights, "key_padding_mask": mask}
    results = []
    for net in (model, reference):
        torch.manual_seed(1)  # the same dropout masks
        out = net(x, memory, **kwargs)
        grads = torch.autograd.grad(
            out, [x, memory, *net.parameters()], allow_unused=True
        )
        results.append((out, grads))
    (out, grads), (out_ref, grads_ref) = results
    torch.testing.assert_close(out, out_ref, rtol=0, atol=1e-12)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        if g_ref is None:
            assert g is None
        else:
            torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-12)
    assert optimizer._collector._pending, "no statistics were collected"
    assert torch.get_rng_state().equal(_state_after(reference, x, memory, kwargs))


def _state_after(net, x, memory, kwargs):
    """The random state after one unhooked call from seed 1 (the replay must not
    consume extra random numbers)."""
    torch.manual_seed(1)
    net(x, memory, **kwargs)
    return torch.get_rng_state()


def test_slots_of_separate_projections() -> None:
    model = Block("cross", kdim=3, vdim=3, batch_first=True)
    names = {layer.name: layer.dims for layer in SINGD(model).layers}
    assert names == {
        "attn.q_proj": (E, E),
        "attn.k_proj": (3, E),
        "attn.v_proj": (3, E),
        "attn.in_proj_bias": (1, 3 * E),
        "attn.out_proj": (E + 1, E),
        "head": (E + 1, 2),
    }


def _manual(attn: nn.MultiheadAttention, query, key, value):
    """Batch-first attention written out, returning every projection's tensors."""
    W, b, d = attn.in_proj_weight, attn.in_proj_bias, E // HEADS
    ones = lambda t: torch.cat([t, torch.ones_like(t[..., :1])], -1)  # noqa: E731
    q, k, v = (
        t @ W[i * E : (i + 1) * E].T + b[i * E : (i + 1) * E]
        for i, t in enumerate((query, key, value))
    )
    for t in (q, k, v):
        t.retain_grad()
    heads = lambda t: t.unflatten(-1, (HEADS, d)).transpose(1, 2)  # noqa: E731
    weights = torch.softmax(heads(q) @ heads(k).transpose(-1, -2) / d**0.5, -1)
    attended = (weights @ heads(v)).transpose(1, 2).flatten(2)
    out = attended @ attn.out_proj.weight.T + attn.out_proj.bias
    out.retain_grad()
    return out, (ones(query), ones(key), ones(value), ones(attended)), (q, k, v, out)


@pytest.mark.parametrize("mode", ["self", "cross"])
def test_projection_factors_equal_brute_force(mode) -> None:
    """KFAC's first factors are the statistics: compare them with dense sums."""
    torch.manual_seed(0)
    model = Block(mode, batch_first=True).double()
    x, memory = _inputs(True)
    key = x if mode == "self" else memory
    out, inputs, outputs = _manual(model.attn, x, key, key)
    reference = model.head(out).sum()
    reference.backward()
    model.zero_grad()
    optimizer = KFAC(model, T=1)
    result = model(x, memory, need_weights=False)
    torch.testing.assert_close(result, reference, rtol=0, atol=1e-12)
    result.backward()
    optimizer.step()
    in_proj, out_proj = optimizer.layers[:2]
    assert (in_proj.name, out_proj.name) == ("attn.in_proj", "attn.out_proj")
    x_in, k_in, _, attended = inputs
    q, k, v, o = outputs
    if mode == "self":  # one packed product: rows [q k v] of one input
        expected = expand_factors([x_in], [torch.cat([q.grad, k.grad, v.grad], -1)], B)
    else:  # the query rows on x, the key-value rows on the memory
        zeros = lambda t, n: torch.zeros(*t.shape[:-1], n, dtype=t.dtype)  # noqa: E731
        g_q = torch.cat([q.grad, zeros(q, 2 * E)], -1)
        g_kv = torch.cat([zeros(k, E), k.grad, v.grad], -1)
        expected = expand_factors([x_in, k_in], [g_q, g_kv], B)
    for actual, wanted in zip(kfac_factors(optimizer, in_proj), expected, strict=True):
        torch.testing.assert_close(actual, wanted, rtol=1e-10, atol=1e-14)
    expected = expand_factors([attended], [o.grad], B)
    for actual, wanted in zip(kfac_factors(optimizer, out_proj), expected, strict=True):
        torch.testing.assert_close(actual, wanted, rtol=1e-10, atol=1e-14)


def test_transformer_encoder_trains_every_parameter() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(
        E, HEADS, dim_feedforward=8, batch_first=True, dropout=0.0
    )
    model = nn.Sequential(
        nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Linear(E, 2)
    )
    optimizer = SINGD(model, T=1, lr=0.01)
    names = [layer.name for layer in optimizer.layers]
    assert (
        "0.layers.0.self_attn.in_proj" in names
        and "0.layers.0.self_attn.out_proj" in names
    )
    before = {n: p.clone() for n, p in model.named_parameters()}
    x, y = torch.randn(4, 3, E), torch.randint(0, 2, (4,))
    nn.functional.cross_entropy(model(x).mean(1), y).backward()
    optimizer.step()
    for name, param in model.named_parameters():
        assert not torch.equal(param, before[name]), name


class _Stack(nn.Module):
    """An encoder and a decoder layer in either layout, one loss term per example."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        options = {"dim_feedforward": 7, "dropout": 0.0, "batch_first": batch_first}
        self.batch_first = batch_first
        self.encoder = nn.TransformerEncoderLayer(E, HEADS, **options)
        self.decoder = nn.TransformerDecoderLayer(E, HEADS, **options)
        self.head = nn.Linear(E, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, L, E] always
        x = x if self.batch_first else x.transpose(0, 1)
        y = self.decoder(x, self.encoder(x))
        y = y if self.batch_first else y.transpose(0, 1)
        return self.head(y.mean(1))


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_sequence_first_transformer_layers_have_batch_first_factors(approx) -> None:
    """The feed-forward `Linear`s of `batch_first=False` layers see `[L, B, E]`.

    Before, their statistics took the sequence as the batch: with `"expand"` the
    output-side factors were `L / B` times too large, with `"reduce"` both wrong.
    """
    X = torch.randn(B, L, E, dtype=torch.float64)
    y = torch.randint(0, 2, (B,))
    factors = []
    for batch_first in (True, False):
        model = _Stack(batch_first).double()
        optimizer = KFAC(model, lr=0.0, T=1, kfac_approx=approx, fallback="sgd")
        nn.functional.cross_entropy(model(X), y).backward()
        optimizer.step()
        factors.append(
            {
                layer.name: (state["A.mat"], state["G.mat"])
                for layer in optimizer.layers
                for state in [optimizer.state[layer.weight]]
            }
        )
    assert {"encoder.linear1", "decoder.linear2"} <= set(factors[0])
    assert factors[0].keys() == factors[1].keys()
    for name, (A, G) in factors[0].items():
        torch.testing.assert_close(factors[1][name][0], A, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(factors[1][name][1], G, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("batch_first", [True, False])
def test_an_unbatched_sequence_is_one_example(batch_first) -> None:
    """`[L, E]` into a Transformer layer: its feed-forward layers see one example.

    Before, their 2-D input was taken as `L` examples: output-side factors `L`
    times too large next to the attention's.
    """
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(
        E, HEADS, dim_feedforward=7, dropout=0.0, batch_first=batch_first
    ).double()
    x = torch.randn(L, E, dtype=torch.float64)
    factors = []
    for batched in (False, True):
        model = copy.deepcopy(layer)
        optimizer = KFAC(model, lr=0.0, T=1, fallback="sgd")
        inputs = x.unsqueeze(0 if batch_first else 1) if batched else x
        model(inputs).square().sum().backward()
        optimizer.step()
        factors.append(
            [optimizer.state[layer.weight]["G.mat"] for layer in optimizer.layers]
        )
    for unbatched, batched in zip(*factors, strict=True):
        torch.testing.assert_close(unbatched, batched, rtol=1e-12, atol=0.0)


class _ScaledQuery(nn.MultiheadAttention):
    """Scales its query in its own `forward`."""

    def forward(self, query, key, value, **kwargs):
        return super().forward(3 * query, key, value, **kwargs)


def test_an_attention_subclass_with_its_own_forward_goes_to_the_fallback() -> None:
    """Before, the adapter recomputed the output without the subclass's change."""
    torch.manual_seed(0)
    block = Block("self")
    block.attn = _ScaledQuery(E, HEADS, batch_first=True)
    block.double()
    nn.init.normal_(block.attn.in_proj_bias)
    x, memory = _inputs(batch_first=True)
    expected = block(x, memory)
    optimizer = SINGD(block, lr=0.1, T=1)
    assert [layer.name for layer in optimizer.layers] == ["head"]
    assert set(block.attn.parameters()) <= set(optimizer.fallback_params)
    torch.testing.assert_close(block(x, memory), expected, rtol=0.0, atol=0.0)
