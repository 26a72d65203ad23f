"""Accounting timings (issue 4): unamplified calibration, cyclic Poisson at n = 2052, and the b-min-sep Monte Carlo
accountant at n = 2052 with 10⁶ samples (target: under 60 s on 2 cores). Prints one JSON object.

Usage: python benchmarks/accounting.py [--mc-samples 1000000]
"""

from __future__ import annotations

import argparse
import json
import os
import time

from corrflow.accounting import SamplingSpec, account
from corrflow.accounting.montecarlo import MonteCarloAccountant
from corrflow.factorization import factorize, participation_for


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mc-samples", type=int, default=1_000_000)
    args = ap.parse_args()
    # StackOverflow shape (000 §5.3): 2052 rounds, 6 participations 342 apart; 16-band Toeplitz BandMF.
    fac = factorize("toeplitz", participation_for(2052, 6, 342, kind="min-sep"), bands=16)
    res = {}
    r, t = timed(lambda: account(fac, delta=1e-6, target_epsilon=8.0))
    res["unamplified_calibration"] = {"seconds": t, "noise_multiplier": r["noise_multiplier"], "epsilon": r["epsilon"]}
    spec = SamplingSpec("cyclic-poisson", 342_477, 1000)
    r, t = timed(lambda: account(fac, delta=1e-6, noise_multiplier=0.6, sampling=spec))
    res["cyclic_poisson_epsilon"] = {"seconds": t, "epsilon": r["epsilon"], "compositions":
                                     r["accountant"]["compositions"]}
    p0 = 1000 / 342_477
    b = 342
    mc = MonteCarloAccountant(fac.encoder.band_array(), b, p0 / (1 - p0 * (b - 1)), warm=True)
    est, t = timed(lambda: mc.sample_losses(0.6, args.mc_samples, seed=0))
    res["bminsep_monte_carlo"] = {"seconds": t, "samples_per_direction": args.mc_samples,
                                  "directions": 2, "epsilon_at_delta_5e-7": est.epsilon(5e-7),
                                  "workers": min(os.cpu_count() or 1, max(1, args.mc_samples // 50_000))}
    print(json.dumps({"benchmark": "accounting", "cpus": os.cpu_count(), "rounds": 2052, **res}))


if __name__ == "__main__":
    main()
