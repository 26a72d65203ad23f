"""Round cost with SecAgg+ (``--secagg``) against the plain exchange, cohorts 10 and 100, a model of
10⁵ parameters, on the in-process grid (no network: protocol and crypto only).

plain: the train messages, the replies (weights), and the server's validate → zero → clip → sum
(`corrflow.run.clipping.ClippedSum`). secagg: the four SecAgg+ stages (`corrflow.strategies.secagg
.secure_sum`) with Flower's ``secaggplus_mod`` and corrflow's client mod on every client. The
client work of both runs in this process: CPU seconds are split into the clients' (inside their
handlers) and the server's (the rest). The clients' training is the same trivial step in both
(a fixed update), so the difference is the secure aggregation. Prints one JSON object.

With ``--noise-node`` two more modes: ``secagg_noise`` (the secure round, then the server draws
σ·c·(C⁻¹Z)_t and adds it, as ``--secagg`` does) and ``noise_node`` (a noise node in this process
joins the round as one more member and adds that noise inside the sum; the clients run the guard
mod); their CPU ratio is the noise node's overhead at the same cohort. The two modes alternate. By
construction the noise node is one more member and every client's neighbour (its threshold
⌈⅔·(ring + 1)⌉): at cohort 10 the round is a ``--secagg`` round of 11 members (≈ 1.2× one of 10);
at cohort 100, ≈ +5 %. Measured numbers: docs/reference/benchmarks.md, "A noise node in the sum".

Usage: python benchmarks/secagg.py [--cohorts 10,100] [--dim 100000] [--repeats 2] [--noise-node]
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


SIGMA = 1.0


def _factorization():
    from corrflow.factorization.build import factorize, participation_for

    return factorize("toeplitz", participation_for(4, 2, 2, kind="min-sep"), bands=2)


def secure_noise_round(m: int, dim: int) -> tuple[float, float]:
    """`secure_round`, then the server's noise draw for round 0 added into the sum."""
    from corrflow.noise import CorrelatedNoise

    gen = CorrelatedNoise(_factorization(), [(dim,), (1,)], SIGMA)
    clock = ClientClock()
    grid = InProcessGrid({"train": clock.wrap(with_secure_aggregation(train))}, m)
    plan = SimpleNamespace(expected={n: f"user-{i}" for i, n in enumerate(grid.get_node_ids())})
    t0 = time.process_time()
    summed = secure_sum(
        grid, messages(grid, dim), plan, 1.0, [(dim,), (1,)], {"zeroing-factor": 100.0}, 600, None
    )
    for total, n in zip(summed.total, gen.next(0), strict=True):
        total += n
    return time.process_time() - t0, clock.cpu


def noise_node_round(m: int, dim: int) -> tuple[float, float]:
    """The secure round with a noise node (in this process, in a temporary directory) as one more
    member; its CPU counts with the clients' (it is another party)."""
    import tempfile

    from corrflow.clients.secagg import with_noise_node_guard
    from corrflow.noisenode.node import NoiseNode
    from corrflow.noisenode.store import NoiseNodeStore
    from corrflow.run.noise_node_link import NoiseNodeLink, NoiseNodeStream
    from corrflow.server.noise_node_sim import pin

    fac = _factorization()
    with tempfile.TemporaryDirectory() as tmp:
        path = fac.save(f"{tmp}/fac.npz")
        recipe = {
            "factorization_sha256": fac.sha256(),
            "noise_multiplier": SIGMA,
            "clip_norm": 1.0,
            "delta": 1e-5,
            "rounds": fac.rounds,
            "shapes": [[dim], [1]],
        }
        node = NoiseNode(NoiseNodeStore(f"{tmp}/node"))
        node.pin(recipe, path.read_bytes())
        i = node.identity()
        stream = NoiseNodeStream(NoiseNodeLink(i["node_id"], i["public_key"], i["signature"]))
        stream.recipe, stream.sigma_max = recipe, node.sigma_max()
        clock = ClientClock()

        def answer(msg: Message, ctx) -> Message:
            config = dict(msg.content.config_records["secaggplus_configs"])
            out = node.handle(config.pop("stage"), config)
            return Message(RecordDict({"secaggplus_configs": ConfigRecord(out)}), reply_to=msg)

        pins = pin(i)
        grid = InProcessGrid(
            {"train": clock.wrap(with_noise_node_guard(with_secure_aggregation(train)))},
            m,
            node_config=lambda p: pins,
            extra_nodes={i["node_id"]: clock.wrap(answer)},
        )
        ids = grid.get_node_ids()
        plan = SimpleNamespace(expected={n: f"user-{k}" for k, n in enumerate(ids)}, round=0)
        t0 = time.process_time()
        summed = secure_sum(
            grid,
            messages(grid, dim),
            plan,
            1.0,
            [(dim,), (1,)],
            {"zeroing-factor": 100.0},
            600,
            None,
            stream,
        )
        elapsed = time.process_time() - t0
    assert len(summed.accepted) == m
    return elapsed, clock.cpu


def best(fn, repeats: int) -> dict:
    return fastest([fn() for _ in range(repeats)])


def fastest(runs: list[tuple[float, float]]) -> dict:
    """The run with the least CPU of ``runs`` ((total, clients) seconds each)."""
    total, clients = min(runs)
    return {
        "cpu_s": round(total, 3),
        "clients_cpu_s": round(clients, 3),
        "server_cpu_s": round(total - clients, 3),
    }


def noise_node_case(m: int, dim: int, repeats: int) -> dict:
    """The two noise modes at cohort ``m`` and the noise node's CPU overhead; the modes alternate
    (A B A B …) so that a change in the shared machine's load biases neither."""
    runs: dict[str, list] = {"secagg_noise": [], "noise_node": []}
    for _ in range(repeats):
        runs["secagg_noise"].append(secure_noise_round(m, dim))
        runs["noise_node"].append(noise_node_round(m, dim))
    server_noise, node = fastest(runs["secagg_noise"]), fastest(runs["noise_node"])
    return {
        "secagg_noise": server_noise,
        "noise_node": node,
        "noise_node_ratio_cpu": round(node["cpu_s"] / server_noise["cpu_s"], 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cohorts", default="10,100")
    ap.add_argument("--dim", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--noise-node", action="store_true", help="also the noise node's modes")
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
                **(noise_node_case(m, args.dim, args.repeats) if args.noise_node else {}),
            }
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
