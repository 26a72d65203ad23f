"""Monte Carlo accounting of banded MF under b-min-sep sampling, balls-in-bins and multi-attribution (004).

004_cab8ae431845c278.txt §5 (Thm 5.1, Eq. 1): for a b-banded, entrywise non-negative lower-triangular C under
b-min-sep Poisson sampling with probability p (Alg. 1), the privacy-loss ratio of P = N(Cx, σ²I) (x the differing
example's participations) against Q = N(0, σ²I) is f_0(y) with

    f_i = (1 − p)·f_{i+1} + p·exp((2⟨c_i, y_{i:i+b}⟩ − ‖c_i‖²)/(2σ²))·f_{i+b},   f_i = 1 for i ≥ n,

computed here in log space, vectorised over samples, O(n·bands) per sample. Warm start (Alg. 2):
(f_0 + p·Σ_{i=1}^{b−1} f_i)/(1 + (b−1)p); with p = 1 and b = T it is balls-in-bins with T bins (digest §1.6).
Multi-attribution (§6, Thm 6.1): each available step draws Binom(k_u, p) of the user's items (cold start only).

δ(ε) = E_{y∼P}[max(0, 1 − e^{ε−L(y)})] is estimated for both adjacency directions (y ∼ P with L = ln P/Q, and
y ∼ Q with L = ln Q/P) and the larger is used. Guarantees come from Estimate-Verify-Release (004 Alg. 5, Thm A.1):
a verifier at threshold δ' with s samples fails to catch a mechanism that is not (ε, δ)-DP with probability at most
exp(−s·KL(δ'‖δ)), giving (ε, δ + q(1 − δ))-DP overall.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from scipy.special import gammaln, logsumexp

from corrflow.errors import InvalidArgumentError, require


def truncate_band(band: np.ndarray) -> np.ndarray:
    """``band`` (n × bands, ``band[i, k] = C[i + k, i]``) with the entries past round n set to 0.

    A Toeplitz encoder's band layout repeats its coefficients in every column, also where row i + k ≥ n does not
    exist; counting those entries in ‖c_i‖² would over-state the squared column norms of the last bands − 1 columns
    and understate the privacy loss of late participations.
    """
    band = np.array(band, dtype=np.float64)
    n, bands = band.shape
    past = np.arange(n)[:, None] + np.arange(bands)[None, :] >= n
    band[past] = 0.0
    return band


def log_likelihood_ratio(y: np.ndarray, band: np.ndarray, sigma: float, min_sep: int, p: float,
                         warm: bool = False, k_u: int = 1) -> np.ndarray:
    """ln P(y)/Q(y) for every column of y (n × S, round-major) by the recursion of 004 Eq. 1 (Thm 6.1 for k_u > 1).

    ``band[i, k] = C[i + k, i]`` (n × bands, zero past row n), bands ≤ min_sep, entries ≥ 0. Returns (S,) float64.
    """
    y = np.asarray(y)
    n, S = y.shape
    b = min_sep
    dtype = y.dtype
    band = truncate_band(band)
    require(band.shape[0] == n, "band", f"{n} columns (one per round of y)", band.shape[0])
    sq = np.sum(band ** 2, axis=1)
    inv2s2 = 1.0 / (2.0 * sigma * sigma)
    log_skip = dtype.type(k_u * math.log1p(-p) if p < 1 else -np.inf)
    js = np.arange(1, k_u + 1)
    rest = k_u - js  # items not sampled; 0·log(1 − p) is 0 even at p = 1
    log_rest = np.where(rest == 0, 0.0, -np.inf) if p == 1 else rest * math.log1p(-p)
    log_pmf = gammaln(k_u + 1) - gammaln(js + 1) - gammaln(rest + 1) + js * math.log(p) + log_rest
    band32 = (band * (2.0 * inv2s2)).astype(dtype)  # 2⟨c_i, y⟩/(2σ²) comes out of the block products directly
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
                terms = np.outer(d, js) + (log_pmf - js**2 * sq[i] * inv2s2)
                join[...] = logsumexp(terms, axis=1)
            join += buf[i % b]
            if p < 1:
                np.add(buf[(i + 1) % b], log_skip, out=skip)
                _logaddexp(skip, join, buf[i % b], tmp)
            else:  # p = 1 (balls-in-bins): an available example always joins
                buf[i % b] = join
    if not warm:
        return buf[0].astype(np.float64)
    require(k_u == 1, "k_u", "1 for warm start (multi-attribution is accounted as a cold start, 004 §6.2)", k_u)
    if b > 1:
        buf[1:b] += dtype.type(math.log(p))
    top = buf.max(axis=0)
    return (top + np.log(np.exp(buf - top).sum(axis=0))).astype(np.float64) - math.log1p((b - 1) * p)


def _block_dots(y: np.ndarray, band: np.ndarray, lo: int, hi: int, out: np.ndarray, prod: np.ndarray) -> None:
    """out[j − lo] = Σ_k band[j, k]·y[j + k] for rows j in [lo, hi) (entries past row n contribute nothing)."""
    n = y.shape[0]
    m = hi - lo
    np.multiply(y[lo:hi], band[lo:hi, :1], out=out[:m])
    for k in range(1, band.shape[1]):
        top = min(hi, n - k)
        if top <= lo:
            break
        r = top - lo
        np.multiply(y[lo + k:top + k], band[lo:top, k:k + 1], out=prod[:r])
        out[:r] += prod[:r]


def _logaddexp(a: np.ndarray, b: np.ndarray, out: np.ndarray, tmp: np.ndarray) -> None:
    """out = log(e^a + e^b) as max + log(1 + e^{−|a−b|}): ~4× faster than np.logaddexp in float32 (whose log1p
    is not vectorised); the rounding of 1 + x loses only terms below float32 resolution. Inputs are finite."""
    np.subtract(a, b, out=tmp)
    np.abs(tmp, out=tmp)
    np.negative(tmp, out=tmp)
    np.exp(tmp, out=tmp)
    tmp += 1
    np.log(tmp, out=tmp)
    np.maximum(a, b, out=out)
    out += tmp


def sample_participations(S: int, n: int, min_sep: int, p: float, rng: np.random.Generator, warm: bool = False,
                          k_u: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One example's (or user's) participations under b-min-sep sampling (004 Alg. 1–3), for S independent runs.

    Returns (run index, round, count) arrays, one entry per participation.
    """
    b = min_sep
    p_any = 1.0 - (1.0 - p) ** k_u  # an available step takes part when Binom(k_u, p) ≥ 1
    if warm:
        # Stationary chain (digest §1.5): available w.p. 1/(1+(b−1)p), else barred for s ~ U{1..b−1} more rounds.
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
    js = np.arange(1, k + 1)
    pmf = np.exp(gammaln(k + 1) - gammaln(js + 1) - gammaln(k - js + 1)) * p**js * (1 - p) ** (k - js)
    return rng.choice(js, size=size, p=pmf / pmf.sum()).astype(np.float64)


