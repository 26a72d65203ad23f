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
from dataclasses import dataclass
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
from corrflow.strategies.canaries import CanaryPlan, canary_arrays

log = logging.getLogger("corrflow")

#: How the in-process and Flower simulation engines name a simulated user (identity partition-id).
IDENTITY = "partition-id"
INTERRUPTED = "interrupted by the operator (SIGINT/SIGTERM)"
#: The clients the cohort engine trains: corrflow's own tasks.
COHORT_CLIENTS = ("numpy", "nextword")


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
            cfg.client not in COHORT_CLIENTS,
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
        (
            cfg.reply_kind != "weights",
            "--replies",
            "weights (the cohort engine replies with the new weights, as corrflow's ClientApps do)",
        ),
    )
    for refused, flag, expected in refusals:
        if refused:
            value = getattr(cfg, flag.lstrip("-").replace("-", "_"), None)
            raise InvalidArgumentError(flag, expected, value)


@dataclass(frozen=True)
class Canaries:
    """An audit's inserted canaries (`corrflow.server.audit`) on the cohort engine: each answers
    every round it is asked with `corrflow.strategies.canaries.canary_arrays`, as its ClientApp
    does on the per-client path.

    Attributes:
        plan: the audit's canaries.
        nodes: partition index → candidate index, one per inserted canary.
        clip_norm: ζ.
    """

    plan: CanaryPlan
    nodes: dict[int, int]
    clip_norm: float


class RunView:
    """A cohort run as a Flower strategy shows it to ``on_round_end`` callbacks and the audit's
    analysis (`corrflow.strategies.canaries.RoundCapture`, ``analyse``): the run, its cohort
    planner and the current model."""

    def __init__(self, run: Run):
        self.run = run

    planner = property(lambda self: self.run.plan.planner)
    params = property(lambda self: self.run.state.params)


class CohortTrainer:
    """Trains a routed round's clients at once and answers with their `Reply` values.

    Args:
        cfg: the run's settings.
        task: corrflow's task for them (`corrflow.clients.tasks.task_for`).
        names: the model's array names, in order (the run's layout).
        canaries: an audit's canaries among the partitions (they answer, they do not train).
        dtype: the next-word model's arithmetic (float32; float64 for the proxy run's
            finite-difference probes).
    """

    def __init__(
        self,
        cfg: RunConfig,
        task: Task,
        names: tuple[str, ...],
        canaries: Canaries | None = None,
        dtype: type = np.float32,
    ):
        self.cfg, self.names, self.canaries, self.dtype = cfg, names, canaries, dtype
        if cfg.client == "nextword":
            self.data = nextword_data(task.user_data, task.users_data)
        else:
            self.data = regression_data(task.user_data)

    def train(self, sent: list[np.ndarray], users: list[int], round_index: int) -> CohortResult:
        """Local training of ``users`` (partition indices) from the model ``sent`` in round
        ``round_index`` (0-based), each with the per-client path's data order."""
        cfg, data = self.cfg, self.data.many(users)
        if cfg.client == "nextword":
            shuffles = [(cfg.seed, u, round_index + 1) for u in users]
            return train_nextword(
                sent, data, shuffles, cfg.local_lr, cfg.local_steps, dtype=self.dtype
            )
        return train_regression(sent, data, cfg.local_lr, cfg.local_steps)

    def replies(self, sent: list[np.ndarray], plan: RoundPlan) -> list[Reply]:
        """The cohort's replies to the routed ``plan``, in node order: per node, the new weights
        (the model sent plus the update, float32, as the ClientApps reply) and the reply's metrics;
        a canary's answer for a canary node."""
        nodes = sorted(plan.expected)
        canary = self.canaries.nodes if self.canaries else {}
        users = [n for n in nodes if n not in canary]
        answers: dict[int, tuple[list[np.ndarray], dict]] = {}
        if users:
            result = self.train(sent, users, plan.round)
            answers.update(
                zip(users, zip(result.new_weights(sent), result.metrics, strict=True), strict=True)
            )
        for node in nodes:
            if node in canary:
                c = self.canaries
                arrays = canary_arrays(list(sent), c.plan, canary[node], c.clip_norm)
                answers[node] = (arrays, {"num-examples": 1})
        return [Reply(node, plan.owners[node], self.names, *answers[node]) for node in nodes]


def run_cohort(
    cfg: RunConfig,
    *,
    noise_key: bytes | None = None,
    fresh: bool = False,
    stop_event: threading.Event | None = None,
    on_round_end: Callable[[dict], None] | None = None,
    on_start: Callable[[Run], None] | None = None,
    canaries: Canaries | None = None,
) -> Run:
    """Run (or resume) ``cfg`` in its run directory on the cohort engine, under the directory's
    lock; the report and metrics are written whatever happens.

    Args:
        cfg: the run's settings (``state_dir`` absolute, ``num_users`` set).
        noise_key: tests only: this start's noise key.
        fresh: move an earlier run aside first.
        stop_event: set by a signal handler: the run stops after the round in progress.
        on_round_end: called with each round's published metrics.
        on_start: called with the run once it has started, before its first round (the audit
            reads each released model from it).
        canaries: an audit's canaries among the partitions.

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
        if on_start is not None:
            on_start(run)
        trainer = CohortTrainer(cfg, task, plan.layout.keys, canaries)
        try:
            _rounds(run, trainer, len(users), stop)
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
