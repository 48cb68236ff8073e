r"""FFT kernels for triangular Toeplitz matrices.

A lower-triangular Toeplitz matrix \(L\) with first column \(c\) acts on a vector by
the causal convolution \((L v)_i = \sum_{j \le i} c_{i-j} v_j\). Zero-padding to
length \(\ge 2d - 1\) turns the FFT's circular convolution into the linear one, so
each kernel costs \(O(d \log d)\) per column instead of \(O(d^2)\).

FFTs run in at least float32 (PyTorch has no CPU FFT for half precision); results
are cast back to the input's dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _power_of_two_size(dim: int) -> int:
    """Return the smallest power of two `>= 2 * dim - 1` (at least 2).

    Args:
        dim: Signal length.

    Returns:
        The FFT length.
    """
    return 1 << (max(2, 2 * dim - 1) - 1).bit_length()


def _fft_size(dim: int) -> int:
    r"""Return the smallest even 5-smooth number `>= 2 * dim - 1`.

    Any length `>= 2 * dim - 1` avoids wrap-around. Lengths \(2^a 3^b 5^c\) are
    fast in PyTorch's FFT, and they are much denser than powers of two: for the
    common `dim = 2^k + 1` (a bias column), the next power of two is almost twice
    as long (`dim = 1025`: 2160 instead of 4096 points, 7x faster on a CPU).

    Args:
        dim: Signal length.

    Returns:
        The FFT length.
    """
    target = max(2, 2 * dim - 1)
    best = _power_of_two_size(dim)
    power_of_5 = 1
    while power_of_5 < best:
        size = power_of_5
        while size < best:
            # fill up with factors 2 (at least one: the length is even)
            candidate = size * (1 << max(1, (-(-target // size) - 1).bit_length()))
            best = min(best, candidate)
            size *= 3
        power_of_5 *= 5
    return best


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Return the dtype in which FFTs are evaluated.

    Args:
        dtype: Input dtype.

    Returns:
        `dtype` promoted to at least float32.
    """
    return torch.promote_types(dtype, torch.float32)


def _columns_as_rows(V: Tensor, dtype: torch.dtype, n_fft: int) -> Tensor:
    r"""Return \(V^\top\) in `dtype`, zero-padded to `n_fft` columns, contiguous.

    FFTs then run along the contiguous last dimension, which PyTorch's CPU FFT
    does about three times faster than along dimension 0 of the same data, and
    the transposition, the cast and the zero padding are one copy (`rfft(x, n=)`
    would pad with a second one).

    Args:
        V: Matrix of shape `[d, n]`.
        dtype: Compute dtype.
        n_fft: Padded length, `>= d`.

    Returns:
        Contiguous matrix of shape `[n, n_fft]`.
    """
    rows = V.new_zeros(V.shape[1], n_fft, dtype=dtype)
    rows[:, : V.shape[0]] = V.T
    return rows


def _filter(c: Tensor, V: Tensor, conjugate: bool, n_fft: int | None = None) -> Tensor:
    r"""Multiply every column of `V` by \(L\) (or \(L^\top\)) in Fourier space.

    With \(N \ge 2d - 1\), the circular convolution with the zero-padded \(c\)
    restricted to its first \(d\) entries is the causal one, and the circular
    correlation (conjugated spectrum) is the anticausal one: for \(j < i\) the
    index \(N + j - i \ge d\) of \(c\) falls into the zero padding.

    Args:
        c: First column of \(L\), shape `[d]`.
        V: Matrix of shape `[d, n]`.
        conjugate: Apply \(L^\top\) instead of \(L\).
        n_fft: FFT length `>= 2d - 1`; default `_fft_size(d)`.

    Returns:
        Matrix of shape `[d, n]` in `V`'s dtype (a transposed view).
    """
    dim = c.shape[0]
    if V.shape[1] == 0:  # no columns: nothing to transform (an FFT of none fails)
        return V.new_empty(V.shape)
    n_fft = n_fft or _fft_size(dim)
    dtype = _compute_dtype(V.dtype)
    c_hat = torch.fft.rfft(c.to(dtype), n=n_fft)
    if conjugate:
        c_hat = c_hat.conj()
    V_hat = torch.fft.rfft(_columns_as_rows(V, dtype, n_fft)).mul_(c_hat)
    return torch.fft.irfft(V_hat, n=n_fft)[:, :dim].to(V.dtype).T


def causal_convolution(c: Tensor, V: Tensor) -> Tensor:
    r"""Return \(L V\) with \(L_{ij} = c_{i-j}\) for \(i \ge j\), else 0.

    Args:
        c: First column of \(L\), shape `[d]`.
        V: Matrix of shape `[d, n]`.

    Returns:
        Matrix of shape `[d, n]` in `V`'s dtype.
    """
    return _filter(c, V, conjugate=False)


