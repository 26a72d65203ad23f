"""Everything that persists a run, in the order that makes a kill at any point safe: ledger log →
checkpoint → per-user store → release journal → release registry → privacy report → metrics (those
two every `REPORT_EVERY` rounds, at the end and at every stop), before a round's model leaves the
server (docs "Conventions", Files). `Recorder` reads the run's state and never changes it;
`restore` reads a verified checkpoint back.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable
from functools import partial
from pathlib import Path

from corrflow.accounting.accountant import LEGACY_NAMES
from corrflow.accounting.report import (
    ReportInputs,
    build_report,
    hash_user_id,
    write_report,
)
from corrflow.accounting.tracking import IncrementalSensitivity
from corrflow.errors import IntegrityError, InvalidArgumentError
from corrflow.fileio import write_json
from corrflow.planning.learnability import learning_section
from corrflow.planning.regime import regime_section
from corrflow.planning.run import total_privacy
from corrflow.run.checkpoint import (
    SAMPLER_KEY,
    SECRET,
    load_arrays,
    manifest_digest,
    write_checkpoint,
)
from corrflow.run.disclosure import OPERATOR_DIR, Disclosure
from corrflow.run.journal import GENESIS, JOURNAL, ReleaseJournal, cohort_digest
from corrflow.run.ledger import (
    LEDGER_LOG,
    Ledger,
    LedgerLog,
    LogPosition,
    replay,
)
from corrflow.run.noise import NoiseStream
from corrflow.run.noise_node_link import noise_node_section
from corrflow.run.noise_trust import noise_workers_trust
from corrflow.run.plan import RunPlan
from corrflow.run.registry import ReleaseRegistry, lineage_section
from corrflow.run.resume import settings_conflict
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
    run directory, the release registry), the state it reads, the noise stream saved with each
    checkpoint, and the journal's hash chain."""

    def __init__(
        self,
        plan: RunPlan,
        state: RunState,
        keys: RunSecrets,
        noise: NoiseStream,
        registry: ReleaseRegistry,
        initial_metrics: dict,
        last_hash: str = GENESIS,
        ledger_log: LedgerLog | None = None,
    ):
        self.plan, self.state, self.keys, self.noise = plan, state, keys, noise
        self.registry, self.initial_metrics = registry, initial_metrics
        self.run_dir = Path(plan.cfg.state_dir)
        self.ledger_log = ledger_log or LedgerLog(self.checkpoint_dir / LEDGER_LOG)
        self.disclosure = Disclosure(plan.accounting.plan.amplified, self.run_dir)
        self._journal = ReleaseJournal(self.run_dir / JOURNAL)
        self._last_hash = last_hash
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
            self._hashed,
            self.ledger_log.position,
        )
        self.adoptions: list[dict] = []  # `corrflow runs adopt` of this run (the report lists them)
        self.app_metrics: set[str] = set()  # a wrapped app's metrics shown (outside the guarantee)
        # Facts of the frozen plan every checkpoint records: computed once per start, not per round
        # (the factorization's hash reads all of its arrays).
        self._facts = {
            "config_fingerprint": plan.cfg.fingerprint(),
            "settings": plan.cfg.run_settings(),
            "factorization_sha256": plan.factorization.sha256(),
        }
        self.received = None  # under secure aggregation: the record of what the server received

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "state"

    def journal(self, t: int, ckpt: Path, cohort: Iterable[str] | None = None) -> None:
        """Release round ``t`` (checkpoint ``ckpt``, the users of its ``cohort``): its cohort's
        entries to the per-user store, then the journal, then the registry. Without ``cohort`` (a
        round released on resume, whose store was checked against the ledger at the start) it is
        read from the ledger — O(population); a round's own release passes its cohort —
        O(cohort)."""
        salt = self.keys.salt
        if cohort is None:
            cohort = (u for u, rs in self.state.ledger.selected.items() if t in rs)
        else:
            cohort = list(cohort)
            self.users.commit_round(
                self.state.ledger.selected, cohort, self._hashed, self.ledger_log.position
            )
        users = [hash_user_id(u, salt) for u in sorted(set(cohort))]
        entry = self._journal.append(
            self.keys.secret,
            run_id=self.keys.run_id,
            round_index=t,
            cohort_sha256=cohort_digest(users),
            checkpoint=ckpt.name,
            manifest_sha256=manifest_digest(ckpt),
            prev=self._last_hash,
            # the key segment that drew row Z_t: with the checkpoint's table, t replays exactly
            noise_segment=self.noise.segments.segment_for(t).public(),
        )
        self.registry.record(self.keys.run_id, t, entry.noise_round, entry.hash)
        self._last_hash = entry.hash

    def record_round(self, entry: dict) -> None:
        """Append a released round's additions to the ledger log (before its checkpoint)."""
        self.checkpoint_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.ledger_log.append(entry)

    def checkpoint(self) -> Path:
        """Write the state after the last round: O(model + cohort) — the ledger and the metric
        history are the ledger log's, whose position the checkpoint vouches for."""
        s, k, c = self.state, self.keys, self.plan
        public = {
            "next_round": s.next_round,
            **self._facts,
            "run_id": k.run_id,
            "identity": c.identity,
            "ledger_log": self.ledger_log.position.to_dict(),
            "noise_multiplier": c.accounting.plan.noise_multiplier,
            "planned_epsilon": c.accounting.plan.epsilon,
            "initial_sha256": k.initial_sha256,
            "amplified": c.accounting.plan.amplified,
            "accountant": c.accounting.plan.accountant.get("name"),
            "pending_overrides": {str(r): v for r, v in s.pending_overrides.items()},
            "empty_streak": s.empty_streak,
        }
        private = {
            "report_salt": k.salt,
            SECRET: k.secret,
            **({SAMPLER_KEY: k.sampler_key} if k.sampler_key is not None else {}),
        }
        # A banded noise buffer's rows live in one ring file beside the checkpoints, one row
        # rewritten per round.
        return write_checkpoint(
            self.checkpoint_dir,
            f"round-{s.next_round:06d}",
            # the momentum beside the model in one file (a checkpoint before it has optimizer.npz)
            {"model": {"arr": s.params, "momentum": s.momentum}},
            public,
            private,
            save_extra=lambda d: self.noise.save(d, self.checkpoint_dir),
        )

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

    def _hashed(self, user: str) -> str:
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
        return write_json(self.run_dir / "metrics.json", [self.initial_metrics, *public], indent=1)


