"""`nn.MultiheadAttention`: unchanged outputs and gradients, exact factors."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from singd_curvlinops import KFAC, SINGD
from singd_curvlinops.layers import attention, attention_core
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
    """The random state after one unhooked call from seed 1 (a collecting call must
    not consume extra random numbers)."""
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


def _masks(layout: str) -> dict[str, dict]:
    """The mask arguments of a self-attention call on `L` positions."""
    batch = 1 if layout == "unbatched" else B
    upper = torch.ones(L, L, dtype=torch.bool).triu(1)
    return {
        "none": {},
        "boolean": {"attn_mask": upper},
        "additive": {"attn_mask": torch.randn(L, L, dtype=torch.float64)},
        "per-head": {"attn_mask": torch.rand(batch * HEADS, L, L) < 0.3},
        "causal": {
            "attn_mask": nn.Transformer.generate_square_subsequent_mask(
                L, dtype=torch.float64
            ),
            "is_causal": True,
        },
    }


def _self_attention_run(layout: str, masks: str, padding: bool) -> tuple:
    """One training call of a self-attention block under KFAC (T=1, dropout 0.5).

    Returns the output, the gradients, the random state after the call and the
    factors of both projections.
    """
    torch.manual_seed(0)
    model = Block("self", batch_first=layout == "batch-first", dropout=0.5).double()
    optimizer = KFAC(model, T=1, lr=0.0)
    x = torch.randn(L, E, dtype=torch.float64) if layout == "unbatched" else None
    if x is None:
        x, _ = _inputs(layout == "batch-first")
    x.requires_grad_()
    torch.manual_seed(2)
    kwargs = {"need_weights": False, **_masks(layout)[masks]}
    if padding:  # of the attention mask's type (PyTorch deprecates mixing them)
        attn_mask = kwargs.get("attn_mask")
        additive = attn_mask is not None and attn_mask.is_floating_point()
        mask = torch.zeros(L if layout == "unbatched" else (B, L), dtype=torch.bool)
        mask[..., -1] = True
        if additive:
            mask = torch.zeros_like(mask, dtype=torch.float64).masked_fill(mask, -1e4)
        kwargs["key_padding_mask"] = mask
    torch.manual_seed(1)
    out = model(x, None, **kwargs)
    state = torch.get_rng_state()
    out.backward()
    grads = [x.grad, *(p.grad for p in model.parameters())]
    optimizer.step()
    factors = [kfac_factors(optimizer, layer) for layer in optimizer.layers[:2]]
    return out, grads, state, factors


@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("masks", ["none", "boolean", "additive", "per-head", "causal"])
@pytest.mark.parametrize("layout", ["batch-first", "sequence-first", "unbatched"])
def test_direct_attention_equals_the_recomputation_with_identity_projections(
    layout, masks, padding, monkeypatch
) -> None:
    """`need_weights=False` calls compute attention from the projected tensors.

    The same output, gradients, dropout masks and statistics as the general
    recomputation (the module run with identity projections), which is not used.
    """

    def identity_projections_are_not_used(call):
        raise AssertionError("the direct path ran the module with identities")

    with monkeypatch.context() as patch:
        patch.setattr(
            attention, "_identity_projections", identity_projections_are_not_used
        )
        direct = _self_attention_run(layout, masks, padding)
    monkeypatch.setattr(attention_core, "direct", lambda call: False)
    general = _self_attention_run(layout, masks, padding)
    out, grads, state, factors = direct
    out_ref, grads_ref, state_ref, factors_ref = general
    torch.testing.assert_close(out, out_ref, rtol=0, atol=1e-12)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-12)
    assert state.equal(state_ref)
    for pair, pair_ref in zip(factors, factors_ref, strict=True):
        for factor, factor_ref in zip(pair, pair_ref, strict=True):
            torch.testing.assert_close(factor, factor_ref, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize(
    ("options", "need_weights", "direct"),
    [
        ({}, False, True),
        ({}, True, False),
        ({"add_bias_kv": True}, False, False),
        ({"add_zero_attn": True}, False, False),
    ],
)
def test_identity_projections_only_where_the_direct_path_cannot_attend(
    options, need_weights, direct, monkeypatch
) -> None:
    calls = []
    identity = attention._identity_projections
    monkeypatch.setattr(
        attention,
        "_identity_projections",
        lambda call: calls.append(call) or identity(call),
    )
    model = Block("self", batch_first=True, **options).double()
    optimizer = SINGD(model, T=1)
    x, memory = _inputs(True)
    model(x, memory, need_weights=need_weights).backward()
    assert optimizer._collector.pending, "no statistics were collected"
    assert len(calls) == (0 if direct else 1)


class _AttentionThenDropout(nn.Module):
    """Self-attention with dropout, then a dropout on its output, then a read-out."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(
            E, HEADS, dropout=0.5, batch_first=batch_first
        )
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(E, 2)

    def forward(self, x, need_weights):
        out, _ = self.attn(x, x, x, need_weights=need_weights)
        return self.head(self.drop(out)).sum()


