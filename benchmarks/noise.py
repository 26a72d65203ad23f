"""Noise-generation speed and memory for d = 10⁷ float32 coordinates, per mode, against independent
Gaussian noise of the same size (measured in the same run) and jax-privacy's
``matrix_factorization_privatizer`` for the same banded Toeplitz factorization when that peer is
installed.

Targets (issue 3, 2 CPU cores): banded (16 bands) ≤ 4× the independent-noise time and ≥ 3× faster
than the peer; banded-inverse (p = 16) ≤ 1.5·p × the independent-noise time; banded buffer = (bands
− 1)·d·4 bytes (+5%). Issue 24: a BLT with 2 buffers (one draw per round, 2·d·4 bytes of state), and
the regenerating modes' fused arithmetic against the unfused combination they replaced (``unfused``
below, a copy of the old code: each draw scaled in place, then added, then a pass for σ), timed
alternately in the same run.

Usage: python benchmarks/noise.py [--dim 10000000] [--rounds 4] [--no-peer]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import tracemalloc

import numpy as np

from corrflow.factorization.build import factorize, participation_for
from corrflow.noise import CorrelatedNoise
from corrflow.noise.prng import PhiloxSource, new_secret


def _time_rounds(fn, rounds: int) -> tuple[float, int]:
    """Median seconds per call of fn(t) over ``rounds`` calls, and the peak traced allocation
    (bytes)."""
    times = []
    tracemalloc.start()
    for t in range(rounds):
        t0 = time.perf_counter()
        fn(t)
        times.append(time.perf_counter() - t0)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return float(np.median(times)), peak


def run(dim: int, rounds: int, use_peer: bool) -> dict:
    key = new_secret()
    src = PhiloxSource(key)
    indep_s, indep_peak = _time_rounds(lambda t: src.normal(t, 0, dim), rounds)
    rng = np.random.default_rng(0)
    plain_s, _ = _time_rounds(lambda t: rng.standard_normal(dim, dtype=np.float32), rounds)
    part = participation_for(64, 4)
    cases = {
        "banded (toeplitz, 16 bands)": factorize("toeplitz", part, bands=16),
        "banded-inverse (bifr, p=16)": factorize("bifr", part, bands=16),
        "dense (64 rounds, at round 8)": factorize("dense", part),
        "identity (dpsgd)": factorize("dpsgd", part),
        "blt (2 buffers)": factorize("blt", part, buffers=2),
    }
    out = {
        "dim": dim,
        "independent_seconds": indep_s,
        "numpy_default_rng_seconds": plain_s,
        "independent_peak_bytes": indep_peak,
        "modes": {},
    }
    for name, fac in cases.items():
        gen = CorrelatedNoise(fac, [(dim,)], key=key)
        if name.startswith("dense"):
            gen.skip_to(8)
            offset = 8
        else:
            gen.skip_to(16)  # steady state: the buffer (banded) or band (banded-inverse) is full
            offset = 16
        secs, peak = _time_rounds(lambda t, g=gen, o=offset: g.next(o + t), rounds)
        entry = {
            "mode": gen.mode,
            "seconds_per_round": secs,
            "ratio_to_independent": secs / indep_s,
            "buffer_bytes": gen.buffer_bytes,
            "peak_traced_bytes_per_round": peak,
            "bands": fac.bands,
        }
        if gen.mode == "banded":
            entry["buffer_ratio_to_(bands-1)*d*4"] = gen.buffer_bytes / ((fac.bands - 1) * dim * 4)
            entry["buffer_dtype"] = str(gen._buffer.dtype)
        if gen.mode == "blt":
            entry["buffer_ratio_to_B*d*4"] = gen.buffer_bytes / (fac.encoder.buffers * dim * 4)
        if gen.mode in ("banded-inverse", "identity", "dense"):
            entry.update(_fused_vs_unfused(gen, offset + rounds, rounds))
        out["modes"][name] = entry
        print(json.dumps({name: entry}), file=sys.stderr)
    if use_peer:
        peer = _peer(cases["banded (toeplitz, 16 bands)"], dim, rounds)
        if peer is not None:
            ours = out["modes"]["banded (toeplitz, 16 bands)"]["seconds_per_round"]
            out["peer"] = {"seconds_per_round": peer, "speedup_banded": peer / ours}
    banded = out["modes"]["banded (toeplitz, 16 bands)"]
    inv = out["modes"]["banded-inverse (bifr, p=16)"]
    out["targets"] = {
        "banded_ratio_to_independent": banded["ratio_to_independent"],
        "banded_inverse_ratio_over_p": inv["ratio_to_independent"] / 16,
        "banded_buffer_ratio": banded["buffer_ratio_to_(bands-1)*d*4"],
        "banded_speedup_vs_peer": out.get("peer", {}).get("speedup_banded"),
        "blt_ratio_to_independent": out["modes"]["blt (2 buffers)"]["ratio_to_independent"],
        "banded_inverse_unfused_over_fused": inv["unfused_over_fused"],
        "identity_unfused_over_fused": out["modes"]["identity (dpsgd)"]["unfused_over_fused"],
    }
    return out


def unfused(gen: CorrelatedNoise, t: int, out: np.ndarray) -> None:
    """The regenerating modes' combination before issue 24 (reference for the benchmark only)."""
    terms = gen._terms(t)
    for c, lo, hi in gen._chunks():
        dst = out[lo:hi]
        for i, (j, coef) in enumerate(terms):
            z = gen._source.normal(j, c, hi - lo)
            if coef != 1.0:
                z *= np.float32(coef)
            if i == 0:
                dst[...] = z
            else:
                dst += z
    if gen.stddev != 1.0:
        out *= np.float32(gen.stddev)


