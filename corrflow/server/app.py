"""The corrflow ServerApp: resolve stable user ids, build (or reuse) the factorization, calibrate σ, run the
correlated-noise strategy, and write ``privacy_report.json`` and ``metrics.json``.

``app`` reads Flower's run config (``flwr run``); :func:`make_server_app` binds a config for in-process simulation.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid, ServerApp

from corrflow.accounting import account
from corrflow.clients.tasks import get_task
from corrflow.errors import CorrflowError, IntegrityError, InvalidArgumentError
from corrflow.factorization import Factorization, Workload, factorize, participation_for
from corrflow.strategies.config import StrategyConfig
from corrflow.strategies.correlated import CorrelatedNoiseStrategy

log = logging.getLogger("corrflow")


def wait_for_nodes(grid: Grid, expected: int, timeout: float = 600.0) -> list[int]:
    """Nodes register asynchronously, also in simulation (flower.md §4.6): wait for ``expected`` of them."""
    start = time.monotonic()
    while len(nodes := sorted(int(n) for n in grid.get_node_ids())) < expected:
        if time.monotonic() - start > timeout:
            raise CorrflowError(f"only {len(nodes)} of {expected} nodes came online within {timeout:.0f} s")
        time.sleep(0.2)
    return nodes


def resolve_users(grid: Grid, nodes: list[int]) -> dict[int, str]:
    """node id → stable user id: the SuperNode public key's fingerprint when node auth gives one, else (simulation)
    the partition id the node reports."""
    keys = {}
    for info in grid.get_nodes() or []:
        key = bytes(getattr(info, "public_key", b"") or b"")
        if key:
            keys[int(info.node_id)] = "key-" + hashlib.sha256(key).hexdigest()[:24]
    if all(n in keys for n in nodes):
        return {n: keys[n] for n in nodes}
    queries = [Message(content=RecordDict({"config": ConfigRecord({"ask": "identity"})}),
                       message_type=MessageType.QUERY, dst_node_id=n) for n in nodes]
    users = {}
    for reply in grid.send_and_receive(queries, timeout=300):
        if reply.has_error():
            continue
        metrics = reply.content.metric_records.get("metrics", MetricRecord())
        if "partition-id" in metrics:
            users[int(reply.metadata.src_node_id)] = f"partition-{int(metrics['partition-id'])}"
    if len(set(users.values())) != len(users):
        raise IntegrityError("two nodes reported the same partition id")
    return users


def load_or_build_factorization(cfg: StrategyConfig, out_dir: Path) -> Factorization:
    workload = Workload.sgd_momentum(cfg.momentum, cfg.cooldown_fraction) if cfg.momentum > 0 else \
        Workload("prefix", 0.0, cfg.cooldown_fraction)
    path = out_dir / "factorization.npz"
    part = participation_for(cfg.num_rounds, cfg.epochs)
    if path.exists():
        fac = Factorization.load(path)
        if fac.kind == cfg.kind and fac.workload == workload and fac.participation == part:
            return fac
    fac = factorize(cfg.kind, part, workload, bands=cfg.bands or None)
    fac.save(path)
    return fac


def run_server(grid: Grid, cfg: StrategyConfig, out_dir: str | Path, *, noise_key: bytes | None = None,
               quiet: bool = False, on_round_end=None) -> CorrelatedNoiseStrategy:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    nodes = wait_for_nodes(grid, cfg.num_users)
    directory = resolve_users(grid, nodes)
    fac = load_or_build_factorization(cfg, out)
    if cfg.non_private:
        sigma, planned = 0.0, None
        log.warning("non-private baseline: no noise is added and there is no privacy guarantee")
    elif cfg.noise_multiplier > 0:
        sigma = cfg.noise_multiplier
        planned = account(fac, delta=cfg.delta, noise_multiplier=sigma)["epsilon"]
    else:
        res = account(fac, delta=cfg.delta, target_epsilon=cfg.target_epsilon)
        sigma, planned = res["noise_multiplier"], res["epsilon"]
    task = get_task(cfg.client, cfg.model_dim, cfg.data_path, cfg.vocab_path, cfg.seq_len)

    def round_end(strategy, metrics):
        metrics.update(task.evaluate(strategy.params))
        if not quiet:
            acc = f" accuracy {metrics['test_accuracy']:.4f}" if "test_accuracy" in metrics else ""
            print(f"round {metrics['round'] + 1:>4}/{cfg.num_rounds}  replies {metrics['replies']:>3}/"
                  f"{metrics['cohort']:<3} rejected {metrics['rejected']:<2} test-loss {metrics['test_loss']:.4f}"
                  f"{acc}  ε {metrics.get('epsilon', float('nan')):.3f}", file=sys.stderr, flush=True)
        (out / "metrics.json").write_text(json.dumps(strategy.metrics_history, indent=1))
        if on_round_end is not None:
            on_round_end(strategy, metrics)

    strategy = CorrelatedNoiseStrategy(cfg, fac, task.initial_weights(), directory, noise_multiplier=sigma,
                                       planned_epsilon=planned, noise_key=noise_key, out_dir=out,
                                       on_round_end=round_end)
    if strategy.remaining_rounds > 0:
        strategy.start(grid=grid, initial_arrays=strategy.initial_arrays(), num_rounds=strategy.remaining_rounds,
                       timeout=600)
    (out / "metrics.json").write_text(json.dumps(strategy.metrics_history, indent=1))
    return strategy


def make_server_app(cfg: StrategyConfig, out_dir: str | Path, **kwargs) -> ServerApp:
    server = ServerApp()

    @server.main()
    def _main(grid: Grid, context: Context) -> None:
        run_server(grid, cfg, out_dir, **kwargs)

    return server


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    try:
        cfg = StrategyConfig.from_run_config(dict(context.run_config))
    except InvalidArgumentError as exc:
        log.error("bad run config: %s", exc)
        raise
    run_server(grid, cfg, Path(cfg.state_dir).parent if cfg.state_dir else Path("."))
