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
pairs, never a \(d_C \times V\) matrix per example.
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
    """

    examples: Tensor
    columns: Tensor
    values: Tensor
    g: Tensor
    num_examples: int

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
        g = self.g.to(dtype)
        g = g if Q_C is None else g @ Q_C
        pairs, slot = torch.unique(
            self.examples * d_K + self.columns, return_inverse=True
        )
        per_pair = g.new_zeros(pairs.numel(), g.shape[1])
        per_pair.index_add_(0, slot, g * self.values.to(dtype).unsqueeze(1))
        total = g.new_zeros(d_K, g.shape[1])
        return total.index_add_(0, pairs % d_K, per_pair.square_()).T


@dataclass(slots=True)
class ExampleGradients:
    r"""The rows of one layer's pass, for sums of squared per-example gradients.

    Attributes:
        chunks: Per micro-batch, the input rows `[N_b, S, d_K]`, the output-gradient
            rows `[N_b, S, d_C]` and the weight \(N_b S\) that undoes the rows'
            normalisation.
        sparse: Per micro-batch of one-hot input rows, their entries.
        scale: Factor applied to \(\Sigma\) (the collector's \(\nu(N)\) and
            gradient-scale correction).
        reduce: Sums \(\Sigma\) over the processes of a data-parallel run (set by
            `distributed.StatisticsExchange`); None in a single process.
    """

    chunks: list[tuple[Tensor, Tensor, float]] = field(default_factory=list)
    sparse: list[SparseUse] = field(default_factory=list)
    scale: float = 1.0
    reduce: Callable[[Tensor], Tensor] | None = None
    pass_id: int | None = None

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
        last = self.chunks[-1] if self.chunks else None
        joined = (
            last is not None
            and pass_id is not None
            and pass_id == self.pass_id
            and last[0].shape[0] == num_examples
        )
        if joined:
            a_last, g_last, w_last = last
            self.chunks[-1] = (
                torch.cat([a_last * w_last**0.5, a * weight**0.5], dim=1),
                torch.cat([g_last, g], dim=1),
                1.0,
            )
        else:
            self.chunks.append((a, g, weight))
        self.pass_id = pass_id

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
        )
        last = self.sparse[-1] if self.sparse else None
        if (
            last is not None
            and pass_id is not None
            and pass_id == self.pass_id
            and last.num_examples == num_examples
        ):
            self.sparse[-1] = last.joined(use)
        else:
            self.sparse.append(use)
        self.pass_id = pass_id

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
        for tensor in (Q_K, Q_C, *(t for c in self.chunks for t in c[:2]), *sparse):
            if tensor is not None:
                dtype = torch.promote_types(dtype, tensor.dtype)
        total = torch.zeros(dims[1], dims[0], dtype=dtype, device=device)
        for rows_a, rows_g, weight in self.chunks:
            a, g = rows_a.to(dtype), rows_g.to(dtype)
            rotated = (
                a if Q_K is None else a @ Q_K.to(dtype),
                g if Q_C is None else g @ Q_C.to(dtype),
            )
            total.add_(_sum_of_squares(*rotated), alpha=weight)
        if self.sparse and Q_K is not None:
            raise ValueError(
                "One-hot input rows need a diagonal input factor (basis Q_K = I)."
            )
        for use in self.sparse:
            Q = None if Q_C is None else Q_C.to(dtype)
            total.add_(use.sum_of_squares(Q, dims[0], dtype))
        if self.reduce is not None:
            total = self.reduce(total)
        return total.mul_(self.scale)


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
