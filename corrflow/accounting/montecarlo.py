"""Monte Carlo accounting of banded MF under b-min-sep sampling, balls-in-bins and multi-attribution
(004).

004: Dong & Ganesh, "Privacy Amplification for BandMF via b-Min-Sep Subsampling", arXiv 2602.09338,
§5 (Thm 5.1, Eq. 1): for a b-banded, entrywise non-negative lower-triangular C under b-min-sep
Poisson sampling with probability p (Alg. 1), the privacy-loss ratio of P = N(Cx, σ²I) (x the
differing example's participations) against Q = N(0, σ²I) is f_0(y) with

    f_i = (1 − p)·f_{i+1} + p·exp((2⟨c_i, y_{i:i+b}⟩ − ‖c_i‖²)/(2σ²))·f_{i+b},   f_i = 1 for i ≥ n,

computed in log space, vectorised over samples, O(n·bands) per sample (`log_likelihood_ratio`,
the definition); the sampler itself runs on compiled kernels (`corrflow.accounting.mc_kernels`:
the same recursion in linear space, the differing example's exponents only where its participations
reach, numpy's ziggurat over xoshiro256++ bits), which the tests hold to it. Warm start (Alg. 2):
(f_0 + p·Σ_{i=1}^{b−1} f_i)/(1 + (b−1)p); with p = 1 and b = T it is balls-in-bins with T bins (004
§4). Multi-attribution (§6, Thm 6.1): each available step draws Binom(k_u, p) of the user's items
(cold start only).

Poisson sampling in every round of a banded encoder (bands ≤ 12): the exact likelihood by a forward
algorithm over the last bands − 1 participation bits (`poisson_banded_llr`). Balls-in-bins:
the N/B phases enumerated (`balls_in_bins_llr`, any encoder).

δ(ε) = E_{y∼P}[max(0, 1 − e^{ε−L(y)})] is estimated for both adjacency directions (y ∼ P with L = ln
P/Q, and y ∼ Q with L = ln Q/P) and the larger is used. Guarantees come from Estimate-Verify-Release
(004 Alg. 5, Thm A.1): a verifier at threshold δ' with s samples fails to catch a mechanism that is
not (ε, δ)-DP with probability at most exp(−s·KL(δ'‖δ)) (Chua et al., arXiv 2412.16802, Fact 4.2),
giving (ε, δ + q(1 − δ))-DP overall. `adaptive_evr` verifies ε at a target δ in
deterministically seeded attempts, each sized from the earlier samples (`samples_to_pass`)
and drawing fresh ones, attempt i spending β/2^(i+1) of the failure budget β inside that δ.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from corrflow.errors import CorrflowError, InvalidArgumentError, require


def truncate_band(band: np.ndarray) -> np.ndarray:
    """``band`` (n × bands, ``band[i, k] = C[i + k, i]``) with the entries past round n set to 0.

    A Toeplitz encoder's band layout repeats its coefficients in every column, also where row i + k
    ≥ n does not exist; counting those entries in ‖c_i‖² would over-state the squared column norms
    of the last bands − 1 columns and understate the privacy loss of late participations.

    Args:
        band: shape (n, bands), ``band[i, k] = C[i + k, i]``.

    Returns:
        A float64 copy, shape (n, bands), with ``band[i, k] = 0`` where i + k ≥ n.
    """
    band = np.array(band, dtype=np.float64)
    n, bands = band.shape
    past = np.arange(n)[:, None] + np.arange(bands)[None, :] >= n
    band[past] = 0.0
    return band


def log_likelihood_ratio(
    y: np.ndarray,
    band: np.ndarray,
    sigma: float,
    min_sep: int,
    p: float,
    warm: bool = False,
    k_u: int = 1,
) -> np.ndarray:
    """ln P(y)/Q(y) for every column of y by the recursion of 004 Eq. 1 (Thm 5.1; Thm 6.1 for k_u >
    1).

    Args:
        y: outputs, shape (n, S), round-major (float32 or float64; the recursion runs in its dtype).
        band: shape (n, bands), ``band[i, k] = C[i + k, i]`` (entries past row n are ignored), bands
            ≤ min_sep, entries ≥ 0.
        sigma: the noise multiplier σ.
        min_sep: b.
        p: the Poisson probability among eligible rounds (1: balls-in-bins).
        warm: the warm-start mixture of 004 Alg. 2 (else cold start, Alg. 1).
        k_u: items per user (multi-attribution, 004 §6; cold start only).

    Returns:
        ln P(y)/Q(y), float64, shape (S,).

    Raises:
        InvalidArgumentError: ``band`` has another number of rows than ``y``, or ``warm`` with k_u >
            1.
    """
    y = np.asarray(y)
    n, S = y.shape
    b = min_sep
    dtype = y.dtype
    band = truncate_band(band)
    require(band.shape[0] == n, "band", f"{n} columns (one per round of y)", band.shape[0])
    sq = np.sum(band**2, axis=1)
    inv2s2 = 1.0 / (2.0 * sigma * sigma)
    log_skip = dtype.type(k_u * math.log1p(-p) if p < 1 else -np.inf)
    js, log_pmf = _joined_items_log_pmf(k_u, p)
    # 2⟨c_i, y⟩/(2σ²) comes out of the block products directly
    band32 = (band * (2.0 * inv2s2)).astype(dtype)
    offset = (log_pmf[0] - sq * inv2s2).astype(dtype)
    block = 64  # rows of ⟨c_i, y_{i:i+L}⟩ computed at a time, so the L passes stay in cache
    dots = np.empty((block, S), dtype=dtype)
    prod = np.empty((block, S), dtype=dtype)
    lo = n
    buf = np.zeros((b, S), dtype=dtype)  # buf[j % b] = log f_j; zero (log 1) past the end
    join, skip, tmp = (np.empty(S, dtype=dtype) for _ in range(3))
    with np.errstate(invalid="ignore", over="ignore"):
        for i in range(n - 1, -1, -1):
            if i < lo:
                lo = max(0, i + 1 - block)
                _block_dots(y, band32, lo, i + 1, dots, prod)
            d = dots[i - lo]
            if k_u == 1:
                np.add(d, offset[i], out=join)
            else:
                _log_sum_exp_of_lines(d, js, log_pmf - js**2 * sq[i] * inv2s2, join)
            join += buf[i % b]
            if p < 1:
                np.add(buf[(i + 1) % b], log_skip, out=skip)
                _logaddexp(skip, join, buf[i % b], tmp)
            else:  # p = 1 (balls-in-bins): an available example always joins
                buf[i % b] = join
    if not warm:
        return buf[0].astype(np.float64)
    return _warm_start_mixture(buf, b, p, k_u)


def _log_sum_exp_of_lines(d: np.ndarray, slopes: np.ndarray, const: np.ndarray, out) -> None:
    """out = ln Σ_j exp(d·slopes_j + const_j) for every entry of d, in float64: the k_u-term sum of
    004 Thm 6.1 as k_u whole-vector passes (a row-wise logsumexp over an S × k_u array is several
    times slower for the few terms k_u has); a −inf constant (a term of probability 0) adds 0.

    Args:
        d: shape (S,).
        slopes: j = 1..k_u.
        const: shape (k_u,), finite or −inf.
        out: shape (S,), written (in its dtype).
    """
    x = d.astype(np.float64)
    lines = [x * float(j) + float(c) for j, c in zip(slopes, const, strict=True)]
    top = lines[0].copy()
    for line in lines[1:]:
        np.maximum(top, line, out=top)
    acc = np.zeros_like(top)
    for line in lines:
        line -= top
        acc += np.exp(line, out=line)
    out[...] = top + np.log(acc)


def _joined_items_log_pmf(k_u: int, p: float) -> tuple[np.ndarray, np.ndarray]:
    """j = 1..k_u and log P(j of a user's k_u items join) under Binomial(k_u, p)
    (004 Thm 6.1)."""
    from scipy.special import gammaln  # lazy: scipy.special slows every CLI start

    js = np.arange(1, k_u + 1)
    rest = k_u - js  # items not sampled; 0·log(1 − p) is 0 even at p = 1
    log_rest = np.where(rest == 0, 0.0, -np.inf) if p == 1 else rest * math.log1p(-p)
    log_pmf = gammaln(k_u + 1) - gammaln(js + 1) - gammaln(rest + 1) + js * math.log(p) + log_rest
    return js, log_pmf


def _warm_start_mixture(buf: np.ndarray, b: int, p: float, k_u: int) -> np.ndarray:
    """The warm-start likelihood ratio (004 Alg. 2): the cold-start ratios of the b start phases
    mixed with the stationary weights (1, p, …, p)/(1 + (b − 1)p)."""
    require(
        k_u == 1,
        "k_u",
        "1 for warm start (multi-attribution is accounted as a cold start, 004 §6.2)",
        k_u,
    )
    if b > 1:
        buf[1:b] += buf.dtype.type(math.log(p))
    top = buf.max(axis=0)
    return (top + np.log(np.exp(buf - top).sum(axis=0))).astype(np.float64) - math.log1p(
        (b - 1) * p
    )


def linear_log_likelihood_ratio(
    y: np.ndarray, band: np.ndarray, sigma: float, min_sep: int, p: float, warm: bool = False
) -> np.ndarray:
    """`log_likelihood_ratio` (k_u = 1) by the compiled linear-space kernels of
    `corrflow.accounting.mc_kernels`: the exponents a_i, numpy's vectorised exp, and 004 Eq. 1
    as f_i = (1 − p)·f_{i+1} + e^{a_i}·f_{i+b} in float64 with exact power-of-two rescaling. Falls
    back to the log-space recursion where e^{a_i} would overflow or a run's result is not finite.

    Args:
        y: outputs, shape (n, S), round-major (float32 or float64: the exponents and e^{a_i} are in
            its dtype).
        band: shape (n, bands), ``band[i, k] = C[i + k, i]``, bands ≤ min_sep, entries ≥ 0.
        sigma: σ.
        min_sep: b.
        p: the Poisson probability among eligible rounds.
        warm: the warm-start mixture of 004 Alg. 2.

    Returns:
        ln P(y)/Q(y), float64, shape (S,).
    """
    from corrflow.accounting import mc_kernels as kernels  # here: numba loads only when needed

    y = np.ascontiguousarray(y)
    band = truncate_band(band)
    require(
        band.shape[0] == y.shape[0],
        "band",
        f"{y.shape[0]} columns (one per round of y)",
        band.shape[0],
    )
    band_v, offset = _exponent_terms(band, sigma, p, y.dtype)
    a = np.empty_like(y)
    kernels.exponents(y, band_v, offset, a)
    return _llr_from_exponents(a, lambda: y, band, sigma, min_sep, p, warm)


def _exponent_terms(
    band: np.ndarray, sigma: float, p: float, dtype
) -> tuple[np.ndarray, np.ndarray]:
    """(band/σ², ln p − ‖c_i‖²/(2σ²)) in ``dtype``: the exponent a_i = ⟨c_i, y⟩/σ² − ‖c_i‖²/(2σ²) +
    ln p of 004 Eq. 1 is ⟨band_i/σ², y_{i:i+bands}⟩ + offset_i."""
    inv = 1.0 / (sigma * sigma)
    return (
        np.ascontiguousarray(band * inv, dtype=dtype),
        (math.log(p) - 0.5 * inv * np.sum(band**2, axis=1)).astype(dtype),
    )


def _llr_from_exponents(
    a: np.ndarray, outputs, band: np.ndarray, sigma: float, min_sep: int, p: float, warm: bool
) -> np.ndarray:
    """ln P(y)/Q(y) from the exponents ``a`` (n × S, overwritten by e^a) by the linear recursion;
    the log-space recursion on ``outputs()`` (y, built only then) where e^a would overflow or a
    run's result is not finite."""
    from corrflow.accounting import mc_kernels as kernels  # here: numba loads only when needed

    if a.max() > kernels.MAX_EXPONENT:
        return log_likelihood_ratio(outputs(), band, sigma, min_sep, p, warm)
    np.exp(a, out=a)
    out = kernels.linear_recursion(a, int(min_sep), float(p), bool(warm))
    bad = ~np.isfinite(out)
    if bad.any():
        out[bad] = log_likelihood_ratio(outputs()[:, bad], band, sigma, min_sep, p, warm)
    return out


def _block_dots(
    y: np.ndarray, band: np.ndarray, lo: int, hi: int, out: np.ndarray, prod: np.ndarray
) -> None:
    """out[j − lo] = Σ_k band[j, k]·y[j + k] for rows j in [lo, hi) (entries past row n contribute
    nothing)."""
    n = y.shape[0]
    m = hi - lo
    np.multiply(y[lo:hi], band[lo:hi, :1], out=out[:m])
    for k in range(1, band.shape[1]):
        top = min(hi, n - k)
        if top <= lo:
            break
        r = top - lo
        np.multiply(y[lo + k : top + k], band[lo:top, k : k + 1], out=prod[:r])
        out[:r] += prod[:r]


def _logaddexp(a: np.ndarray, b: np.ndarray, out: np.ndarray, tmp: np.ndarray) -> None:
    """out = log(e^a + e^b) as max + log(1 + e^{−|a−b|}): ~4× faster than np.logaddexp in float32
    (whose log1p is not vectorised); the rounding of 1 + x loses only terms below float32
    resolution. Inputs are finite."""
    np.subtract(a, b, out=tmp)
    np.abs(tmp, out=tmp)
    np.negative(tmp, out=tmp)
    np.exp(tmp, out=tmp)
    tmp += 1
    np.log(tmp, out=tmp)
    np.maximum(a, b, out=out)
    out += tmp


def sample_participations(
    S: int,
    n: int,
    min_sep: int,
    p: float,
    rng: np.random.Generator,
    warm: bool = False,
    k_u: int = 1,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One example's (or user's) participations under b-min-sep sampling (004 Alg. 1–3), for S
    independent runs.

    Args:
        S: the number of independent runs.
        n: rounds.
        min_sep: b.
        p: the Poisson probability among eligible rounds.
        rng: the generator.
        warm: start from the stationary distribution (004 Alg. 2).
        k_u: items per user: a round is taken when Binom(k_u, p) ≥ 1, with that count (004 Alg. 3).

    Returns:
        (run index, round, count): three arrays of equal length, one entry per participation.
    """
    b = min_sep
    p_any = 1.0 - (1.0 - p) ** k_u  # an available step takes part when Binom(k_u, p) ≥ 1
    if warm:
        # Stationary chain (004 Alg. 2): available w.p. 1/(1+(b−1)p), else barred for s ~ U{1..b−1}
        # more rounds.
        barred = rng.random(S) >= 1.0 / (1.0 + (b - 1) * p)
        s = np.where(barred, rng.integers(1, max(b, 2), size=S), 0)
        last = s - b
    else:
        last = np.full(S, -b)
    rows = np.arange(S)
    out_rows, out_pos = [], []
    while rows.size:
        nxt = last[rows] + b - 1 + rng.geometric(p_any, size=rows.size)
        ok = nxt < n
        rows, nxt = rows[ok], nxt[ok]
        out_rows.append(rows)
        out_pos.append(nxt)
        last[rows] = nxt
    r, pos = np.concatenate(out_rows), np.concatenate(out_pos)
    counts = np.ones(r.size) if k_u == 1 else _binomial_at_least_one(k_u, p, r.size, rng)
    return r, pos, counts


def _binomial_at_least_one(k: int, p: float, size: int, rng: np.random.Generator) -> np.ndarray:
    from scipy.special import gammaln  # lazy: scipy.special slows every CLI start

    js = np.arange(1, k + 1)
    pmf = (
        np.exp(gammaln(k + 1) - gammaln(js + 1) - gammaln(k - js + 1)) * p**js * (1 - p) ** (k - js)
    )
    return rng.choice(js, size=size, p=pmf / pmf.sum()).astype(np.float64)


def add_means(
    y: np.ndarray, band: np.ndarray, rows: np.ndarray, pos: np.ndarray, counts: np.ndarray
) -> None:
    """Add each participation's mean: y[:, s] += count·C[:, pos] (in place).

    Participations of one run are ≥ bands apart, so the scattered entries never collide.

    Args:
        y: shape (n, S), round-major; modified in place.
        band: shape (n, bands), ``band[i, k] = C[i + k, i]``.
        rows: the run index s of each participation.
        pos: its round.
        counts: its multiplicity.
    """
    n, S = y.shape
    # Scatter in memory order (round-major flat index, each (round, run) hit once per band offset):
    # several times faster than unsorted fancy indexing at n = 2048; entries past round n are a
    # suffix (sorted by round).
    base = pos.astype(np.int64) * S + rows
    if np.all(counts == 1):
        base = np.sort(base)
        vals = band[base // S].astype(y.dtype)
    else:
        order = np.argsort(base, kind="stable")
        base = base[order]
        vals = (band[base // S] * counts[order][:, None]).astype(y.dtype)
    pos = base // S
    flat = y.reshape(-1)
    for k in range(band.shape[1]):
        m = int(np.searchsorted(pos, n - k))
        flat[base[:m] + k * S] += vals[:m, k]


# -- Poisson and balls-in-bins sampling of a banded encoder: exact likelihood ----------------------

#: Most bands the Poisson forward algorithm takes (2^(bands−1) states per sample); above it MMCC is
# the bound.
MAX_FORWARD_BANDS = 12


def column_gram_bands(band: np.ndarray) -> np.ndarray:
    """Inner products of nearby columns of a banded encoder, for `poisson_banded_llr`.

    Args:
        band: shape (n, bands), ``band[i, k] = C[i + k, i]``.

    Returns:
        G, shape (n, bands − 1), G[j, d − 1] = ⟨c_j, c_{j+d}⟩ for d = 1..bands − 1, columns
        truncated at row n.
    """
    band = truncate_band(band)
    n, L = band.shape
    G = np.zeros((n, max(L - 1, 0)))
    for d in range(1, L):
        # c_j has rows j..j+L−1 (band[j, k] at row j+k); c_{j+d} has band[j+d, k'] at row j+d+k';
        # overlap k = d+k'.
        for kp in range(L - d):
            G[: n - d, d - 1] += band[: n - d, d + kp] * band[d:, kp]
    return G


def participation_window(band: np.ndarray, sigma: float) -> np.ndarray:
    """Inner products of each column of a banded encoder with its neighbours, over σ², laid out per
    column.

    Args:
        band: shape (n, bands), ``band[i, k] = C[i + k, i]``.
        sigma: σ.

    Returns:
        W, shape (n, 2·bands − 1), W[j, t] = ⟨c_j, c_i⟩/σ² with i = j − bands + 1 + t (0 where i is
        outside 0..n − 1); W[j, bands − 1] = ‖c_j‖²/σ².
    """
    band = truncate_band(band)
    n, L = band.shape
    # ⟨c_j, c_{j+d}⟩
    G = np.concatenate([np.sum(band**2, axis=1)[:, None], column_gram_bands(band)], axis=1)
    W = np.zeros((n, 2 * L - 1))
    W[:, L - 1 :] = G  # i = j + d ≥ j
    for d in range(1, L):  # i = j − d: ⟨c_{j−d}, c_j⟩ = G[j − d, d]
        W[d:, L - 1 - d] = G[: n - d, d]
    return W / (sigma * sigma)


def poisson_banded_llr(y: np.ndarray, band: np.ndarray, sigma: float, p: float) -> np.ndarray:
    """ln P(y)/Q(y) for Poisson sampling with probability p in every round of a banded encoder,
    exactly.

    P = Σ_x Π_j p^{x_j}(1−p)^{1−x_j} · N(Cx, σ²I), Q = N(0, σ²I) (004 §1.3 / 002 Lemma 4.5
    reduction). With c_j = C[:, j] (``band[j, k] = C[j + k, j]``), ln N(Cx)/N(0)(y) = Σ_j x_j a_j −
    Σ_{j<k<j+L} x_j x_k G_jk/σ² with a_j = (⟨c_j, y⟩ − ‖c_j‖²/2)/σ²: a chain whose interactions
    reach L − 1 rounds back, summed over x by a forward algorithm on the last L − 1 participation
    bits (2^(L−1) states; rescaled every round, linear space). Cost O(n·2^(L−1)) per sample.

    Args:
        y: outputs, shape (n, S), round-major.
        band: shape (n, L), ``band[i, k] = C[i + k, i]``, L ≤ `MAX_FORWARD_BANDS`.
        sigma: σ.
        p: the per-round probability, in (0, 1).

    Returns:
        ln P(y)/Q(y), float64, shape (S,).

    Raises:
        InvalidArgumentError: more than `MAX_FORWARD_BANDS` bands, or p outside (0, 1).
    """
    y = np.asarray(y, dtype=np.float64)
    band = truncate_band(band)
    n, S = y.shape
    L = band.shape[1]
    require(
        L <= MAX_FORWARD_BANDS,
        "factorization",
        f"at most {MAX_FORWARD_BANDS} bands for the exact Poisson "
        "likelihood (2^(bands−1) states); MMCC covers more",
        L,
    )
    require(0 < p < 1, "sampling_probability", "a probability in (0, 1) for Poisson sampling", p)
    inv = 1.0 / (sigma * sigma)
    sq = np.sum(band**2, axis=1)
    dots = np.zeros((n, S))
    _block_dots(y, band, 0, n, dots, np.empty((n, S)))
    # log-odds of joining, before interactions
    a = (dots - 0.5 * sq[:, None]) * inv + math.log(p / (1 - p))
    G = column_gram_bands(band) * inv
    K = 1 << (L - 1)
    bits = (np.arange(K)[:, None] >> np.arange(L - 1)[None, :]) & 1  # bit d−1 of state s: x_{j−d}
    half = K >> 1
    log_scale = np.full(S, n * math.log1p(-p))
    alpha = np.zeros((K, S))
    alpha[0] = 1.0
    new = np.empty_like(alpha)
    for j in range(n):
        # Interaction of joining at j with the earlier participations recorded in the state.
        inter = np.zeros(K)
        for d in range(1, min(L - 1, j) + 1):
            inter += bits[:, d - 1] * G[j - d, d - 1]
        m = np.maximum(a[j], 0.0)
        join = np.exp(a[j] - m)  # (S,)
        stay = np.exp(-m)
        w1 = np.exp(-inter)[:, None] * alpha  # joining weight per predecessor state (K, S)
        if K == 1:
            new[0] = alpha[0] * stay + w1[0] * join
        else:
            # s' = ((s << 1) | x) mod K: predecessors of s' are s'>>1 and (s'>>1) | half.
            lo, hi = alpha[:half], alpha[half:]
            new[0::2] = (lo + hi) * stay
            new[1::2] = (w1[:half] + w1[half:]) * join
        total = new.sum(axis=0)
        alpha = new / total
        new = np.empty_like(alpha)
        log_scale += m + np.log(total)
    return log_scale


def balls_in_bins_llr(y: np.ndarray, C: np.ndarray, sigma: float, bins: int) -> np.ndarray:
    """ln P(y)/Q(y) for balls-in-bins with ``bins`` bins: the example takes a uniform phase φ and
    trains in rounds φ, φ + T, φ + 2T, … (004 §1.4; Choquette-Choo et al., "Near Exact Privacy
    Amplification for Matrix Mechanisms", arXiv 2410.06266). Exact for any encoder: L =
    logsumexp_φ(⟨Cx_φ, y⟩/σ² − ‖Cx_φ‖²/(2σ²)) − ln T.

    Args:
        y: outputs, shape (n, S), round-major.
        C: the encoder, shape (n, n).
        sigma: σ.
        bins: T.

    Returns:
        ln P(y)/Q(y), float64, shape (S,).
    """
    from scipy.special import logsumexp  # lazy: scipy.special slows every CLI start

    y = np.asarray(y, dtype=np.float64)
    n = y.shape[0]
    X = (np.arange(n)[:, None] % bins == np.arange(bins)[None, :]).astype(np.float64)
    M = np.asarray(C, dtype=np.float64) @ X  # n × T: the mean under each phase
    w = (M.T @ y - 0.5 * np.sum(M * M, axis=0)[:, None]) / (sigma * sigma)
    return logsumexp(w, axis=0) - math.log(bins)


# -- δ estimation and EVR --------------------------------------------------------------------------


def delta_terms(losses: np.ndarray, epsilon: float) -> np.ndarray:
    """Unbiased terms of δ(ε) (004 §2.5).

    Args:
        losses: privacy-loss samples L, shape (S,).
        epsilon: ε.

    Returns:
        max(0, 1 − e^{ε − L}), shape (S,).
    """
    return -np.expm1(np.minimum(epsilon - losses, 0.0))


def bernoulli_kl(a: float, b: float) -> float:
    """The Bernoulli KL divergence, for EVR's failure bound (004 App. A).

    Args:
        a: a probability in [0, 1].
        b: a probability in (0, 1).

    Returns:
        KL(Bern(a) ‖ Bern(b)) = a·ln(a/b) + (1 − a)·ln((1 − a)/(1 − b)).
    """
    out = 0.0
    if a > 0:
        out += a * math.log(a / b)
    if a < 1:
        out += (1 - a) * math.log((1 - a) / (1 - b))
    return out


def overall_delta(samples: int, delta_prime: float) -> float:
    """The δ that Estimate-Verify-Release releases (004 Alg. 5, Thm A.1).

    Args:
        samples: s, the verifier's samples per direction.
        delta_prime: δ', the verifier's threshold.

    Returns:
        min over δ ∈ [δ', 1) of δ + exp(−s·KL(δ'‖δ))(1 − δ), at most 1.
    """
    from scipy.optimize import minimize_scalar  # lazy: scipy's import slows every CLI start

    def f(log_tau):
        d = min(delta_prime * math.exp(log_tau), 1 - 1e-16)
        return d + math.exp(-samples * bernoulli_kl(delta_prime, d)) * (1 - d)

    res = minimize_scalar(
        f, bounds=(0.0, math.log(1.0 / delta_prime)), method="bounded", options={"xatol": 1e-10}
    )
    return float(min(res.fun, f(0.0), 1.0))


def minimum_samples(delta_prime: float, delta_target: float) -> int:
    """The verifier's sample count a target δ needs (004 App. A, which verifies at δ' = δ/2).

    Args:
        delta_prime: δ', the verifier's threshold.
        delta_target: the δ to release, δ' < δ_target < 1.

    Returns:
        The smallest s with overall_delta(s, δ') ≤ δ_target (binary search; `overall_delta`).

    Raises:
        InvalidArgumentError: (field ``delta``) δ' ≥ δ_target or out of (0, 1), or more than 2^50
            samples needed.
    """
    require(
        0 < delta_prime < delta_target < 1,
        "delta",
        "δ' < δ_target in (0, 1)",
        (delta_prime, delta_target),
    )
    lo, hi = 1, 2
    while overall_delta(hi, delta_prime) > delta_target:
        hi *= 2
        if hi > 1 << 50:
            raise InvalidArgumentError(
                "delta", "a target reachable with fewer than 2^50 samples", delta_target
            )
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if overall_delta(mid, delta_prime) <= delta_target:
            hi = mid
        else:
            lo = mid
    return hi


@dataclass
class MonteCarloEstimate:
    """Privacy-loss samples for both adjacency directions at one σ (004 §2.5).

    ``count`` samples were drawn per direction; when ``floor`` is set only the losses above it are
    stored (the others add 0 to δ(ε) for every ε ≥ floor).

    Attributes:
        sigma: σ.
        add: L = ln P/Q with y ∼ P (the differing example present), stored losses, shape (S₊,).
        remove: L = ln Q/P with y ∼ Q, stored losses, shape (S₋,).
        count: samples drawn per direction (None: the smaller array's length).
        floor: the loss below which samples were dropped, or None.
        samples: ``count``, as an int.
    """

    sigma: float
    add: np.ndarray  # L = ln P/Q, y ∼ P   (the differing example present)
    remove: np.ndarray  # L = ln Q/P, y ∼ Q
    count: int | None = None
    floor: float | None = None
    samples: int = field(init=False)

    def __post_init__(self) -> None:
        if self.count is None:
            self.count = int(min(len(self.add), len(self.remove)))
        self.samples = int(self.count)

    def merged(self, other: MonteCarloEstimate) -> MonteCarloEstimate:
        """The pooled estimate of two independent sample sets at the same σ.

        Args:
            other: another estimate at the same σ.

        Returns:
            The pooled `MonteCarloEstimate`: counts added, losses stored above the higher floor.
        """
        floor = max((f for f in (self.floor, other.floor) if f is not None), default=None)

        def cut(a):
            return a if floor is None else a[a > floor]

        return MonteCarloEstimate(
            self.sigma,
            np.concatenate([cut(self.add), cut(other.add)]),
            np.concatenate([cut(self.remove), cut(other.remove)]),
            count=self.samples + other.samples,
            floor=floor,
        )

    def delta(self, epsilon: float) -> tuple[float, float]:
        """The estimated δ(ε), for the worse direction.

        Args:
            epsilon: ε.

        Returns:
            (δ̂(ε), its standard error), from the direction with the larger pair.

        Raises:
            InvalidArgumentError: ε below the stored ``floor`` (the dropped samples would matter).
        """
        require(
            self.floor is None or epsilon >= self.floor - 1e-12,
            "epsilon",
            f"at least the stored floor {self.floor}",
            epsilon,
        )
        best = (0.0, 0.0)
        N = self.samples
        for losses in (self.add, self.remove):
            t = delta_terms(losses, epsilon)
            mean = float(t.sum()) / N
            var = max(float(np.dot(t, t)) / N - mean * mean, 0.0) * N / max(N - 1, 1)
            best = max(best, (mean, math.sqrt(var / N)))
        return best

    def epsilon(self, delta: float, z: float = 0.0) -> float:
        """The ε at which the estimated δ meets ``delta``.

        Args:
            delta: δ.
            z: standard errors added to δ̂ (0: the point estimate; z > 0: the upper confidence end
                of ε).

        Returns:
            ε with δ̂(ε) + z·se(ε) = δ (to 1e-9), at least the stored floor (or 0), which is
            returned when it already meets δ.
        """
        from scipy.optimize import brentq  # lazy: scipy's import slows every CLI start

        def g(eps):
            d, se = self.delta(eps)
            return d + z * se - delta

        lo = 0.0 if self.floor is None else max(self.floor, 0.0)
        top = max([float(a.max()) for a in (self.add, self.remove) if a.size] + [lo])
        if g(lo) <= 0:
            return lo
        return float(brentq(g, lo, top + 1.0, xtol=1e-9))


def _collect(parts, sizes: list[int], progress: bool) -> list:
    """Batches in order, with progress on stderr when asked: one line rewritten in place on a
    terminal, else a line per tenth (a log file gets ten lines, not one per batch)."""
    out, done, total, shown = [], 0, sum(sizes), 0
    live = sys.stderr.isatty()
    for part, size in zip(parts, sizes, strict=True):
        out.append(part)
        done += size
        if progress and (live or done * 10 // total > shown):
            shown = done * 10 // total
            print(
                f"\rmonte carlo samples {done}/{total} per direction"
                if live
                else f"monte carlo samples {done}/{total} per direction",
                end="\n" if done == total or not live else "",
                file=sys.stderr,
                flush=True,
            )
    return out


#: Outputs per chunk of the compiled b-min-sep path (runs × rounds): its few n × runs arrays stay in
# cache; at least 64 runs per chunk, and more for short n, so that the per-chunk calls do not
# dominate.
KERNEL_CHUNK = 64 * 2048

#: Sampling schemes the Monte Carlo accountant draws from: 004's b-min-sep chain (Eq. 1; warm start,
# or multi-attribution), Poisson in every round and balls-in-bins (exact likelihoods above).
SCHEMES = ("bminsep", "poisson", "balls-in-bins")


class MonteCarloAccountant:
    """Samples privacy losses of banded MF under b-min-sep (or multi-attribution) sampling (004 Eq.
    1), Poisson sampling in every round (forward algorithm, ≤ 12 bands) or balls-in-bins (phase
    enumeration, any encoder).

    ``scheme="poisson"``: ``p`` is the per-round probability, ``min_sep`` is ignored (1).
    ``scheme="balls-in-bins"``: ``min_sep`` is the number of bins T (``p`` = 1).

    Args:
        band: shape (n, bands), ``band[i, k] = C[i + k, i]``, entrywise non-negative (bands ≤
            min_sep for b-min-sep; ≤ `MAX_FORWARD_BANDS` for Poisson).
        min_sep: b (b-min-sep), or the number of bins T (balls-in-bins).
        p: the Poisson probability among eligible rounds (b-min-sep), or per round (Poisson).
        warm: warm start (004 Alg. 2; b-min-sep only, and False when k_u > 1).
        k_u: items per user (multi-attribution, 004 §6; cold-start b-min-sep only).
        dtype: the dtype of the sampled outputs and of the exponents (the compiled b-min-sep
            recursion runs in float64).
        batch: samples per batch (a batch's draws depend only on its child seed).
        scheme: one of `SCHEMES`.

    Raises:
        InvalidArgumentError: an unknown scheme, a negative or malformed band, more bands than the
            scheme allows, p out of range, or k_u > 1 outside cold-start b-min-sep.
    """

    def __init__(
        self,
        band: np.ndarray,
        min_sep: int,
        p: float,
        *,
        warm: bool = True,
        k_u: int = 1,
        dtype=np.float32,
        batch: int = 16384,
        scheme: str = "bminsep",
    ):
        band = np.asarray(band, dtype=np.float64)
        require(scheme in SCHEMES, "scheme", f"one of {SCHEMES}", scheme)
        require(
            band.ndim == 2 and band.shape[1] >= 1,
            "factorization",
            "a banded encoder (n × bands)",
            band.shape,
        )
        band = truncate_band(band)
        require(
            bool(np.all(band >= 0)),
            "factorization",
            "an entrywise non-negative banded C for Monte Carlo accounting (004 §2.2)",
        )
        if scheme == "bminsep":
            require(
                band.shape[1] <= min_sep,
                "factorization",
                f"at most min_sep = {min_sep} bands for the banded recursion (004 Eq. 1)",
                band.shape[1],
            )
        if scheme == "poisson":
            require(
                band.shape[1] <= MAX_FORWARD_BANDS,
                "factorization",
                f"at most {MAX_FORWARD_BANDS} bands for the exact Poisson likelihood (use the MMCC "
                "accountant above)",
                band.shape[1],
            )
            require(
                0 < p < 1, "sampling_probability", "a probability in (0, 1) for Poisson sampling", p
            )
            min_sep, warm = 1, False
        if scheme == "balls-in-bins":
            p, warm = 1.0, True
        require(0 < p <= 1, "sampling_probability", "a probability in (0, 1]", p)
        require(isinstance(k_u, int) and k_u >= 1, "k_u", "a positive integer", k_u)
        self.band, self.min_sep, self.p, self.warm, self.k_u = (
            band,
            int(min_sep),
            float(p),
            bool(warm),
            k_u,
        )
        self.scheme = scheme
        self.dtype, self.batch = dtype, int(batch)
        if k_u > 1:
            require(
                scheme == "bminsep" and not warm,
                "warm",
                "cold-start b-min-sep for multi-attribution (004 §6.2)",
                warm,
            )
        if scheme == "balls-in-bins":
            n = band.shape[0]
            C = np.zeros((n, n))
            for k in range(band.shape[1]):
                idx = np.arange(n - k)
                C[idx + k, idx] = band[: n - k, k]
            self._C = C
            X = (np.arange(n)[:, None] % self.min_sep == np.arange(self.min_sep)[None, :]).astype(
                np.float64
            )
            self._phase_means = C @ X  # n × T

    @property
    def rounds(self) -> int:
        """n."""
        return self.band.shape[0]

    def sample_losses(
        self,
        sigma: float,
        samples: int,
        seed: int | np.random.SeedSequence,
        workers: int | None = None,
        progress: bool = False,
        keep_above: float | None = None,
    ) -> MonteCarloEstimate:
        """``samples`` losses in each direction at noise multiplier σ (fresh, independent draws per
        seed).

        Batches get child seeds and are spread over ``workers`` processes (default: the CPU count
        for large runs); the result depends only on (seed, samples, batch size).

        Args:
            sigma: σ > 0.
            samples: per direction, ≥ 2.
            seed: an integer or a ``SeedSequence``.
            workers: processes (None: up to the CPU count, one per 2·10⁶ sampled outputs,
                samples × rounds).
            progress: a progress line on stderr.
            keep_above: keep only losses above it (δ(ε) for ε ≥ ``keep_above`` needs no others; the
                count of all samples is kept), to bound memory.

        Returns:
            The `MonteCarloEstimate`.
        """
        require(np.isfinite(sigma) and sigma > 0, "noise_multiplier", "a positive number", sigma)
        require(isinstance(samples, int) and samples >= 2, "mc_samples", "an integer ≥ 2", samples)
        ss = seed if isinstance(seed, np.random.SeedSequence) else np.random.SeedSequence(seed)
        sizes = [min(self.batch, samples - s0) for s0 in range(0, samples, self.batch)]
        jobs = [
            (sigma, size, child, keep_above)
            for size, child in zip(sizes, ss.spawn(len(sizes)), strict=True)
        ]
        if workers is None:
            # a pool's start and transfers cost more than a few million outputs take to sample
            workers = min(os.cpu_count() or 1, max(1, samples * self.rounds // 2_000_000))
        if workers > 1 and len(jobs) > 1:
            if self.scheme == "bminsep" and self.k_u == 1:
                # Compile (or load) the kernels here, once, so that the forked workers inherit them.
                self._bminsep_batch(sigma, 1, np.random.default_rng(0))
            ctx = multiprocessing.get_context("fork")
            with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
                parts = _collect(pool.map(self._job, jobs, chunksize=4), sizes, progress)
        else:
            parts = _collect((self._job(job) for job in jobs), sizes, progress)
        return MonteCarloEstimate(
            sigma,
            np.concatenate([a for a, _ in parts]),
            np.concatenate([r for _, r in parts]),
            count=samples,
            floor=keep_above,
        )

    def _job(self, job) -> tuple[np.ndarray, np.ndarray]:
        sigma, size, child, keep_above = job
        add, remove = self._batch(sigma, (size, child))
        if keep_above is not None:
            add, remove = add[add > keep_above], remove[remove > keep_above]
        return add, remove

    def _batch(self, sigma: float, job) -> tuple[np.ndarray, np.ndarray]:
        S, child = job
        rng = np.random.default_rng(child)
        n = self.rounds
        if self.scheme == "bminsep" and self.k_u == 1:
            return self._bminsep_batch(sigma, S, rng)
        # One Gaussian draw serves both directions: each direction's estimate is still a mean of
        # i.i.d. terms, and the EVR failure bound is applied to the failing direction alone, so
        # their correlation does not matter.
        z = rng.standard_normal((n, S), dtype=self.dtype)
        z *= self.dtype(sigma)
        remove = -self._llr(z, sigma)
        if self.scheme == "balls-in-bins":
            z += self._phase_means[:, rng.integers(0, self.min_sep, size=S)].astype(z.dtype)
        elif self.scheme == "poisson":
            rows, pos, counts = sample_participations(S, n, 1, self.p, rng)
            # participations may be closer than the bands: accumulate
            for k in range(self.band.shape[1]):
                ok = pos + k < n
                np.add.at(z, (pos[ok] + k, rows[ok]), self.band[pos[ok], k].astype(z.dtype))
        else:
            add_means(
                z,
                self.band,
                *sample_participations(S, n, self.min_sep, self.p, rng, self.warm, self.k_u),
            )
        return self._llr(z, sigma), remove

    def _bminsep_batch(
        self, sigma: float, S: int, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray]:
        """Both directions' losses for S runs of b-min-sep sampling (k_u = 1) by the compiled
        kernels, in chunks of about `KERNEL_CHUNK` outputs (their arrays stay in cache): z,
        the exponents of y = σz, those of y = σz + Cx from them (only rounds near a participation
        change), then the linear recursion for each."""
        from corrflow.accounting import mc_kernels as kernels  # here: numba loads only when needed

        n, dtype, band = self.rounds, self.dtype, self.band
        band_v, offset = _exponent_terms(band, sigma, self.p, dtype)
        window = participation_window(band, sigma).astype(dtype)
        add, remove = np.empty(S), np.empty(S)
        # xoshiro256++'s state: never all zero
        state = rng.integers(1, 2**63, size=4, dtype=np.uint64)
        runs = max(64, KERNEL_CHUNK // n)
        buffers: dict[int, tuple] = {}  # per chunk width (all chunks but the last share one set)
        for lo in range(0, S, runs):
            m = min(runs, S - lo)
            if m not in buffers:
                buffers[m] = (
                    *(np.empty((n, m), dtype=dtype) for _ in range(3)),
                    np.empty((n, m), dtype=np.uint8),
                )
            z, a_q, a_p, x = buffers[m]
            x.fill(0)
            kernels.sample_noise(state, float(sigma), z)
            kernels.exponents(z, band_v, offset, a_q)
            kernels.participation_exponents(
                state, window, self.min_sep, self.p, self.warm, a_q, a_p, x
            )

            def with_means(z=z, x=x):
                y, (pos, rows) = z.copy(), np.nonzero(x)
                add_means(y, band, rows, pos, np.ones(rows.size))
                return y

            remove[lo : lo + m] = -_llr_from_exponents(
                a_q, lambda z=z: z, band, sigma, self.min_sep, self.p, self.warm
            )
            add[lo : lo + m] = _llr_from_exponents(
                a_p, with_means, band, sigma, self.min_sep, self.p, self.warm
            )
        return add, remove

    def _llr(self, y: np.ndarray, sigma: float) -> np.ndarray:
        if self.scheme == "poisson":
            return poisson_banded_llr(y, self.band, sigma, self.p)
        if self.scheme == "balls-in-bins":
            return balls_in_bins_llr(y, self._C, sigma, self.min_sep)
        return log_likelihood_ratio(y, self.band, sigma, self.min_sep, self.p, self.warm, self.k_u)

    def verify(
        self, sigma: float, epsilon: float, delta_prime: float, samples: int, seed
    ) -> tuple[bool, float]:
        """The EVR verifier (004 Alg. 5): pass iff δ̂(ε) ≤ δ' in both directions, on fresh samples.

        Args:
            sigma: the candidate σ.
            epsilon: ε.
            delta_prime: δ', the threshold.
            samples: per direction.
            seed: an integer or a ``SeedSequence``.

        Returns:
            (passed, δ̂ of the worse direction).
        """
        d, _ = self.sample_losses(sigma, samples, seed).delta(epsilon)
        return d <= delta_prime, d


# -- adaptive, deterministic Estimate-Verify-Release at the target δ -------------------------------

#: Share of the target δ spent on the verifier's failure probability β (attempt i gets β/2^(i+1));
# the rest, δ_v, is the δ the mechanism itself must have at the released ε.
EVR_FAILURE_SHARE = 0.05
#: The estimation batch is sized so that a verification of that size would have a threshold δ' of
# this fraction of the target δ (`first_verification_size`) ...
EVR_FIRST_THRESHOLD = 0.4
#: ... but at most this many samples by default (at δ = 1e-6 that size is 8.7·10⁷); the first
# attempt draws at most as many again, later attempts what their estimate says they need.
FIRST_BATCH_CAP = 40_000_000
#: Default cap on the samples per direction, all batches together (n = 48: about 4 minutes on 2
# idle cores): the estimation batch and the first attempt draw at most 2 × `FIRST_BATCH_CAP`;
# later attempts are sized by `samples_to_pass` and run only while they fit under the cap.
DEFAULT_MAX_SAMPLES = 240_000_000
#: Standard deviations of an attempt's own δ̂ that its size leaves between the estimated δ(ε) and
# its threshold (`samples_to_pass`).
PASS_Z = 2.0
#: After a failed attempt the next ε is at least (1 + this) times the failed one.
EPSILON_STEP = 0.01
#: Relative step of the ε grid an attempt's ε is chosen on (`plan_attempt`).
EPSILON_GRID = 0.0025


def verify_threshold(samples: int, share: float, delta_v: float) -> float:
    """The largest threshold δ' with exp(−s·KL(δ'‖δ_v)) ≤ share: a verifier passing iff δ̂ ≤ δ'
    wrongly passes a mechanism whose δ exceeds δ_v with probability ≤ share (Chernoff, 004 Thm A.1 /
    Chua et al., arXiv 2412.16802, Fact 4.2).

    Args:
        samples: s, the verifier's samples.
        share: the allowed wrong-pass probability.
        delta_v: δ_v, the mechanism's δ to verify.

    Returns:
        δ' (to 1e-9 relative of δ_v); 0 when even δ' = 0 is not enough.
    """
    from scipy.optimize import brentq  # lazy: scipy's import slows every CLI start

    need = math.log(1.0 / share) / samples
    if bernoulli_kl(0.0, delta_v) < need:
        return 0.0
    d = brentq(lambda x: bernoulli_kl(x, delta_v) - need, 0.0, delta_v, xtol=delta_v * 1e-9)
    step = delta_v * 1e-9
    # brentq may land just above the root: step to its safe side
    while d > 0 and bernoulli_kl(d, delta_v) < need:
        d, step = max(0.0, d - step), 2 * step
    return float(d)


def first_verification_size(
    delta_target: float,
    share_of_failure: float = EVR_FAILURE_SHARE,
    ratio: float = EVR_FIRST_THRESHOLD,
) -> int:
    """The sample count at which a first verification's threshold reaches ``ratio``·δ_target.

    Args:
        delta_target: the target δ.
        share_of_failure: the share β/δ of the target spent on the verifier's failure probability.
        ratio: the first attempt's threshold δ' must reach this fraction of the target.

    Returns:
        The smallest s (to 1%) whose first-attempt threshold (failure share β/2) reaches
        ``ratio``·δ_target.
    """
    beta = share_of_failure * delta_target
    delta_v = delta_target - beta
    s = 2
    while verify_threshold(s, beta / 2, delta_v) < ratio * delta_target:
        s = int(s * 1.01) + 1
    return s


def samples_to_pass(
    delta_upper: float,
    share: float,
    delta_v: float,
    *,
    spread: float = 1.0,
    z: float = PASS_Z,
    cap: int | None = None,
) -> int | None:
    """The adaptive budget rule of `adaptive_evr`: the fresh samples an attempt needs to pass
    at an ε whose δ(ε) is estimated at most ``delta_upper``.

    The attempt's threshold δ'(s) = verify_threshold(s, share, δ_v) grows with s toward δ_v; its
    estimate δ̂(ε) on s fresh samples has standard deviation √(spread·δ(ε)/s) (terms in [0, 1]: Var
    ≤ spread·E with spread ≤ 1). The rule: the smallest s (to 1%) with δ'(s) ≥ δ_up +
    z·√(spread·δ_up/s), so that the attempt passes unless δ(ε) > δ_up or its δ̂ lands z standard
    deviations high. The threshold, not this rule, keeps a wrong pass below ``share`` (004 App. A,
    Thm A.1; Chua et al., arXiv 2412.16802, Fact 4.2), whatever s is.

    Args:
        delta_upper: δ_up, an upper estimate of δ(ε) at the attempt's ε (≥ 0).
        share: the attempt's wrong-pass probability β_i.
        delta_v: δ_v, the mechanism's δ to verify.
        spread: Var(term)/E(term) of the δ terms at ε, in (0, 1] (1: the bound for terms in [0, 1]).
        z: standard deviations of the attempt's own δ̂ left as margin.
        cap: the most samples allowed (None: 2^50).

    Returns:
        s, or None when no s ≤ cap passes (δ_up ≥ δ_v, or the cap is too small).
    """
    cap = 1 << 50 if cap is None else int(cap)
    if not 0 <= delta_upper < delta_v:
        return None

    need0 = math.log(1.0 / share) / -math.log1p(-delta_v)  # below it not even δ' = 0 verifies

    def ok(s: int) -> bool:
        margin = z * math.sqrt(spread * delta_upper / s)
        return s >= need0 and verify_threshold(s, share, delta_v) >= delta_upper + margin

    lo = max(2, int(need0))
    hi = lo
    while not ok(hi):
        if hi >= cap:
            return None
        lo, hi = hi, min(2 * hi, cap)
    while hi > lo * 1.01 + 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return int(hi)


def plan_attempt(
    pool: MonteCarloEstimate,
    share: float,
    delta_v: float,
    limit: int,
    epsilon_min: float,
    release_z: float,
) -> tuple[float, int, float] | None:
    """The next attempt of `adaptive_evr`: the smallest ε ≥ ``epsilon_min`` (on a grid of
    relative step `EPSILON_GRID`) whose `samples_to_pass` fits in ``limit``.

    δ_up(ε) = δ̂(ε) + release_z·se(ε) on the pool (at least one sample's worth, 1/N, so that an empty
    tail does not read as δ = 0), and the spread Var/E of the δ terms from the pool too.

    Args:
        pool: the earlier samples (estimation batches and failed attempts' fresh samples).
        share: the attempt's wrong-pass probability β_i.
        delta_v: δ_v.
        limit: the most samples the attempt may draw.
        epsilon_min: the smallest ε to consider.
        release_z: standard errors added to δ̂ for δ_up.

    Returns:
        (ε, samples, δ_up), or None when no ε on the grid (up to 50× ``epsilon_min``) fits.
    """
    n = pool.samples
    eps = max(epsilon_min, pool.floor or 0.0, 1e-6)
    top = 50 * eps
    while eps <= top:
        d, se = pool.delta(eps)
        upper = max(d + release_z * se, 1.0 / n)
        spread = min(1.0, max(0.05, se * se * n / d)) if d > 0 else 1.0
        s = samples_to_pass(upper, share, delta_v, spread=spread, cap=limit)
        if s is not None:
            return eps, s, upper
        eps *= 1 + EPSILON_GRID
    return None


@dataclass
class EVRAttempt:
    """One verification of `adaptive_evr`.

    Attributes:
        samples: its fresh samples per direction (sized from the earlier samples).
        threshold: δ'.
        failure_share: β_i, its wrong-pass probability.
        epsilon: the ε chosen on the earlier samples.
        delta_upper: δ_up, the upper estimate of δ(ε) on the earlier samples that sized it.
        delta_hat: δ̂(ε) on its fresh samples.
        passed: δ̂ ≤ δ'.
    """

    samples: int
    threshold: float  # δ'
    failure_share: float  # β_i
    epsilon: float  # ε chosen on the earlier samples
    delta_upper: float  # δ_up(ε) on the earlier samples, which sized the attempt
    delta_hat: float  # δ̂(ε) on the attempt's fresh samples
    passed: bool


@dataclass
class EVRRun:
    """Outcome of `adaptive_evr`: ``passed`` → (epsilon, delta_target) holds with the
    verifier's failure probability counted in δ; else the budget was spent (``estimate`` is the
    point estimate at δ_v, not a bound)."""

    passed: bool
    epsilon: float | None
    delta_target: float
    delta_verified: float  # δ_v
    failure_budget: float  # β
    estimate: float
    samples_drawn: int
    max_samples: int
    attempts: list[EVRAttempt]

    def to_dict(self) -> dict:
        """The run as the report shows it.

        Returns:
            The run's fields for the report's ``accountant`` section (``verification_passed``,
            ``delta_mechanism``, ``verifier_failure_budget``, ``epsilon_estimate``, samples and
            attempts).
        """
        return {
            "verification_passed": self.passed,
            "delta_mechanism": self.delta_verified,
            "verifier_failure_budget": self.failure_budget,
            "epsilon_estimate": self.estimate,
            "samples_drawn": self.samples_drawn,
            "max_samples": self.max_samples,
            "attempts": [vars(a) for a in self.attempts],
        }


def adaptive_evr(
    mc: MonteCarloAccountant,
    sigma: float,
    delta_target: float,
    seed: int,
    *,
    max_samples: int = DEFAULT_MAX_SAMPLES,
    first_samples: int | None = None,
    release_z: float = 3.0,
    time_limit: float | None = None,
    progress: bool = False,
    clock=None,
    workers: int | None = None,
) -> EVRRun:
    """ε verified at ``delta_target`` by Estimate-Verify-Release with adaptively sized attempts
    (004 App. A, Alg. 5 for one σ, Thm A.1).

    Estimation batch: s₀ samples (`first_verification_size`, at most `FIRST_BATCH_CAP`;
    or ``first_samples``). Attempt i then picks, on every sample drawn before it (the pool), the
    smallest ε (≥ the point estimate at δ_v for i = 0, ≥ (1 + `EPSILON_STEP`)·ε_{i−1} after a
    failure) whose `samples_to_pass` fits (at most s₀ for i = 0, else what is left of
    ``max_samples``), draws that many fresh samples and passes iff δ̂(ε) ≤ δ'_i, the largest
    threshold whose wrong-pass probability against δ_v = (1 − 0.05)·δ is ≤ β_i = β/2^(i+1), β =
    0.05·δ (`verify_threshold`). A failed attempt's samples join the pool. The budget thus
    grows where the estimate says a pass is near, up to ``max_samples``.

    Why adaptive sizes keep the guarantee (004 Thm A.1 with the failure bound of Chua et al., arXiv
    2412.16802, Fact 4.2): attempt i's ε_i, s_i and δ'_i are functions of the samples drawn before
    it, and its own samples are fresh, so conditionally on that history its δ̂ is a mean of s_i
    i.i.d. terms in [0, 1] and, if the mechanism is not (ε_i, δ_v)-DP, P(δ̂ ≤ δ'_i | history) ≤
    exp(−s_i·KL(δ'_i‖δ_v)) ≤ β_i. Summing over attempts (a union bound over the history-dependent
    sequence), the probability that any attempt passes a wrong ε is ≤ Σ β_i ≤ β, so the released ε
    holds at δ_v + β = δ. Data-dependent sizes only change how many attempts run and their cost,
    never a threshold's validity; reusing a failed attempt's samples for later estimates is the same
    as estimating on any other earlier data.

    Deterministic given ``seed``: estimation batch j and attempt i have their own child seeds.
    ``time_limit`` (seconds) aborts the search with an error (nothing released).

    Args:
        mc: the Monte Carlo accountant of the scheme.
        sigma: σ.
        delta_target: the target δ.
        seed: the run's seed.
        max_samples: the cap on samples per direction, all batches.
        first_samples: the estimation batch's size (None: the default rule above).
        release_z: standard errors added to δ̂ on the pool for the upper estimate δ_up(ε).
        time_limit: seconds after which the search aborts (None: none).
        progress: progress lines on stderr.
        clock: a monotonic clock (default ``time.monotonic``), for tests.
        workers: sampler processes (None: the CPU count).

    Returns:
        The `EVRRun`.

    Raises:
        CorrflowError: the time limit was reached (nothing is released).
    """
    import time

    clock = clock or time.monotonic
    start = clock()
    search = _EVRSearch(mc, sigma, delta_target, seed, max_samples, release_z, workers, progress)
    if first_samples is None:
        s0 = min(first_verification_size(delta_target), FIRST_BATCH_CAP)
    else:
        s0 = int(first_samples)
    search.estimate(max(2, min(s0, max_samples // 2)))
    while search.i < len(search.children) and search.j < len(search.est_seeds):
        if time_limit is not None and clock() - start > time_limit:
            raise CorrflowError(
                f"monte carlo accounting aborted after {clock() - start:.0f} s (time limit "
                f"{time_limit:g} s) with {search.drawn} samples per direction; nothing is released"
            )
        step = search.step()
        if step == "passed":
            return search.result(True, search.attempts[-1].epsilon)
        if step == "spent":
            break
    return search.result(False, None)


class _EVRSearch:
    """The state of one `adaptive_evr` search: the pool of samples drawn so far (losses below the
    floor dropped), the attempts made, and the child seeds of estimation batch j and attempt i."""

    def __init__(self, mc, sigma, delta_target, seed, max_samples, release_z, workers, progress):
        self.mc, self.sigma, self.delta_target = mc, sigma, delta_target
        self.max_samples, self.release_z = max_samples, release_z
        self.workers, self.progress = workers, progress
        self.beta = EVR_FAILURE_SHARE * delta_target
        self.delta_v = delta_target - self.beta
        est_root, ver_root = np.random.SeedSequence(seed).spawn(2)
        self.est_seeds, self.children = est_root.spawn(64), ver_root.spawn(64)
        self.attempts: list[EVRAttempt] = []
        self.i, self.j = 0, 1
        self.floor = None

    def draw(self, size, child, floor=None):
        return self.mc.sample_losses(
            self.sigma,
            size,
            child,
            workers=self.workers,
            progress=self.progress,
            keep_above=floor,
        )

    def estimate(self, s0: int) -> None:
        """Draw the estimation batch of ``s0`` samples and set the floor."""
        pool = self.draw(s0, self.est_seeds[0])
        # Keep only losses that can matter: below the ε at 100·δ (at least 50 samples above it)
        # nothing contributes to δ̂ at the thresholds used; a floor set too high only makes ε
        # larger, never invalid.
        level = max(100 * self.delta_target, 50 / pool.samples)
        floor = pool.epsilon(level) if level < 0.5 else None
        if floor is not None:
            pool = MonteCarloEstimate(
                self.sigma,
                pool.add[pool.add > floor],
                pool.remove[pool.remove > floor],
                count=pool.samples,
                floor=floor,
            )
        self.pool, self.floor, self.drawn, self.s0 = pool, floor, s0, s0

    def step(self) -> str:
        """Plan and run the next attempt: ``"passed"``, ``"failed"``, ``"spent"`` (no affordable
        attempt) or ``"estimated"`` (the first attempt could not be sized: the pool doubled)."""
        i, pool, delta_v, z = self.i, self.pool, self.delta_v, self.release_z
        left = self.max_samples - self.drawn
        share = self.beta / 2 ** (i + 1)
        if i == 0:
            plan = plan_attempt(pool, share, delta_v, min(self.s0, left), pool.epsilon(delta_v), z)
        else:
            eps_min = self.attempts[-1].epsilon * (1 + EPSILON_STEP)
            plan = plan_attempt(pool, share, delta_v, left, eps_min, z)
        if plan is None:
            if i > 0 or left < 2:
                return "spent"
            # The estimation batch is too small to size a first attempt: estimation only (no share
            # of β spent), doubling the pool.
            size = min(self.drawn, left)
            self.pool = pool.merged(self.draw(size, self.est_seeds[self.j], self.floor))
            self.drawn, self.j, self.s0 = self.drawn + size, self.j + 1, self.drawn + size
            return "estimated"
        eps, size, upper = plan
        threshold = verify_threshold(size, share, delta_v)
        ver = self.draw(size, self.children[i], self.floor)
        self.drawn += size
        d_hat, _ = ver.delta(eps)
        passed = bool(d_hat <= threshold)
        self.attempts.append(EVRAttempt(size, threshold, share, eps, upper, d_hat, passed))
        if self.progress:
            print(
                f"monte carlo attempt {i}: ε = {eps:.6g}, δ̂ = {d_hat:.3g} vs δ' = {threshold:.3g} "
                f"({'passed' if passed else 'failed'}, {size} samples)",
                file=sys.stderr,
            )
        self.pool = pool.merged(ver)
        if passed:
            return "passed"
        self.i += 1
        return "failed"

    def result(self, passed: bool, eps: float | None) -> EVRRun:
        return EVRRun(
            passed,
            eps,
            self.delta_target,
            self.delta_v,
            self.beta,
            self.pool.epsilon(self.delta_v),
            self.drawn,
            self.max_samples,
            self.attempts,
        )
