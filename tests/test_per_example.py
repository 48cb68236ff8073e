"""`ExampleGradients`: squared projected per-example gradients, against einsum."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from singd_curvlinops import per_example
from singd_curvlinops.per_example import ExampleGradients

CPU = torch.device("cpu")


def orthogonal(dim: int, generator: torch.Generator) -> Tensor:
    matrix = torch.randn(dim, dim, generator=generator, dtype=torch.float64)
    return torch.linalg.qr(matrix).Q


def reference(chunks: list[tuple[Tensor, Tensor]], Q_K: Tensor, Q_C: Tensor) -> Tensor:
    """Σ over micro-batches of N_b S Σ_n (Q_Cᵀ (Σ_s g_ns a_nsᵀ) Q_K)²."""
    total = 0
    for a, g in chunks:
        num, positions = a.shape[:2]
        gradients = torch.einsum("nsc,nsk->nck", g, a)
        rotated = Q_C.T @ gradients @ Q_K
        total = total + num * positions * rotated.square().sum(0)
    return total


# (positions, d_K, d_C): the first two take the Gramian, the last two the
# per-example products (S² (d_C + d_K) > d_C d_K)
SHAPES = [(1, 7, 5), (2, 9, 8), (3, 4, 2), (5, 6, 3)]


@pytest.mark.parametrize("chunk_numbers", [per_example.CHUNK_NUMBERS, 1, 60])
@pytest.mark.parametrize(("positions", "d_K", "d_C"), SHAPES)
def test_squared_projections_over_micro_batches(
    monkeypatch, positions: int, d_K: int, d_C: int, chunk_numbers: int
) -> None:
    monkeypatch.setattr(per_example, "CHUNK_NUMBERS", chunk_numbers)
    generator = torch.Generator().manual_seed(positions * 100 + d_K)
    Q_K, Q_C = orthogonal(d_K, generator), orthogonal(d_C, generator)
    record, chunks = ExampleGradients(scale=2.5), []
    for num in (4, 7):  # micro-batches of different sizes
        a = torch.randn(num, positions, d_K, generator=generator, dtype=torch.float64)
        g = torch.randn(num, positions, d_C, generator=generator, dtype=torch.float64)
        record.add(a.flatten(0, 1), g.flatten(0, 1), num)
        chunks.append((a, g))
    expected = 2.5 * reference(chunks, Q_K, Q_C)
    result = record.squared_projections(Q_K, Q_C, dims=(d_K, d_C), device=CPU)
    assert result.shape == (d_C, d_K)
    assert torch.allclose(result, expected, rtol=1e-12, atol=0)


def test_reduce_sees_the_unscaled_sum_and_low_precision_is_computed_in_float32():
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(6, 3, generator=generator).bfloat16()
    g = torch.randn(6, 2, generator=generator).bfloat16()
    seen = []

    def reduce(total: Tensor) -> Tensor:
        seen.append(total.clone())
        return total * 3

    record = ExampleGradients(scale=0.5, reduce=reduce)
    record.add(a, g, 6)
    Q_K, Q_C = torch.eye(3, dtype=torch.bfloat16), torch.eye(2, dtype=torch.bfloat16)
    result = record.squared_projections(Q_K, Q_C, dims=(3, 2), device=CPU)
    unscaled = 6 * torch.einsum("nc,nk->ck", g.float().square(), a.float().square())
    assert seen[0].dtype == result.dtype == torch.float32
    assert torch.allclose(seen[0], unscaled, rtol=1e-6)
    assert torch.allclose(result, 1.5 * unscaled, rtol=1e-6)


def test_no_examples_give_zeros() -> None:
    """A process without data takes part in the collective with zeros."""
    result = ExampleGradients().squared_projections(
        torch.eye(3, dtype=torch.float64),
        torch.eye(2, dtype=torch.float64),
        dims=(3, 2),
        device=CPU,
    )
    assert torch.equal(result, torch.zeros(2, 3, dtype=torch.float64))
    without_bases = ExampleGradients().squared_projections(
        None, None, dims=(3, 2), device=CPU
    )
    assert torch.equal(without_bases, torch.zeros(2, 3, dtype=torch.float32))


def test_identity_bases_may_be_left_out() -> None:
    """A diagonal factor's basis is the identity: None means no rotation."""
    generator = torch.Generator().manual_seed(3)
    a = torch.randn(10, 4, generator=generator, dtype=torch.float64)
    g = torch.randn(10, 3, generator=generator, dtype=torch.float64)
    Q_C = orthogonal(3, generator)
    record = ExampleGradients()
    record.add(a, g, 5)
    rotated = record.squared_projections(
        torch.eye(4, dtype=torch.float64), Q_C, dims=(4, 3), device=CPU
    )
    plain = record.squared_projections(None, Q_C, dims=(4, 3), device=CPU)
    assert torch.allclose(rotated, plain, rtol=1e-13, atol=0)


