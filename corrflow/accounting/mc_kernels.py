"""Compiled kernels for the b-min-sep Monte Carlo accountant (004 Eq. 1), the hot path of a verified
ε at small δ.

A verified δ = 1e-5 needs ~15 M privacy-loss samples per direction; at n = 2048 rounds that is
3·10¹⁰ Gaussian draws and twice as many recursion steps. The numpy formulation spent its time in the
generator (numpy's float32 ziggurat costs ~8.5 ns a draw on the reference machine) and in the dozen
passes over memory the log-space recursion takes per round. Here (numba, installed from wheels; no C
toolchain), per chunk of runs laid out round-major (n × S):

- `sample_noise` draws σ·z by the 256-layer ziggurat (numpy's algorithm and tables) over
  xoshiro256++ bits, seeded per batch from the run's numpy ``Generator`` (~1.9 ns a draw);
- `exponents` computes a_i = ⟨c_i, y_{i:i+bands}⟩/σ² − ‖c_i‖²/(2σ²) + ln p of y = σz for every
  round, vectorised over runs;
- `participation_exponents` draws the differing example's b-min-sep participations (004 Alg.
  1/2) and derives the exponents of y = σz + Cx from those of σz: only the 2·bands − 1 rounds around
  each participation change;
- numpy's SIMD ``exp`` turns the exponents into e^{a_i}, and `linear_recursion` runs 004 Eq. 1
  in linear space, f_i = (1 − p)·f_{i+1} + e^{a_i}·f_{i+b}, in float64 with exact power-of-two
  rescaling (no exp or log per step).

`corrflow.accounting.montecarlo.log_likelihood_ratio` (log space, numpy) remains the
definition; the tests hold these kernels to it. Where e^{a_i} would overflow (a_i >
`MAX_EXPONENT`, only at tiny σ) or a run's result is not finite (an overflow between checks,
or a chain that vanished, possible at p = 1 where f_i = e^{a_i}·f_{i+b}), the caller recomputes it
in log space.
"""

from __future__ import annotations

import math

import numba
import numpy as np

#: The linear recursion keeps each new value within [2^−SCALE_BITS, 2^SCALE_BITS] by exact
# power-of-two rescaling, checked every CHECK_EVERY rounds.
SCALE_BITS = 200
CHECK_EVERY = 4
#: Largest a_i the linear recursion takes: e^{a_i} must be finite in float32. Typical exponents are
# a few units (a_i ≈ ‖c_i‖²/(2σ²) ± ‖c_i‖/σ at a participation); the recursion's finiteness check
# catches the rest.
MAX_EXPONENT = 88.0


