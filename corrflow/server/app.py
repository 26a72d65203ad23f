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
from corrflow.accounting.accountant import SamplingSpec
from corrflow.clients.tasks import get_task
from corrflow.errors import CorrflowError, IntegrityError, InvalidArgumentError, require
from corrflow.factorization import Factorization, Workload, factorize, participation_for
from corrflow.participation.attribution import AttributionGraph, bound_contributions, load_attribution
from corrflow.participation.planner import CohortPlanner
from corrflow.server.learnability import check_learnable
from corrflow.server.metrics import initial_entry, round_line, write_metrics
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


def resolve_users(grid: Grid, nodes: list[int], by_partition: bool = False) -> dict[int, str]:
    """node id → stable id: the SuperNode public key's fingerprint when node auth gives one, else (simulation) the
    partition id the node reports. ``by_partition`` (cross-silo: the manifest names silos by partition) always
    asks for the partition id."""
    keys = {}
    for info in grid.get_nodes() or []:
        key = bytes(getattr(info, "public_key", b"") or b"")
        if key:
            keys[int(info.node_id)] = "key-" + hashlib.sha256(key).hexdigest()[:24]
    if not by_partition and all(n in keys for n in nodes):
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
    if cfg.participation == "fixed-epoch":
        part = participation_for(cfg.num_rounds, cfg.epochs)
    else:  # any b-separated pattern: at most ⌈n/b⌉ participations
        part = participation_for(cfg.num_rounds, cfg.max_participations, cfg.b, kind="min-sep")
    if path.exists():
        fac = Factorization.load(path)
        if fac.kind == cfg.kind and fac.workload == workload and fac.participation == part and \
                fac.metadata.get("taper_lower_min_sep") == (cfg.taper or None):
            return fac
    fac = factorize(cfg.kind, part, workload, bands=cfg.bands or None, taper=cfg.taper or None)
    fac.save(path)
    return fac


def load_graph(path: str) -> AttributionGraph:
    """An attribution file (CSV ``item,user`` / JSON lines ``{"item", "users"}``) or arXiv metadata JSON lines
    (items = paper ids, users = normalised authors)."""
    p = Path(path)
    if p.suffix == ".jsonl":
        with open(p, encoding="utf-8") as f:
            first = next((line for line in f if line.strip()), "")
        try:
            is_arxiv = "item" not in json.loads(first)
        except (json.JSONDecodeError, TypeError):
            is_arxiv = False
        if is_arxiv:
            from corrflow.data.arxiv import ArxivReader, arxiv_attribution

            return arxiv_attribution(ArxivReader(p))
    return load_attribution(p)


def build_planner(cfg: StrategyConfig, identities: list[str]) -> tuple[CohortPlanner, dict[str, str] | None, dict]:
    """Items (SuperNode identities, or cross-silo example ids from the manifest), the users behind them, user-level
    contribution bounding (k_u), and the cohort planner. Returns (planner, item → silo identity, bounding info)."""
    item_home = None
    if cfg.mode == "cross-silo":
        from corrflow.data.partition import load_manifest

        manifest = load_manifest(cfg.manifest_path)
        item_home = {str(item): f"partition-{part['partition_id']}" for part in manifest["partitions"]
                     for item in part.get("items", part.get("users", []))}
        missing = sorted({h for h in item_home.values()} - set(identities))
        require(not missing, "manifest-path", "a silo (partition) online for every manifest partition", missing[:5])
        items = sorted(item_home)
    else:
        items = sorted(identities)
    if cfg.attribution_path:
        graph = load_graph(cfg.attribution_path)
        index = {item: i for i, item in enumerate(graph.item_ids)}
        unknown = [i for i in items if i not in index]
        require(not unknown, "attribution-path", "every item (node identity or example id) in the graph",
                unknown[:5])
        graph = AttributionGraph(items, graph.user_ids, [graph.item_users[index[i]] for i in items])
    else:
        graph = AttributionGraph(items, items, [[i] for i in range(len(items))])
    info = {"items": graph.num_items, "users": graph.num_users}
    if cfg.max_items_per_user:
        bound = bound_contributions(graph, cfg.max_items_per_user, seed=cfg.schedule_seed)
        info.update(bound.to_dict(), max_items_per_user=cfg.max_items_per_user)
        kept = [graph.item_ids[i] for i in bound.kept]
        graph = AttributionGraph(kept, graph.user_ids, [graph.item_users[i] for i in bound.kept])
    planner = CohortPlanner(cfg.participation, graph.item_ids, graph.item_users, graph.user_ids, cfg.num_rounds,
                            cfg.b, rate=cfg.participation_rate, seed=cfg.schedule_seed)
    return planner, item_home, info


