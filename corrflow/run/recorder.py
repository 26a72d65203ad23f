"""The run's files and what they record: the ledger log and the per-user store that each round's
commit appends to (`corrflow.run.store.RunStore`, in the order ledger log → checkpoint → per-user
store → release journal → release registry), and the privacy report and metrics, written every
`REPORT_EVERY` rounds, at the end and at every stop, after the round's commit (docs "Conventions",
Files). `Recorder` reads the run's state and never changes it.
"""

from __future__ import annotations

import logging
import math
from functools import partial
from pathlib import Path

from corrflow.accounting.report import (
    ReportInputs,
    build_report,
    hash_user_id,
    write_report,
)
from corrflow.fileio import write_json_rows
from corrflow.planning.learnability import learning_section
from corrflow.planning.regime import regime_section
from corrflow.planning.run import total_privacy
from corrflow.run.disclosure import OPERATOR_DIR, Disclosure
from corrflow.run.ledger import LEDGER_LOG, LedgerLog
from corrflow.run.noise import NoiseStream
from corrflow.run.noise_node_link import noise_node_section
from corrflow.run.noise_trust import noise_workers_trust
from corrflow.run.plan import RunPlan
from corrflow.run.registry import ReleaseRegistry, lineage_section
from corrflow.run.secure_sum import trust_section
from corrflow.run.state import RunSecrets, RunState
from corrflow.run.user_store import STORE, PerUserRecord

log = logging.getLogger("corrflow")

#: privacy_report.json and metrics.json list every user and every round, so they are rewritten every
# REPORT_EVERY rounds, at the last round and at every stop (and on every start of a resumed run);
# between, each round appends O(cohort) to the ledger log, journal and operator's rounds.jsonl.
REPORT_EVERY = 10


class Recorder:
    """The files of one run (see the module docstring): what it writes about (the plan), where (the
    run directory, the release registry), the state it reads and the noise stream saved with each
    checkpoint."""

    def __init__(
        self,
        plan: RunPlan,
        state: RunState,
        keys: RunSecrets,
        noise: NoiseStream,
        registry: ReleaseRegistry,
        initial_metrics: dict,
        ledger_log: LedgerLog | None = None,
    ):
        self.plan, self.state, self.keys, self.noise = plan, state, keys, noise
        self.registry, self.initial_metrics = registry, initial_metrics
        self.run_dir = Path(plan.cfg.state_dir)
        self.ledger_log = ledger_log or LedgerLog(self.checkpoint_dir / LEDGER_LOG)
        self.disclosure = Disclosure(plan.accounting.plan.amplified, self.run_dir)
        self._hashes: dict[str, str] = {}  # user → salted hash (hashed once per run start)
        # The per-user record, written for each round's cohort; on a resume checked against the
        # checkpoint's ledger (rebuilt from it where they differ). An amplified run's is the
        # operator's: its cohorts are secret.
        name = STORE
        if self.disclosure.secret:
            self.disclosure.operator_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            name = f"{OPERATOR_DIR}/{STORE}"
        self.users = PerUserRecord.start(
            self.run_dir,
            name,
            keys.run_id,
            None if ledger_log is None else state.ledger.selected,
            self.hashed,
            self.ledger_log.position,
        )
        self.adoptions: list[dict] = []  # `corrflow runs adopt` of this run (the report lists them)
        self.app_metrics: set[str] = set()  # a wrapped app's metrics shown (outside the guarantee)
        self.received = None  # under secure aggregation: the record of what the server received

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "state"

    def report(self) -> dict:
        """The privacy report (docs "Conventions", Privacy report) of the run so far, assembled by
        `corrflow.accounting.report.build_report` from the run's facts; O(rounds + cohort), never
        O(population): the per-user record is its store's (`corrflow.run.user_store`)."""
        s, c = self.state, self.plan
        plan, salt = c.accounting.plan, self.keys.salt
        k_u = c.planner.items_per_user
        dim = sum(math.prod(shape) for shape in c.layout.trainable_shapes)
        secure = None
        if c.cfg.secure_aggregation:
            received = None if self.received is None else self.received.to_dict()
            secure = trust_section(c.cfg.clip_norm, dim, c.planner.expected, received)
        return build_report(
            ReportInputs(
                factorization=c.factorization,
                plan=plan,
                realized=c.accounting.realized(
                    s.ledger.selected, s.ledger.overrides, s.sensitivity
                ),
                clip_norm=c.cfg.clip_norm,
                delta=c.cfg.delta,
                target_epsilon=c.cfg.target_epsilon,
                planned_participation={**c.planner.to_dict(), "mode": c.cfg.mode},
                planned_sensitivity=float(k_u) * c.factorization.sensitivity.value,
                planned_sensitivity_exact=c.factorization.sensitivity.exact and k_u == 1,
                summary=self.users.summary,
                store=self.users.section(),
                policy=c.cfg.policy,
                overrides=[
                    {
                        **o,
                        "item": hash_user_id(o["item"], salt),
                        "users": [hash_user_id(u, salt) for u in o["users"]],
                    }
                    for o in s.ledger.overrides
                ],
                rejections=len(s.ledger.rejections),
                rounds_completed=s.next_round,
                rounds_planned=c.cfg.num_rounds,
                stopped_reason=s.stopped_reason,
                run_id=self.keys.run_id,
                identity=c.identity,
                learning=self.learning(),
                notes=tuple(c.notes),
                report_every=REPORT_EVERY,
                regime=regime_section(plan.noise_multiplier, dim, c.planner.expected),
                eval_every=c.cfg.eval_every,
                lineage=lineage_section(self.noise.segments, self.adoptions),
                noise_workers=noise_workers_trust(self.noise).get("trust"),
                secure_aggregation=secure,
                # corrects ``secure`` in place: the server never holds a noiseless sum
                noise_node=noise_node_section(self.noise, secure),
                vocabulary=plan.vocabulary,
                total=partial(total_privacy, vocabulary=plan.vocabulary),
            )
        )

    def hashed(self, user: str) -> str:
        """``user``'s salted hash (each user hashed once per run start)."""
        h = self._hashes.get(user)
        if h is None:
            h = self._hashes[user] = hash_user_id(user, self.keys.salt)
        return h

    def learning(self) -> dict:
        return learning_section([self.initial_metrics, *self.state.metrics_history], self.plan.rho)

    def write_report(self) -> Path:
        """privacy_report.json: the report as published (`Disclosure.public_report`)."""
        return write_report(
            self.disclosure.public_report(self.report(), sorted(self.app_metrics)),
            self.run_dir / "privacy_report.json",
        )

    def write_metrics(self) -> Path:
        """metrics.json: the initial model as round −1, then one entry per round, as published."""
        public = [self.disclosure.public_metrics(m) for m in self.state.metrics_history]
        return write_json_rows(self.run_dir / "metrics.json", [self.initial_metrics, *public])
