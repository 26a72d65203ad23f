"""The cohort engine (``corrflow simulate --backend cohort``): the same run as the in-process grid —
the same population ids (``partition-0`` … as simulation's identity probe reports them), the same
cohorts, clipping, noise, server optimizer, checkpoints, journal and report — but a round's clients
are trained together in this process (`corrflow.clients.cohort`) instead of one Flower message
each. Their updates reach `corrflow.run.Run.step` as the `corrflow.run.Reply` values the
per-client path produces, so the server's round is unchanged.

It serves corrflow's own numpy and nextword tasks, cross-device; everything else is refused with
a reason (`check_supported`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from corrflow.clients.cohort import (
    CohortResult,
    nextword_data,
    regression_data,
    train_nextword,
    train_regression,
)
from corrflow.clients.tasks import Task, task_for
from corrflow.config import RunConfig
from corrflow.errors import InvalidArgumentError
from corrflow.run import Reply, RoundPlan, Run, RunLock, open_run_directory, prepare
from corrflow.run.evaluation import ScheduledEvaluation

log = logging.getLogger("corrflow")

#: How the in-process and Flower simulation engines name a simulated user (identity partition-id).
IDENTITY = "partition-id"
INTERRUPTED = "interrupted by the operator (SIGINT/SIGTERM)"


def check_supported(cfg: RunConfig) -> None:
    """Refuse, naming the flag, what the cohort engine does not serve: it trains corrflow's numpy
    and nextword tasks itself, so there are no client messages to mask (secure aggregation), no
    Ray to shard the noise over, no Keras model and no user ClientApp (the wrapper); a cross-silo
    manifest routes several items to one silo, which it does not model.

    Raises:
        InvalidArgumentError: an unsupported setting, named as the CLI spells it.
    """
    refusals = (
        (cfg.secure_aggregation, "--secagg", "no --secagg (the cohort engine sends no messages)"),
        (
            cfg.noise_workers > 0,
            "--noise-workers",
            "0 (the cohort engine runs without Ray; the noise is drawn in process)",
        ),
        (
            cfg.client not in ("numpy", "nextword"),
            "--client",
            "numpy or nextword (the cohort engine trains corrflow's own tasks; Keras models and "
            "the wrapper's ClientApps run on --backend inprocess or flower)",
        ),
        (cfg.mode != "cross-device", "--mode", "cross-device (the cohort engine's only mode)"),
        (
            cfg.identity not in (None, IDENTITY),
            "--identity",
            f"{IDENTITY} (the simulated users' ids) or unset",
        ),
    )
    for refused, flag, expected in refusals:
        if refused:
            value = getattr(cfg, flag.lstrip("-").replace("-", "_"), None)
            raise InvalidArgumentError(flag, expected, value)


class CohortTrainer:
    """Trains a routed round's clients at once and answers with their `Reply` values.

    Args:
        cfg: the run's settings.
        task: corrflow's task for them (`corrflow.clients.tasks.task_for`).
        names: the model's array names, in order (the run's layout).
    """

    def __init__(self, cfg: RunConfig, task: Task, names: tuple[str, ...]):
        self.cfg, self.names = cfg, names
        if cfg.client == "nextword":
            self.data = nextword_data(task.user_data)
        else:
            self.data = regression_data(task.user_data)

    def train(self, sent: list[np.ndarray], users: list[int], round_index: int) -> CohortResult:
        """Local training of ``users`` (partition indices) from the model ``sent`` in round
        ``round_index`` (0-based), each with the per-client path's data order."""
        cfg, data = self.cfg, [self.data(u) for u in users]
        if cfg.client == "nextword":
            shuffles = [(cfg.seed, u, round_index + 1) for u in users]
            return train_nextword(sent, data, shuffles, cfg.local_lr, cfg.local_steps)
        return train_regression(sent, data, cfg.local_lr, cfg.local_steps)

    def replies(self, sent: list[np.ndarray], plan: RoundPlan) -> list[Reply]:
        """The cohort's replies to the routed ``plan``: per node, the new weights (the model sent
        plus the update, float32, as the ClientApps reply) and the reply's metrics."""
        nodes = sorted(plan.expected)
        if not nodes:
            return []
        result = self.train(sent, nodes, plan.round)
        return [
            Reply(node, plan.owners[node], self.names, new, metrics)
            for node, new, metrics in zip(
                nodes, result.new_weights(sent), result.metrics, strict=True
            )
        ]


def run_cohort(
    cfg: RunConfig,
    *,
    noise_key: bytes | None = None,
    fresh: bool = False,
    stop_event: threading.Event | None = None,
    on_round_end: Callable[[dict], None] | None = None,
) -> Run:
    """Run (or resume) ``cfg`` in its run directory on the cohort engine, under the directory's
    lock; the report and metrics are written whatever happens.

    Args:
        cfg: the run's settings (``state_dir`` absolute, ``num_users`` set).
        noise_key: tests only: this start's noise key.
        fresh: move an earlier run aside first.
        stop_event: set by a signal handler: the run stops after the round in progress.
        on_round_end: called with each round's published metrics.

    Returns:
        The run, complete or stopped.

    Raises:
        InvalidArgumentError: a setting the cohort engine does not serve (`check_supported`).
    """
    check_supported(cfg)
    stop = stop_event or threading.Event()
    task = task_for(cfg)
    users = [f"partition-{i}" for i in range(cfg.num_users)]
    with RunLock(Path(cfg.state_dir)):
        resume = open_run_directory(cfg.state_dir, fresh)
        initial = task.initial_weights()
        plan = prepare(cfg, users, initial, None, IDENTITY)
        if len(plan.layout.trainable) != len(plan.layout.keys):
            raise InvalidArgumentError("--client", "a task whose arrays all train", cfg.client)
        evaluate = ScheduledEvaluation(task.evaluate, cfg.eval_every, cfg.num_rounds)
        run = Run.start(
            plan, initial, resume, noise_key=noise_key, evaluate=evaluate, on_round_end=on_round_end
        )
        evaluate.bind(run)
        try:
            _rounds(run, CohortTrainer(cfg, task, plan.layout.keys), len(users), stop)
        finally:
            run.write_report()
            run.write_metrics()
        learning = run.learning()
        if learning["learned"] is False and not run.state.stopped_reason:
            log.warning(
                "corrflow: %s; the report's `learning` section has the numbers", learning["verdict"]
            )
        return run


def _rounds(run: Run, trainer: CohortTrainer, population: int, stop: threading.Event) -> None:
    """Rounds until the run is complete or stopped; an interrupt abandons nothing (rounds are
    trained and released whole) and stops the run on the record."""
    user_to_node = {f"partition-{i}": i for i in range(population)}
    online = frozenset(range(population))
    item_home = run.plan.item_home
    while not stop.is_set() and (plan := run.plan_next()) is not None:
        routed = plan.route(user_to_node, online, item_home)
        sent = run.plan.layout.full(run.state.params)
        if run.step(routed, trainer.replies(sent, routed)) is None:
            return
    cfg = run.plan.cfg
    if stop.is_set() and not run.state.stopped_reason and run.state.next_round < cfg.num_rounds:
        run.stop(
            f"{INTERRUPTED} before round {run.state.next_round + 1} of {cfg.num_rounds}; "
            "nothing of that round was released"
        )