def ziggurat_tables(bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """The 256-layer ziggurat of the standard normal (Marsaglia & Tsang, "The Ziggurat Method for
    Generating Random Variables", J. Stat. Softw. 5(8), 2000) as numpy's ``standard_normal`` uses
    it: the same base r, v (the area of each layer) from r in closed form, v = r·φ̃(r) +
    √(π/2)·erfc(r/√2) with φ̃(x) = e^{−x²/2}, and magnitudes of ``bits`` bits (52 for float64 draws,
    23 for float32). The acceptance bounds are rounded down, so a proposal the rectangle test
    accepts lies inside the density.

    Args:
        bits: 52 or 23.

    Returns:
        (ki, wi, fi, r): shapes (256,), int64 acceptance bounds, float64 layer widths per unit
        magnitude and densities, and the base r.
    """
    from scipy.special import erfc

    r = 3.6541528853610087963519472518
    v = r * math.exp(-0.5 * r * r) + math.sqrt(math.pi / 2) * erfc(r / math.sqrt(2))
    m1 = 2.0**bits
    ki, wi, fi = np.zeros(256, dtype=np.int64), np.zeros(256), np.zeros(256)
    dn = tn = r
    q = v / math.exp(-0.5 * dn * dn)
    ki[0] = int((dn / q) * m1)
    wi[0], wi[255] = q / m1, dn / m1
    fi[0], fi[255] = 1.0, math.exp(-0.5 * dn * dn)
    for i in range(254, 0, -1):
        dn = math.sqrt(-2.0 * math.log(v / dn + math.exp(-0.5 * dn * dn)))
        ki[i + 1] = int((dn / tn) * m1)
        tn = dn
        fi[i] = math.exp(-0.5 * dn * dn)
        wi[i] = dn / m1
    return ki, wi, fi, r


#: The tables for float64 draws (52-bit magnitudes) and for float32 draws (23-bit, two draws per 64
# random bits).
ZIG64 = ziggurat_tables(52)
ZIG32 = ziggurat_tables(23)


# The generator's state travels as four uint64 scalars, not an array: numba reference-counts every
# array passed to or bound in an inlined function, which costs more than the draw itself.


@numba.njit
def _rotl(x, k):  # pragma: no cover - compiled
    return (x << np.uint64(k)) | (x >> np.uint64(64 - k))


@numba.njit
def _next_u64(s0, s1, s2, s3):  # pragma: no cover - compiled
    """xoshiro256++ (Blackman & Vigna, "Scrambled Linear Pseudorandom Number Generators", arXiv
    1805.01407).

    Returns:
        (64 random bits, the next state s0, s1, s2, s3).
    """
    out = _rotl(s0 + s3, 23) + s0
    t = s1 << np.uint64(17)
    s2 ^= s0
    s3 ^= s1
    s1 ^= s2
    s0 ^= s3
    s2 ^= t
    return out, s0, s1, s2, _rotl(s3, 45)


@numba.njit
def _next_double(s0, s1, s2, s3):  # pragma: no cover - compiled
    """Uniform on [0, 1) with 53 random bits, and the next state."""
    bits, s0, s1, s2, s3 = _next_u64(s0, s1, s2, s3)
    return np.int64(bits >> np.uint64(11)) * (1.0 / 9007199254740992.0), s0, s1, s2, s3


# Module-level arrays are compile-time constants in numba: no reference counting when the hot loop
# reads them.
_KI64, _WI64, _FI64, _R = ZIG64
_KI32, _WI32, _FI32, _ = ZIG32
_MASK52 = np.uint64((1 << 52) - 1)
_MASK23 = np.uint64((1 << 23) - 1)
_LOW32 = np.uint64(0xFFFFFFFF)


@numba.njit
def _proposal(bits, half):  # pragma: no cover - compiled
    """A ziggurat proposal from random bits: layer (bits 0–7), sign (bit 8), magnitude (the 52 bits
    above, or 23 of a 32-bit half when ``half``), x = ±magnitude·w_layer; and whether the rectangle
    test accepts it."""
    idx = np.int64(bits & np.uint64(0xFF))
    sign = 1.0 - 2.0 * np.float64((bits >> np.uint64(8)) & np.uint64(1))
    if half:
        rabs = np.int64((bits >> np.uint64(9)) & _MASK23)
        return idx, sign * (rabs * _WI32[idx]), rabs < _KI32[idx]
    rabs = np.int64((bits >> np.uint64(9)) & _MASK52)
    return idx, sign * (rabs * _WI64[idx]), rabs < _KI64[idx]


@numba.njit
def _normal_rare(s0, s1, s2, s3, half, idx, x):  # pragma: no cover - compiled
    """The ziggurat's base strip (the tail beyond r, Marsaglia 1964) and wedges for a proposal the
    rectangle test rejected, then new proposals (from 64 fresh bits each) until one is accepted
    (numpy's ``random_standard_normal``).

    Returns:
        (an N(0, 1) draw, the next state).
    """
    fi = _FI32 if half else _FI64
    while True:
        if idx == 0:
            while True:
                u, s0, s1, s2, s3 = _next_double(s0, s1, s2, s3)
                v, s0, s1, s2, s3 = _next_double(s0, s1, s2, s3)
                xx = -math.log1p(-u) / _R
                yy = -math.log1p(-v)
                if yy + yy > xx * xx:
                    # the proposal's sign (also for ±0)
                    return (math.copysign(_R + xx, x), s0, s1, s2, s3)
        u, s0, s1, s2, s3 = _next_double(s0, s1, s2, s3)
        if (fi[idx - 1] - fi[idx]) * u + fi[idx] < math.exp(-0.5 * x * x):
            return x, s0, s1, s2, s3
        bits, s0, s1, s2, s3 = _next_u64(s0, s1, s2, s3)
        idx, x, accept = _proposal(bits & _LOW32 if half else bits, half)
        if accept:
            return x, s0, s1, s2, s3


@numba.njit(cache=True, nogil=True)
def sample_noise(st, sigma, z_out):  # pragma: no cover - compiled
    """Fill ``z_out`` with σ·N(0, 1) draws by the 256-layer ziggurat of numpy's
    ``random_standard_normal`` (Marsaglia & Tsang 2000) over xoshiro256++ bits: 52-bit magnitudes
    (`ZIG64`) for float64 outputs, two draws with 23-bit magnitudes (`ZIG32`, numpy's
    float32 variant) per 64 bits for float32 outputs.

    Args:
        st: the xoshiro256++ state, shape (4,), uint64, not all zero (advanced in place).
        sigma: σ.
        z_out: shape (n, S), C-contiguous, float32 or float64, written.
    """
    n, S = z_out.shape
    flat = z_out.reshape(n * S)  # the caller's arrays are C-contiguous: a view
    size = n * S
    half = z_out.itemsize == 4
    s0, s1, s2, s3 = st[0], st[1], st[2], st[3]
    t = 0
    while t < size:
        bits, s0, s1, s2, s3 = _next_u64(s0, s1, s2, s3)
        if half:
            idx, x, accept = _proposal(bits & _LOW32, True)
            if not accept:
                x, s0, s1, s2, s3 = _normal_rare(s0, s1, s2, s3, True, idx, x)
            flat[t] = sigma * x
            if t + 1 < size:  # the high half of the same 64 bits
                idx, x, accept = _proposal(bits >> np.uint64(32), True)
                if not accept:
                    x, s0, s1, s2, s3 = _normal_rare(s0, s1, s2, s3, True, idx, x)
                flat[t + 1] = sigma * x
            t += 2
        else:
            idx, x, accept = _proposal(bits, False)
            if not accept:
                x, s0, s1, s2, s3 = _normal_rare(s0, s1, s2, s3, False, idx, x)
            flat[t] = sigma * x
            t += 1
    st[0], st[1], st[2], st[3] = s0, s1, s2, s3


@numba.njit(cache=True, nogil=True)
def participation_exponents(st, window, min_sep, p, warm, a_q, a_p, x_out):
    """The exponents of the mechanism with the differing example (y = σz + Cx) from those without it
    (y = σz).

    x is one example's b-min-sep participations (004 Alg. 1; warm start Alg. 2), drawn per run.
    Since ⟨c_i, σz + Cx⟩ = ⟨c_i, σz⟩ + Σ_j x_j⟨c_i, c_j⟩ and a banded C has ⟨c_i, c_j⟩ = 0 for |i −
    j| ≥ bands, a participation in round j changes only rounds j − bands + 1 … j + bands − 1. The
    participations of all runs are sorted by round (counting sort) and applied in that order, so the
    rows being changed stay in cache.

    Args:
        st: the xoshiro256++ state, shape (4,), uint64 (advanced in place).
        window: shape (n, 2·bands − 1), ``window[j, t]`` = ⟨c_j, c_{j − bands + 1 + t}⟩/σ² (0
            outside 0..n − 1), the exponents' dtype.
        min_sep: b.
        p: the Poisson probability among eligible rounds.
        warm: start from the chain's stationary distribution.
        a_q: shape (n, S), the exponents of y = σz.
        a_p: shape (n, S), written: the exponents of y = σz + Cx.
        x_out: shape (n, S), uint8, zeroed by the caller; set to 1 where the example participates.
    """
    n, S = a_q.shape
    half = (window.shape[1] - 1) // 2  # bands − 1
    b = min_sep
    s0, s1, s2, s3 = st[0], st[1], st[2], st[3]
    stay = 1.0 / (1.0 + (b - 1) * p)
    per_log = 1.0 / math.log1p(-p) if p < 1.0 else 0.0
    cap = S * (n // b + 1)  # participations are ≥ b apart
    run_of = np.empty(cap, dtype=np.int64)
    round_of = np.empty(cap, dtype=np.int64)
    start = np.zeros(n + 1, dtype=np.int64)
    count = 0
    for s in range(S):
        last = -b
        if warm and b > 1:
            u, s0, s1, s2, s3 = _next_double(s0, s1, s2, s3)
            if u >= stay:
                u, s0, s1, s2, s3 = _next_double(s0, s1, s2, s3)
                last = 1 + np.int64(u * (b - 1)) - b  # barred for U{1..b−1} more rounds
        while True:
            # gap = (b − 1) + Geom(p) on {1, 2, …}, by inversion: P(Geom ≥ g) = (1 − p)^(g−1); 1 − u
            # is exact
            g = 1
            if p < 1.0:
                u, s0, s1, s2, s3 = _next_double(s0, s1, s2, s3)
                g = 1 + np.int64(math.log(1.0 - u) * per_log)
            j = last + b - 1 + g
            if j >= n:
                break
            x_out[j, s] = 1
            run_of[count], round_of[count] = s, j
            start[j + 1] += 1
            count += 1
            last = j
    st[0], st[1], st[2], st[3] = s0, s1, s2, s3
    for j in range(n):
        start[j + 1] += start[j]
    fill = start[:n].copy()
    runs = np.empty(count, dtype=np.int64)
    for c in range(count):
        j = round_of[c]
        runs[fill[j]] = run_of[c]
        fill[j] += 1
    copied = 0
    for j in range(n):
        top = min(j + half + 1, n)
        while copied < top:  # rows reach a_p in order, just before the first change to them
            for s in range(S):
                a_p[copied, s] = a_q[copied, s]
            copied += 1
        lo = max(j - half, 0)
        for c in range(start[j], start[j + 1]):
            s = runs[c]
            for i in range(lo, top):
                a_p[i, s] += window[j, i - j + half]


@numba.njit(cache=True, nogil=True)
def exponents(y, band_over_var, offset, out):  # pragma: no cover - compiled
    """out[i, s] = Σ_k ``band_over_var[i, k]``·y[i + k, s] + ``offset[i]`` (rows past n contribute
    nothing).

    With ``band_over_var`` = band/σ² and ``offset`` = ln p − ‖c_i‖²/(2σ²) this is the exponent a_i
    of 004 Eq. 1.

    Args:
        y: shape (n, S).
        band_over_var: shape (n, bands), the out dtype.
        offset: shape (n,), the out dtype.
        out: shape (n, S), written.
    """
    n, S = y.shape
    bands = band_over_var.shape[1]
    for i in range(n):
        top = min(bands, n - i)
        o = offset[i]
        for s in range(S):
            out[i, s] = o
        k = 0
        # four bands per pass over the row: a quarter of the loads and stores of out
        while k + 4 <= top:
            c0, c1 = band_over_var[i, k], band_over_var[i, k + 1]
            c2, c3 = band_over_var[i, k + 2], band_over_var[i, k + 3]
            for s in range(S):
                out[i, s] += (c0 * y[i + k, s] + c1 * y[i + k + 1, s]) + (
                    c2 * y[i + k + 2, s] + c3 * y[i + k + 3, s]
                )
            k += 4
        while k < top:
            c = band_over_var[i, k]
            for s in range(S):
                out[i, s] += c * y[i + k, s]
            k += 1


@numba.njit(cache=True, nogil=True)
def linear_recursion(E, min_sep, p, warm):  # pragma: no cover - compiled
    """ln f_0 (cold start) or the warm-start mixture (004 Alg. 2) of 004 Eq. 1 in linear space.

    f_i = (1 − p)·f_{i+1} + E_i·f_{i+b}, f_i = 1 for i ≥ n, E_i = e^{a_i}. Every `CHECK_EVERY`
    rounds, a run whose new value left [2^−`SCALE_BITS`, 2^`SCALE_BITS`] has its ring of
    the last b values multiplied by 2^∓SCALE_BITS (exact) and the exponent counted. One round
    multiplies a value by at most 1 + e^{a_i}, so with a_i ≤ `MAX_EXPONENT` a value stays
    finite between checks in all but extreme cases; values that underflow are below 2^−(1074 −
    SCALE_BITS) of the ring's largest and negligible. A run whose result is not finite (an overflow,
    or a chain that vanished) returns ±∞ or NaN, and the caller recomputes it in log space.

    Args:
        E: shape (n, S), e^{a_i}.
        min_sep: b.
        p: the Poisson probability among eligible rounds.
        warm: the warm-start mixture (f_0 + p·Σ_{j=1}^{b−1} f_j)/(1 + (b − 1)p), else f_0.

    Returns:
        ln P(y)/Q(y), float64, shape (S,).
    """
    n, S = E.shape
    b = min_sep
    q = 1.0 - p
    hi = 2.0**SCALE_BITS
    lo = 1.0 / hi
    ring = np.ones((b, S))
    scale = np.zeros(S, dtype=np.int64)
    for step in range(n):
        i = n - 1 - step
        r = i % b
        r1 = (i + 1) % b
        if step % CHECK_EVERY != CHECK_EVERY - 1:
            for s in range(S):
                ring[r, s] = q * ring[r1, s] + E[i, s] * ring[r, s]
            continue
        top = 0.0
        bottom = hi
        for s in range(S):
            v = q * ring[r1, s] + E[i, s] * ring[r, s]
            ring[r, s] = v
            top = max(top, v)
            bottom = min(bottom, v)
        if top > hi or bottom < lo:
            for s in range(S):
                v = ring[r, s]
                if v > hi or (v < lo and v > 0.0):
                    f, d = (lo, 1) if v > hi else (hi, -1)
                    for j in range(b):
                        ring[j, s] *= f
                    scale[s] += d
    out = np.empty(S)
    shift = SCALE_BITS * math.log(2.0)
    denom = math.log1p((b - 1) * p) if warm else 0.0
    for s in range(S):
        total = ring[0, s]
        if warm:
            for j in range(1, b):
                total += p * ring[j, s]
        out[s] = math.log(total) + scale[s] * shift - denom if total > 0.0 else -math.inf
    return out
