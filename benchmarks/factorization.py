"""Factorization quality and speed against the peer (jax-privacy), measured in the same run.

Prints one JSON object: for each case, our total squared error (sensitivity 1) and seconds next to
the peer's, with the target ratios (loss ratio ≤ 1.001; speed-up ≥ 5× for dense n=256, ≥
3× for Toeplitz n=16384). ``--large`` adds the scale targets: dense n=2000, k=20 within 0.5% of its
dual lower bound in under 15 minutes, and banded Toeplitz n=100000, 64 bands in under 60 s. The peer
columns are null when jax-privacy is not installed (``pip install -e ".[peer]"``).

Usage: python benchmarks/factorization.py [--large] [--no-peer]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from corrflow.factorization.dense import optimize_dense
from corrflow.factorization.participation import Participation
from corrflow.factorization.sensitivity import sensitivity_from_gram
from corrflow.factorization.toeplitz import ToeplitzLoss, optimize_toeplitz
from corrflow.factorization.workloads import Workload

PREFIX = Workload.prefix()


def _peer():
    try:
        import jax

        jax.config.update("jax_enable_x64", True)
        from jax_privacy.matrix_factorization import dense, toeplitz
    except ImportError:
        return None
    return dense, toeplitz


def dense_case(n: int, k: int, peer, tol: float = 5e-4) -> dict:
    part = Participation.fixed_epoch(n, k)

    def progress(it, loss):
        if it % 25 == 0:
            print(
                json.dumps(
                    {
                        "dense_n": n,
                        "iteration": it,
                        "loss": loss,
                        "seconds": time.perf_counter() - t0,
                    }
                ),
                file=sys.stderr,
                flush=True,
            )

    t0 = time.perf_counter()
    res = optimize_dense(PREFIX, part, tol=tol, callback=progress if n >= 1000 else None)
    ours_s = time.perf_counter() - t0
    out = {
        "case": f"dense n={n} k={k}",
        "ours_loss": res.loss,
        "ours_seconds": ours_s,
        "lower_bound": res.lower_bound,
        "relative_gap": res.relative_gap,
        "iterations": res.iterations,
    }
    if peer is not None:
        t0 = time.perf_counter()
        C = np.asarray(peer[0].optimize(n, epochs=k), dtype=np.float64)
        peer_s = time.perf_counter() - t0
        sens = sensitivity_from_gram(C.T @ C, part)
        loss = sens.value**2 * float(np.sum((PREFIX.matrix(n) @ np.linalg.inv(C)) ** 2))
        out.update(
            peer_loss=loss, peer_seconds=peer_s, loss_ratio=res.loss / loss, speedup=peer_s / ours_s
        )
    return out


def toeplitz_case(n: int, bands: int, peer) -> dict:
    t0 = time.perf_counter()
    res = optimize_toeplitz(PREFIX, n, bands)
    ours_s = time.perf_counter() - t0
    out = {"case": f"toeplitz n={n} bands={bands}", "ours_loss": res.loss, "ours_seconds": ours_s}
    if peer is not None:
        t0 = time.perf_counter()
        coef = np.asarray(peer[1].optimize_banded_toeplitz(n, bands), dtype=np.float64)
        peer_s = time.perf_counter() - t0
        loss = ToeplitzLoss.build(PREFIX, n, n, 1)(coef / np.linalg.norm(coef))[0]
        out.update(
            peer_loss=loss, peer_seconds=peer_s, loss_ratio=res.loss / loss, speedup=peer_s / ours_s
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--large",
        action="store_true",
        help="also run the n=2000 dense and n=100000 Toeplitz targets",
    )
    ap.add_argument("--only-large", action="store_true", help="skip the peer comparison cases")
    ap.add_argument("--no-peer", action="store_true")
    args = ap.parse_args()
    peer = None if args.no_peer else _peer()
    cases = []
    for n in () if args.only_large else (64, 256):
        cases.append(dense_case(n, 4, peer))
        print(json.dumps(cases[-1]), file=sys.stderr)
    for n in () if args.only_large else (2048, 16384):
        for bands in (16, 64):
            cases.append(toeplitz_case(n, bands, peer))
            print(json.dumps(cases[-1]), file=sys.stderr)
    targets = {}
    if peer is not None and cases:
        targets["loss_ratio_max"] = max(c["loss_ratio"] for c in cases)
        targets["dense_256_speedup"] = next(
            c["speedup"] for c in cases if c["case"] == "dense n=256 k=4"
        )
        targets["toeplitz_16384_speedup_min"] = min(
            c["speedup"] for c in cases if "n=16384" in c["case"]
        )
    if args.large:
        big = toeplitz_case(100_000, 64, None)
        cases.append(big)
        targets["toeplitz_100000_64_seconds"] = big["ours_seconds"]
        # The criterion: within 0.5% of the dual bound.
        d = dense_case(2000, 20, None, tol=5e-3)
        cases.append(d)
        targets.update(
            dense_2000_seconds=d["ours_seconds"],
            dense_2000_gap=d["relative_gap"],
            dense_2000_lower_bound=d["lower_bound"],
            dense_2000_loss=d["ours_loss"],
        )
    print(
        json.dumps(
            {
                "benchmark": "factorization",
                "cpus": os.cpu_count(),
                "peer": peer is not None,
                "cases": cases,
                "targets": targets,
            }
        )
    )


if __name__ == "__main__":
    main()