def test_uses_of_one_pass_join_into_one_gradient_per_example() -> None:
    """A layer applied twice in one pass: each example's gradient sums both uses."""
    generator = torch.Generator().manual_seed(4)
    num, d_K, d_C = 5, 3, 2
    x1, x2 = (
        torch.randn(num, s, d_K, generator=generator, dtype=torch.float64)
        for s in (2, 3)
    )
    g1, g2 = (
        torch.randn(num, s, d_C, generator=generator, dtype=torch.float64)
        for s in (2, 3)
    )
    record = ExampleGradients()
    for x, g in ((x1, g1), (x2, g2)):  # rows normalised by 1/sqrt(N S) per use
        a = x / (num * x.shape[1]) ** 0.5
        record.add(a.flatten(0, 1), g.flatten(0, 1), num, pass_id=7)
    per_example = torch.einsum("nsc,nsk->nck", g1, x1) + torch.einsum(
        "nsc,nsk->nck", g2, x2
    )
    expected = per_example.square().sum(0)
    result = record.squared_projections(None, None, dims=(d_K, d_C), device=CPU)
    assert torch.allclose(result, expected, rtol=1e-12, atol=0)
    separate = ExampleGradients()  # other passes: squares summed, not joined
    for x, g in ((x1, g1), (x2, g2)):
        a = x / (num * x.shape[1]) ** 0.5
        separate.add(a.flatten(0, 1), g.flatten(0, 1), num, pass_id=None)
    apart = separate.squared_projections(None, None, dims=(d_K, d_C), device=CPU)
    assert not torch.allclose(apart, expected)


def test_uses_of_one_pass_over_other_examples_stay_apart() -> None:
    """A layer applied to the batch and to a part of it in one pass: the uses
    cannot be matched example by example, so each use's squares are summed."""
    generator = torch.Generator().manual_seed(5)
    d_K, d_C, positions = 3, 2, 2
    Q_K, Q_C = orthogonal(d_K, generator), orthogonal(d_C, generator)
    record, chunks = ExampleGradients(), []
    for num in (6, 3):
        a = torch.randn(num, positions, d_K, generator=generator, dtype=torch.float64)
        g = torch.randn(num, positions, d_C, generator=generator, dtype=torch.float64)
        record.add(a.flatten(0, 1), g.flatten(0, 1), num, pass_id=7)
        chunks.append((a, g))
    result = record.squared_projections(Q_K, Q_C, dims=(d_K, d_C), device=CPU)
    assert len(record.chunks) == 2
    assert torch.allclose(result, reference(chunks, Q_K, Q_C), rtol=1e-12, atol=0)


def one_hot_rows(tokens: Tensor, vocabulary: int, padding_idx: int | None):
    """The embedding adapter's sparse `"expand"` rows and the same rows densely."""
    from singd_curvlinops.layers import EmbeddingAdapter

    embedding = torch.nn.Embedding(vocabulary, 2, padding_idx=padding_idx).double()
    sparse = EmbeddingAdapter().input_rows(embedding, tokens, "expand")
    dense = torch.nn.functional.one_hot(tokens.reshape(-1), vocabulary).double()
    if padding_idx is not None:
        dense[:, padding_idx] = 0.0  # the padding row gets no gradient
    return sparse, dense / tokens.numel() ** 0.5


