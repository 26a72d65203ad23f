"""Utility at equal (ε, δ): correlated noise (banded Toeplitz MF) vs DP-SGD's independent noise vs no noise, on the
synthetic StackOverflow-style next-word task with learnable word order (numpy bigram model), same users, data,
initialisation, schedule, optimizer and clipping per seed — ``corrflow compare`` at several ε.

Goal (000 Fig. 3): MF closes at least half of DP-SGD's accuracy gap to the non-private model. Prints one JSON object:
per ε, each arm's final held-out accuracy and loss (means over seeds), the gap each kind closes, and the seconds.

Usage: python benchmarks/utility.py [--epsilons 2,8] [--preset quick] [--seeds 3] [--kinds toeplitz] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

from corrflow.server.compare import PRESETS, compare, stderr_progress, table, with_overrides


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epsilons", default="2,8")
    ap.add_argument("--preset", default="quick", choices=sorted(PRESETS))
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--kinds", default="toeplitz")
    ap.add_argument("--out", default=None, help="keep the comparisons here (default: a temporary directory)")
    args = ap.parse_args()
    logging.getLogger("corrflow").setLevel(logging.ERROR)
    root = Path(args.out or tempfile.mkdtemp(prefix="corrflow-utility-"))
    results = {}
    for eps in (float(e) for e in args.epsilons.split(",")):
        preset = with_overrides(PRESETS[args.preset], epsilon=eps, seeds=args.seeds)
        started = time.perf_counter()
        res = compare(preset, args.kinds.split(","), root / f"eps{eps:g}", progress=stderr_progress)
        print(table(res), file=sys.stderr, flush=True)
        results[f"{eps:g}"] = {"arms": {n: {k: a[k] for k in ("accuracy", "loss", "kind", "noise_multiplier")}
                                        for n, a in res["arms"].items()},
                               "gap_closed": res["gap_closed"], "seconds": time.perf_counter() - started}
    p = PRESETS[args.preset]
    print(json.dumps({"benchmark": "utility", "preset": args.preset, "client": p.client, "users": p.users,
                      "rounds": p.rounds, "epochs": p.epochs, "cohort": p.cohort, "delta": p.delta,
                      "seeds": args.seeds or p.seeds, "results": results, "target_gap_closed": 0.5,
                      "out": str(root)}))


if __name__ == "__main__":
    main()
