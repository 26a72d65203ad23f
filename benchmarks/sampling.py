"""Sampling speed: 10⁶ items attributed to 10⁵ users, multi-attribution b-min-sep (004
Alg. 3), and plain b-min-sep over 10⁶ items; milliseconds per round (target < 50 ms on 2 cores).
Prints one JSON object.

Usage: python benchmarks/sampling.py [--rounds 200]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from corrflow.participation import BMinSepSampler, MultiAttributionSampler


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()
    items, users, b = 1_000_000, 100_000, 50
    rng = np.random.default_rng(0)
    sizes = np.minimum(1 + rng.geometric(0.6, size=items) - 1, 8)  # long-tailed authors per item
    flat = rng.integers(0, users, size=int(sizes.sum()))
    item_users = np.split(flat, np.cumsum(sizes)[:-1])
    p0 = 1000 / items
    out = {}
    for name, sampler in (
        ("bminsep", BMinSepSampler(items, b, BMinSepSampler.probability_for_rate(p0, b), 0)),
        ("multi_attribution", MultiAttributionSampler(item_users, users, b, p0, 0)),
    ):
        t0 = time.perf_counter()
        counts = [len(sampler.sample()) for _ in range(args.rounds)]
        sec = (time.perf_counter() - t0) / args.rounds
        out[name] = {
            "ms_per_round": 1000 * sec,
            "mean_cohort": float(np.mean(counts)),
            "projected_seconds_2000_rounds": 2000 * sec,
        }
    print(
        json.dumps(
            {
                "benchmark": "sampling",
                "cpus": os.cpu_count(),
                "items": items,
                "users": users,
                "min_sep": b,
                **out,
                "target_ms_per_round": 50,
            }
        )
    )


if __name__ == "__main__":
    main()