def add_means(y: np.ndarray, band: np.ndarray, rows: np.ndarray, pos: np.ndarray, counts: np.ndarray) -> None:
    """y[:, s] += count·C[:, pos] for every participation (y round-major, n × S). Participations of one run are
    ≥ bands apart, so the scattered entries never collide."""
    n = y.shape[0]
    for k in range(band.shape[1]):
        ok = pos + k < n
        y[pos[ok] + k, rows[ok]] += (counts[ok] * band[pos[ok], k]).astype(y.dtype)


# -- δ estimation and EVR ---------------------------------------------------------------------------------------

def delta_terms(losses: np.ndarray, epsilon: float) -> np.ndarray:
    """max(0, 1 − e^{ε − L}) per sample: unbiased terms of δ(ε) (004 §2.5)."""
    return -np.expm1(np.minimum(epsilon - losses, 0.0))


def bernoulli_kl(a: float, b: float) -> float:
    """KL(Bern(a) ‖ Bern(b))."""
    out = 0.0
    if a > 0:
        out += a * math.log(a / b)
    if a < 1:
        out += (1 - a) * math.log((1 - a) / (1 - b))
    return out


def overall_delta(samples: int, delta_prime: float) -> float:
    """min over δ ∈ [δ', 1) of δ + exp(−s·KL(δ'‖δ))(1 − δ): the δ that EVR releases (004 Thm A.1)."""
    from scipy.optimize import minimize_scalar  # lazy: scipy's import slows every CLI start

    def f(log_tau):
        d = min(delta_prime * math.exp(log_tau), 1 - 1e-16)
        return d + math.exp(-samples * bernoulli_kl(delta_prime, d)) * (1 - d)
    res = minimize_scalar(f, bounds=(0.0, math.log(1.0 / delta_prime)), method="bounded",
                          options={"xatol": 1e-10})
    return float(min(res.fun, f(0.0), 1.0))