def plan_privacy(cfg: StrategyConfig, fac: Factorization, planner: CohortPlanner) -> tuple[float, float | None, dict]:
    """σ and planned ε. Unamplified: one Gaussian with sensitivity k_u (a user's ≤ k_u items each follow the
    factorization's pattern, so their sum has sensitivity ≤ k_u by the triangle inequality). Monte Carlo: the
    planner's own sampler — warm b-min-sep (004 Alg. 2) or multi-attribution with k_u (Alg. 3, Thm 6.1) — at its
    Poisson probability p, verified at δ/2."""
    k_u = planner.items_per_user
    if cfg.non_private:
        log.warning("non-private baseline: no noise is added and there is no privacy guarantee")
        return 0.0, None, {"name": "none", "sampling": "none", "slack": 0.0}
    target = {"noise_multiplier": cfg.noise_multiplier} if cfg.noise_multiplier > 0 else \
        {"target_epsilon": cfg.target_epsilon}
    if cfg.accountant == "monte-carlo":
        require(k_u == 1 or planner.kind == "multi-attribution", "accountant",
                "participation multi-attribution when a user holds several items (k_u > 1)", k_u)
        spec = SamplingSpec(planner.kind, planner.summary().items, planner.expected, items_per_user=k_u,
                            sampling_probability=planner.p)
        res = account(fac, delta=cfg.delta, sampling=spec, mc_samples=cfg.mc_samples, seed=cfg.schedule_seed,
                      **target)
        return res["noise_multiplier"], res["epsilon"], res["accountant"]
    if "noise_multiplier" in target:
        res = account(fac, delta=cfg.delta, noise_multiplier=cfg.noise_multiplier / k_u)
        sigma = cfg.noise_multiplier
    else:
        res = account(fac, delta=cfg.delta, target_epsilon=cfg.target_epsilon)
        sigma = res["noise_multiplier"] * k_u
    acc = {**res["accountant"], "sampling": f"none ({planner.kind}, unamplified)", "items_per_user": k_u,
           "normalisation": f"sensitivity {k_u} = k_u × 1 under the planned participation"}
    return sigma, res["epsilon"], acc


def run_server(grid: Grid, cfg: StrategyConfig, out_dir: str | Path, *, noise_key: bytes | None = None,
               quiet: bool = False, on_round_end=None) -> CorrelatedNoiseStrategy:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    nodes = wait_for_nodes(grid, cfg.num_users)
    directory = resolve_users(grid, nodes, by_partition=cfg.mode == "cross-silo")
    planner, item_home, bounding = build_planner(cfg, sorted(directory.values()))
    if bounding.get("dropped"):
        log.warning("contribution bounding (k_u = %d) dropped %d of %d items", cfg.max_items_per_user,
                    bounding["dropped"], bounding["items"])
    fac = load_or_build_factorization(cfg, out)
    sigma, planned, accountant = plan_privacy(cfg, fac, planner)
    accountant = {**accountant, "contribution_bounding": bounding}
    task = get_task(cfg.client, cfg.model_dim, cfg.data_path, cfg.vocab_path, cfg.seq_len, cfg.seed)
    check_learnable(fac, sigma, task.initial_weights(), planner.expected)
    initial = initial_entry(task.evaluate, task.initial_weights())

    def round_end(strategy, metrics):
        metrics.update(task.evaluate(strategy.params))
        if not quiet:
            print(round_line(metrics, cfg.num_rounds), file=sys.stderr, flush=True)
        write_metrics(out / "metrics.json", initial, strategy.metrics_history)
        if on_round_end is not None:
            on_round_end(strategy, metrics)

    strategy = CorrelatedNoiseStrategy(cfg, fac, task.initial_weights(), directory, noise_multiplier=sigma,
                                       planned_epsilon=planned, noise_key=noise_key, out_dir=out,
                                       on_round_end=round_end, planner=planner, item_home=item_home,
                                       planned_accounting=accountant)
    if strategy.remaining_rounds > 0:
        strategy.start(grid=grid, initial_arrays=strategy.initial_arrays(), num_rounds=strategy.remaining_rounds,
                       timeout=600)
    write_metrics(out / "metrics.json", initial, strategy.metrics_history)
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
