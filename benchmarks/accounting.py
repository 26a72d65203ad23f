"""Accounting timings: unamplified calibration, cyclic Poisson at n = 2052, the b-min-sep Monte
Carlo accountant at n = 2052 with 10⁶ samples (target: under 60 s on 2 cores), Monte Carlo
``verify_target`` at δ = 1e-5, and MMCC: Poisson MMCC for non-negative 16-band Toeplitz encoders at
n ∈ {128, 512, 2048} (target: n = 2048 in under 10 minutes on 2 cores) and for a non-Toeplitz
banded encoder at n = 512; and (section ``verified``) a b-min-sep ε verified at δ = 1e-5 for
n = 2048 rounds and 16 bands (target: ≤ 120 s on 2 idle cores), with its samples per second,
against the bounds without Monte Carlo for the same encoder: MMCC under Poisson sampling at the
same rate (``--verified-mmcc``; minutes) and the cyclic Poisson PLD. Prints one JSON
object.

Usage: python benchmarks/accounting.py [--sections
unamplified,cyclic,bminsep,verify,throughput,verified,mmcc] [--mmcc-rounds 128,512,2048]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from corrflow.accounting import SamplingSpec, account
from corrflow.accounting.montecarlo import MonteCarloAccountant
from corrflow.factorization import factorize, participation_for

SECTIONS = ("unamplified", "cyclic", "bminsep", "verify", "throughput", "verified", "mmcc")


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def mmcc_case(kind: str, n: int, sigma: float, p: float) -> dict:
    """Poisson MMCC (002 Alg. 1) at noise multiplier σ, sampling probability p, δ = 1e-6,
    single-epoch encoder."""
    fac = factorize(kind, participation_for(n, 1), bands=16)
    spec = SamplingSpec("poisson", round(n / p), n, accountant="mmcc")
    r, t = timed(
        lambda: account(fac, delta=1e-6, noise_multiplier=sigma, sampling=spec, progress=True)
    )
    a = r["accountant"]
    unamp = account(fac, delta=1e-6, noise_multiplier=sigma)["epsilon"]
    out = {
        "kind": kind,
        "structure": fac.encoder.structure,
        "rounds": n,
        "bands": 16,
        "noise_multiplier": sigma,
        "sampling_probability": p,
        "delta": 1e-6,
        "seconds": t,
        "epsilon": r["epsilon"],
        "unamplified_epsilon_one_participation": unamp,
        "rows": a["rows"],
        "distinct_rows": a["distinct_rows"],
        "max_p_tilde": a["max_p_tilde"],
        "grid": a["grid"],
    }
    print(json.dumps(out), file=sys.stderr, flush=True)
    return out


def verified_case(sigma: float) -> dict:
    """`account` at δ = 1e-5 under b-min-sep (b = 16, p0 = 1/32) for a 16-band
    Toeplitz encoder over 2048 rounds, wall and CPU seconds (the Monte Carlo's worker processes
    included), against the bounds that need no Monte Carlo for the same encoder and rate."""
    import resource

    fac = factorize("toeplitz", participation_for(2048, 128, 16, kind="min-sep"), bands=16)
    # p0 = B/N = 1/32; b = N/B/2 = 16 by the planner's rule
    spec = SamplingSpec("bminsep", 3200, 100)

    def cpu():
        own, kids = (
            resource.getrusage(resource.RUSAGE_SELF),
            resource.getrusage(resource.RUSAGE_CHILDREN),
        )
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    c0 = cpu()
    r, t = timed(lambda: account(fac, delta=1e-5, noise_multiplier=sigma, sampling=spec, seed=1))
    used = cpu() - c0
    a = r["accountant"]
    drawn = a.get("samples_drawn") or 0
    out = {
        "rounds": 2048,
        "bands": 16,
        "min_sep": 16,
        "expected_rate": 1 / 32,
        "noise_multiplier": sigma,
        "delta": 1e-5,
        "epsilon": r["epsilon"],
        "guarantee": r["guarantee"],
        "selected": a.get("selected"),
        "seconds": t,
        "cpu_seconds": used,
        "cpus": os.cpu_count(),
        "target_seconds": 120,
        "samples_per_direction": drawn,
        "samples_per_second": drawn / t if t else None,
        "samples_per_cpu_second": drawn / used if used else None,
        "bounds": {b["accountant"]: b["epsilon"] for b in a.get("bounds", [])},
    }
    cyc = account(
        fac, delta=1e-5, noise_multiplier=sigma, sampling=SamplingSpec("cyclic-poisson", 3200, 100)
    )
    out["cyclic_poisson_epsilon"] = cyc["epsilon"]
    mm, tm = timed(
        lambda: account(
            fac,
            delta=1e-5,
            noise_multiplier=sigma,
            sampling=SamplingSpec("poisson", 3200, 100, accountant="mmcc"),
        )
    )
    out["mmcc_poisson_epsilon"], out["mmcc_seconds"] = mm["epsilon"], tm
    out["mmcc_ratio"] = mm["epsilon"] / r["epsilon"]
    print(json.dumps(out), file=sys.stderr, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mc-samples", type=int, default=1_000_000)
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--mmcc-rounds", default="128,512,2048")
    ap.add_argument("--mmcc-sigma", type=float, default=4.0)
    ap.add_argument("--mmcc-p", type=float, default=0.01)
    ap.add_argument("--throughput-samples", type=int, default=32_768)
    ap.add_argument("--verified-sigma", type=float, default=1.0)
    args = ap.parse_args()
    sections = args.sections.split(",")
    res = {}
    # StackOverflow shape (000 §5.3): 2052 rounds, 6 participations 342 apart; 16-band Toeplitz
    # BandMF.
    if {"unamplified", "cyclic", "bminsep"} & set(sections):
        fac = factorize("toeplitz", participation_for(2052, 6, 342, kind="min-sep"), bands=16)
    if "unamplified" in sections:
        r, t = timed(lambda: account(fac, delta=1e-6, target_epsilon=8.0))
        res["unamplified_calibration"] = {
            "seconds": t,
            "noise_multiplier": r["noise_multiplier"],
            "epsilon": r["epsilon"],
        }
    if "cyclic" in sections:
        spec = SamplingSpec("cyclic-poisson", 342_477, 1000)
        r, t = timed(lambda: account(fac, delta=1e-6, noise_multiplier=0.6, sampling=spec))
        res["cyclic_poisson_epsilon"] = {
            "seconds": t,
            "epsilon": r["epsilon"],
            "compositions": r["accountant"]["compositions"],
        }
    if "bminsep" in sections:
        p0 = 1000 / 342_477
        b = 342
        mc = MonteCarloAccountant(fac.encoder.band_array(), b, p0 / (1 - p0 * (b - 1)), warm=True)
        est, t = timed(lambda: mc.sample_losses(0.6, args.mc_samples, seed=0))
        res["bminsep_monte_carlo"] = {
            "seconds": t,
            "samples_per_direction": args.mc_samples,
            "directions": 2,
            "epsilon_at_delta_5e-7": est.epsilon(5e-7),
            "workers": min(os.cpu_count() or 1, max(1, args.mc_samples // 50_000)),
        }
    if "verify" in sections:
        # A small verification case: 48 rounds, 4-band Toeplitz, b = 12, δ = 1e-5 — default
        # samples, then the target.
        small = factorize("toeplitz", participation_for(48, 4, 12, kind="min-sep"), bands=4)
        spec = SamplingSpec("bminsep", 48_000, 400)
        r, t = timed(lambda: account(small, delta=1e-5, noise_multiplier=1.0, sampling=spec))
        a = r["accountant"]
        res["bminsep_verified_at_target"] = {
            "seconds": t,
            "epsilon": r["epsilon"],
            "delta": r["delta"],
            "guarantee": r["guarantee"],
            "selected": a["selected"],
            "samples_per_direction": a.get("samples_drawn"),
            "bounds": {b["accountant"]: b["epsilon"] for b in a["bounds"]},
        }
    if "throughput" in sections:
        # The ``verified`` case: n = 2048, 16 bands, b-min-sep b = 16, p0 = 1/32; one process, both
        # directions.
        big = factorize("toeplitz", participation_for(2048, 128, 16, kind="min-sep"), bands=16)
        p0, b = 1 / 32, 16
        mc = MonteCarloAccountant(big.encoder.band_array(), b, p0 / (1 - p0 * (b - 1)), warm=True)
        c0 = time.process_time()
        _, t = timed(lambda: mc.sample_losses(1.0, args.throughput_samples, seed=0, workers=1))
        cpu = time.process_time() - c0
        from corrflow.accounting.montecarlo import first_verification_size

        need = 2 * first_verification_size(1e-5)
        res["throughput_n2048_bands16"] = {
            "samples_per_direction": args.throughput_samples,
            "seconds": t,
            "cpu_seconds": cpu,
            "samples_per_cpu_second": args.throughput_samples / cpu,
            "samples_needed_at_delta_1e-5": need,
            "projected_seconds_on_2_cores": need / (args.throughput_samples / cpu) / 2,
        }
    if "verified" in sections:
        res["bminsep_n2048_verified"] = verified_case(args.verified_sigma)
    if "mmcc" in sections:
        rounds = [int(x) for x in args.mmcc_rounds.split(",") if x]
        res["mmcc_toeplitz"] = [
            mmcc_case("toeplitz", n, args.mmcc_sigma, args.mmcc_p) for n in rounds
        ]
        res["mmcc_banded_non_toeplitz"] = mmcc_case("banded", 512, args.mmcc_sigma, args.mmcc_p)
    print(json.dumps({"benchmark": "accounting", "cpus": os.cpu_count(), **res}))


if __name__ == "__main__":
    main()
