"""The compiled b-min-sep Monte Carlo kernels against their definitions: the log-space recursion of
004 Eq. 1, the explicit outputs y = σz + Cx, the b-min-sep chain's exact marginals, and the standard
normal."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from corrflow.accounting import mc_kernels as kernels
from corrflow.accounting.montecarlo import (
    MonteCarloAccountant,
    _exponent_terms,
    linear_log_likelihood_ratio,
    log_likelihood_ratio,
    participation_window,
    truncate_band,
)
from corrflow.factorization import factorize, participation_for

CASES = [  # (n, epochs, min_sep, bands, p, warm, sigma)
    (48, 4, 12, 4, 0.06, True, 1.0),
    (48, 4, 12, 4, 0.06, False, 0.5),
    (64, 4, 16, 8, 0.3, True, 0.3),
    (40, 4, 10, 10, 1.0, True, 1.0),  # P/B = b: every available round joins
    (30, 3, 10, 1, 0.2, False, 0.8),  # one band (DP-SGD under b-min-sep)
]


def _band(n, epochs, min_sep, bands):
    return truncate_band(
        factorize(
            "toeplitz", participation_for(n, epochs, min_sep, kind="min-sep"), bands=bands
        ).encoder.band_array()
    )


def _draw(band, sigma, min_sep, p, warm, S, dtype=np.float64, seed=(9, 8, 7, 6)):
    n = band.shape[0]
    st = np.array(seed, dtype=np.uint64)
    z, a_q, a_p = (np.empty((n, S), dtype=dtype) for _ in range(3))
    x = np.zeros((n, S), dtype=np.uint8)
    band_v, offset = _exponent_terms(band, sigma, p, dtype)
    kernels.sample_noise(st, sigma, z)
    kernels.exponents(z, band_v, offset, a_q)
    kernels.participation_exponents(
        st, participation_window(band, sigma).astype(dtype), min_sep, p, warm, a_q, a_p, x
    )
    return z, a_q, a_p, x


def _with_means(z, x, band):
    """y = z + Cx, written out: x's participations (n × S indicators) through the banded encoder."""
    n, y = z.shape[0], z.copy()
    for d in range(band.shape[1]):
        y[d:] += x[: n - d] * band[: n - d, d : d + 1]
    return y


@pytest.mark.parametrize("case", CASES)
def test_linear_recursion_equals_the_log_space_recursion(case):
    n, k, b, bands, p, warm, sigma = case
    band = _band(n, k, b, bands)
    z, _, _, x = _draw(band, sigma, b, p, warm, 301)
    for arr in (z, _with_means(z, x, band)):
        ref = log_likelihood_ratio(arr, band, sigma, b, p, warm)
        assert np.abs(linear_log_likelihood_ratio(arr, band, sigma, b, p, warm) - ref).max() < 1e-11
        # float32 outputs: the exponents and e^a in float32, the recursion in float64
        got32 = linear_log_likelihood_ratio(arr.astype(np.float32), band, sigma, b, p, warm)
        assert np.abs(got32 - ref).max() < 2e-5 * max(1.0, np.abs(ref).max())


def test_tiny_sigma_falls_back_to_the_log_space_recursion():
    """Exponents beyond e^88 (σ = 0.02) and a vanished chain at p = 1 are recomputed in log space,
    not lost."""
    band = _band(40, 4, 10, 10)
    for sigma, p in ((0.02, 0.5), (0.05, 1.0)):
        z, _, _, x = _draw(band, sigma, 10, p, True, 64)
        for arr in (z, _with_means(z, x, band)):
            got = linear_log_likelihood_ratio(arr, band, sigma, 10, p, True)
            ref = log_likelihood_ratio(arr, band, sigma, 10, p, True)
            assert np.all(np.isfinite(got))
            np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-9)


@pytest.mark.parametrize("case", CASES)
def test_participation_exponents_equal_those_of_the_explicit_outputs(case):
    n, k, b, bands, p, warm, sigma = case
    band = _band(n, k, b, bands)
    z, _, a_p, x = _draw(band, sigma, b, p, warm, 97)
    y = _with_means(z, x, band)
    band_v, offset = _exponent_terms(band, sigma, p, np.float64)
    direct = np.empty_like(y)
    kernels.exponents(y, band_v, offset, direct)
    np.testing.assert_allclose(a_p, direct, rtol=0, atol=1e-12)
    for s in range(x.shape[1]):  # the b-min-sep property
        rounds = np.flatnonzero(x[:, s])
        assert np.all(np.diff(rounds) >= b)


def _exact_marginals(n, b, p, warm):
    """P(participation in round i) by the b-state Markov chain of 004 §1.5 (state 0 available, s > 0
    barred)."""
    pi = np.zeros(b)
    if warm:
        pi[0] = 1 / (1 + (b - 1) * p)
        pi[1:] = p / (1 + (b - 1) * p)
    else:
        pi[0] = 1.0
    out = np.empty(n)
    for i in range(n):
        out[i] = pi[0] * p
        nxt = np.zeros(b)
        nxt[0] = pi[0] * (1 - p) + (pi[1] if b > 1 else 0.0)
        if b > 1:
            nxt[b - 1] += pi[0] * p
            nxt[1 : b - 1] += pi[2:]
        else:
            nxt[0] += pi[0] * p
        pi = nxt
    return out