def power_series_inverse(c: Tensor, leaf_dim: int = 256) -> Tensor:
    r"""Return the first \(d\) coefficients \(g\) of \(1 / \sum_m c_m x^m\).

    Triangular Toeplitz matrices multiply like power series modulo \(x^d\), so \(g\)
    is the first column of \(L^{-1}\) for the lower-triangular Toeplitz \(L\) with
    first column \(c\): the solution of \(L g = e_1\). It is found by blocked
    forward substitution: solve the first half, subtract its contribution to the
    second half (a Toeplitz block times a vector, one FFT convolution), solve the
    second half; blocks of at most `leaf_dim` rows are solved densely. This costs
    \(O(d \log^2 d)\) and, unlike Newton's iteration \(g \gets g (2 - c g)\)
    (\(O(d \log d)\)), does not multiply the rounding error by \(\max_k |g_k|\) at
    each doubling, which fails already for condition numbers near \(10^6\).

    Args:
        c: Coefficients, shape `[d]`, with \(c_0 \neq 0\) (not checked).
        leaf_dim: Largest block solved as a dense triangular system.

    Returns:
        Vector of shape `[d]`, in `c`'s dtype promoted to at least float32 (so that
        applying it to a half-precision operand loses nothing).
    """
    dim = c.shape[0]
    c = c.to(_compute_dtype(c.dtype))
    leaf = min(dim, leaf_dim)
    index = torch.arange(leaf, device=c.device)
    offsets = index.unsqueeze(1) - index.unsqueeze(0)
    L_leaf = torch.where(offsets >= 0, c[offsets.clamp(min=0)], 0.0)
    g = torch.zeros(dim, 1, dtype=c.dtype, device=c.device)  # right-hand side e_1,
    g[0] = 1.0  # overwritten block by block with the solution

    def substitute(lo: int, hi: int) -> None:
        if hi - lo <= leaf:
            L = L_leaf[: hi - lo, : hi - lo]
            g[lo:hi] = torch.linalg.solve_triangular(L, g[lo:hi], upper=False)
            return
        mid = (lo + hi) // 2
        substitute(lo, mid)
        solved = torch.nn.functional.pad(g[lo:mid], (0, 0, 0, hi - mid))
        # power-of-two lengths: on this ill-conditioned recursion they keep the
        # error ~20x lower than 5-smooth ones (1/(1 - x)^2 at d = 20000: 2e-10)
        n_fft = _power_of_two_size(hi - lo)
        g[mid:hi] -= _filter(c[: hi - lo], solved, False, n_fft)[mid - lo :]
        substitute(mid, hi)

    substitute(0, dim)
    return g.squeeze(1)


def anticausal_convolution(c: Tensor, V: Tensor) -> Tensor:
    r"""Return \(L^\top V\), the correlation of every column of `V` with \(c\).

    Args:
        c: First column of \(L\), shape `[d]`.
        V: Matrix of shape `[d, n]`.

    Returns:
        Matrix of shape `[d, n]` in `V`'s dtype.
    """
    return _filter(c, V, conjugate=True)


def diagonal_sums_of_gram(X: Tensor) -> Tensor:
    r"""Return \(t_m = \sum_i (X X^\top)_{i+m,\,i}\) for \(m = 0, \dots, d-1\).

    \(t_m = \sum_j \sum_i X_{i+m,j} X_{ij}\) is the autocorrelation of the columns
    of \(X\) summed over columns,
    \(t = \mathcal{F}^{-1}(\sum_j |\mathcal{F} X_{:j}|^2)\).

    Args:
        X: Matrix of shape `[d, n]`.

    Returns:
        Vector of shape `[d]` in `X`'s dtype; zeros if `X` has no columns.
    """
    dim, n_fft = X.shape[0], _fft_size(X.shape[0])
    if X.shape[1] == 0:  # the empty sum (an FFT of no columns fails)
        return X.new_zeros(dim)
    X_hat = torch.fft.rfft(_columns_as_rows(X, _compute_dtype(X.dtype), n_fft))
    # |X̂|² summed over columns: the real and imaginary parts side by side in one
    # contiguous row per column, reduced along dim 0 (10-20x faster on a CPU
    # than reducing dims (0, 2) of the [n, F, 2] view at once)
    squares = torch.view_as_real(X_hat).reshape(X_hat.shape[0], 2 * X_hat.shape[1])
    squares = squares.square()
    power = squares.sum(0).view(-1, 2).sum(1)
    return torch.fft.irfft(power, n=n_fft)[:dim].to(X.dtype)


def cross_correlation(w: Tensor, c: Tensor) -> Tensor:
    r"""Return \(t_m = \sum_{u \ge m} w_u c_{u-m}\) for \(m = 0, \dots, d-1\).

    Args:
        w: Vector of shape `[d]`.
        c: Vector of shape `[d]`.

    Returns:
        Vector of shape `[d]` in `c`'s dtype.
    """
    dim, n_fft = c.shape[0], _fft_size(c.shape[0])
    dtype = _compute_dtype(c.dtype)
    w_hat = torch.fft.rfft(w.to(dtype), n=n_fft)
    c_hat = torch.fft.rfft(c.to(dtype), n=n_fft)
    return torch.fft.irfft(w_hat * c_hat.conj(), n=n_fft)[:dim].to(c.dtype)


def diagonal_sums(mat: Tensor) -> Tensor:
    r"""Return the sums of the diagonals \(m = -(d-1), \dots, d-1\) of a square matrix.

    Reversing the rows and padding each with \(d\) zeros skews the matrix so that
    every diagonal becomes a column of a `[d, 2d - 1]` view: \(O(d^2)\), one pass.

    Args:
        mat: Matrix of shape `[d, d]`.

    Returns:
        Vector of shape `[2d - 1]`; entry `d - 1 + m` is the sum of the diagonal
        with offset `m` (positive: above the main diagonal).
    """
    dim = mat.shape[0]
    padded = torch.nn.functional.pad(mat.flip(0), (0, dim))  # [d, 2d]
    skewed = padded.flatten()[: dim * (2 * dim - 1)].view(dim, 2 * dim - 1)
    # skewed[i, j] = mat[d - 1 - i, j - i]: column j holds the diagonal j - (d - 1).
    return skewed.sum(0)
