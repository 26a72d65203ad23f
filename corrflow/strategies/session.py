"""One training run, start to end, shared by corrflow's ServerApp, ``corrflow simulate`` and the
Flower wrapper: lock the run's directory, check it against the release journal, resolve stable user
ids, plan (factorization, cohort planner, σ), then run
`CorrelatedNoiseStrategy`; the report and metrics are written
whatever happens.

The caller describes the run with one `RunSpec`; `prepare_run` finds the population and
its identities on the grid, has `corrflow.run.prepare` decide the run's
`RunPlan`, starts the `Run` and wraps it in the
strategy."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from corrflow.config import RunConfig
from corrflow.errors import IntegrityError
from corrflow.run import Run, RunLock, open_run_directory, prepare
from corrflow.run.resume import ResumePoint
from corrflow.strategies import identity as ids
from corrflow.strategies.app_metrics import ServerEvaluation
from corrflow.strategies.correlated import CorrelatedNoiseStrategy
from corrflow.strategies.messaging import NodeDirectory, model_arrays, model_record
from corrflow.strategies.wire import RecordingGrid, WireRecord

log = logging.getLogger("corrflow")

#: Seconds without a new SuperNode after which the population counts as complete (nodes register one
# by one).
SETTLE_SECONDS = 3.0


@dataclass
class RunSpec:
    """Everything a run needs from its caller: the settings (``cfg.state_dir`` absolute: the run
    directory), the initial model, corrflow's server-side evaluation, the user's strategy (the
    wrapper) with its configs and centralized evaluation, a callback after each round, the fewest
    nodes to wait for when ``num_users`` is unset, and for tests a fixed noise key."""

    cfg: RunConfig
    initial: ArrayRecord | list[np.ndarray]
    # server-side, on the trainable float32 arrays
    evaluate: Callable[[list[np.ndarray]], dict] | None = None
    inner: Strategy | None = None
    train_config: ConfigRecord | None = None
    evaluate_config: ConfigRecord | None = None
    evaluate_fn: Callable[[int, ArrayRecord], Any] | None = None  # Flower's centralized evaluation
    on_round_end: Callable[[CorrelatedNoiseStrategy, dict], None] | None = None
    min_nodes: int = 1
    # refuses a population the caller cannot serve
    population_check: Callable[[int], None] | None = None
    fresh: bool = False
    noise_key: bytes | None = None  # tests only: this start's key segment (never the CLI)
    stop_event: threading.Event | None = None

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.state_dir)


def run_strategy(grid: Grid, spec: RunSpec) -> tuple[CorrelatedNoiseStrategy, Result]:
    """Run (or resume) the whole training under an exclusive lock on the run directory.
    ``spec.fresh`` moves an earlier run aside first; ``spec.stop_event`` (set by a signal handler)
    ends the run after the round in progress."""
    with RunLock(spec.run_dir):
        if spec.cfg.secure_aggregation:  # the report says what the server saw from this record
            grid = RecordingGrid(grid, WireRecord())
        strategy = prepare_run(grid, spec)
        try:
            result = strategy.start(
                grid=grid,
                timeout=spec.cfg.node_timeout,
                train_config=spec.train_config,
                evaluate_config=spec.evaluate_config,
                evaluate_fn=spec.evaluate_fn,
            )
        finally:
            strategy.run.write_report()
            strategy.run.write_metrics()
        learning = strategy.run.learning()
        if learning["learned"] is False and strategy.stopped_reason is None:
            log.warning(
                "corrflow: %s; the report's `learning` section has the numbers", learning["verdict"]
            )
        return strategy, result


def prepare_run(grid: Grid, spec: RunSpec) -> CorrelatedNoiseStrategy:
    """Everything before round 1 (the caller holds the run directory's lock): resume point,
    identities, population, then the run's plan and the run itself (`corrflow.run`), fresh or
    restored, inside the strategy."""
    resume = open_run_directory(spec.run_dir, spec.fresh)
    received = None
    if isinstance(grid, RecordingGrid):  # after an earlier run was moved aside, if it was
        received = grid.record
        received.attach(spec.run_dir)
    source = spec.cfg.identity or ids.default_identity(grid)
    if source == "per-launch" and resume.checkpoint is not None:
        raise IntegrityError(
            f"{resume.checkpoint.path}: identity = per-launch runs cannot resume (every launch "
            "gives the nodes new identities, so the ledger could not follow them); start a new run "
            "with --fresh"
        )
    cfg = spec.cfg.replace(num_users=population(grid, spec, resume))
    if spec.population_check is not None:
        spec.population_check(cfg.num_users)
    log.info("corrflow: run directory %s, identity %s", spec.run_dir, source)
    nodes = ids.wait_for_nodes(grid, cfg.num_users, cfg.node_timeout, spec.stop_event)
    directory = ids.resolve(grid, nodes, source, timeout=cfg.node_timeout, stop=spec.stop_event)
    arrays, names = model_arrays(spec.initial)
    plan = prepare(cfg, list(directory.values()), arrays, names, source)
    # A Flower app's evaluate_fn is the run's server-side evaluation: its loss is checkpointed with
    # each round and feeds the learning verdict (corrflow.strategies.app_metrics).
    server = None
    if spec.evaluate is None and spec.evaluate_fn is not None:
        server = ServerEvaluation(spec.evaluate_fn, partial(model_record, plan.layout))
    strategies: list[CorrelatedNoiseStrategy] = []  # the callback receives the strategy built below
    on_end = None if spec.on_round_end is None else (lambda m: spec.on_round_end(strategies[0], m))
    run = Run.start(
        plan,
        arrays,
        resume,
        noise_key=spec.noise_key,
        evaluate=spec.evaluate or server,
        on_round_end=on_end,
        received=received,
    )
    if hasattr(spec.evaluate, "bind"):  # evaluation every N rounds reads the round from the run
        spec.evaluate.bind(run)
    resolver = partial(
        ids.resolve, grid, source=source, strict=False, timeout=min(60.0, cfg.node_timeout)
    )
    strategies.append(
        CorrelatedNoiseStrategy(
            run,
            NodeDirectory(directory, resolver, run.report_salt),
            spec.inner,
            spec.stop_event,
            server,
        )
    )
    stop = strategies[0].stop_event

    def head_lost() -> None:  # a lost Ray head stops the run (noise_shards), named: no interrupt
        stop.reason = run.noise.lost
        stop.set()

    run.noise.watch(head_lost)
    return strategies[0]


def population(grid: Grid, spec: RunSpec, resume: ResumePoint) -> int:
    """``num_users``; else the resumed run's; else the nodes connected once ``spec.min_nodes`` are
    and no more arrived for `SETTLE_SECONDS`."""
    if spec.cfg.num_users is not None:
        return spec.cfg.num_users
    if resume.checkpoint is not None:
        return int(resume.checkpoint.public["settings"]["num_users"])
    count = len(ids.wait_for_nodes(grid, spec.min_nodes, spec.cfg.node_timeout))
    stable_since = time.monotonic()
    while time.monotonic() - stable_since < SETTLE_SECONDS:
        time.sleep(0.2)
        if (now := len(list(grid.get_node_ids()))) != count:
            count, stable_since = now, time.monotonic()
    log.info("corrflow: the population is the %d SuperNodes connected", count)
    return count