def minimum_samples(delta_prime: float, delta_target: float) -> int:
    """Smallest s with overall_delta(s, δ') ≤ δ_target (binary search, digest §6.5)."""
    require(0 < delta_prime < delta_target < 1, "delta", "δ' < δ_target in (0, 1)", (delta_prime, delta_target))
    lo, hi = 1, 2
    while overall_delta(hi, delta_prime) > delta_target:
        hi *= 2
        if hi > 1 << 50:
            raise InvalidArgumentError("delta", "a target reachable with fewer than 2^50 samples", delta_target)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if overall_delta(mid, delta_prime) <= delta_target:
            hi = mid
        else:
            lo = mid
    return hi


@dataclass
class MonteCarloEstimate:
    """Privacy-loss samples for both adjacency directions at one σ."""

    sigma: float
    add: np.ndarray        # L = ln P/Q, y ∼ P   (the differing example present)
    remove: np.ndarray     # L = ln Q/P, y ∼ Q
    samples: int = field(init=False)

    def __post_init__(self) -> None:
        self.samples = int(min(len(self.add), len(self.remove)))

    def delta(self, epsilon: float) -> tuple[float, float]:
        """(δ̂(ε), its standard error) for the worse direction."""
        best = (0.0, 0.0)
        for losses in (self.add, self.remove):
            t = delta_terms(losses, epsilon)
            est = (float(t.mean()), float(t.std(ddof=1) / math.sqrt(len(t))))
            best = max(best, est)
        return best

    def epsilon(self, delta: float, z: float = 0.0) -> float:
        """ε with δ̂(ε) + z·se(ε) = δ (z = 0: point estimate; z > 0: upper confidence end)."""
        from scipy.optimize import brentq  # lazy: scipy's import slows every CLI start

        def g(eps):
            d, se = self.delta(eps)
            return d + z * se - delta
        hi = float(max(self.add.max(), self.remove.max(), 0.0)) + 1.0
        if g(0.0) <= 0:
            return 0.0
        return float(brentq(g, 0.0, hi, xtol=1e-9))


def _collect(parts, sizes: list[int], progress: bool) -> list:
    """Batches in order, with a progress line on stderr when asked."""
    out, done, total = [], 0, sum(sizes)
    for part, size in zip(parts, sizes, strict=True):
        out.append(part)
        done += size
        if progress:
            print(f"\rmonte carlo samples {done}/{total} per direction", end="\n" if done == total else "",
                  file=sys.stderr, flush=True)
    return out