def restore(
    ctx: RunPlan, ckpt: Path, noise: NoiseStream, initial_sha256: str
) -> tuple[RunState, RunSecrets, LedgerLog]:
    """The state and secrets of a verified checkpoint, and the ledger log at its position (read and
    checked: the ledger and metric history are rebuilt from it); refuses one of another run,
    factorization, σ, model or initial model, naming what differs."""
    public = json.loads((ckpt / "state.json").read_text())
    _check_same_run(ctx, ckpt, public, initial_sha256)
    params = load_arrays(ckpt, "model")
    if [tuple(p.shape) for p in params] != [tuple(s) for s in ctx.layout.trainable_shapes]:
        raise IntegrityError(f"{ckpt}: model shapes differ from the model being trained")
    # The momentum is in model.npz; a checkpoint of a corrflow before it has optimizer.npz.
    momentum = load_arrays(ckpt, "model", "momentum") or load_arrays(ckpt, "optimizer")
    if [tuple(m.shape) for m in momentum] != [tuple(p.shape) for p in params]:
        raise IntegrityError(f"{ckpt}: the optimizer's momentum does not fit the model's shapes")
    ledger_log, ledger, history = _read_ledger(ckpt, public)
    state = RunState(
        params,
        momentum,
        ledger,
        history,
        int(public["next_round"]),
        int(public.get("empty_streak", 0)),
        None,
        {int(r): list(v) for r, v in public.get("pending_overrides", {}).items()},
        IncrementalSensitivity.of(ctx.factorization.encoder, ledger.selected),
    )
    if noise.next_round != state.next_round:
        raise IntegrityError(
            f"{ckpt}: noise state is at round {noise.next_round}, model at {state.next_round}"
        )
    keys = RunSecrets(
        (ckpt / "report_salt").read_bytes(),
        (ckpt / SECRET).read_bytes(),
        _sampler_key(ctx, ckpt),
        public["run_id"],
        public.get("initial_sha256", initial_sha256),
    )
    log.info("corrflow: resumed from %s at round %d", ckpt.name, state.next_round + 1)
    return state, keys, ledger_log


