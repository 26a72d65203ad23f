"""Issue 21's acceptance check: `corrflow account` at δ = 1e-5 for seeds 1..5, b-min-sep and Poisson
sampling of a 4-band Toeplitz encoder (n = 48, k = 4, b = 12, N = 1000, B = 50, σ = 1), against an
exact-likelihood Monte Carlo reference (a point estimate at δ from independent samples) and MMCC.
Prints one JSON object.

    PYTHONPATH=. python benchmarks/amplified_accounting.py [--seeds 1 2 3 4 5] [--reference-samples
    20000000] [--samplers bminsep poisson]
"""

from __future__ import annotations

import argparse
import json
import time

from corrflow.accounting import SamplingSpec, account
from corrflow.accounting.accountant import MonteCarloEVRAccountant
from corrflow.factorization import factorize, participation_for


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--reference-samples", type=int, default=20_000_000)
    ap.add_argument(
        "--samplers", nargs="+", default=["bminsep", "poisson"], choices=["bminsep", "poisson"]
    )
    args = ap.parse_args()
    fac = factorize("toeplitz", participation_for(48, 4, 12, kind="min-sep"), bands=4)
    out = {
        "factorization": "toeplitz n=48 k=4 min_sep=12 bands=4",
        "noise_multiplier": 1.0,
        "delta": args.delta,
    }
    for kind in args.samplers:
        spec = SamplingSpec(kind, 1000, 50)
        runs = []
        for seed in args.seeds:
            t0 = time.perf_counter()
            res = account(fac, delta=args.delta, noise_multiplier=1.0, sampling=spec, seed=seed)
            acc = res["accountant"]
            runs.append(
                {
                    "seed": seed,
                    "epsilon": res["epsilon"],
                    "delta": res["delta"],
                    "guarantee": res["guarantee"],
                    "selected": acc["selected"],
                    "samples_drawn": acc.get("samples_drawn"),
                    "seconds": time.perf_counter() - t0,
                    "bounds": {b["accountant"]: b["epsilon"] for b in acc["bounds"]},
                }
            )
        eps = [r["epsilon"] for r in runs]
        mc, _ = MonteCarloEVRAccountant(spec)._mc(fac)
        t0 = time.perf_counter()
        ref = mc.sample_losses(1.0, args.reference_samples, seed=10_000).epsilon(args.delta)
        t_ref = time.perf_counter() - t0
        out[kind] = {
            "runs": runs,
            "spread": max(eps) / min(eps) - 1,
            "reference_epsilon": ref,
            "reference_samples": args.reference_samples,
            "reference_samples_per_second": args.reference_samples / t_ref,
            "max_ratio_to_reference": max(eps) / ref,
            "other_bounds": {
                k: v for k, v in runs[0]["bounds"].items() if k != runs[0]["selected"]
            },
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
