"""One training run, start to end, shared by corrflow's ServerApp, ``corrflow simulate`` and the Flower wrapper:
lock the run's directory, check it against the release journal, resolve stable user ids, plan (factorization,
cohort planner, σ), then run :class:`~corrflow.strategies.correlated.CorrelatedNoiseStrategy` and write the report
and metrics whatever happens."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from corrflow.errors import IntegrityError
from corrflow.fileio import write_json, write_text
from corrflow.planning import build_planner, load_or_build_factorization, plan_privacy
from corrflow.planning.learnability import check_learnable, learning_section
from corrflow.strategies import identity as ids
from corrflow.strategies.config import StrategyConfig
from corrflow.strategies.correlated import CorrelatedNoiseStrategy
from corrflow.strategies.model import ModelLayout
from corrflow.strategies.run_state import RunLock, archive_run, check_resume

log = logging.getLogger("corrflow")


@dataclass
class RunHooks:
    """What the caller brings: the model, its evaluation, and (for the wrapper) the user's own strategy."""
    initial: ArrayRecord | list[np.ndarray]
    evaluate: Callable[[list[np.ndarray]], dict] | None = None      # server-side, on the trainable float32 arrays
    inner: Strategy | None = None
    train_config: ConfigRecord | None = None
    evaluate_config: ConfigRecord | None = None
    evaluate_fn: Callable[[int, ArrayRecord], Any] | None = None     # Flower's centralized evaluation
    on_round_end: Callable | None = None


def run_strategy(grid: Grid, cfg: StrategyConfig, out_dir: str | Path, hooks: RunHooks, *,
                 noise_key: bytes | None = None, fresh: bool = False,
                 stop_event: threading.Event | None = None) -> tuple[CorrelatedNoiseStrategy, Result]:
    """Run (or resume) the whole training under an exclusive lock on ``out_dir``. ``fresh`` moves an earlier run
    aside first; ``stop_event`` (set by a signal handler) ends the run cleanly after the round in progress."""
    out = Path(out_dir).resolve()
    with RunLock(out):
        if not (out / ".gitignore").exists():   # keys, ledger and cohorts: never committed by a `git add -A`
            write_text(out / ".gitignore", "# corrflow run directory: private state, never commit it\n*\n")
        if fresh:
            archive_run(out, cfg.state_dir)
        resume = check_resume(out, cfg.state_dir)
        source = cfg.identity or ids.default_identity(grid)
        if source == "per-launch" and resume.checkpoint is not None:
            raise IntegrityError(f"{resume.checkpoint}: identity = per-launch runs cannot resume (every launch gives "
                                 "the nodes new identities, so the ledger could not follow them); start a new run "
                                 "with --fresh")
        log.info("corrflow: run directory %s (state %s), identity %s", out, Path(cfg.state_dir).resolve(), source)
        nodes = ids.wait_for_nodes(grid, cfg.num_users, cfg.node_timeout)
        directory = ids.resolve(grid, nodes, source)
        planner, item_home, bounding = build_planner(cfg, sorted(directory.values()))
        if bounding.get("dropped"):
            log.warning("contribution bounding (k_u = %d) dropped %d of %d items", cfg.max_items_per_user,
                        bounding["dropped"], bounding["items"])
        fac = load_or_build_factorization(cfg, out)
        plan = plan_privacy(cfg, fac, planner)
        plan = replace(plan, accountant={**plan.accountant, "contribution_bounding": bounding})
        if plan.amplified:
            log.info("corrflow: amplified ε assumes the cohorts stay secret: they are drawn from a private key "
                     "(not schedule-seed), kept 0600 in %s, and the ledger there names who trained; keep it private",
                     Path(cfg.state_dir).resolve())
        layout = ModelLayout.of(hooks.initial)
        rho = check_learnable(fac, plan.noise_multiplier, layout.trainable_arrays(hooks.initial), planner.expected)
        # metrics.json: the initial model as round −1, then one entry per round.
        initial = {"round": -1, **(hooks.evaluate(layout.trainable_arrays(hooks.initial)) if hooks.evaluate else {})}

        def write_metrics(strategy) -> None:
            write_json(out / "metrics.json", [initial, *strategy.metrics_history], indent=1)

        def round_end(strategy, metrics):
            write_metrics(strategy)
            if hooks.on_round_end is not None:
                hooks.on_round_end(strategy, metrics)

        strategy = CorrelatedNoiseStrategy(
            cfg, fac, hooks.initial, directory, privacy=plan, noise_key=noise_key, out_dir=out,
            on_round_end=round_end, planner=planner, item_home=item_home, resume=resume, identity=source,
            evaluate=hooks.evaluate,
            resolve_nodes=partial(ids.resolve, grid, source=source, strict=False, timeout=min(60.0, cfg.node_timeout)),
            stop_event=stop_event, inner=hooks.inner,
            report_extra=lambda s: {"learning": learning_section([initial, *s.metrics_history], rho)})
        try:
            result = strategy.start(grid=grid, timeout=cfg.node_timeout, train_config=hooks.train_config,
                                    evaluate_config=hooks.evaluate_config, evaluate_fn=hooks.evaluate_fn)
        finally:
            strategy.write_report()
            write_metrics(strategy)
        learning = learning_section([initial, *strategy.metrics_history], rho)
        if learning["learned"] is False and strategy.stopped_reason is None:
            log.warning("corrflow: %s; the report's `learning` section has the numbers", learning["verdict"])
        return strategy, result
