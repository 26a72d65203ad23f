"""NumPy's ``np.random.default_rng(key).permutation(n)`` for many keys at once, compiled.

The per-client path draws each client's data order from its own generator,
``default_rng((seed, user, round, 400))``, one permutation per local epoch. Building a NumPy
generator costs about 20 µs (the seed sequence's hashing runs in Python-level Cython), more than a
small client's whole minibatch step, so the cohort engine draws the same permutations here: NumPy's
``SeedSequence`` (entropy pool of 4 words, hashmix/mix), its ``PCG64`` bit generator (the 128-bit
LCG with the XSL-RR output; O'Neill, "PCG: A Family of Simple Fast Space-Efficient Statistically
Good Algorithms for Random Number Generation", 2014), and ``Generator.shuffle``'s Fisher–Yates
with masked rejection on buffered 32-bit draws, reproduced word for word in integers.

`permutations` checks itself against NumPy once per process on a few keys and, should a NumPy
release ever change any of the three, says so and draws with NumPy itself: the data order is part
of the per-client semantics, never approximated.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import lru_cache

import numba
import numpy as np

log = logging.getLogger("corrflow")

_M32 = np.uint64(0xFFFFFFFF)
_U = np.uint64
# SeedSequence's hash constants (numpy.random.bit_generator).
_INIT_A, _MULT_A = _U(0x43B0D7E5), _U(0x931E8875)
_INIT_B, _MULT_B = _U(0x8B51F9DD), _U(0x58F38DED)
_MIX_L, _MIX_R = _U(0xCA01F9DD), _U(0x4973F715)
_POOL = 4
# PCG64's default 128-bit multiplier, high and low words.
_MUL_HI, _MUL_LO = _U(0x2360ED051FC65DA4), _U(0x4385DF649FCCF645)


@numba.njit(cache=True)
def _hashmix(value, const):  # pragma: no cover - compiled
    value = (value ^ const[0]) & _M32
    const[0] = (const[0] * _MULT_A) & _M32
    value = (value * const[0]) & _M32
    return value ^ (value >> _U(16))


@numba.njit(cache=True)
def _mix(x, y):  # pragma: no cover - compiled
    r = (_MIX_L * x - _MIX_R * y) & _M32
    return r ^ (r >> _U(16))


@numba.njit(cache=True)
def _pcg_seed(entropy):  # pragma: no cover - compiled
    """SeedSequence(entropy).generate_state(4, uint64) as PCG64 takes it: (state, increment)
    words [s_hi, s_lo, i_hi, i_lo]."""
    pool = np.zeros(_POOL, np.uint64)
    const = np.array([_INIT_A], np.uint64)
    for i in range(_POOL):
        pool[i] = _hashmix(entropy[i] if i < len(entropy) else _U(0), const)
    for src in range(_POOL):
        for dst in range(_POOL):
            if src != dst:
                pool[dst] = _mix(pool[dst], _hashmix(pool[src], const))
    for src in range(_POOL, len(entropy)):
        for dst in range(_POOL):
            pool[dst] = _mix(pool[dst], _hashmix(entropy[src], const))
    words = np.zeros(8, np.uint64)
    h = _INIT_B
    for i in range(8):
        v = (pool[i % _POOL] ^ h) & _M32
        h = (h * _MULT_B) & _M32
        v = (v * h) & _M32
        words[i] = v ^ (v >> _U(16))
    out = np.zeros(4, np.uint64)
    for k in range(4):
        out[k] = words[2 * k] | (words[2 * k + 1] << _U(32))
    return out


@numba.njit(cache=True)
def _mulhi(a, b):  # pragma: no cover - compiled
    a0, a1, b0, b1 = a & _M32, a >> _U(32), b & _M32, b >> _U(32)
    p00, p01, p10 = a0 * b0, a0 * b1, a1 * b0
    mid = (p00 >> _U(32)) + (p01 & _M32) + (p10 & _M32)
    return a1 * b1 + (p01 >> _U(32)) + (p10 >> _U(32)) + (mid >> _U(32))


@numba.njit(cache=True)
def _step(hi, lo, inc_hi, inc_lo):  # pragma: no cover - compiled
    """PCG64's LCG: state ← state·MUL + inc (mod 2^128), as (high, low) words."""
    new_hi = _mulhi(lo, _MUL_LO) + hi * _MUL_LO + lo * _MUL_HI
    new_lo = lo * _MUL_LO
    out_lo = new_lo + inc_lo
    return new_hi + inc_hi + (_U(1) if out_lo < new_lo else _U(0)), out_lo


@numba.njit(cache=True)
def _output(hi, lo):  # pragma: no cover - compiled
    """PCG64's XSL-RR output of a state."""
    v = hi ^ lo
    rot = hi >> _U(58)
    return (v >> rot) | (v << ((_U(64) - rot) & _U(63)))