@pytest.mark.parametrize(
    "b,p,warm", [(5, 0.3, False), (5, 0.3, True), (4, 1.0, True), (1, 0.2, False)]
)
def test_participations_follow_the_b_min_sep_chain(b, p, warm):
    n, S = 24, 40_000
    band = np.ones((n, 1))
    x = _draw(band, 1.0, b, p, warm, S)[3]
    expect = _exact_marginals(n, b, p, warm)
    se = np.sqrt(expect * (1 - expect) / S) + 1e-12
    assert np.all(np.abs(x.mean(axis=1) - expect) <= 5 * se)


def test_ziggurat_tables_are_numpys():
    """Our tables equal numpy's (numba ships a copy): float64 to 1e-12; the float32 variant's widths
    and densities to float32 rounding (ours are kept in float64)."""
    constants = pytest.importorskip("numba.np.random._constants")
    numpy64 = (constants.ki_double, constants.wi_double, constants.fi_double)
    for ours, theirs, tol in (
        (kernels.ZIG64[:3], numpy64, 1e-12),
        (kernels.ZIG32[1:3], (constants.wi_float, constants.fi_float), 1e-7),
    ):
        for a, b in zip(ours, theirs, strict=True):
            b = np.asarray(b, dtype=np.float64)
            assert (
                np.max(np.abs(np.asarray(a, dtype=np.float64) - b) / np.maximum(np.abs(b), 1e-300))
                < tol
            )
    # acceptance bounds: ours are rounded down (a rectangle-accepted proposal is inside the
    # density), at most 1 below
    ki32 = np.asarray(constants.ki_float, dtype=np.int64)
    assert np.all((kernels.ZIG32[0] <= ki32) & (kernels.ZIG32[0] >= ki32 - 1))
    assert kernels.ZIG64[3] == pytest.approx(constants.ziggurat_nor_r, rel=1e-15)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_normal_draws_are_standard_normal_including_the_tail(dtype):
    z = np.empty((1000, 2000), dtype=dtype)
    kernels.sample_noise(np.array([5, 6, 7, 8], dtype=np.uint64), 1.0, z)
    x = z.ravel().astype(np.float64)
    assert stats.kstest(x, "norm").pvalue > 1e-3
    assert abs(x.mean()) < 5 / math.sqrt(x.size) and abs(x.var() - 1) < 5 * math.sqrt(2 / x.size)
    # beyond the ziggurat's base r ≈ 3.654 only the tail algorithm produces values
    tail, expect = np.mean(np.abs(x) > kernels.ZIG64[3]), 2 * stats.norm.sf(kernels.ZIG64[3])
    assert abs(tail - expect) < 5 * math.sqrt(expect / x.size)


def test_monte_carlo_losses_are_deterministic_per_seed_and_independent_across_seeds():
    band = _band(48, 4, 12, 4)
    mc = MonteCarloAccountant(band, 12, 0.06, warm=True, batch=1000)
    a = mc.sample_losses(1.0, 2500, seed=3, workers=1)
    b = mc.sample_losses(1.0, 2500, seed=3, workers=2)
    c = mc.sample_losses(1.0, 2500, seed=4, workers=1)
    np.testing.assert_array_equal(a.add, b.add)
    np.testing.assert_array_equal(a.remove, b.remove)
    assert not np.any(a.add == c.add)
    # E_Q[P/Q] = 1 and E_P[Q/P] = 1: both directions' likelihood ratios average to one (a check of
    # the whole draw)
    big = mc.sample_losses(1.0, 200_000, seed=5, workers=1)
    for losses in (big.remove, big.add):
        w = np.exp(-losses)
        assert abs(w.mean() - 1) < 5 * w.std() / math.sqrt(w.size)


def test_tiny_sigma_batches_equal_the_small_noise_limit():
    """At σ → 0 the likelihood ratio of pure noise is the probability that the example never
    participates: ln P/Q(z) → ln P(x = 0), for every z (the other terms are e^{−‖Cx‖²/(2σ²)}
    smaller). At σ = 0.02 every exponent of the differing example's outputs overflows e^88, so the
    batch takes the log-space fallback on outputs it rebuilds from the drawn participations."""
    n, b, p = 40, 10, 0.5
    mc = MonteCarloAccountant(_band(n, 4, b, 10), b, p, warm=True)
    est = mc.sample_losses(0.02, 300, seed=1, workers=1)
    stay = 1 / (1 + (b - 1) * p)  # warm start: available, else barred for s = 1..b−1 more rounds
    never = stay * (1 - p) ** n + sum(p * stay * (1 - p) ** (n - s) for s in range(1, b))
    np.testing.assert_allclose(est.remove, -math.log(never), rtol=1e-9)
    # ‖Cx‖²/(2σ²) dominates with x drawn from P
    assert np.all(np.isfinite(est.add)) and est.add.min() > 100