def _check_same_run(ctx: RunPlan, ckpt: Path, public: dict, initial_sha256: str) -> None:
    """Refuse a checkpoint (its ``state.json``: ``public``) of other settings, another
    factorization, σ, accounting regime or initial model, naming what differs."""
    cfg, sigma = ctx.cfg, ctx.accounting.plan.noise_multiplier
    if public["config_fingerprint"] != cfg.fingerprint():
        diff = settings_conflict(ckpt.parent, cfg.run_settings()) or "unrecorded settings"
        raise IntegrityError(
            f"{ckpt / 'state.json'}: the checkpoint belongs to a run with other settings ({diff}); "
            "resume with the same settings, or start a new run with --fresh"
        )
    if public["factorization_sha256"] != ctx.factorization.sha256():
        raise IntegrityError(f"{ckpt}: the checkpoint was made with another factorization")
    if public["noise_multiplier"] != sigma:
        raise InvalidArgumentError(
            "noise-multiplier", f"{public['noise_multiplier']} (the checkpoint's)", sigma
        )
    plan = ctx.accounting.plan
    started_with = public.get("accountant", plan.accountant.get("name"))
    was = (
        public.get("amplified", plan.amplified),
        LEGACY_NAMES.get(started_with, started_with),
    )
    if was != (plan.amplified, plan.accountant.get("name")) or (
        (ckpt / SAMPLER_KEY).is_file() and not plan.amplified
    ):
        # The run's accounting (the bound, and whether its cohorts are secret) is fixed when it
        # starts: a resume that re-plans to another regime would change the planned ε and the
        # cohorts' key mid-run.
        raise IntegrityError(
            f"{ckpt / 'state.json'}: the run started with accountant {was[1]} "
            f"({'amplified, secret cohorts' if was[0] else 'unamplified'}); resuming now plans "
            f"{plan.accountant.get('name')} ({'amplified' if plan.amplified else 'unamplified'}) — "
            "resume with the inputs it started with (name its --accountant), or start anew with "
            "--fresh"
        )
    if public.get("initial_sha256", initial_sha256) != initial_sha256:
        raise InvalidArgumentError(
            "initial_arrays",
            "the initial model this run started from (a resumed run "
            "cannot change it; start a new run with --fresh / fresh=True)",
            f"arrays with SHA-256 {initial_sha256[:16]}…",
        )


def _read_ledger(ckpt: Path, public: dict) -> tuple[LedgerLog, Ledger, list[dict]]:
    """The ledger log at the position the checkpoint vouches for, and the ledger and metric history
    replayed from it (IntegrityError when it records another number of rounds)."""
    ledger_log = LedgerLog(ckpt.parent / LEDGER_LOG)
    if "ledger_log" in public:
        ledger_log.position = LogPosition.from_dict(public["ledger_log"])
        ledger, history = replay(ledger_log.read())
    else:
        # A checkpoint of a corrflow before the ledger log held the whole ledger: it becomes the
        # log's first line (a snapshot), vouched for by the next checkpoint.
        ledger, history = Ledger.from_dict(public["ledger"]), public["metrics_history"]
        ledger_log.append({"snapshot": {"ledger": ledger.to_dict(), "metrics_history": history}})
    if ledger.rounds_completed != int(public["next_round"]):
        raise IntegrityError(
            f"{ledger_log.path}: records {ledger.rounds_completed} rounds, the checkpoint "
            f"{public['next_round']}"
        )
    return ledger_log, ledger, history


def _sampler_key(ctx: RunPlan, ckpt: Path) -> bytes | None:
    """The private key the amplified plan's cohorts are drawn from (its earlier rounds replay from
    it)."""
    if not ctx.accounting.plan.amplified:
        return None
    path = ckpt / SAMPLER_KEY
    if not path.is_file():
        raise IntegrityError(
            f"{path}: missing from a checkpoint its manifest vouches for (written by a corrflow "
            "that drew amplified cohorts from the public schedule seed): the amplified ε would "
            "not hold for its cohorts. Start a new run with --fresh"
        )
    return path.read_bytes()
