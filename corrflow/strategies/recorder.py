"""The run's state and everything that persists it: the one place where a round, a stop or an
operator override changes the run (:meth:`Recorder.apply`), and where checkpoint, release journal,
release registry, privacy report and metrics are written — in that order, before a round's model
leaves the server (docs "Conventions", Files).

:class:`RunState` is what changes: the model, the optimizer's momentum, the ledger, the metric
history, the next round, the streak of empty rounds, the stop reason and pending overrides.
:class:`RunSecrets` is fixed for the run's life: the report salt, the server secret (HMAC key of
checkpoints and journal), the sampler key of an amplified run, the run id and the SHA-256 of the
initial model.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from corrflow.accounting.policy import RunAccounting, pattern_followed
from corrflow.accounting.report import (
    hash_user_id,
    participation_section,
    privacy_report,
    write_report,
)
from corrflow.config import RunConfig
from corrflow.errors import IntegrityError, InvalidArgumentError
from corrflow.factorization.base import Factorization
from corrflow.fileio import write_json
from corrflow.noise import CorrelatedNoise
from corrflow.noise.engine import RING_FILE, save_state
from corrflow.participation.planner import CohortPlanner
from corrflow.planning.learnability import learning_section
from corrflow.planning.run import total_privacy
from corrflow.strategies.checkpoint import (
    SAMPLER_KEY,
    SECRET,
    load_arrays,
    manifest_digest,
    write_checkpoint,
)
from corrflow.strategies.disclosure import Disclosure
from corrflow.strategies.journal import GENESIS, JOURNAL, ReleaseJournal, cohort_digest
from corrflow.strategies.ledger import Ledger
from corrflow.strategies.registry import ReleaseRegistry, lineage_section
from corrflow.strategies.round_core import RoundRecord, reason_class
from corrflow.strategies.run_state import ResumePoint, settings_conflict

log = logging.getLogger("corrflow")


@dataclass
class RunState:
    params: list[np.ndarray]
    momentum: list[np.ndarray]
    ledger: Ledger = field(default_factory=Ledger)
    metrics_history: list[dict] = field(default_factory=list)
    next_round: int = 0
    empty_streak: int = 0
    stopped_reason: str | None = None
    pending_overrides: dict[int, list[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class RunSecrets:
    salt: bytes
    secret: bytes
    sampler_key: bytes | None
    run_id: str
    initial_sha256: str

    @classmethod
    def new(cls, amplified: bool, initial_sha256: str) -> RunSecrets:
        return cls(
            secrets.token_bytes(32),
            secrets.token_bytes(32),
            secrets.token_bytes(32) if amplified else None,
            secrets.token_hex(8),
            initial_sha256,
        )


@dataclass(frozen=True)
class Stop:
    """The run stops before its planned rounds (budget guard, interrupt), for ``reason``."""

    reason: str


@dataclass(frozen=True)
class Override:
    """An operator adds ``items`` to round ``round``'s cohort (checked by the separation monitor
    like any item)."""

    round: int
    items: list[str]


@dataclass(frozen=True)
class RecordingContext:
    """What the recorder writes about and where: settings, factorization, privacy plan and policy,
    planner, the identity source, the run directory, the noise stream (saved with each checkpoint),
    the initial model's metrics (metrics.json's round −1), the pre-flight noise-to-signal ratio ρ,
    and a callback after each round."""

    cfg: RunConfig
    factorization: Factorization
    accounting: RunAccounting
    planner: CohortPlanner
    identity: str
    run_dir: Path
    noise: CorrelatedNoise
    initial_metrics: dict
    rho: float | None
    disclosure: Disclosure
    registry: ReleaseRegistry
    notes: tuple[str, ...] = ()  # what was built where it differs from what the settings name
    on_round_end: Callable[[dict], None] | None = None

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "state"


class Recorder:
    """Owns :class:`RunState` and its files; see the module docstring."""

    def __init__(
        self, ctx: RecordingContext, state: RunState, keys: RunSecrets, last_hash: str = GENESIS
    ):
        self.ctx, self.state, self.keys = ctx, state, keys
        self.journal = ReleaseJournal(ctx.run_dir / JOURNAL)
        self._last_hash = last_hash
        self.adoptions: list[dict] = []  # `corrflow runs adopt` of this run (the report lists them)
        self.app_metrics: set[str] = set()  # a wrapped app's metrics shown (outside the guarantee)

    # -- starting ----------------------------------------------------------------------------------
    @classmethod
    def start(
        cls,
        ctx: RecordingContext,
        params: list[np.ndarray],
        initial_sha256: str,
        resume: ResumePoint,
    ) -> Recorder:
        """A new run from ``params``, or the checkpoint ``resume`` names (whose unreleased round is
        released)."""
        if resume.checkpoint is None:
            state = RunState(params, [np.zeros_like(p) for p in params])
            recorder = cls(
                ctx, state, RunSecrets.new(ctx.accounting.plan.amplified, initial_sha256)
            )
            ctx.registry.claim(recorder.keys.run_id, ctx.run_dir)
            return recorder
        recorder = cls(
            ctx,
            *_restore(ctx, resume.checkpoint, [p.shape for p in params], initial_sha256),
            resume.journal[-1].hash if resume.journal else GENESIS,
        )
        run_id = recorder.keys.run_id
        ctx.registry.check(run_id, ctx.run_dir, len(resume.journal))
        recorder.adoptions = ctx.registry.adoptions(run_id)
        for entry in resume.journal[
            ctx.registry.released(run_id) :
        ]:  # killed between journal and registry
            ctx.registry.record(run_id, entry.round, entry.noise_round, entry.hash)
        if (
            resume.unreleased_round is not None
        ):  # checkpointed, then killed before its journal entry
            recorder._journal(resume.unreleased_round, resume.checkpoint)
            log.info(
                "round %d was checkpointed but not released before the restart; released now",
                resume.unreleased_round + 1,
            )
        return recorder

    # -- the one place state changes ---------------------------------------------------------------
    def apply(self, change: RoundRecord | Stop | Override) -> None:
        """Apply a completed round (then checkpoint → journal → report → metrics), a stop, or an
        override."""
        if isinstance(change, Override):
            self.state.pending_overrides.setdefault(int(change.round), []).extend(change.items)
        elif isinstance(change, Stop):
            self.state.stopped_reason = change.reason
            log.warning("training stops: %s", change.reason)
            self.write_report()
        else:
            self._apply_round(change)

    def _apply_round(self, r: RoundRecord) -> None:
        s, followed_before = self.state, pattern_followed(self.state.ledger.overrides)
        if s.next_round != r.round or self.ctx.noise.next_round != r.noise_position:
            raise IntegrityError(
                f"round {r.round + 1} does not follow the run's state (next round "
                f"{s.next_round + 1}, noise at {self.ctx.noise.next_round})"
            )
        s.pending_overrides.pop(r.round, None)
        s.ledger.overrides.extend(r.overrides)
        s.ledger.select(r.round, r.users)
        for who, reason in r.rejections:
            s.ledger.reject(r.round, who, reason)
        for key in r.accepted:
            s.ledger.accept(r.round, key)
        s.ledger.epsilon_history.append(r.epsilon)
        self.ctx.disclosure.record_round(r.metrics)
        s.params, s.momentum, s.next_round = r.params, r.momentum, r.round + 1
        s.ledger.rounds_completed = s.next_round
        s.metrics_history.append(r.metrics)
        if r.asked:
            s.empty_streak = 0 if r.accepted else s.empty_streak + 1
        self._journal(r.round, self._checkpoint())
        if (
            followed_before
            and not pattern_followed(s.ledger.overrides)
            and self.ctx.accounting.plan.private
        ):
            why = (
                "min-sep broken and accepted (policy accept-and-account)"
                if any(o["action"] == "accepted-and-accounted" for o in r.overrides)
                else "an operator override"
            )
            log.warning(
                "round %d: %s: the report now uses post-hoc accounting of the realised "
                "participation, "
                "ε = %.4f",
                r.round + 1,
                why,
                r.epsilon,
            )
        if self.ctx.cfg.max_empty_rounds and s.empty_streak >= self.ctx.cfg.max_empty_rounds:
            s.stopped_reason = self.ctx.disclosure.stop_reason(
                self._empty_reason(),
                (
                    f"no valid replies in {s.empty_streak} consecutive rounds (the reasons are in "
                    "the operator log)"
                ),
            )
            log.error("training stops: %s", s.stopped_reason)
        self.write_report()
        self.write_metrics()
        if self.ctx.on_round_end is not None:
            self.ctx.on_round_end(self.ctx.disclosure.public_metrics(r.metrics))

    def _empty_reason(self) -> str:
        s = self.state
        first = s.next_round - s.empty_streak
        reasons = {}
        for r in s.ledger.rejections:
            if r["round"] >= first:
                why = reason_class(r["reason"])
                reasons[why] = reasons.get(why, 0) + 1
        top = ", ".join(
            f"{why} ×{n}" for why, n in sorted(reasons.items(), key=lambda kv: -kv[1])[:3]
        )
        return (
            f"no valid replies in {s.empty_streak} consecutive rounds "
            f"({first + 1}–{s.next_round}): "
            f"{top or 'no replies arrived'}"
        )

    # -- files -------------------------------------------------------------------------------------
    def _journal(self, t: int, ckpt: Path) -> None:
        ledger, salt = self.state.ledger, self.keys.salt
        users = [
            hash_user_id(u, salt) for u in sorted(u for u, rs in ledger.selected.items() if t in rs)
        ]
        entry = self.journal.append(
            self.keys.secret,
            run_id=self.keys.run_id,
            round_index=t,
            cohort_sha256=cohort_digest(users),
            checkpoint=ckpt.name,
            manifest_sha256=manifest_digest(ckpt),
            prev=self._last_hash,
            noise_segment=self.ctx.noise.segments.segment_for(t).public(),
        )
        self.ctx.registry.record(self.keys.run_id, t, entry.noise_round, entry.hash)
        self._last_hash = entry.hash

    def _checkpoint(self) -> Path:
        s, k, c = self.state, self.keys, self.ctx
        public = {
            "next_round": s.next_round,
            "config_fingerprint": c.cfg.fingerprint(),
            "settings": c.cfg.run_settings(),
            "run_id": k.run_id,
            "identity": c.identity,
            "factorization_sha256": c.factorization.sha256(),
            "ledger": s.ledger.to_dict(),
            "noise_multiplier": c.accounting.plan.noise_multiplier,
            "planned_epsilon": c.accounting.plan.epsilon,
            "initial_sha256": k.initial_sha256,
            "amplified": c.accounting.plan.amplified,
            "accountant": c.accounting.plan.accountant.get("name"),
            "pending_overrides": {str(r): v for r, v in s.pending_overrides.items()},
            "metrics_history": s.metrics_history,
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
            c.checkpoint_dir,
            f"round-{s.next_round:06d}",
            {"model": s.params, "optimizer": s.momentum},
            public,
            private,
            save_extra=lambda d: save_state(
                c.noise, d / "noise", ring=c.checkpoint_dir / RING_FILE
            ),
        )

    def report(self) -> dict:
        """The privacy report (docs "Conventions", Privacy report) of the run so far."""
        s, c = self.state, self.ctx
        plan, salt = c.accounting.plan, self.keys.salt
        real = c.accounting.realized(s.ledger.selected, s.ledger.overrides)
        overrides = [
            {
                **o,
                "item": hash_user_id(o["item"], salt),
                "users": [hash_user_id(u, salt) for u in o["users"]],
            }
            for o in s.ledger.overrides
        ]
        k_u = c.planner.items_per_user
        report = privacy_report(
            factorization=c.factorization,
            noise_multiplier=plan.noise_multiplier,
            clip_norm=c.cfg.clip_norm,
            delta=plan.delta if plan.delta is not None else c.cfg.delta,
            target_epsilon=c.cfg.target_epsilon,
            accountant=plan.accountant,
            planned={
                "sensitivity": float(k_u) * c.factorization.sensitivity.value,
                "sensitivity_exact": c.factorization.sensitivity.exact and k_u == 1,
                "epsilon": plan.epsilon,
                "participation": {**c.planner.to_dict(), "mode": c.cfg.mode},
            },
            realized={
                "sensitivity": real.sensitivity,
                "sensitivity_exact": real.sensitivity_exact,
                "epsilon": real.epsilon,
                "accounting": real.accounting,
                "delta": real.delta,
                "guarantee": real.delta is not None and real.delta <= c.cfg.delta * (1 + 1e-12),
                "participation": participation_section(
                    s.ledger.selected, salt, c.cfg.policy, overrides
                ),
                "rejections": len(s.ledger.rejections),
            },
            rounds_completed=s.next_round,
            rounds_planned=c.cfg.num_rounds,
            stopped_reason=s.stopped_reason,
            run_id=self.keys.run_id,
            identity={"source": c.identity, "stable_across_restarts": c.identity != "per-launch"},
            learning=self.learning(),
        )
        report["mechanism"]["notes"] = list(c.notes)
        report["lineage"] = lineage_section(c.noise.segments, self.adoptions)
        if (
            plan.vocabulary is not None
        ):  # a run on a dataset file: how its vocabulary was built, and the total
            report["vocabulary"] = plan.vocabulary
            report["total"] = total_privacy(real.epsilon, report["delta"], plan.vocabulary)
        return report

    def learning(self) -> dict:
        return learning_section(
            [self.ctx.initial_metrics, *self.state.metrics_history], self.ctx.rho
        )

    def write_report(self) -> Path:
        """privacy_report.json: the report as published (:meth:`Disclosure.public_report`)."""
        return write_report(
            self.ctx.disclosure.public_report(self.report(), sorted(self.app_metrics)),
            self.ctx.run_dir / "privacy_report.json",
        )

    def write_metrics(self) -> Path:
        """metrics.json: the initial model as round −1, then one entry per round, as published."""
        public = [self.ctx.disclosure.public_metrics(m) for m in self.state.metrics_history]
        return write_json(
            self.ctx.run_dir / "metrics.json", [self.ctx.initial_metrics, *public], indent=1
        )


def _restore(
    ctx: RecordingContext, ckpt: Path, shapes: list[tuple[int, ...]], initial_sha256: str
) -> tuple[RunState, RunSecrets]:
    """The state and secrets of a verified checkpoint; refuses one of another run, factorization, σ,
    model or initial model, naming what differs."""
    public = json.loads((ckpt / "state.json").read_text())
    cfg, sigma = ctx.cfg, ctx.accounting.plan.noise_multiplier
    if public["config_fingerprint"] != cfg.fingerprint():
        diff = settings_conflict(ctx.checkpoint_dir, cfg.run_settings()) or "unrecorded settings"
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
    was = (
        public.get("amplified", plan.amplified),
        public.get("accountant", plan.accountant.get("name")),
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
    params = load_arrays(ckpt, "model")
    if [tuple(p.shape) for p in params] != [tuple(s) for s in shapes]:
        raise IntegrityError(f"{ckpt}: model shapes differ from the model being trained")
    state = RunState(
        params,
        load_arrays(ckpt, "optimizer"),
        Ledger.from_dict(public["ledger"]),
        public["metrics_history"],
        int(public["next_round"]),
        int(public.get("empty_streak", 0)),
        None,
        {int(r): list(v) for r, v in public.get("pending_overrides", {}).items()},
    )
    if ctx.noise.next_round != state.next_round:
        raise IntegrityError(
            f"{ckpt}: noise state is at round {ctx.noise.next_round}, model at {state.next_round}"
        )
    keys = RunSecrets(
        (ckpt / "report_salt").read_bytes(),
        (ckpt / SECRET).read_bytes(),
        _sampler_key(ctx, ckpt),
        public["run_id"],
        public.get("initial_sha256", initial_sha256),
    )
    log.info("corrflow: resumed from %s at round %d", ckpt.name, state.next_round + 1)
    return state, keys


def _sampler_key(ctx: RecordingContext, ckpt: Path) -> bytes | None:
    """The private key the amplified plan's cohorts are drawn from (its earlier rounds replay from
    it)."""
    if not ctx.accounting.plan.amplified:
        return None
    path = ckpt / SAMPLER_KEY
    if not path.is_file():
        raise IntegrityError(
            f"{path}: missing from a checkpoint its manifest vouches for (written by a corrflow "
            "that "
            "drew amplified cohorts from the public schedule seed): the amplified ε would not hold "
            "for its cohorts. Start a new run with --fresh"
        )
    return path.read_bytes()
