"""Utility at equal (ε, δ): corrflow's matrix-factorization noise vs DP-SGD's independent noise vs no noise, on the
synthetic StackOverflow-style next-word task (Keras LSTM), same users, schedule, optimizer and clipping.

Goal (000 Fig. 3): MF closes at least half of DP-SGD's gap to the non-private model. Prints one JSON object with
the final held-out cross-entropy and next-word accuracy (means of the last 3 rounds) and the fraction of each gap
closed (null when the arms tie, e.g. all at zero accuracy). The non-private arm adds
no noise (config ``non_private``; its ε is null). Runs on the in-process grid (no Ray) to keep the timing about the
training, not the simulator.

Usage: python benchmarks/utility.py [--users 400] [--rounds 20] [--epochs 2] [--epsilon 8] [--client keras]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

from corrflow.clients.tasks import get_task
from corrflow.server.app import run_server
from corrflow.server.inprocess import InProcessGrid
from corrflow.strategies.config import StrategyConfig


def run_arm(name: str, kind: str, args, **sigma) -> dict:
    out = tempfile.mkdtemp(prefix=f"corrflow-utility-{name}-")
    cfg = StrategyConfig(num_users=args.users, num_rounds=args.rounds, epochs=args.epochs, kind=kind,
                         delta=args.delta, clip_norm=args.clip, client=args.client, momentum=0.9,
                         server_lr=args.server_lr, local_lr=0.5 if args.client == "keras" else 0.1,
                         local_steps=1 if args.client == "keras" else 5, state_dir=os.path.join(out, "state"),
                         **sigma)
    task = get_task(cfg.client, cfg.model_dim, cfg.data_path, cfg.vocab_path, cfg.seq_len)
    t0 = time.perf_counter()
    s = run_server(InProcessGrid(task.handlers, cfg.num_users), cfg, out, quiet=True)
    keys = ["test_loss"] + (["test_accuracy"] if args.client == "keras" else [])
    res = {"kind": kind, "noise_multiplier": s.sigma, "epsilon": s.ledger.epsilon_history[-1],
           "seconds": time.perf_counter() - t0}
    for key in keys:  # mean of the last 3 rounds
        res[key] = float(np.mean([m[key] for m in s.metrics_history[-3:]]))
    print(json.dumps({name: res}), file=sys.stderr, flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--epsilon", type=float, default=8.0)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--server-lr", type=float, default=0.3)
    ap.add_argument("--client", default="keras")
    args = ap.parse_args()
    arms = {"mf": run_arm("mf", "toeplitz", args, target_epsilon=args.epsilon),
            "dpsgd": run_arm("dpsgd", "dpsgd", args, target_epsilon=args.epsilon),
            "nonprivate": run_arm("nonprivate", "toeplitz", args, non_private=True)}
    gaps = {}
    for key in ("test_loss", "test_accuracy"):
        if key in arms["mf"]:
            mf, sgd, free = (arms[k][key] for k in ("mf", "dpsgd", "nonprivate"))
            gaps[key] = (mf - sgd) / (free - sgd) if free != sgd else None
    print(json.dumps({"benchmark": "utility", "task": args.client, "users": args.users, "rounds": args.rounds,
                      "epochs": args.epochs, "cohort": args.users // (args.rounds // args.epochs),
                      "epsilon": args.epsilon, "delta": args.delta, "arms": arms, "gap_closed": gaps,
                      "target_gap_closed": 0.5}))


if __name__ == "__main__":
    main()