@pytest.mark.parametrize("need_weights", [False, True])  # direct and identity route
@pytest.mark.parametrize("batch_first", [True, False])
def test_a_dropout_after_the_attention_draws_the_unmodified_models_mask(
    batch_first, need_weights
) -> None:
    """The output of a collecting call is laid out in memory as the module's.

    Before, with `batch_first=True` the recomputed output was contiguous where the
    module returns a transposed view of a sequence-first tensor: a dropout after it
    drew the same numbers in another order, a different mask than without the
    optimizer.
    """
    torch.manual_seed(0)
    model = _AttentionThenDropout(batch_first).double()
    reference = copy.deepcopy(model)
    optimizer = SINGD(model, T=1)
    x, _ = _inputs(batch_first)
    results = []
    for net in (model, reference):
        torch.manual_seed(1)
        out = net(x, need_weights)
        results.append((out, torch.autograd.grad(out, [x, *net.parameters()])))
    (out, grads), (out_ref, grads_ref) = results
    assert optimizer._collector.pending, "no statistics were collected"
    torch.testing.assert_close(out, out_ref, rtol=0, atol=1e-12)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-12)


class _Calls(TorchFunctionMode):
    """Counts the calls of one torch function (outside the capture's mode)."""

    def __init__(self, func) -> None:
        super().__init__()
        self.func, self.count = func, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: PLW3201
        self.count += func is self.func
        return func(*args, **(kwargs or {}))


def test_a_collecting_call_attends_once() -> None:
    """The projections are exposed inside the module's own call, not by a rerun."""
    torch.manual_seed(0)
    model = Block("self", batch_first=True).double()
    optimizer = SINGD(model, T=1)
    x, memory = _inputs(True)
    with _Calls(nn.functional.scaled_dot_product_attention) as calls:
        model(x, memory, need_weights=False).backward()
    assert optimizer._collector.pending, "no statistics were collected"
    assert calls.count == 1


def test_a_call_that_raises_leaves_no_capture_behind() -> None:
    """The forward hook that leaves the capture also runs when the call raises."""
    torch.manual_seed(0)
    model = Block("self", batch_first=True).double()
    optimizer = SINGD(model, T=1)
    x, memory = _inputs(True)
    wrong_mask = torch.zeros(L + 1, L + 1, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="attn_mask"):
        model(x, memory, attn_mask=wrong_mask)
    assert torch._C._len_torch_function_stack() == 0
    model(x, memory, need_weights=False).backward()  # collects as before
    assert optimizer._collector.pending, "no statistics were collected"


ALIASES = {
    "same": lambda t: t,
    "view": lambda t: t.view_as(t),
    "detached": torch.detach,
}


def _attend(inputs: Callable, hooked: bool) -> tuple:
    """Run self-attention's module on `inputs(x)`; return output, grads, factors.

    `inputs` maps the input `x` to the leaf whose gradient is compared and the
    query, key and value. The factors (KFAC's, after one step) are None unhooked.
    """
    torch.manual_seed(0)
    model = nn.MultiheadAttention(E, HEADS, batch_first=True).double()
    optimizer = KFAC(model, lr=0.0, T=1, fallback="sgd") if hooked else None
    x, _ = _inputs(batch_first=True)
    leaf, query, key, value = inputs(x)
    out = model(query, key, value, need_weights=False)[0]
    out.square().sum().backward()
    grads = [leaf.grad, *(p.grad for p in model.parameters())]
    if optimizer is None:
        return out, grads, None
    optimizer.step()
    return out, grads, [kfac_factors(optimizer, layer) for layer in optimizer.layers]


def _assert_plain_with_factors_of(inputs: Callable, factors_of: Callable) -> None:
    """Hooked, the module's output and gradients are those of the unhooked one,
    and its factors those of a run on `factors_of(x)`."""
    out, grads, factors = _attend(inputs, hooked=True)
    out_plain, grads_plain, _ = _attend(inputs, hooked=False)
    torch.testing.assert_close(out, out_plain, rtol=0, atol=1e-12)
    for g, g_plain in zip(grads, grads_plain, strict=True):
        torch.testing.assert_close(g, g_plain, rtol=0, atol=1e-12)
    _, _, expected = _attend(factors_of, hooked=True)
    for pair, pair_expected in zip(factors, expected, strict=True):
        for factor, factor_expected in zip(pair, pair_expected, strict=True):
            torch.testing.assert_close(factor, factor_expected, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_inputs_that_alias_one_tensor_are_self_attention(alias: str) -> None:
    """`attn(x, a(x), a(x))` with `a(x)` aliasing `x`: one packed use, own gradients.

    FSDP2's pre-forward hook hands an attention unit its inputs this way; before,
    the adapter took them for cross-attention (three uses, no cross terms in `G`).
    Each input keeps its own gradient path: with detached keys and values no
    gradient reaches `x` through them, as without the optimizer.
    """
    make = ALIASES[alias]
    _assert_plain_with_factors_of(
        lambda x: (x, x, make(x), make(x)), lambda x: (x, x, x, x)
    )


def _stacked(x: Tensor) -> Tensor:
    return torch.stack([x, x.flip(1), 2 * x]).detach().requires_grad_()


def test_views_of_one_storage_at_other_offsets_are_distinct_inputs() -> None:
    """Query, key and value as slices of one stacked tensor (the same storage,
    shape and strides, other offsets) hold other numbers: not self-attention,
    but three uses, as for three separate tensors."""

    def views(x: Tensor) -> tuple:
        stacked = _stacked(x)
        return stacked, *stacked.unbind(0)

    def separate(x: Tensor) -> tuple:
        stacked = _stacked(x)
        return stacked, *(t.clone() for t in stacked.unbind(0))

    _assert_plain_with_factors_of(views, separate)
