"""One training run, start to end, shared by corrflow's ServerApp, ``corrflow simulate`` and the
Flower wrapper: lock the run's directory, check it against the release journal, resolve stable user
ids, plan (factorization, cohort planner, σ), then run
:class:`~corrflow.strategies.correlated.CorrelatedNoiseStrategy`; the report and metrics are written
whatever happens.

The caller describes the run with one :class:`RunSpec`; :func:`prepare_run` turns it into a
:class:`PreparedRun` (the round core's context, the recorder, the node directory), which the
strategy drives."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from corrflow.accounting.policy import RunAccounting
from corrflow.config import RunConfig
from corrflow.errors import IntegrityError
from corrflow.fileio import write_text
from corrflow.noise import CorrelatedNoise, restore_state
from corrflow.noise.engine import RING_FILE
from corrflow.noise.prng import new_secret
from corrflow.planning import build_planner, load_or_build_factorization, plan_privacy
from corrflow.planning.learnability import check_learnable
from corrflow.planning.run import mechanism_notes
from corrflow.strategies import identity as ids
from corrflow.strategies.app_metrics import ServerEvaluation
from corrflow.strategies.correlated import CorrelatedNoiseStrategy
from corrflow.strategies.disclosure import Disclosure, operator_log
from corrflow.strategies.messaging import NodeDirectory
from corrflow.strategies.model import ModelLayout, arrays_sha256
from corrflow.strategies.recorder import Recorder, RecordingContext
from corrflow.strategies.registry import ReleaseRegistry
from corrflow.strategies.round_core import RoundContext
from corrflow.strategies.run_state import RUN_FILES, ResumePoint, RunLock, archive_run, check_resume
from corrflow.strategies.server_optimizer import MomentumServerOptimizer, check_workload_matches

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
    evaluate: Callable[[list[np.ndarray]], dict] | None = (
        None  # server-side, on the trainable float32 arrays
    )
    inner: Strategy | None = None
    train_config: ConfigRecord | None = None
    evaluate_config: ConfigRecord | None = None
    evaluate_fn: Callable[[int, ArrayRecord], Any] | None = None  # Flower's centralized evaluation
    on_round_end: Callable[[CorrelatedNoiseStrategy, dict], None] | None = None
    min_nodes: int = 1
    population_check: Callable[[int], None] | None = (
        None  # refuses a population the caller cannot serve
    )
    fresh: bool = False
    noise_key: bytes | None = None  # tests only: this start's key segment (never the CLI)
    stop_event: threading.Event | None = None

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.state_dir)


@dataclass(frozen=True)
class PreparedRun:
    """A run ready to train: what each round reads, the recorder that owns its state, who is behind
    each node, the identity source, the user's strategy and evaluation, the event that stops it, and
    where reply-level events are logged."""

    round: RoundContext
    recorder: Recorder
    directory: NodeDirectory
    identity: str
    inner: Strategy | None
    evaluate: Callable[[list[np.ndarray]], dict] | None
    stop_event: threading.Event
    reply_log: logging.Logger  # reply-level events (operator-only in amplified runs)


def run_strategy(grid: Grid, spec: RunSpec) -> tuple[CorrelatedNoiseStrategy, Result]:
    """Run (or resume) the whole training under an exclusive lock on the run directory.
    ``spec.fresh`` moves an earlier run aside first; ``spec.stop_event`` (set by a signal handler)
    ends the run after the round in progress."""
    with RunLock(spec.run_dir):
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
            strategy.run.recorder.write_report()
            strategy.run.recorder.write_metrics()
        learning = strategy.run.recorder.learning()
        if learning["learned"] is False and strategy.stopped_reason is None:
            log.warning(
                "corrflow: %s; the report's `learning` section has the numbers", learning["verdict"]
            )
        return strategy, result


def prepare_run(grid: Grid, spec: RunSpec) -> CorrelatedNoiseStrategy:
    """Everything before round 1 (the caller holds the run directory's lock): resume point,
    identities, population, planner, factorization, σ, the learnability check, and the strategy over
    a fresh or restored state."""
    resume = _resume_point(spec)
    source = spec.cfg.identity or ids.default_identity(grid)
    if source == "per-launch" and resume.checkpoint is not None:
        raise IntegrityError(
            f"{resume.checkpoint}: identity = per-launch runs cannot resume (every launch gives "
            "the "
            "nodes new identities, so the ledger could not follow them); start a new run with "
            "--fresh"
        )
    cfg = spec.cfg.replace(num_users=population(grid, spec, resume))
    if spec.population_check is not None:
        spec.population_check(cfg.num_users)
    log.info("corrflow: run directory %s, identity %s", spec.run_dir, source)
    nodes = ids.wait_for_nodes(grid, cfg.num_users, cfg.node_timeout)
    directory = ids.resolve(grid, nodes, source, timeout=cfg.node_timeout)
    planner, item_home, bounding = build_planner(cfg, sorted(directory.values()))
    if bounding.get("dropped"):
        log.warning(
            "contribution bounding (k_u = %d) dropped %d of %d items",
            cfg.max_items_per_user,
            bounding["dropped"],
            bounding["items"],
        )
    fac = load_or_build_factorization(cfg, spec.run_dir)
    check_workload_matches(fac.workload, cfg.momentum, cfg.cooldown_fraction)
    notes = mechanism_notes(cfg, fac)
    for note in notes:
        log.warning("corrflow: %s", note)
    plan = plan_privacy(cfg, fac, planner)
    plan = replace(plan, accountant={**plan.accountant, "contribution_bounding": bounding})
    if plan.amplified:
        log.info(
            "corrflow: amplified ε assumes the cohorts stay secret: they are drawn from a private "
            "key (not "
            "schedule-seed), kept 0600 in %s, and the ledger there names who trained; keep it "
            "private",
            spec.run_dir / "state",
        )
    layout = ModelLayout.of(spec.initial)
    params = layout.trainable_arrays(spec.initial)
    noise = _noise(fac, layout, resume, spec.noise_key)
    # A Flower app's evaluate_fn is the run's server-side evaluation: its loss is checkpointed with
    # each round and feeds the learning verdict (corrflow.strategies.app_metrics).
    evaluate = spec.evaluate
    if evaluate is None and spec.evaluate_fn is not None:
        evaluate = ServerEvaluation(spec.evaluate_fn, layout.record)
    accounting = RunAccounting.of(
        fac, plan, cfg.delta if plan.delta is None else plan.delta, plan.target_epsilon
    )  # the training's share of the budget
    ctx = RoundContext(
        cfg,
        layout,
        planner,
        accounting,
        MomentumServerOptimizer(fac.workload, cfg.num_rounds, cfg.server_lr),
        noise,
        float(plan.noise_multiplier),
        item_home,
    )
    strategies: list[CorrelatedNoiseStrategy] = []  # the callback receives the strategy built below
    on_end = None if spec.on_round_end is None else (lambda m: spec.on_round_end(strategies[0], m))
    disclosure = Disclosure(plan.amplified, spec.run_dir)
    recording = RecordingContext(
        cfg,
        fac,
        accounting,
        planner,
        source,
        spec.run_dir,
        noise,
        {"round": -1, **(evaluate(params) if evaluate else {})},
        check_learnable(fac, plan.noise_multiplier, params, planner.expected),
        disclosure,
        ReleaseRegistry(cfg.release_registry or None),
        tuple(notes),
        on_end,
    )
    recorder = Recorder.start(recording, params, arrays_sha256(spec.initial), resume)
    if recorder.keys.sampler_key is not None:
        planner.seed_privately(recorder.keys.sampler_key)
    resolver = partial(
        ids.resolve, grid, source=source, strict=False, timeout=min(60.0, cfg.node_timeout)
    )
    run = PreparedRun(
        ctx,
        recorder,
        NodeDirectory(directory, resolver, recorder.keys.salt),
        source,
        spec.inner,
        evaluate,
        spec.stop_event or threading.Event(),
        operator_log(disclosure),
    )
    strategies.append(CorrelatedNoiseStrategy(run))
    return strategies[0]


def _resume_point(spec: RunSpec) -> ResumePoint:
    """The run directory made private to git, an earlier run archived when asked or when it left
    files behind without a checkpoint, and what the directory resumes from."""
    run_dir = spec.run_dir
    if not (
        run_dir / ".gitignore"
    ).exists():  # keys, ledger and cohorts: never committed by a `git add -A`
        write_text(
            run_dir / ".gitignore", "# corrflow run directory: private state, never commit it\n*\n"
        )
    if spec.fresh:
        archive_run(run_dir)
    resume = check_resume(run_dir)
    if resume.checkpoint is None and any((run_dir / name).exists() for name in RUN_FILES):
        archive_run(
            run_dir, reason="a new run"
        )  # a report of an earlier run is archived, never overwritten
    return resume


def _noise(fac, layout: ModelLayout, resume: ResumePoint, key: bytes | None) -> CorrelatedNoise:
    """A new run's noise, or the checkpoint's with a new key segment: every process start draws
    the rows from the checkpoint's next round on with a fresh key from the OS (``key`` only in
    tests), so a run resumed from a rolled-back copy never repeats a released round's noise. A
    test key the run already used is never reused: that start draws from the OS."""
    if resume.checkpoint is not None:
        noise = restore_state(
            resume.checkpoint / "noise", fac, ring=resume.checkpoint.parent / RING_FILE
        )
        used = {s.key for s in noise.segments.segments}
        noise.begin_segment(key if key not in used else None)
        return noise
    return CorrelatedNoise(fac, layout.trainable_shapes, 1.0, key=key or new_secret())


def population(grid: Grid, spec: RunSpec, resume: ResumePoint) -> int:
    """``num_users``; else the resumed run's; else the nodes connected once ``spec.min_nodes`` are
    and no more arrived for :data:`SETTLE_SECONDS`."""
    if spec.cfg.num_users is not None:
        return spec.cfg.num_users
    if resume.checkpoint is not None:
        return int(
            json.loads((resume.checkpoint / "state.json").read_text())["settings"]["num_users"]
        )
    count = len(ids.wait_for_nodes(grid, spec.min_nodes, spec.cfg.node_timeout))
    stable_since = time.monotonic()
    while time.monotonic() - stable_since < SETTLE_SECONDS:
        time.sleep(0.2)
        if (now := len(list(grid.get_node_ids()))) != count:
            count, stable_since = now, time.monotonic()
    log.info("corrflow: the population is the %d SuperNodes connected", count)
    return count