class _CachedSource:
    """The generator's draws, made once and handed out as fresh copies: times the combining
    arithmetic without the draws (whose cost is the same for both variants and dominates and blurs a
    measurement on a shared machine)."""

    def __init__(self, source):
        self._source, self._cache = source, {}

    def normal(self, round_index: int, chunk: int, size: int) -> np.ndarray:
        key = (round_index, chunk, size)
        if key not in self._cache:
            self._cache[key] = self._source.normal(round_index, chunk, size)
        return self._cache[key].copy()


def _fused_vs_unfused(gen: CorrelatedNoise, t: int, rounds: int) -> dict:
    """Median seconds (wall and CPU) of the engine's fused combination and of ``unfused`` for round
    t, alternated, with the draws cached (``_CachedSource``; both variants pay the same copy per
    draw)."""
    out = np.empty(gen.dim, dtype=np.float32)
    ref = np.empty(gen.dim, dtype=np.float32)
    times = {"fused": [], "unfused": [], "fused_cpu": [], "unfused_cpu": []}
    source, gen._source = gen._source, _CachedSource(gen._source)
    try:
        gen._stateless(t, out)  # fill the cache
        for _ in range(rounds):
            for name, fn in (
                ("fused", lambda: gen._stateless(t, out)),
                ("unfused", lambda: unfused(gen, t, ref)),
            ):
                c0, w0 = time.process_time(), time.perf_counter()
                fn()
                times[name + "_cpu"].append(time.process_time() - c0)
                times[name].append(time.perf_counter() - w0)
    finally:
        gen._source = source
    med = {k: float(np.median(v)) for k, v in times.items()}
    return {
        "fused_seconds": med["fused"],
        "unfused_seconds": med["unfused"],
        "fused_cpu_seconds": med["fused_cpu"],
        "unfused_cpu_seconds": med["unfused_cpu"],
        "unfused_over_fused": med["unfused"] / med["fused"],
        "unfused_over_fused_cpu": med["unfused_cpu"] / med["fused_cpu"],
        "max_abs_difference": float(np.max(np.abs(out - ref))),
    }


def _peer(fac, dim: int, rounds: int) -> float | None:
    try:
        import jax
        import jax.numpy as jnp
        from jax_privacy import noise_addition
        from jax_privacy.matrix_factorization import toeplitz
    except ImportError:
        return None
    enc = fac.encoder
    coef = jnp.asarray(enc.coef / np.linalg.norm(enc.coef), dtype=jnp.float32)
    noising = toeplitz.inverse_as_streaming_matrix(coef, column_normalize_for_n=enc.n)
    priv = noise_addition.matrix_factorization_privatizer(
        noising, stddev=1.0, prng_key=0, dtype=jnp.float32
    )
    grads = jnp.zeros((dim,), dtype=jnp.float32)
    state = priv.init(grads)
    update = jax.jit(priv.update)
    for _ in range(17):  # compile and fill the buffer, as for ours
        noisy, state = update(grads, state)
    noisy.block_until_ready()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        noisy, state = update(grads, state)
        noisy.block_until_ready()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=10_000_000)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--no-peer", action="store_true")
    args = ap.parse_args()
    res = run(args.dim, args.rounds, not args.no_peer)
    print(json.dumps({"benchmark": "noise", "cpus": os.cpu_count(), **res}))


if __name__ == "__main__":
    main()
