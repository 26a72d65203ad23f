"""Compiled recursions of the stateful noise modes, one cache-sized block of coordinates at a time.

The engine draws each block's z (a few hundred KiB, ``corrflow.noise.engine.BLOCK`` floats) and
hands it here while it is still in cache: the state rows are read once and written once per round,
and nothing model-sized is allocated. Arithmetic is float64 in registers (the recursions'
coefficients are O(1), BLT's θ is close to 1 and must not be rounded to float32), outputs and state
are float32. No ``fastmath``: every operation is rounded as written, in a fixed order, so the
streaming path and the replay/regeneration path (both run these kernels) agree bit for bit.
"""

from __future__ import annotations

import numba
import numpy as np

#: Coordinates per sub-block of the float64 accumulator (32 KiB: L1). The inner loops run over
# slices indexed from 0: with ``row[lo + i]`` numba's negative-index wraparound kept LLVM from
# vectorising them (2.7× slower, measured); four ring rows per pass over the accumulator instead of
# one take a third off the kernel (same operations in the same order, so the same bits).
_SUB = 4096


@numba.njit(cache=True, nogil=True)
def banded_block(z, ring, slots, weights, diag, gain, slot, lo, out):  # pragma: no cover - compiled
    """One block of 001 Alg. 1: y = (z − Σ_r weights[r]·ring[slots[r]]) / diag, accumulated in
    float64 over the ring rows in the order given; ring[slot] ← float32(y) (when slot ≥ 0) and
    out ← float32(y)·gain in float32, the same product as the engine's replay of the last round.

    Shapes: z (m,) float32; ring (p − 1, d) float32; slots (k,) int64, weights (k,) float64; out
    (d,) float32; the block covers coordinates [lo, lo + m).
    """
    g32 = np.float32(gain)
    acc = np.empty(_SUB, dtype=np.float64)
    for s in range(0, z.shape[0], _SUB):
        n = min(z.shape[0] - s, _SUB)
        a, zs = lo + s, z[s : s + n]
        for i in range(n):
            acc[i] = np.float64(zs[i])
        r = 0
        while r + 4 <= slots.shape[0]:  # four rows per pass over acc, subtracted in order
            w0, w1, w2, w3 = weights[r], weights[r + 1], weights[r + 2], weights[r + 3]
            r0, r1 = ring[slots[r], a : a + n], ring[slots[r + 1], a : a + n]
            r2, r3 = ring[slots[r + 2], a : a + n], ring[slots[r + 3], a : a + n]
            for i in range(n):
                x = (acc[i] - w0 * np.float64(r0[i])) - w1 * np.float64(r1[i])
                acc[i] = (x - w2 * np.float64(r2[i])) - w3 * np.float64(r3[i])
            r += 4
        for q in range(r, slots.shape[0]):
            w, row = weights[q], ring[slots[q], a : a + n]
            for i in range(n):
                acc[i] -= w * np.float64(row[i])
        dst = out[a : a + n]
        if slot >= 0:
            new = ring[slot, a : a + n]
            for i in range(n):
                y = np.float32(acc[i] / diag)
                new[i] = y
                dst[i] = y * g32
        else:
            for i in range(n):
                dst[i] = np.float32(acc[i] / diag) * g32


@numba.njit(cache=True, nogil=True)
def blt_block(z, state, decay, weight, gain, lo, out):  # pragma: no cover - compiled
    """One block of MXZ24 Alg. 3 (arXiv 2408.08868) for C⁻¹: y = z − Σ_j ω_j S_j; S_j ← θ_j S_j + y;
    out = y·gain (σ/s), in float64 with the float32 state rounded once per round.

    Shapes: z (m,) float32; state (B, d) float32; decay θ and weight ω (B,) float64; out (d,)
    float32; the block covers coordinates [lo, lo + m).
    """
    y = np.empty(_SUB, dtype=np.float64)
    for s in range(0, z.shape[0], _SUB):
        n = min(z.shape[0] - s, _SUB)
        a, zs = lo + s, z[s : s + n]
        for i in range(n):
            y[i] = np.float64(zs[i])
        for j in range(state.shape[0]):
            w, row = weight[j], state[j, a : a + n]
            for i in range(n):
                y[i] -= np.float64(row[i]) * w
        for j in range(state.shape[0]):
            theta, row = decay[j], state[j, a : a + n]
            for i in range(n):
                row[i] = np.float32(np.float64(row[i]) * theta + y[i])
        dst = out[a : a + n]
        for i in range(n):
            dst[i] = np.float32(y[i] * gain)
