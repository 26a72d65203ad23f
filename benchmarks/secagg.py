"""Round cost with SecAgg+ (``--secagg``) against the plain exchange, cohorts 10 and 100, a model of
10⁵ parameters, on the in-process grid (no network: protocol and crypto only).

plain: the train messages, the replies (weights), and the server's validate → zero → clip → sum
(`corrflow.run.clipping.ClippedSum`). secagg: the four SecAgg+ stages (`corrflow.strategies.secagg
.secure_sum`) with Flower's ``secaggplus_mod`` and corrflow's client mod on every client. The
client work of both runs in this process: CPU seconds are split into the clients' (inside their
handlers) and the server's (the rest). The clients' training is the same trivial step in both
(a fixed update), so the difference is the secure aggregation. Prints one JSON object.

Usage: python benchmarks/secagg.py [--cohorts 10,100] [--dim 100000] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from types import SimpleNamespace

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

from corrflow.clients.secagg import with_secure_aggregation
from corrflow.run.clipping import ClippedSum
from corrflow.run.secure_sum import secure_sum_params
from corrflow.server.inprocess import InProcessGrid
from corrflow.strategies.messaging import array_view, exchange
from corrflow.strategies.secagg import secure_sum


class ClientClock:
    """CPU seconds spent inside the clients' handlers."""

    def __init__(self):
        self.cpu = 0.0

    def wrap(self, handler):
        def timed(msg: Message, ctx: Context) -> Message:
            t0 = time.process_time()
            try:
                return handler(msg, ctx)
            finally:
                self.cpu += time.process_time() - t0

        return timed


def train(msg: Message, ctx: Context) -> Message:
    """A fixed update per client (seeded by its partition): the training itself costs ~nothing."""
    sent = msg.content["arrays"].to_numpy_ndarrays()
    rng = np.random.default_rng(int(ctx.node_config["partition-id"]))
    new = [s + rng.normal(scale=0.01, size=s.shape).astype(np.float32) for s in sent]
    return Message(RecordDict({"arrays": ArrayRecord(new)}), reply_to=msg)


def messages(grid, dim: int) -> list[Message]:
    sent = [np.zeros(dim, np.float32), np.zeros(1, np.float32)]
    config = ConfigRecord({"clip-norm": 1.0, "server-round": 1})
    return [
        Message(
            RecordDict({"arrays": ArrayRecord(sent), "config": config}),
            message_type=MessageType.TRAIN,
            dst_node_id=n,
        )
        for n in grid.get_node_ids()
    ]


def plain_round(m: int, dim: int) -> tuple[float, float]:
    clock = ClientClock()
    grid = InProcessGrid({"train": clock.wrap(train)}, m)
    t0 = time.process_time()
    sent = [np.zeros(dim, np.float32), np.zeros(1, np.float32)]
    replies = exchange(grid, messages(grid, dim), 600, None)
    total = ClippedSum([(dim,), (1,)])
    for r in replies:
        total.add([array_view(a) for a in r.content["arrays"].values()], sent, 1.0, 100.0)
    return time.process_time() - t0, clock.cpu


def secure_round(m: int, dim: int) -> tuple[float, float]:
    clock = ClientClock()
    grid = InProcessGrid({"train": clock.wrap(with_secure_aggregation(train))}, m)
    plan = SimpleNamespace(expected={n: f"user-{i}" for i, n in enumerate(grid.get_node_ids())})
    t0 = time.process_time()
    summed = secure_sum(
        grid, messages(grid, dim), plan, 1.0, [(dim,), (1,)], {"zeroing-factor": 100.0}, 600, None
    )
    assert len(summed.accepted) == m
    return time.process_time() - t0, clock.cpu


def best(fn, repeats: int) -> dict:
    runs = [fn() for _ in range(repeats)]
    total, clients = min(runs)
    return {
        "cpu_s": round(total, 3),
        "clients_cpu_s": round(clients, 3),
        "server_cpu_s": round(total - clients, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cohorts", default="10,100")
    ap.add_argument("--dim", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    out = {
        "dim": args.dim,
        "cpu": "time.process_time (this process, clients included)",
        "cases": [],
    }
    for m in (int(c) for c in args.cohorts.split(",")):
        plain = best(partial(plain_round, m, args.dim), args.repeats)
        secure = best(partial(secure_round, m, args.dim), args.repeats)
        p = secure_sum_params(m, 1.0, args.dim + 1)
        out["cases"].append(
            {
                "cohort": m,
                "neighbours": p.num_shares,
                "threshold": p.threshold,
                "plain": plain,
                "secagg": secure,
                "ratio_cpu": round(secure["cpu_s"] / plain["cpu_s"], 1),
                "ratio_server_cpu": round(
                    secure["server_cpu_s"] / max(plain["server_cpu_s"], 1e-3), 1
                ),
                "secagg_client_cpu_s_per_client": round(secure["clients_cpu_s"] / m, 4),
            }
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
