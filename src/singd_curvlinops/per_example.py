r"""Per-example gradients, kept as rows, and their squares in a Kronecker eigenbasis.

A layer's gradient on example \(n\) is \(\nabla_n = \sum_s g_{n,s} \hat x_{n,s}^\top
\in \mathbb{R}^{d_C \times d_K}\), summed over the weight-sharing positions \(s\)
(the output locations of a convolution, the sequence of a transformer layer), with
\(\hat x = [x; 1]\) for a layer with bias. EKFAC (George et al., 2018) needs, for
orthogonal bases \(Q_K\), \(Q_C\) of the two sides, the sums of squares

\[
\Sigma = \sum_n \bigl(Q_C^\top \nabla_n Q_K\bigr)^{\odot 2} \in \mathbb{R}^{d_C
\times d_K},
\]

where the bases are the eigenvectors of factors that are known only once the whole
pass has been collected. `ExampleGradients` therefore keeps the rows of the pass
(curvlinops' `"expand"` rows of `singd_curvlinops.statistics`, as the adapters
give them: \(a = \hat x / \sqrt{N_b S}\) for a micro-batch of \(N_b\) examples
with \(S\) positions each, and \(\tilde g\)) and forms \(\Sigma\) when asked,
without holding all \(\nabla_n\) at once: with rotated rows \(\bar a = a Q_K\),
\(\bar g = \tilde g Q_C\),

\[
\Sigma_{ij} = \sum_n \sum_{s,t} \bar g_{n,s,i}\, \bar g_{n,t,i}\;
\bar a_{n,s,j}\, \bar a_{n,t,j}
\]

is one matrix product of the position Gramians, \(S^2 (d_C + d_K)\) numbers per
example, or else the squared per-example products \(\bar g_n^\top \bar a_n\),
\(d_C d_K\) numbers per example, whichever is smaller; examples go in chunks of
at most `CHUNK_NUMBERS` such numbers.

One-hot input rows (`SparseRows` of an embedding, whose input factor is diagonal,
so \(Q_K = I\)) are kept as entries: entry \(e\) of example \(n_e\) puts
\(v_e \bar g_{r_e}\) into column \(c_e\) of \(\nabla_{n_e}\) (\(r_e\) its row,
\(v_e\) its value), so \(\Sigma\) is a sum over the distinct (example, column)
pairs, never a \(d_C \times V\) matrix per example. Where a one-hot use and a
dense use of one pass meet (an embedding tied to an output layer: the head's
transposed use gives dense rows in the embedding's orientation, \(a\) its output
gradients and \(\tilde g\) its inputs), each example's gradient is their sum, so
that per example (in chunks) the dense product is formed and the entries are
added into it before squaring.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from singd_curvlinops.statistics import SparseRows

# at most this many intermediate numbers per chunk of examples (64 MiB in float32)
CHUNK_NUMBERS = 2**24


@dataclass(frozen=True, slots=True)
class SparseUse:
    r"""One-hot input rows of a micro-batch as entries, normalisation undone.

    Attributes:
        examples: Example \(n_e\) of each entry, `[nnz]`.
        columns: Column \(c_e\) of each entry, `[nnz]`.
        values: Value \(v_e\) of each entry times \(\sqrt{N_b S}\), `[nnz]`.
        g: Output-gradient row of each entry's position, `[nnz, d_C]`.
        num_examples: \(N_b\).
        pass_id: The backward pass of its uses (None: unknown).
    """

    examples: Tensor
    columns: Tensor
    values: Tensor
    g: Tensor
    num_examples: int
    pass_id: int | None = None

    def joined(self, other: SparseUse) -> SparseUse:
        """Return the entries of both uses (one pass over the same examples).

        Args:
            other: A later use of the pass.

        Returns:
            The concatenated entries.
        """
        return SparseUse(
            torch.cat([self.examples, other.examples]),
            torch.cat([self.columns, other.columns]),
            torch.cat([self.values, other.values]),
            torch.cat([self.g, other.g]),
            self.num_examples,
            self.pass_id,
        )

    def sum_of_squares(
        self, Q_C: Tensor | None, d_K: int, dtype: torch.dtype
    ) -> Tensor:
        r"""Return \(\sum_n (Q_C^\top \nabla_n)^{\odot 2}\), `[d_C, d_K]`.

        Entries of one (example, column) pair are summed before squaring.

        Args:
            Q_C: Orthogonal `[d_C, d_C]` of `dtype`, or None for the identity.
            d_K: The number of columns (the vocabulary).
            dtype: The dtype of the computation.

        Returns:
            The sums of squares.
        """
        pairs, slot = torch.unique(
            self.examples * d_K + self.columns, return_inverse=True
        )
        contributions = self.rotated(Q_C, dtype)
        per_pair = contributions.new_zeros(pairs.numel(), contributions.shape[1])
        per_pair.index_add_(0, slot, contributions)
        total = contributions.new_zeros(d_K, contributions.shape[1])
        return total.index_add_(0, pairs % d_K, per_pair.square_()).T

    def rotated(self, Q_C: Tensor | None, dtype: torch.dtype) -> Tensor:
        r"""Return each entry's part of its column of \(Q_C^\top \nabla_{n_e}\).

        That is \(v_e Q_C^\top g_e\).

        Args:
            Q_C: Orthogonal `[d_C, d_C]` of `dtype`, or None for the identity.
            dtype: The dtype of the computation.

        Returns:
            Tensor `[nnz, d_C]` (as rows).
        """
        g = self.g.to(dtype)
        g = g if Q_C is None else g @ Q_C
        return g * self.values.to(dtype).unsqueeze(1)


@dataclass(frozen=True, slots=True)
class DenseUse:
    r"""Dense rows of a micro-batch's uses, one block of positions per example.

    Attributes:
        a: Input rows `[N_b, S, d_K]`.
        g: Output-gradient rows `[N_b, S, d_C]`.
        weight: \(N_b S\), which undoes the rows' normalisation (1 for joined
            uses, whose rows carry it).
        pass_id: The backward pass of its uses (None: unknown).
    """

    a: Tensor
    g: Tensor
    weight: float
    pass_id: int | None = None

    @property
    def num_examples(self) -> int:
        r"""\(N_b\)."""
        return self.a.shape[0]

    def joined(self, other: DenseUse) -> DenseUse:
        """Return the rows of both uses (one pass over the same examples).

        Args:
            other: Another use of the pass.

        Returns:
            The rows concatenated along the positions, normalisation undone.
        """
        return DenseUse(
            torch.cat([self.a * self.weight**0.5, other.a * other.weight**0.5], 1),
            torch.cat([self.g, other.g], dim=1),
            1.0,
            self.pass_id,
        )


@dataclass(slots=True)
class ExampleGradients:
    r"""The rows of one layer's pass, for sums of squared per-example gradients.

    A micro-batch's uses in one backward pass sum into one gradient per example:
    dense uses are joined along the positions (`add`), one-hot uses into one
    `SparseUse`, and a dense and a one-hot use of the same pass (an embedding
    tied to an output layer, whose transposed use gives dense rows) are squared
    together (`squared_projections`).

    Attributes:
        chunks: Per micro-batch, its dense uses.
        sparse: Per micro-batch, its one-hot uses' entries.
        scale: Factor applied to \(\Sigma\) (the collector's \(\nu(N)\) and
            gradient-scale correction).
        reduce: Sums \(\Sigma\) over the processes of a data-parallel run (set by
            `distributed.StatisticsExchange`); None in a single process.
    """

    chunks: list[DenseUse] = field(default_factory=list)
    sparse: list[SparseUse] = field(default_factory=list)
    scale: float = 1.0
    reduce: Callable[[Tensor], Tensor] | None = None

    def add(
        self, a: Tensor, g: Tensor, num_examples: int, pass_id: int | None = None
    ) -> None:
        r"""Keep a use's `"expand"` rows (references, unless uses are joined).

        Uses of one backward pass (a layer applied several times, tied weights)
        contribute to the same per-example gradients: their rows are joined along
        the positions, each with its normalisation undone.

        Args:
            a: Input rows `[N_b S, d_K]`, example-major, \(\hat x / \sqrt{N_b S}\).
            g: Output-gradient rows `[N_b S, d_C]`, in the same order.
            num_examples: \(N_b\).
            pass_id: The use's backward pass (None: unknown, never joined).
        """
        if not num_examples or not a.shape[0]:
            return  # an empty batch has no per-example gradients
        if isinstance(a, SparseRows):
            self._add_sparse(a, g, num_examples, pass_id)
            return
        positions = a.shape[0] // num_examples
        a = a.unflatten(0, (num_examples, positions))
        g = g.unflatten(0, (num_examples, positions))
        weight = float(num_examples * positions)
        _keep(self.chunks, DenseUse(a, g, weight, pass_id))

    def merge(self, other: ExampleGradients) -> None:
        """Take the uses of a tied weight's other orientation (`Layer.twin`).

        Args:
            other: The twin's rows, already in this layer's orientation
                (`a` the twin's output gradients, `g` its inputs); uses of a
                pass that this record also saw join its gradients per example.
        """
        for dense in other.chunks:
            _keep(self.chunks, dense)
        for use in other.sparse:
            _keep(self.sparse, use)

    def _add_sparse(
        self, a: SparseRows, g: Tensor, num_examples: int, pass_id: int | None
    ) -> None:
        r"""Keep one-hot rows as entries (see `add`; joined like dense rows).

        Args:
            a: The rows, with the row of each entry.
            g: Output-gradient rows `[N_b S, d_C]`.
            num_examples: \(N_b\).
            pass_id: The use's backward pass.

        Raises:
            ValueError: If the rows do not say which row each entry is in.
        """
        if a.rows is None:
            raise ValueError(
                "Per-example gradients (EKFAC) need the row of every entry of "
                "sparse input rows: the layer adapter's SparseRows must set `rows`."
            )
        positions = a.num_rows // num_examples
        use = SparseUse(
            examples=a.rows // positions,
            columns=a.columns,
            values=a.values * float(num_examples * positions) ** 0.5,
            g=g[a.rows],
            num_examples=num_examples,
            pass_id=pass_id,
        )
        _keep(self.sparse, use)

    def squared_projections(
        self,
        Q_K: Tensor | None,
        Q_C: Tensor | None,
        *,
        dims: tuple[int, int],
        device: torch.device,
    ) -> Tensor:
        r"""Return `scale` times \(\Sigma\) for the bases \(Q_K\), \(Q_C\).

        Computed in at least float32 (and summed over the processes with `reduce`).

        Args:
            Q_K: Orthogonal `[d_K, d_K]`, the basis vectors as columns; None for
                the identity.
            Q_C: Orthogonal `[d_C, d_C]`, or None.
            dims: `(d_K, d_C)` (a process without rows contributes zeros).
            device: The device of the result.

        Returns:
            Tensor `[d_C, d_K]`.

        Raises:
            ValueError: If one-hot rows meet a basis \(Q_K\) other than the
                identity (their layer's input factor must be diagonal).
        """
        dtype = torch.float32
        sparse = (t for use in self.sparse for t in (use.values, use.g))
        for tensor in (
            Q_K,
            Q_C,
            *(t for c in self.chunks for t in (c.a, c.g)),
            *sparse,
        ):
            if tensor is not None:
                dtype = torch.promote_types(dtype, tensor.dtype)
        total = torch.zeros(dims[1], dims[0], dtype=dtype, device=device)
        if self.sparse and Q_K is not None:
            raise ValueError(
                "One-hot input rows need a diagonal input factor (basis Q_K = I)."
            )
        Q_C = None if Q_C is None else Q_C.to(dtype)
        # a one-hot use of a dense use's pass is squared with it, once
        partners = {use.pass_id: use for use in self.sparse}
        paired = set()
        for dense in self.chunks:
            a, g = dense.a.to(dtype), dense.g.to(dtype)
            a = a if Q_K is None else a @ Q_K.to(dtype)
            g = g if Q_C is None else g @ Q_C
            partner = partners.get(dense.pass_id)
            if _same_pass(partner, dense.pass_id, dense.num_examples):
                paired.add(id(partners.pop(dense.pass_id)))
                total.add_(_sum_of_mixed_squares(a, g, dense.weight, partner, Q_C))
            else:
                total.add_(_sum_of_squares(a, g), alpha=dense.weight)
        for use in self.sparse:
            if id(use) not in paired:
                total.add_(use.sum_of_squares(Q_C, dims[0], dtype))
        if self.reduce is not None:
            total = self.reduce(total)
        return total.mul_(self.scale)


def _keep(uses: list, use: DenseUse | SparseUse) -> None:
    """Join `use` into the kept use of its pass, or keep it as a use of its own.

    Args:
        uses: The kept uses of one kind (dense, or one-hot).
        use: A new use of that kind.
    """
    for index, kept in enumerate(uses):
        if _same_pass(kept, use.pass_id, use.num_examples):
            uses[index] = kept.joined(use)
            return
    uses.append(use)


def _same_pass(
    last: DenseUse | SparseUse | None, pass_id: int | None, num_examples: int
) -> bool:
    """Return whether a use belongs to the gradients per example of `last`.

    Args:
        last: An earlier use (None: none).
        pass_id: The later use's backward pass (None: unknown, never joined).
        num_examples: Its number of examples.

    Returns:
        True for the same known pass over the same examples.
    """
    return (
        last is not None
        and pass_id is not None
        and last.pass_id == pass_id
        and last.num_examples == num_examples
    )


def _sum_of_mixed_squares(
    a: Tensor, g: Tensor, weight: float, use: SparseUse, Q_C: Tensor | None
) -> Tensor:
    r"""Return \(\sum_n (D_n + S_n)^{\odot 2}\) for dense and one-hot uses of a pass.

    \(D_n = \sqrt{w}\, g_n^\top a_n\) (rotated rows, `_sum_of_squares`) and
    \(S_n\) the one-hot entries' columns \(v_e Q_C^\top g_e\) (`SparseUse`)
    sum into each example's gradient before squaring; per example this is a
    `[d_K, d_C]` matrix, in chunks of at most `CHUNK_NUMBERS` numbers.

    Args:
        a: Rotated input rows `[N, S, d_K]`.
        g: Rotated output-gradient rows `[N, S, d_C]`.
        weight: \(w\), the dense rows' normalisation to undo.
        use: The one-hot entries of the same examples.
        Q_C: The output basis (None: the identity), in `g`'s dtype.

    Returns:
        Tensor `[d_C, d_K]`.
    """
    num, _, d_K = a.shape
    d_C = g.shape[-1]
    order = torch.argsort(use.examples, stable=True)
    examples, columns = use.examples[order], use.columns[order]
    entries = use.rotated(Q_C, g.dtype)[order]
    # entries of examples [k, l) are [bounds[k], bounds[l]) (one host read)
    bounds = torch.searchsorted(examples, torch.arange(num + 1, device=a.device))
    bounds = bounds.tolist()
    step = max(1, CHUNK_NUMBERS // (d_C * d_K))
    total = a.new_zeros(d_K, d_C)
    for start in range(0, num, step):
        stop = min(start + step, num)
        per_example = torch.bmm(a[start:stop].mT, g[start:stop]).mul_(weight**0.5)
        first, last = bounds[start], bounds[stop]
        slots = (examples[first:last] - start) * d_K + columns[first:last]
        per_example.view(-1, d_C).index_add_(0, slots, entries[first:last])
        total.add_(per_example.square_().sum(0))
    return total.T


def _sum_of_squares(a: Tensor, g: Tensor) -> Tensor:
    r"""Return \(\sum_n (g_n^\top a_n)^{\odot 2}\) for rows `a` `[N, S, d_K]`, `g` `[N, S, d_C]`.

    Args:
        a: Input rows per example.
        g: Output-gradient rows per example.

    Returns:
        Tensor `[d_C, d_K]`.
    """  # noqa: E501
    num, positions, d_K = a.shape
    d_C = g.shape[-1]
    gramian = positions**2 * (d_C + d_K) <= d_C * d_K
    per_example = positions**2 * (d_C + d_K) if gramian else d_C * d_K
    step = max(1, CHUNK_NUMBERS // per_example)
    total = a.new_zeros(d_C, d_K)
    for start in range(0, num, step):
        a_n, g_n = a[start : start + step], g[start : start + step]
        if gramian:  # Σ_{n,s,t} (g_ns ∘ g_nt)(a_ns ∘ a_nt)ᵀ as one product
            g_pairs = (g_n.unsqueeze(2) * g_n.unsqueeze(1)).reshape(-1, d_C)
            a_pairs = (a_n.unsqueeze(2) * a_n.unsqueeze(1)).reshape(-1, d_K)
            total.addmm_(g_pairs.T, a_pairs)
        else:
            total.add_(torch.bmm(g_n.mT, a_n).square_().sum(0))
    return total
