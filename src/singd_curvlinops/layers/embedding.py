r"""`torch.nn.Embedding` as a linear layer on one-hot inputs.

A lookup `weight[i]` of a table \(E \in \mathbb{R}^{V \times D}\) is the linear map
\(y = E^\top e_i\) on the one-hot vector \(e_i \in \mathbb{R}^V\): a layer with
\(d_\text{in} = V\), \(d_\text{out} = D\), no bias and the weight stored
transposed, so \(\Gamma = (\nabla E)^\top\), `[D, V]`. With curvlinops' expand
convention over the \(N S\) looked-up positions of a batch (\(S\) per example),
its input factor is

\[
U_K = \frac{1}{N S} \sum_{n, s} e_{i_{ns}} e_{i_{ns}}^\top
    = \frac{1}{N S} \operatorname{diag}(c), \qquad c_v = \#\{(n, s): i_{ns} = v\},
\]

exactly diagonal (token counts), so the input side is always stored as a diagonal
(a dense \(K\) would stay diagonal under SINGD's update) and the rows are kept as
`SparseRows`: no \(V \times V\) or \(N S \times V\) matrix is ever formed. The
output factor \(U_C\) is that of a linear layer on the output gradients. Positions
holding `padding_idx`, whose table row PyTorch never updates, have zero input rows
(they count in \(N S\), as any position does). With `"reduce"` the input rows are
the per-example token histograms divided by \(S\); their Gram matrix is no longer
diagonal and enters through its diagonal.

Supported: `max_norm=None` (a renormalising lookup changes the table in the forward
pass) and `sparse=False`; other embeddings go to the fallback rule.
"""

from __future__ import annotations

from typing import Any

import torch
from curvlinops.kfac import KFACType
from torch import Tensor
from torch.nn import Embedding, Module, Parameter

from singd_curvlinops.layers.base import LayerAdapter
from singd_curvlinops.layers.matching import plain_forward
from singd_curvlinops.statistics import SparseRows


class EmbeddingAdapter(LayerAdapter):
    """`torch.nn.Embedding` with `max_norm=None` and `sparse=False` (module docs)."""

    description = "torch.nn.Embedding (max_norm=None, sparse=False)"
    unbatched_dims = None  # its inputs are indices (`layer_input`)
    transposed = True
    one_hot = True

    def matches(self, module: Module) -> bool:
        """Return whether `module` is a dense, non-renormalising `Embedding`.

        Args:
            module: A submodule of the model.

        Returns:
            True for `Embedding` (and subclasses that keep its `forward`) without
            `max_norm` and `sparse`.
        """
        return (
            isinstance(module, Embedding)
            and plain_forward(module, Embedding)
            and module.max_norm is None
            and not module.sparse
        )

    def bias(self, module: Module) -> Parameter | None:
        """Return None: a lookup has no bias.

        Args:
            module: An embedding.

        Returns:
            None.
        """
        return None

    def dims(self, module: Module) -> tuple[int, int]:
        """Return `(V, D)` of a `[V, D]` table.

        Args:
            module: An embedding.

        Returns:
            The vocabulary size (input side) and the embedding size.
        """
        num_embeddings, embedding_dim = module.weight.shape
        return num_embeddings, embedding_dim

    def to_matrix(self, tensors: Any, params: tuple[Parameter, ...]) -> Tensor:
        """Return the transposed table layout `[D, V, *extra]` (a view).

        Args:
            tensors: One tensor `[V, D, *extra]`.
            params: The table.

        Returns:
            The transposed view.
        """
        return tensors[0].transpose(0, 1)

    def from_matrix(
        self, matrix: Tensor, params: tuple[Parameter, ...]
    ) -> list[Tensor]:
        """Return the table layout `[V, D, *extra]` of a matrix (a view).

        Args:
            matrix: `[D, V, *extra]`.
            params: The table.

        Returns:
            One tensor.
        """
        return [matrix.transpose(0, 1)]

    def layer_input(
        self, module: Module, args: tuple, kwargs: dict[str, Any]
    ) -> Tensor:
        """Return the looked-up indices `[batch, ...]`.

        Args:
            module: The embedding.
            args: Positional arguments of the call.
            kwargs: Keyword arguments of the call.

        Returns:
            The index tensor.
        """
        return args[0] if args else kwargs["input"]

    def input_rows(self, module: Module, x: Tensor, kfac_approx: str) -> SparseRows:
        r"""Return the one-hot rows of the indices `x`, `[batch, ...]`, as `SparseRows`.

        Args:
            module: The embedding.
            x: The indices.
            kfac_approx: `"expand"` (one row per position, scaled by
                \(1/\sqrt{N S}\)) or `"reduce"` (one row per example: its token
                histogram over \(S\), scaled by \(1/\sqrt{N}\)).

        Returns:
            The rows; the values have the dtype of the table.
        """
        batch, shared = x.shape[0], x.shape[1:].numel()
        vocabulary = module.weight.shape[0]
        tokens = x.reshape(batch, shared)
        keep = None if module.padding_idx is None else tokens != module.padding_idx
        dtype = module.weight.dtype
        if kfac_approx == KFACType.EXPAND:
            columns = tokens.reshape(-1) if keep is None else tokens[keep]
            rows = torch.arange(batch * shared, device=tokens.device)
            rows = rows if keep is None else rows[keep.reshape(-1)]
            scale = (batch * shared) ** -0.5 if batch * shared else 0.0
            values = columns.new_full(columns.shape, scale, dtype=dtype)
            return SparseRows(columns, values, vocabulary, batch * shared, rows)
        example = tokens.new_tensor(range(batch)).unsqueeze(1).expand_as(tokens)
        keys = example * vocabulary + tokens  # (example, token) pairs
        keys = keys.reshape(-1) if keep is None else keys[keep]
        pairs, counts = keys.unique(return_counts=True)
        values = counts.to(dtype) / (shared * batch**0.5)
        return SparseRows(
            pairs % vocabulary, values, vocabulary, batch, pairs // vocabulary
        )
