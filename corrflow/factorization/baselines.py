"""Baselines and classical mechanisms (000 §4–5, App. D, J, K: Choquette-Choo, McMahan, Rush,
Thakurta, "Multi-Epoch Matrix Factorization Mechanisms for Private Machine Learning", arXiv
2211.06530).

* binary tree (Honaker) with tree completion and the zeroed virtual-node noise of 000 App. D.3;
* the FFT mechanism in its real-valued form (000 App. K): C_F = circulant(y)[:, :n], y =
  ifft(√fft(v));
* stamping (000 App. D.4): I_s ⊗ C;
* the decoders of 000 Table 1 — online Honaker (estimate from below, restarts) and FFT Mechanism 1 —
  for reproducing that table; the product uses the optimal decoder A C⁻¹, realised in gradient
  space.

Encoders with more rows than rounds (tree: nodes, FFT: 2n) are replaced by the square
lower-triangular C̃ with C̃ᵀC̃ = CᵀC (reversed Cholesky): the same sensitivity and the same
optimal-decoder error (both depend on CᵀC only), streamable round by round.
"""

from __future__ import annotations

import numpy as np

from corrflow.errors import require
from corrflow.factorization.dense import reversed_cholesky
from corrflow.factorization.encoders import (
    DENSE_LIMIT,
    BandedEncoder,
    DenseEncoder,
    Encoder,
    ToeplitzEncoder,
)


def tree_levels(n: int) -> int:
    return int(np.ceil(np.log2(n))) if n > 1 else 0


def tree_gram(n: int) -> np.ndarray:
    """X = CᵀC of the binary-tree encoder over the real leaves 0..n−1 (virtual-only nodes dropped).

    X[i, j] = number of tree nodes covering both leaves = L + 1 − height(lowest common ancestor).
    """
    L = tree_levels(n)
    idx = np.arange(n)
    x = idx[:, None] ^ idx[None, :]
    lca_height = np.where(x == 0, 0, np.floor(np.log2(np.maximum(x, 1))).astype(int) + 1)
    return (L + 1 - lca_height).astype(np.float64)


def honaker_variances(levels: int) -> np.ndarray:
    """V_h: variance of the estimate-from-below of a height-h node with unit node noise (000 App.
    D.3)."""
    V = np.ones(levels + 1)
    for h in range(1, levels + 1):
        V[h] = 1.0 / (1.0 + 1.0 / (2.0 * V[h - 1]))
    return V


def online_honaker_per_query(n: int) -> np.ndarray:
    """Per-query error of the online Honaker decoder with tree completion and virtual-noise zeroing.

    Query t (< n−1) sums the estimates of the dyadic subtrees of t+1 (disjoint supports, so
    variances add); the last query uses the root estimate over 2^L leaves, with the noise of
    virtual-only nodes removed.
    """
    L = tree_levels(n)
    V = honaker_variances(L)
    err = np.array(
        [sum(V[h] for h in range(L + 1) if (t + 1) >> h & 1) for t in range(n)], dtype=np.float64
    )
    err[n - 1] = _restricted_root_variance(n, L, V)
    return err


def _restricted_root_variance(n: int, L: int, V: np.ndarray) -> float:
    """‖root estimate‖² keeping only nodes that cover at least one real leaf."""

    def rec(h: int, start: int) -> float:
        if start >= n:
            return 0.0
        if h == 0:
            return 1.0
        w = V[h]
        half = 1 << (h - 1)
        return w * w + (1 - w) ** 2 * (rec(h - 1, start) + rec(h - 1, start + half))

    return rec(L, 0)


def fft_filter(n: int) -> np.ndarray:
    """y = ifft(√fft(v)), v = [1]*n + [0]*n (principal root; real by 000 Lemma K.1)."""
    v = np.concatenate([np.ones(n), np.zeros(n)])
    return np.real(np.fft.ifft(np.sqrt(np.fft.fft(v).astype(complex))))


def fft_encoder_matrix(n: int) -> np.ndarray:
    """C_F = circulant(y)[:, :n], shape 2n×n (000 App. K)."""
    y = fft_filter(n)
    idx = np.arange(2 * n)
    return y[(idx[:, None] - idx[None, :n]) % (2 * n)]


