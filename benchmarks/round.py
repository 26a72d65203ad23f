"""Server time per round: 100 clients × 4M float32 parameters, corrflow's strategy against Flower's
``DifferentialPrivacyServerSideFixedClipping(FedAvg)`` (independent noise), rounds alternating
between the two in one process so that both see the same machine load.

Both receive the same kind of full-weight replies (the model sent + an update of norm ≈ 100 > clip),
subtract the model sent, clip each update to ℓ2 ≤ clip, sum/average and add Gaussian noise. corrflow
also validates every reply, adds the banded correlated noise (C⁻¹Z)_t (10 bands), steps its momentum
optimizer, and — before the model may leave the server — writes the atomic checkpoint, the
release-journal entry, the release registry record, the privacy report and metrics. A banded noise
buffer's checkpoint writes one new row per round into a ring file (O(d) bytes, not (bands−1)·d).
Reported: corrflow's round with the checkpoint, without it and without any bookkeeping, each as a
ratio to Flower's round (medians over the rounds), and the time of each phase. Target:
the round with the checkpoint ≤ 1.0× Flower's.

Usage: python benchmarks/round.py [--clients 100] [--params 4000000] [--rounds 3] [--bands 10]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg

from corrflow.config import RunConfig
from corrflow.run.checkpoint import CHECKPOINT
from corrflow.run.resume import RunLock
from corrflow.server.inprocess import InProcessGrid, enable_offline_messages
from corrflow.strategies.session import RunSpec, prepare_run


def _payloads(d: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [
        rng.standard_normal(d, dtype=np.float32) * 0.5 for _ in range(4)
    ]  # norm ≈ 0.5·√d ≫ clip


def _corrflow(args, tmp: Path):
    """A prepared corrflow run whose clients answer with the model sent + a fixed large update."""
    d, m = args.params, args.clients
    base = _payloads(d)

    def train(msg, ctx):
        sent = msg.content["arrays"].to_numpy_ndarrays()[0]
        return Message(
            RecordDict(
                {
                    "arrays": ArrayRecord([sent + base[ctx.node_config["partition-id"] % 4]]),
                    "metrics": MetricRecord({"num-examples": 10}),
                }
            ),
            reply_to=msg,
        )

    rounds = args.bands * 2
    cfg = RunConfig(
        num_users=m * args.bands,
        num_rounds=rounds,
        epochs=2,
        kind="toeplitz",
        bands=args.bands,
        noise_multiplier=1.0,
        momentum=0.9,
        cooldown_fraction=0.0,
        clip_norm=1.0,
        state_dir=str(tmp / "run"),
        release_registry=str(tmp / "registry.sqlite"),
    )
    grid = InProcessGrid({"train": train}, cfg.num_users)
    lock = RunLock(cfg.state_dir).__enter__()
    strategy = prepare_run(grid, RunSpec(cfg, [np.zeros(d, np.float32)]))
    return strategy, grid, lock


class _Phases:
    """Wall time of each phase of corrflow's round: collect (validate, subtract, clip, sum), release
    (noise, optimizer, realised ε), bookkeeping (the recorder's apply: checkpoint, journal,
    registry, report, metrics) and, within it, the checkpoint alone."""

    def __init__(self, strategy):
        import corrflow.run.core as core

        self.times: dict[str, list[float]] = {
            "collect": [],
            "release": [],
            "bookkeeping": [],
            "checkpoint": [],
        }
        run = strategy.run
        core.collect = self._timed("collect", core.collect)
        core.release = self._timed("release", core.release)
        run._apply = self._timed("bookkeeping", run._apply)
        run._store.checkpoint = self._timed("checkpoint", run._store.checkpoint)

    def _timed(self, name, fn):
        def run(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.times[name].append(time.perf_counter() - t0)

        return run

    def median(self, name: str) -> float:
        return statistics.median(self.times[name])


def _corrflow_round(strategy, grid, r: int) -> float:
    arrays = strategy.initial_arrays()
    grid.push_messages(list(strategy.configure_train(r + 1, arrays, None, grid)))
    replies = list(grid.pull_messages([]))
    t0 = time.perf_counter()
    new_arrays, _ = strategy.aggregate_train(r + 1, replies)
    elapsed = time.perf_counter() - t0
    assert new_arrays is not None, "corrflow released no model"
    return elapsed


def _flower_round(peer, base: list[np.ndarray], clients: int, d: int) -> float:
    current = ArrayRecord([np.zeros(d, np.float32)])
    peer.current_arrays = current
    sent = current.to_numpy_ndarrays()[0]
    requests = [
        Message(RecordDict({}), message_type="train", dst_node_id=n) for n in range(1, clients + 1)
    ]
    replies = [
        Message(
            RecordDict(
                {
                    "arrays": ArrayRecord([sent + base[i % 4]]),
                    "metrics": MetricRecord({"num-examples": 10}),
                }
            ),
            reply_to=q,
        )
        for i, q in enumerate(requests)
    ]
    t0 = time.perf_counter()
    new_arrays, _ = peer.aggregate_train(1, replies)
    elapsed = time.perf_counter() - t0
    assert new_arrays is not None, "Flower released no model"
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--params", type=int, default=4_000_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bands", type=int, default=10)
    args = ap.parse_args()
    logging.getLogger("flwr").setLevel(logging.WARNING)  # Flower logs a line per reply
    enable_offline_messages()
    tmp = Path(tempfile.mkdtemp(prefix="corrflow-bench-round-"))
    try:
        strategy, grid, lock = _corrflow(args, tmp)
        phases = _Phases(strategy)
        peer = DifferentialPrivacyServerSideFixedClipping(
            FedAvg(fraction_train=1.0, min_train_nodes=args.clients),
            noise_multiplier=1.0,
            clipping_norm=1.0,
            num_sampled_clients=args.clients,
        )
        base = _payloads(args.params)
        ours, theirs = [], []
        # ABBA: the one that runs first alternates, so load drifts hit both
        for r in range(args.rounds):
            if r % 2 == 0:
                ours.append(_corrflow_round(strategy, grid, r))
                gc.collect()
                theirs.append(_flower_round(peer, base, args.clients, args.params))
            else:
                theirs.append(_flower_round(peer, base, args.clients, args.params))
                gc.collect()
                ours.append(_corrflow_round(strategy, grid, r))
            gc.collect()
        state = Path(strategy.cfg.state_dir) / "state"
        ckpt_bytes = (state / CHECKPOINT).stat().st_size
        ring = state / "noise_ring.bin"
        ring_bytes = ring.stat().st_size if ring.exists() else 0
        lock.__exit__(None, None, None)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    o, t = statistics.median(ours), statistics.median(theirs)
    b, c = phases.median("bookkeeping"), phases.median("checkpoint")
    noise = strategy.run.noise
    print(
        json.dumps(
            {
                "benchmark": "round",
                "cpus": os.cpu_count(),
                "load_average_1min": os.getloadavg()[0],
                "clients": args.clients,
                "params": args.params,
                "bands": args.bands,
                "rounds": args.rounds,
                "order": "alternating, ABBA",
                "noise_mode": noise.mode,
                "corrflow_round_seconds": o,
                "corrflow_round_without_checkpoint_seconds": o - c,
                "corrflow_round_without_bookkeeping_seconds": o - b,
                "flower_dp_fixed_clipping_seconds": t,
                "ratio_with_checkpoint": o / t,
                "ratio_without_checkpoint": (o - c) / t,
                "ratio_without_bookkeeping": (o - b) / t,
                "phases_seconds": {name: phases.median(name) for name in phases.times},
                "rounds_seconds": {"corrflow": ours, "flower": theirs},
                "noise_buffer_bytes": noise.buffer_bytes,
                "checkpoint_directory_bytes": ckpt_bytes,
                "ring_file_bytes": ring_bytes,
                "noise_state_bytes_written_per_round": noise.dim * 4
                if ring_bytes
                else noise.buffer_bytes,
                "target_ratio": 1.0,
                "meets_target": o / t <= 1.0,
            }
        )
    )


if __name__ == "__main__":
    main()
