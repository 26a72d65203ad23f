"""Server aggregation time per round: 100 clients × 4M float32 parameters, corrflow's strategy against Flower's
``DifferentialPrivacyServerSideFixedClipping(FedAvg)`` (independent noise) measured in the same run.

Both deserialize the same full-weight replies, subtract the model sent, clip each update to ℓ2 ≤ clip, sum/average
and add Gaussian noise; corrflow also validates every reply, adds the banded correlated noise (C⁻¹Z)_t, steps its
momentum optimizer and appends the release-journal entry. Its atomic
checkpoint (model, optimizer, noise buffer) is timed separately. Target (issue 5): aggregation ≤ 1.25× Flower's.

Usage: python benchmarks/round.py [--clients 100] [--params 4000000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg

from corrflow.accounting.tracking import PrivacyPlan
from corrflow.config import RunConfig
from corrflow.factorization import factorize, participation_for
from corrflow.server.inprocess import enable_offline_messages
from corrflow.strategies.correlated import CorrelatedNoiseStrategy


def _replies(nodes, arrays_fn):
    out = []
    for n in nodes:
        req = Message(content=RecordDict({}), message_type="train", dst_node_id=n)
        out.append(Message(content=RecordDict({"arrays": ArrayRecord([arrays_fn(n)]),
                                               "metrics": MetricRecord({"num-examples": 10})}), reply_to=req))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--params", type=int, default=4_000_000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    enable_offline_messages()
    d, m, rounds = args.params, args.clients, args.rounds
    users = m * 10
    rng = np.random.default_rng(0)
    base = [rng.standard_normal(d, dtype=np.float32) * 0.01 for _ in range(4)]  # reused payloads (memory)

    # corrflow: 10 groups of `m` users, one group per round, 10-band Toeplitz BandMF.
    tmp = tempfile.mkdtemp(prefix="corrflow-bench-")
    cfg = RunConfig(num_users=users, num_rounds=10, epochs=1, noise_multiplier=1.0, model_dim=d,
                         momentum=0.9, cooldown_fraction=0.0, state_dir=os.path.join(tmp, "state"))
    from corrflow.factorization.workloads import Workload
    fac = factorize("toeplitz", participation_for(10, 1), Workload("momentum", 0.9))
    directory = {1000 + i: f"partition-{i}" for i in range(users)}
    strat = CorrelatedNoiseStrategy(cfg, fac, [np.zeros(d, np.float32)], directory,
                                    privacy=PrivacyPlan(1.0, 1.0), out_dir=tmp)
    ckpt_times = []
    real_ckpt = strat._checkpoint

    def timed_ckpt():
        t0 = time.perf_counter()
        path = real_ckpt()
        ckpt_times.append(time.perf_counter() - t0)
        return path

    strat._checkpoint = timed_ckpt

    class _Grid:
        def get_node_ids(self):
            return list(directory)

    ours = []
    for _ in range(rounds):
        msgs = strat.configure_train(1, strat.initial_arrays(), None, _Grid())
        nodes = [int(x.metadata.dst_node_id) for x in msgs]
        # Full weights (the default reply, as for Flower's wrapper): the model sent + an update of norm ≈ 100 > clip.
        replies = _replies(nodes, lambda n: strat.params[0] + base[n % 4] * 50)
        t0 = time.perf_counter()
        strat.aggregate_train(1, replies)
        ours.append(time.perf_counter() - t0 - ckpt_times[-1])

    # Flower: central DP with fixed clipping around FedAvg, independent noise.
    peer = DifferentialPrivacyServerSideFixedClipping(FedAvg(fraction_train=1.0, min_train_nodes=m),
                                                      noise_multiplier=1.0, clipping_norm=1.0, num_sampled_clients=m)
    current = ArrayRecord([np.zeros(d, np.float32)])
    theirs = []
    for _ in range(rounds):
        peer.current_arrays = current
        replies = _replies(list(range(1, m + 1)), lambda n: base[n % 4] * 50)
        t0 = time.perf_counter()
        peer.aggregate_train(1, replies)
        theirs.append(time.perf_counter() - t0)

    o, t = statistics.median(ours), statistics.median(theirs)
    print(json.dumps({"benchmark": "round", "cpus": os.cpu_count(), "clients": m, "params": d,
                      "corrflow_aggregation_seconds": o, "flower_dp_fixed_clipping_seconds": t, "ratio": o / t,
                      "corrflow_checkpoint_seconds": statistics.median(ckpt_times),
                      "noise_buffer_bytes": strat.noise.buffer_bytes, "bands": fac.bands,
                      "target_ratio": 1.25}))


if __name__ == "__main__":
    main()
