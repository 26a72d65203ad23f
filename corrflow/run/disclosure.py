"""What a run publishes, and what only its operator sees (the threat model's line between the two).

Public: the console, ``privacy_report.json`` and ``metrics.json`` (what a run directory is shared
for). Operator-only: the ``operator/`` directory of the run (0700; files 0600): ``operator.log``
(each reply rejected or zeroed, with its sender), ``rounds.jsonl`` (each round's accepted, clipped,
zeroed and rejected counts), ``participation.json`` (the realised participation, summarised) and,
in an amplified run, ``participation.sqlite`` (per hashed user, the rounds it was selected in:
`corrflow.run.user_store`).

* **Amplified runs** (Poisson, cyclic Poisson, b-min-sep samplers accounted with amplification: 001,
  002, 004) promise an ε that holds only while nobody learns who was sampled. Nothing public depends
  on the secret cohorts: the report keeps ε, δ, accountant, settings and the rounds, and the
  per-user participation, the per-round counts of replies, the realised sensitivity, the node ids of
  rejected replies and the reasons a round had no valid reply go to the operator files alone; the
  console prints per round the held-out metrics and ε only.
* **Every run**: per-round counts of accepted, clipped, zeroed or rejected replies are statistics of
  user data that the DP release does not cover. Unamplified runs (whose schedule is public anyway)
  publish them on the console and in ``metrics.json``, and the report lists them under
  ``outside_guarantee``.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from corrflow.fileio import write_json

log = logging.getLogger("corrflow")

#: Round metrics that are statistics of who replied and what they sent (outside the DP release).
COHORT_METRICS = (
    "replies",
    "accepted",
    "kept",
    "clipped",
    "zeroed",
    "rejected",
    "top_rejection",
    "aggregation_seconds",
)
OPERATOR_DIR = "operator"


@dataclass(frozen=True)
class Disclosure:
    """Where each piece of a run's record goes; ``secret``: the run's cohorts are secret (amplified
    ε)."""

    secret: bool
    run_dir: Path

    @property
    def operator_dir(self) -> Path:
        return self.run_dir / OPERATOR_DIR

    def public_metrics(self, metrics: dict) -> dict:
        """A round's metrics as published (amplified: without the cohort's statistics)."""
        return (
            {k: v for k, v in metrics.items() if k not in COHORT_METRICS}
            if self.secret
            else dict(metrics)
        )

    def record_round(self, metrics: dict) -> None:
        """Append a round's cohort statistics to the operator's ``rounds.jsonl``."""
        line = json.dumps(
            {k: metrics[k] for k in ("round", *COHORT_METRICS) if k in metrics}, sort_keys=True
        )
        _append_private(self._dir() / "rounds.jsonl", line + "\n")

    def complete_rounds(self, metrics_history: list[dict]) -> int:
        """At a restart, append the lines of released rounds that ``rounds.jsonl`` lacks: a round
        is released before its line is written (`corrflow.run.store.RunStore.commit`), so a kill
        between the two leaves the last released round without one. Only the file's tail is read.

        Args:
            metrics_history: every released round's metrics, in order (round i's at index i).

        Returns:
            The number of lines appended.
        """
        path = self._dir() / "rounds.jsonl"
        last, torn = -1, False
        if path.exists():
            with path.open("rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
                tail = f.read()
            torn = bool(tail) and not tail.endswith(b"\n")
            for raw in reversed(tail.splitlines()):
                try:
                    last = int(json.loads(raw)["round"])
                    break
                except (ValueError, KeyError, TypeError):
                    continue  # a line torn by a kill, or cut by the tail's start
        missing = [m for m in metrics_history if int(m.get("round", -1)) > last]
        if missing and torn:
            _append_private(path, "\n")  # a torn last line stays on its own line
        for metrics in missing:
            self.record_round(metrics)
        return len(missing)

    def public_report(self, report: dict, app_metrics: list[str] = ()) -> dict:
        """The report as published: amplified runs keep ε, δ, accountant, settings and rounds, and
        point to the operator's participation file for the rest; every run lists what it publishes
        outside the guarantee. ``app_metrics``: a wrapped app's aggregated metrics shown
        ("train.NAME", "evaluate.NAME"; corrflow.strategies.app_metrics)."""
        if not self.secret:
            return {
                **report,
                "outside_guarantee": {
                    "metrics": list(COHORT_METRICS[:-1]) + list(app_metrics),
                    "realized.rejections": "count of rejected replies",
                    "why": (
                        "statistics of the replies, not covered by the DP release (the schedule is "
                        "public)"
                        + (
                            "; train.* and evaluate.* are the app's own metrics, aggregated by its "
                            "strategy from the cohort's replies and logged as Flower logs them"
                            if app_metrics
                            else ""
                        )
                    ),
                },
            }
        realized = report["realized"]
        write_json(
            self._dir() / "participation.json",
            {"realized": realized},
            indent=1,
            sort_keys=True,
            private=True,
        )
        kept = {k: realized[k] for k in ("epsilon", "accounting") if k in realized}
        kept["participation"] = {
            "policy": realized["participation"].get("policy"),
            "operator_only": str(Path(OPERATOR_DIR) / "participation.json"),
        }
        return {
            **report,
            "realized": kept,
            "outside_guarantee": {
                "metrics": [],
                "why": (
                    "amplified ε: nothing public depends on the secret cohorts; the operator's "
                    f"files in {OPERATOR_DIR}/ hold the per-user participation, the per-round "
                    "counts and rejections"
                    + (
                        ", and operator.log the app's aggregated metrics ("
                        + ", ".join(app_metrics)
                        + ")"
                        if app_metrics
                        else ""
                    )
                ),
            },
        }

    def stop_reason(self, reason: str, public: str) -> str:
        """A cohort-dependent stop reason as published (the details go to the operator log)."""
        if not self.secret:
            return reason
        operator_log(self).warning("%s", reason)
        return public

    def _dir(self) -> Path:
        d = self.operator_dir
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        return d


class DisclosureView:
    """A run's `Disclosure` as seen from outside the run: where things go and what is published,
    without a way to write the operator's files (only the run appends to them)."""

    __slots__ = ("_of",)

    def __init__(self, of: Disclosure):
        self._of = of

    @property
    def secret(self) -> bool:
        """The run's cohorts are secret (amplified ε)."""
        return self._of.secret

    @property
    def operator_dir(self) -> Path:
        return self._of.operator_dir

    def public_metrics(self, metrics: dict) -> dict:
        """A round's metrics as published (see `Disclosure.public_metrics`).

        Args:
            metrics: the round's metrics.

        Returns:
            A new dict.
        """
        return self._of.public_metrics(metrics)


def _append_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        f.write(text)


def operator_log(disclosure: Disclosure) -> logging.Logger:
    """The logger for reply-level events (who was rejected and why): ``corrflow`` in a run whose
    schedule is public; in an amplified run ``corrflow.operator``, which writes only to the
    operator's ``operator.log``."""
    if not disclosure.secret:
        return log
    logger = logging.getLogger("corrflow.operator")
    path = str(disclosure._dir() / "operator.log")
    if not any(getattr(h, "baseFilename", None) == path for h in logger.handlers):
        for h in list(logger.handlers):
            logger.removeHandler(h)
            h.close()
        # owner-only before the first line
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.close(fd)
        handler = logging.FileHandler(path)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return logger
