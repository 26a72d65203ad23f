"""Making a computed round durable: `RunStore.commit` writes what `corrflow.run.core.Run.step`
computed (a `corrflow.run.round.RoundRecord`, already applied to the run's state in memory) in
the order that makes a kill at any point safe — ledger log → checkpoint → per-user store → release
journal → release registry — before the round's model leaves the server (docs "Conventions",
Files). A round after the first writes six files: the ledger log, the one checkpoint file, the
noise ring (a banded noise's), the per-user store, the journal and the registry (then a line of
the operator's ``rounds.jsonl``, a log); the run's secrets are written once per process start
(`corrflow.run.checkpoint.SecretFiles`).

`restore` reads a verified checkpoint back into the run's state and secrets.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

from corrflow.accounting.accountant import LEGACY_NAMES
from corrflow.accounting.tracking import IncrementalSensitivity
from corrflow.errors import IntegrityError, InvalidArgumentError
from corrflow.run.checkpoint import (
    SALT,
    SAMPLER_KEY,
    SECRET,
    Checkpoint,
    Published,
    SecretFiles,
    has_previous_layout,
    remove_previous_layout,
    write_checkpoint,
)
from corrflow.run.journal import GENESIS, JOURNAL, ReleaseJournal, cohort_digest
from corrflow.run.ledger import LEDGER_LOG, Ledger, LedgerLog, LogPosition, replay, round_entry
from corrflow.run.noise import NoiseStream
from corrflow.run.plan import RunPlan
from corrflow.run.recorder import Recorder
from corrflow.run.resume import settings_conflict
from corrflow.run.round import RoundRecord
from corrflow.run.state import RunSecrets, RunState

log = logging.getLogger("corrflow")


class RunStore:
    """The run's durable record of its rounds (see the module docstring).

    Args:
        recorder: the run's files (ledger log, per-user store) and what it writes about.
        published: the checkpoint the run resumed from (None: a new run).
        last_hash: the release journal's last entry's hash.
    """

    def __init__(
        self, recorder: Recorder, published: Checkpoint | None = None, last_hash: str = GENESIS
    ):
        self._rec = recorder
        self.state_dir = recorder.checkpoint_dir
        self._journal = ReleaseJournal(recorder.run_dir / JOURNAL)
        self._last_hash = last_hash
        self._secrets = SecretFiles(
            self.state_dir, None if published is None else published.secret_files
        )
        # files of the previous layout (a resumed one, or one a kill left after its conversion):
        # removed after this start's first publish
        self._old_layout = has_previous_layout(self.state_dir)
        # Facts of the frozen plan every checkpoint records: computed once per start, not per round
        # (the factorization's hash reads all of its arrays).
        plan = recorder.plan
        self._facts = {
            "config_fingerprint": plan.cfg.fingerprint(),
            "settings": plan.cfg.run_settings(),
            "factorization_sha256": plan.factorization.sha256(),
        }

    def commit(self, r: RoundRecord) -> Published:
        """Make round ``r`` durable: its ledger-log line, then the checkpoint (which vouches for
        the log's new position), then its release (`release`), then the operator's
        ``rounds.jsonl`` line.

        Args:
            r: the round, already applied to the run's state.

        Returns:
            The published checkpoint's name and digest.
        """
        # 0700: the ledger log holds raw user ids (created by the run's first round)
        self.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._rec.ledger_log.append(
            round_entry(
                r.round, r.users, r.accepted, r.rejections, r.overrides, r.epsilon, r.metrics
            )
        )
        ckpt = self.checkpoint()
        self.release(r.round, ckpt, r.users)
        # the operator's line, once the round is released (a restart writes it when a kill came
        # between the two: `Disclosure.complete_rounds`)
        self._rec.disclosure.record_round(r.metrics)
        return ckpt

    def checkpoint(self) -> Published:
        """Write the state after the last round: O(model + cohort) — the ledger and the metric
        history are the ledger log's, whose position the checkpoint vouches for.

        Returns:
            Its name and digest.
        """
        rec = self._rec
        s, k, c = rec.state, rec.keys, rec.plan
        public = {
            "next_round": s.next_round,
            **self._facts,
            "run_id": k.run_id,
            "identity": c.identity,
            "ledger_log": rec.ledger_log.position.to_dict(),
            "noise_multiplier": c.accounting.plan.noise_multiplier,
            "planned_epsilon": c.accounting.plan.epsilon,
            "initial_sha256": k.initial_sha256,
            "amplified": c.accounting.plan.amplified,
            "accountant": c.accounting.plan.accountant.get("name"),
            "pending_overrides": {str(r): v for r, v in s.pending_overrides.items()},
            "empty_streak": s.empty_streak,
        }
        self._secrets.put(SALT, k.salt)
        self._secrets.put(SECRET, k.secret)
        if k.sampler_key is not None:
            self._secrets.put(SAMPLER_KEY, k.sampler_key)
        noise = rec.noise.save(self.state_dir, self._secrets)
        secrets = self._secrets.take()
        published = write_checkpoint(
            self.state_dir,
            f"round-{s.next_round:06d}",
            {"model": s.params, "momentum": s.momentum},
            public,
            noise,
            secrets,
            k.secret,
        )
        self._secrets.publish(secrets)
        if self._old_layout:
            remove_previous_layout(self.state_dir)
            self._old_layout = False
        return published

    def release(
        self, t: int, ckpt: Published | Checkpoint, cohort: Iterable[str] | None = None
    ) -> None:
        """Release round ``t`` (checkpoint ``ckpt``, the users of its ``cohort``): its cohort's
        entries to the per-user store, then the journal, then the registry. Without ``cohort`` (a
        round released on resume, whose store was checked against the ledger at the start) it is
        read from the ledger — O(population); a round's own release passes its cohort —
        O(cohort).

        Args:
            t: the round, 0-based.
            ckpt: the checkpoint that holds the state after it.
            cohort: its users (None: read from the ledger).
        """
        rec = self._rec
        if cohort is None:
            cohort = (u for u, rs in rec.state.ledger.selected.items() if t in rs)
        else:
            cohort = list(cohort)
            rec.users.commit_round(
                rec.state.ledger.selected, cohort, rec.hashed, rec.ledger_log.position
            )
        users = [rec.hashed(u) for u in sorted(set(cohort))]  # hashed once per run start
        entry = self._journal.append(
            rec.keys.secret,
            run_id=rec.keys.run_id,
            round_index=t,
            cohort_sha256=cohort_digest(users),
            checkpoint=ckpt.name,
            manifest_sha256=ckpt.digest,
            prev=self._last_hash,
            # the key segment that drew row Z_t: with the checkpoint's table, t replays exactly
            noise_segment=rec.noise.segments.segment_for(t).public(),
        )
        rec.registry.record(rec.keys.run_id, t, entry.noise_round, entry.hash)
        self._last_hash = entry.hash


def restore(
    ctx: RunPlan, ckpt: Checkpoint, noise: NoiseStream, initial_sha256: str
) -> tuple[RunState, RunSecrets, LedgerLog]:
    """The state and secrets of a verified checkpoint, and the ledger log at its position (read and
    checked: the ledger and metric history are rebuilt from it); refuses one of another run,
    factorization, σ, model or initial model, naming what differs.

    Args:
        ctx: the run's plan.
        ckpt: the checkpoint (`corrflow.run.checkpoint.load_checkpoint`).
        noise: the noise stream restored from it.
        initial_sha256: the SHA-256 of the initial model the run is started with.

    Returns:
        The state, the secrets and the ledger log.

    Raises:
        IntegrityError: see above.
    """
    public = ckpt.public
    _check_same_run(ctx, ckpt, initial_sha256)
    params = ckpt.arrays("model")
    if [tuple(p.shape) for p in params] != [tuple(s) for s in ctx.layout.trainable_shapes]:
        raise IntegrityError(f"{ckpt.path}: model shapes differ from the model being trained")
    momentum = ckpt.arrays("momentum")
    if [tuple(m.shape) for m in momentum] != [tuple(p.shape) for p in params]:
        raise IntegrityError(
            f"{ckpt.path}: the optimizer's momentum does not fit the model's shapes"
        )
    ledger_log, ledger, history = _read_ledger(ckpt)
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
            f"{ckpt.path}: noise state is at round {noise.next_round}, model at {state.next_round}"
        )
    keys = RunSecrets(
        ckpt.secrets[SALT],
        ckpt.secrets[SECRET],
        _sampler_key(ctx, ckpt),
        public["run_id"],
        public.get("initial_sha256", initial_sha256),
    )
    log.info("corrflow: resumed from %s at round %d", ckpt.name, state.next_round + 1)
    return state, keys, ledger_log


def _check_same_run(ctx: RunPlan, ckpt: Checkpoint, initial_sha256: str) -> None:
    """Refuse a checkpoint of other settings, another factorization, σ, accounting regime or
    initial model, naming what differs."""
    cfg, sigma, public = ctx.cfg, ctx.accounting.plan.noise_multiplier, ckpt.public
    where = f"{ckpt.path}:state.json"
    if public["config_fingerprint"] != cfg.fingerprint():
        diff = settings_conflict(ckpt.state_dir, cfg.run_settings()) or "unrecorded settings"
        raise IntegrityError(
            f"{where}: the checkpoint belongs to a run with other settings ({diff}); "
            "resume with the same settings, or start a new run with --fresh"
        )
    if public["factorization_sha256"] != ctx.factorization.sha256():
        raise IntegrityError(f"{ckpt.path}: the checkpoint was made with another factorization")
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
        SAMPLER_KEY in ckpt.secrets and not plan.amplified
    ):
        # The run's accounting (the bound, and whether its cohorts are secret) is fixed when it
        # starts: a resume that re-plans to another regime would change the planned ε and the
        # cohorts' key mid-run.
        raise IntegrityError(
            f"{where}: the run started with accountant {was[1]} "
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


def _read_ledger(ckpt: Checkpoint) -> tuple[LedgerLog, Ledger, list[dict]]:
    """The ledger log at the position the checkpoint vouches for, and the ledger and metric history
    replayed from it (IntegrityError when it records another number of rounds)."""
    public = ckpt.public
    ledger_log = LedgerLog(ckpt.state_dir / LEDGER_LOG)
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


def _sampler_key(ctx: RunPlan, ckpt: Checkpoint) -> bytes | None:
    """The private key the amplified plan's cohorts are drawn from (its earlier rounds replay from
    it)."""
    if not ctx.accounting.plan.amplified:
        return None
    if SAMPLER_KEY not in ckpt.secrets:
        raise IntegrityError(
            f"{Path(ckpt.state_dir) / SAMPLER_KEY}: missing from a checkpoint (written by a "
            "corrflow that drew amplified cohorts from the public schedule seed): the amplified ε "
            "would not hold for its cohorts. Start a new run with --fresh"
        )
    return ckpt.secrets[SAMPLER_KEY]
