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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

# at most this many intermediate numbers per chunk of examples (64 MiB in float32)
CHUNK_NUMBERS = 2**24


@dataclass(slots=True)
class ExampleGradients:
    r"""The rows of one layer's pass, for sums of squared per-example gradients.

    Attributes:
        chunks: Per micro-batch, the input rows `[N_b, S, d_K]`, the output-gradient
            rows `[N_b, S, d_C]` and the weight \(N_b S\) that undoes the rows'
            normalisation.
        scale: Factor applied to \(\Sigma\) (the collector's \(\nu(N)\) and
            gradient-scale correction).
        reduce: Sums \(\Sigma\) over the processes of a data-parallel run (set by
            `distributed.StatisticsExchange`); None in a single process.
    """

    chunks: list[tuple[Tensor, Tensor, float]] = field(default_factory=list)
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
        """
        dtype = torch.float32
        for tensor in (Q_K, Q_C, *(t for chunk in self.chunks for t in chunk[:2])):
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
