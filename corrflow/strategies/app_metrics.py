"""The wrapped app's own metrics, shown as Flower shows them, as far as privacy allows.

* The inner strategy's aggregated train metrics and its federated evaluation are statistics of the
  cohort's data, outside the DP release (as with Flower's own DP wrappers). They are logged as
  Flower's ``Strategy.start`` logs them (``└──> Aggregated MetricRecord: …``) — on the public
  console (Flower's logger) when the run's schedule is public (unamplified), and only on the
  operator log when the cohorts are secret (amplified ε) — and the privacy report lists their names
  under ``outside_guarantee``. Flower's ``Result`` holds them either way (it stays in the
  operator's process).
* ``evaluate_fn`` runs on server-held data and on the released model (post-processing of the DP
  release): shown as Flower shows it in every run, and its loss is corrflow's held-out loss, so it
  feeds the report's ``learning`` verdict (`ServerEvaluation`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
from flwr.app import ArrayRecord, MetricRecord
from flwr.common import log as flwr_log

from corrflow.run import Run

log = logging.getLogger("corrflow")
INFO = logging.INFO


class AppMetrics:
    """Where one run shows its app's metrics (module docstring).

    Args:
        run: the run; its disclosure decides console or operator log, and the names shown are
            listed under its report's ``outside_guarantee`` (`Run.show_outside_guarantee`).
    """

    def __init__(self, run: Run):
        self.run = run

    def round_header(self, server_round: int, num_rounds: int) -> None:
        """Flower's ``[ROUND r/N]`` line (no data in it)."""
        flwr_log(INFO, "")
        flwr_log(INFO, "[ROUND %s/%s]", server_round, num_rounds)

    def aggregated(self, kind: str, server_round: int, record: MetricRecord | None) -> None:
        """The inner strategy's aggregated ``kind`` ("train" or "evaluate") metrics of a round; for
        a train round without any (no reply accepted, or none aggregated), a line that says so."""
        if record is None:
            if kind == "train":
                why = (
                    "\t└──> no Aggregated MetricRecord in round %d: no reply accepted, or the "
                    "strategy aggregated no train metrics (corrflow's counters: metrics.json)"
                )
                if self.run.disclosure.secret:
                    self.run.log.info(why.replace("\t", "train: "), server_round)
                else:
                    flwr_log(INFO, why, server_round)
            return
        self.run.show_outside_guarantee(f"{kind}.{k}" for k in record)
        if self.run.disclosure.secret:
            self.run.log.info(
                "round %d %s: └──> Aggregated MetricRecord: %s", server_round, kind, record
            )
        else:
            flwr_log(INFO, "\t└──> Aggregated MetricRecord: %s", record)

    @staticmethod
    def initial_evaluation(record: MetricRecord | None) -> None:
        flwr_log(INFO, "Initial global evaluation results: %s", record)

    @staticmethod
    def global_evaluation(record: MetricRecord | None) -> None:
        flwr_log(INFO, "Global evaluation")
        flwr_log(INFO, "\t└──> MetricRecord: %s", record)


class ServerEvaluation:
    """A Flower ``evaluate_fn(server_round, arrays)`` as corrflow's server-side evaluation: called
    once per model (the starting model as round 0, each released model as its round, inside the
    round so that its loss is checkpointed with it); ``results`` keeps each round's
    ``MetricRecord`` for Flower's ``Result`` and log.

    The held-out loss is the metric named ``loss``, else the one metric whose name ends in
    ``loss``; the accuracy likewise (``accuracy``/``acc``).

    Args:
        fn: the user's ``evaluate_fn``.
        record: turns corrflow's trainable float32 arrays into the app's ``ArrayRecord``.
    """

    def __init__(
        self,
        fn: Callable[[int, ArrayRecord], MetricRecord | None],
        record: Callable[[list[np.ndarray]], ArrayRecord],
    ):
        self.fn, self.record = fn, record
        self.round = 0  # the Flower round of the next model evaluated (run_rounds sets it)
        self.results: dict[int, MetricRecord | None] = {}
        self._said = False

    def __call__(self, params: list[np.ndarray]) -> dict:
        res = self.fn(self.round, self.record(params))
        self.results[self.round] = res
        return self.held_out(res)

    def held_out(self, res: MetricRecord | None) -> dict:
        """corrflow's held-out metrics (``test_loss``, ``test_accuracy``) from an evaluate_fn
        result."""
        if res is None:
            return {}
        out = {}
        for name, ends in (("test_loss", ("loss",)), ("test_accuracy", ("accuracy", "acc"))):
            key = _pick(res, ends)
            if (
                key is not None
                and isinstance(res[key], int | float)
                and not isinstance(res[key], bool)
            ):
                out[name] = float(res[key])
        if "test_loss" not in out and not self._said:
            self._said = True
            log.warning(
                "corrflow: evaluate_fn returned no loss (metrics %s): the report's learning "
                "verdict needs one named 'loss' or ending in 'loss'",
                sorted(res),
            )
        return out


def _pick(res: MetricRecord, ends: tuple[str, ...]) -> str | None:
    keys = list(res)
    for end in ends:
        if end in keys:
            return end
    matches = [k for k in keys if k.lower().endswith(ends)]
    return matches[0] if len(matches) == 1 else None
