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

    def add(self, a: Tensor, g: Tensor, num_examples: int) -> None:
        r"""Keep a micro-batch's `"expand"` rows (references, not copies).

        Args:
            a: Input rows `[N_b S, d_K]`, example-major, \(\hat x / \sqrt{N_b S}\).
            g: Output-gradient rows `[N_b S, d_C]`, in the same order.
            num_examples: \(N_b\).
        """
        positions = a.shape[0] // num_examples
        self.chunks.append(
            (
                a.unflatten(0, (num_examples, positions)),
                g.unflatten(0, (num_examples, positions)),
                float(num_examples * positions),
            )
        )

    def squared_projections(self, Q_K: Tensor, Q_C: Tensor) -> Tensor:
        r"""Return `scale` times \(\Sigma\) for the bases \(Q_K\), \(Q_C\).

        Computed in at least float32 (and summed over the processes with `reduce`).

        Args:
            Q_K: Orthogonal `[d_K, d_K]`, the basis vectors as columns.
            Q_C: Orthogonal `[d_C, d_C]`.

        Returns:
            Tensor `[d_C, d_K]`.
        """
        dtype = torch.promote_types(
            torch.promote_types(Q_K.dtype, Q_C.dtype), torch.float32
        )
        Q_K, Q_C = Q_K.to(dtype), Q_C.to(dtype)
        total = Q_K.new_zeros(Q_C.shape[0], Q_K.shape[0])
        for a, g, weight in self.chunks:
            rotated = (a.to(dtype) @ Q_K, g.to(dtype) @ Q_C)
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