@pytest.mark.parametrize("padding_idx", [None, 2])
def test_one_hot_rows_equal_their_dense_rows(padding_idx: int | None) -> None:
    """Sparse rows (an embedding's) give Σ of the same rows stored densely, with
    micro-batches, two uses of one pass (joined) and repeated tokens."""
    generator = torch.Generator().manual_seed(5)
    vocabulary, d_C = 6, 3
    Q_C = orthogonal(d_C, generator)
    sparse_record, dense_record = ExampleGradients(), ExampleGradients()
    for pass_id, num in ((0, 4), (0, 4), (1, 3)):  # two uses in pass 0
        tokens = torch.randint(0, vocabulary, (num, 5), generator=generator)
        tokens[0, :2] = 2  # a padding token (when there is one), repeated
        g = torch.randn(num * 5, d_C, generator=generator, dtype=torch.float64)
        sparse, dense = one_hot_rows(tokens, vocabulary, padding_idx)
        sparse_record.add(sparse, g, num, pass_id)
        dense_record.add(dense, g, num, pass_id)
    dims = (vocabulary, d_C)
    expected = dense_record.squared_projections(None, Q_C, dims=dims, device=CPU)
    actual = sparse_record.squared_projections(None, Q_C, dims=dims, device=CPU)
    assert len(sparse_record.sparse) == 2  # pass 0 joined, pass 1 apart
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-14)
    if padding_idx is not None:
        assert actual[:, padding_idx].abs().max() == 0


@pytest.mark.parametrize("chunk_numbers", [per_example.CHUNK_NUMBERS, 1, 60])
@pytest.mark.parametrize("order", ["one-hot first", "dense first", "merged"])
def test_one_hot_and_dense_uses_of_one_pass_square_their_sum(
    monkeypatch: pytest.MonkeyPatch, chunk_numbers: int, order: str
) -> None:
    """An embedding tied to an output layer: its one-hot use and the head's
    transposed (dense) use sum into each example's gradient before squaring,
    added in either order or merged from the twin's record, in chunks of
    examples; as if the one-hot rows were dense rows of the same pass."""
    monkeypatch.setattr(per_example, "CHUNK_NUMBERS", chunk_numbers)
    generator = torch.Generator().manual_seed(7)
    vocabulary, d_C = 6, 3
    Q_C = orthogonal(d_C, generator)
    mixed, twin, dense_only = ExampleGradients(), ExampleGradients(), ExampleGradients()
    for pass_id, num in ((0, 4), (1, 3)):
        tokens = torch.randint(0, vocabulary, (num, 5), generator=generator)
        tokens[0, :2] = 2  # a token repeated within an example
        g = torch.randn(num * 5, d_C, generator=generator, dtype=torch.float64)
        sparse, dense = one_hot_rows(tokens, vocabulary, None)
        x_head = torch.randn(num * 2, vocabulary, generator=generator).double()
        a_head = x_head / (num * 2) ** 0.5  # two positions per example
        g_head = torch.randn(num * 2, d_C, generator=generator, dtype=torch.float64)
        uses = [(sparse, g), (a_head, g_head)]
        if order == "dense first":
            uses.reverse()
        for index, (a, g_use) in enumerate(uses):
            merged_later = order == "merged" and index == 1
            (twin if merged_later else mixed).add(a, g_use, num, pass_id)
        dense_only.add(dense, g, num, pass_id)
        dense_only.add(a_head, g_head, num, pass_id)
    if order == "merged":
        mixed.merge(twin)
    dims = (vocabulary, d_C)
    expected = dense_only.squared_projections(None, Q_C, dims=dims, device=CPU)
    actual = mixed.squared_projections(None, Q_C, dims=dims, device=CPU)
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-14)
    assert (len(mixed.sparse), len(mixed.chunks)) == (2, 2)  # one of each per pass


def test_one_hot_rows_need_the_identity_input_basis() -> None:
    generator = torch.Generator().manual_seed(6)
    record = ExampleGradients()
    sparse, _ = one_hot_rows(torch.tensor([[0, 1], [2, 1]]), 4, None)
    record.add(sparse, torch.randn(4, 2, dtype=torch.float64), 2)
    with pytest.raises(ValueError, match="diagonal input factor"):
        record.squared_projections(
            orthogonal(4, generator), None, dims=(4, 2), device=CPU
        )


def test_ekfac_trains_an_embedding_and_leaves_its_padding_row() -> None:
    """EKFAC on a model with `nn.Embedding` (one-hot inputs): the loss falls, the
    padding row never moves (regression: `SparseRows` had no per-example path)."""
    from singd_curvlinops import EKFAC

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(11, 4, padding_idx=3),
        torch.nn.Flatten(),
        torch.nn.Linear(24, 3),
    ).double()
    tokens, labels = torch.randint(0, 11, (16, 6)), torch.randint(0, 3, (16,))
    tokens[:, 0] = 3
    padding_row = model[0].weight[3].detach().clone()
    optimizer = EKFAC(model, lr=0.05, T=1, damping=0.1)
    losses = []
    for _ in range(10):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(tokens), labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert torch.equal(model[0].weight[3], padding_row)
    assert optimizer.describe() is not None