class MonteCarloAccountant:
    """Samples privacy losses of banded MF under b-min-sep (or balls-in-bins, or multi-attribution) sampling."""

    def __init__(self, band: np.ndarray, min_sep: int, p: float, *, warm: bool = True, k_u: int = 1,
                 dtype=np.float32, batch: int = 16384):
        band = np.asarray(band, dtype=np.float64)
        require(band.ndim == 2 and band.shape[1] >= 1, "factorization", "a banded encoder (n × bands)", band.shape)
        band = truncate_band(band)
        require(bool(np.all(band >= 0)), "factorization", "an entrywise non-negative banded C for Monte Carlo "
                "accounting (004 §2.2)")
        require(band.shape[1] <= min_sep, "min_sep", f"at least the number of bands ({band.shape[1]}) for the "
                "banded recursion (004 Eq. 1)", min_sep)
        require(0 < p <= 1, "sampling_probability", "a probability in (0, 1]", p)
        require(isinstance(k_u, int) and k_u >= 1, "k_u", "a positive integer", k_u)
        self.band, self.min_sep, self.p, self.warm, self.k_u = band, int(min_sep), float(p), bool(warm), k_u
        self.dtype, self.batch = dtype, int(batch)
        if k_u > 1:
            require(not warm, "warm", "cold start for multi-attribution (004 §6.2)", warm)

    @property
    def rounds(self) -> int:
        return self.band.shape[0]

    def sample_losses(self, sigma: float, samples: int, seed: int | np.random.SeedSequence,
                      workers: int | None = None, progress: bool = False) -> MonteCarloEstimate:
        """``samples`` losses in each direction at noise multiplier σ (fresh, independent draws per seed).

        Batches get child seeds and are spread over ``workers`` processes (default: the CPU count for large
        runs); the result depends only on (seed, samples, batch size).
        """
        require(np.isfinite(sigma) and sigma > 0, "noise_multiplier", "a positive number", sigma)
        require(isinstance(samples, int) and samples >= 2, "mc_samples", "an integer ≥ 2", samples)
        ss = seed if isinstance(seed, np.random.SeedSequence) else np.random.SeedSequence(seed)
        sizes = [min(self.batch, samples - s0) for s0 in range(0, samples, self.batch)]
        jobs = list(zip(sizes, ss.spawn(len(sizes)), strict=True))
        if workers is None:
            workers = min(os.cpu_count() or 1, max(1, samples // 50_000))
        if workers > 1 and len(jobs) > 1:
            ctx = multiprocessing.get_context("fork")
            with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
                parts = _collect(pool.map(self._batch, [sigma] * len(jobs), jobs), sizes, progress)
        else:
            parts = _collect((self._batch(sigma, job) for job in jobs), sizes, progress)
        return MonteCarloEstimate(sigma, np.concatenate([a for a, _ in parts]), np.concatenate([r for _, r in parts]))

    def _batch(self, sigma: float, job) -> tuple[np.ndarray, np.ndarray]:
        S, child = job
        rng = np.random.default_rng(child)
        n = self.rounds
        # One Gaussian draw serves both directions: each direction's estimate is still a mean of i.i.d. terms, and
        # the EVR failure bound is applied to the failing direction alone, so their correlation does not matter.
        z = rng.standard_normal((n, S), dtype=self.dtype)
        z *= self.dtype(sigma)
        remove = -self._llr(z, sigma)
        add_means(z, self.band, *sample_participations(S, n, self.min_sep, self.p, rng, self.warm, self.k_u))
        return self._llr(z, sigma), remove

    def _llr(self, y: np.ndarray, sigma: float) -> np.ndarray:
        return log_likelihood_ratio(y, self.band, sigma, self.min_sep, self.p, self.warm, self.k_u)

    def verify(self, sigma: float, epsilon: float, delta_prime: float, samples: int, seed) -> tuple[bool, float]:
        """EVR verifier: pass iff δ̂(ε) ≤ δ' (both directions); returns (passed, δ̂)."""
        d, _ = self.sample_losses(sigma, samples, seed).delta(epsilon)
        return d <= delta_prime, d