@numba.njit(cache=True)
def _draw(entropy, starts, sizes, epochs, out, out_starts):  # pragma: no cover - compiled
    """Per generator c (key words ``entropy[starts[c]:starts[c + 1]]``), ``epochs`` successive
    permutations of 0 … sizes[c] − 1 into ``out[out_starts[c]:]``: PCG64(SeedSequence(key)), then
    Generator.shuffle's Fisher–Yates (j uniform on 0 … i by masked rejection on buffered 32-bit
    draws, 64-bit past 2^32)."""
    for c in range(len(sizes)):
        seed = _pcg_seed(entropy[starts[c] : starts[c + 1]])
        inc_hi = (seed[2] << _U(1)) | (seed[3] >> _U(63))
        inc_lo = (seed[3] << _U(1)) | _U(1)
        hi, lo = _step(_U(0), _U(0), inc_hi, inc_lo)
        lo2 = lo + seed[1]
        hi, lo = _step(hi + seed[0] + (_U(1) if lo2 < lo else _U(0)), lo2, inc_hi, inc_lo)
        has32, buffered = False, _U(0)
        n, at = sizes[c], out_starts[c]
        for _ in range(epochs):
            perm = out[at : at + n]
            for i in range(n):
                perm[i] = i
            for i in range(n - 1, 0, -1):
                bound = _U(i)
                mask = bound | (bound >> _U(1))
                mask |= mask >> _U(2)
                mask |= mask >> _U(4)
                mask |= mask >> _U(8)
                mask |= mask >> _U(16)
                mask |= mask >> _U(32)
                while True:
                    if bound > _M32:
                        hi, lo = _step(hi, lo, inc_hi, inc_lo)
                        j = _output(hi, lo) & mask
                    elif has32:
                        has32 = False
                        j = buffered & mask
                    else:
                        hi, lo = _step(hi, lo, inc_hi, inc_lo)
                        v = _output(hi, lo)
                        has32, buffered = True, v >> _U(32)
                        j = (v & _M32) & mask
                    if j <= bound:
                        break
                k = int(j)
                perm[i], perm[k] = perm[k], perm[i]
            at += n


def _words(key: Sequence[int]) -> list[int]:
    """SeedSequence's entropy words of ``key``: each non-negative int as its little-endian 32-bit
    words (0 as one word)."""
    out = []
    for v in map(int, key):
        if v < 0:
            raise ValueError(f"a generator key word must be non-negative, got {v}")
        out.append(v & 0xFFFFFFFF)
        v >>= 32
        while v:
            out.append(v & 0xFFFFFFFF)
            v >>= 32
    return out


def _entropy(keys) -> tuple[np.ndarray, np.ndarray]:
    """All keys' entropy words, flat, and where each key's start (one more than keys)."""
    try:  # the cohort's keys, one word each: one array op instead of a loop per key
        table = np.array(keys, np.int64)
    except (OverflowError, ValueError):  # words past 2^63, or keys of different lengths
        table = None
    one_word = table is not None and table.ndim == 2 and table.size
    if one_word and 0 <= table.min() and table.max() <= 0xFFFFFFFF:
        starts = np.arange(len(keys) + 1, dtype=np.int64) * table.shape[1]
        return table.ravel().astype(np.uint64), starts
    words = [_words(k) for k in keys]
    starts = np.cumsum([0] + [len(w) for w in words]).astype(np.int64)
    return np.array([x for w in words for x in w], np.uint64), starts


def _compiled(keys, sizes, epochs) -> np.ndarray:
    entropy, starts = _entropy(keys)
    sizes = np.asarray(sizes, np.int64)
    out_starts = np.concatenate([[0], np.cumsum(sizes * epochs)]).astype(np.int64)
    out = np.empty(int(out_starts[-1]), np.int64)
    _draw(entropy, starts, sizes, epochs, out, out_starts)
    return out


def _numpy(keys, sizes, epochs) -> np.ndarray:
    out = []
    for key, n in zip(keys, sizes, strict=True):
        rng = np.random.default_rng(list(map(int, key)))
        out += [rng.permutation(int(n)) for _ in range(epochs)]
    return np.concatenate(out + [np.zeros(0, np.int64)]).astype(np.int64)


#: Keys and sizes the compiled draws are checked on: several words, a word past 2^32, n = 0, 1.
_PROBES = (((0, 0, 1, 400), 97), ((7, 12_345, 2_051, 400), 410), ((2**40 + 3, 5), 1), ((1,), 0))


@lru_cache(maxsize=1)
def compiled_matches_numpy() -> bool:
    """Whether the compiled draws equal NumPy's on `_PROBES` (two epochs each); logged if not."""
    keys, sizes = zip(*_PROBES, strict=True)
    ok = np.array_equal(_compiled(keys, sizes, 2), _numpy(keys, sizes, 2))
    if not ok:
        log.warning(
            "corrflow: this NumPy's default_rng permutations differ from the cohort engine's "
            "compiled copy; the cohort engine draws them with NumPy (slower, same order)"
        )
    return ok


def permutations(keys: Sequence[Sequence[int]], sizes: Sequence[int], epochs: int) -> np.ndarray:
    """Per key, ``epochs`` successive ``np.random.default_rng(key).permutation(size)`` draws.

    Args:
        keys: per generator, its seed words (non-negative ints).
        sizes: per generator, n.
        epochs: permutations drawn from each generator, in turn.

    Returns:
        The draws, flat (int64): per generator in turn, its ``epochs`` permutations of
        0 … n − 1 in turn, exactly as NumPy's generator draws them.

    Raises:
        ValueError: a negative key word.
    """
    if compiled_matches_numpy():
        return _compiled(keys, sizes, epochs)
    return _numpy(keys, sizes, epochs)