def fft_gram(n: int) -> np.ndarray:
    """C_FᵀC_F: the symmetric Toeplitz top-left block of the circulant with eigenvalues |v̂| (000
    App. K)."""
    v = np.concatenate([np.ones(n), np.zeros(n)])
    col = np.real(np.fft.ifft(np.abs(np.fft.fft(v))))[:n]
    idx = np.arange(n)
    return col[np.abs(idx[:, None] - idx[None, :])]


def fft_mechanism1_per_query(n: int) -> np.ndarray:
    """Per-query error of Mechanism 1, B_F = circulant(y)[:n, :]: every row has norm² ‖y‖²."""
    y = fft_filter(n)
    return np.full(n, float(y @ y))


def restart_stamped_per_query(block_per_query: np.ndarray, stamps: int) -> np.ndarray:
    """Restart decoder for s stamps of a prefix-sum block (000 App. D.4): query q·m + r has error
    q·e_final + e_r (rows below a block repeat the block's final row; supports are disjoint)."""
    e = np.asarray(block_per_query, dtype=np.float64)
    return (np.arange(stamps)[:, None] * e[-1] + e[None, :]).ravel()


def encoder_from_gram(X: np.ndarray) -> DenseEncoder:
    """A streamable square encoder for a Gram matrix.

    Args:
        X: CᵀC, shape (n, n).

    Returns:
        The dense lower-triangular encoder C̃ with C̃ᵀC̃ = X (reversed Cholesky).
    """
    return DenseEncoder(reversed_cholesky(X))


def tree_encoder(n: int) -> DenseEncoder:
    """The binary-tree (Honaker) mechanism as a square encoder (000 App. D).

    Args:
        n: rounds.

    Returns:
        C̃ (n × n) with C̃ᵀC̃ = `tree_gram` (n).
    """
    require(n <= DENSE_LIMIT, "rounds", f"at most {DENSE_LIMIT} for the tree encoder", n)
    return encoder_from_gram(tree_gram(n))


def fft_encoder(n: int) -> DenseEncoder:
    """The real-valued FFT mechanism as a square encoder (000 §4, App. K).

    Args:
        n: rounds.

    Returns:
        C̃ (n × n) with C̃ᵀC̃ = `fft_gram` (n).
    """
    require(n <= DENSE_LIMIT, "rounds", f"at most {DENSE_LIMIT} for the FFT encoder", n)
    return encoder_from_gram(fft_gram(n))


def stamp_gram(X: np.ndarray, stamps: int) -> np.ndarray:
    """The Gram matrix of a stamped encoder (000 App. D.4).

    Args:
        X: shape (m, m).
        stamps: s.

    Returns:
        I_s ⊗ X, shape (s·m, s·m).
    """
    return np.kron(np.eye(stamps), X)


def stamp_encoder(encoder: Encoder, stamps: int) -> Encoder:
    """I_s ⊗ C (000 App. D.4): banded structures stay banded (restarting every block), others become
    dense.

    Args:
        encoder: C (m × m).
        stamps: s ≥ 1.

    Returns:
        The (s·m × s·m) encoder.
    """
    require(
        isinstance(stamps, int | np.integer) and stamps >= 1, "stamps", "a positive integer", stamps
    )
    if stamps == 1:
        return encoder
    if isinstance(encoder, BandedEncoder | ToeplitzEncoder):
        band = encoder.band if isinstance(encoder, BandedEncoder) else encoder.band_array()
        return BandedEncoder(
            np.tile(band, (stamps, 1)) * _block_valid(encoder.n, band.shape[1], stamps)
        )
    require(
        encoder.n * stamps <= DENSE_LIMIT,
        "stamps",
        f"rounds·stamps ≤ {DENSE_LIMIT} for a dense stamped encoder",
        encoder.n * stamps,
    )
    return DenseEncoder(np.kron(np.eye(stamps), encoder.matrix()))


def _block_valid(m: int, p: int, stamps: int) -> np.ndarray:
    valid = (np.arange(m)[:, None] + np.arange(p)[None, :]) < m
    return np.tile(valid, (stamps, 1)).astype(np.float64)
