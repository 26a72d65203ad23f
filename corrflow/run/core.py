"""A run of correlated-noise training, without Flower: `prepare` decides the frozen
`RunPlan`; `Run` owns everything that changes — the state, the
noise stream, the secrets and the files — and is driven round by round::

    run = Run.start(plan, initial_arrays, open_run_directory(run_dir))
    while (round_plan := run.plan_next()) is not None:
        routed = round_plan.route(user_to_node, online)  # who trains what
        replies = [...]  # one corrflow.run.Reply per answer, from any transport
        if run.step(routed, replies) is None:
            break  # stopped: state.stopped_reason says why

``step`` is the one place the run's state changes (a round, a stop or an override goes through
`Run._apply`); outside the run, the state is a read-only `RunView`.
A step computes the round — clip → sum → noise → optimizer → finite check, with the ε that
``plan_next`` computed for the budget guard — into a `RoundRecord` without touching disk, applies it
to the state in memory, then commits it (`corrflow.run.store.RunStore.commit`: ledger log →
checkpoint → per-user store → release journal → registry → the operator's round line), then writes
the report and metrics (every `REPORT_EVERY` rounds, at the end and at every stop): the order that
makes a kill at any point safe; a round's own writes are O(model + cohort), never O(population).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from corrflow.accounting.policy import RunAccounting, pattern_followed
from corrflow.accounting.tracking import IncrementalSensitivity
from corrflow.config import RunConfig
from corrflow.errors import IntegrityError, InvalidArgumentError, NoiseWorkerLostError, require
from corrflow.fileio import write_text
from corrflow.planning import build_planner, load_or_build_factorization, plan_privacy
from corrflow.planning.learnability import check_learnable
from corrflow.planning.run import mechanism_notes
from corrflow.run.disclosure import Disclosure, DisclosureView, operator_log
from corrflow.run.journal import GENESIS
from corrflow.run.model import ModelLayout, arrays_sha256
from corrflow.run.noise import NoiseStream, NoiseView
from corrflow.run.noise_node_link import NoiseNodeStream
from corrflow.run.noise_shards import open_noise
from corrflow.run.optimizer import MomentumServerOptimizer, check_workload_matches
from corrflow.run.plan import RunPlan
from corrflow.run.recorder import REPORT_EVERY, Recorder
from corrflow.run.registry import ReleaseRegistry
from corrflow.run.resume import RUN_FILES, ResumePoint, archive_run, check_resume
from corrflow.run.round import (
    Reply,
    RoundPlan,
    RoundRecord,
    SummedReplies,
    budget_reason,
    collect,
    plan_round,
    reason_class,
    release,
)
from corrflow.run.state import Override, RunSecrets, RunState, RunView, Stop
from corrflow.run.store import RunStore, restore

log = logging.getLogger("corrflow")


def open_run_directory(run_dir: str | Path, fresh: bool = False) -> ResumePoint:
    """The run directory made private to git, an earlier run archived when asked or when it left
    files behind without a checkpoint, and what the directory resumes from (the caller holds its
    `RunLock`).

    Args:
        run_dir: the run directory (created if missing).
        fresh: move an earlier run aside (``previous-runs/``) and start anew.

    Returns:
        The `ResumePoint`: a new run, or the checkpoint to resume from.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / ".gitignore").exists():  # keys, ledger, cohorts: never in a `git add -A`
        write_text(
            run_dir / ".gitignore", "# corrflow run directory: private state, never commit it\n*\n"
        )
    if fresh:
        archive_run(run_dir)
    resume = check_resume(run_dir)
    if resume.checkpoint is None and any((run_dir / name).exists() for name in RUN_FILES):
        archive_run(run_dir, reason="a new run")  # an earlier run's report is never overwritten
    return resume


def prepare(
    cfg: RunConfig,
    users: Sequence[str],
    initial: Sequence[np.ndarray],
    names: Sequence[str] | None = None,
    identity: str = "user-id",
) -> RunPlan:
    """Everything a run decides before round 1: the cohort planner over the population, the
    factorization (built once, cached in ``cfg.state_dir``), σ and the planned ε, the server
    optimizer, the model's layout and the learnability check.

    Args:
        cfg: the run's settings (``num_users`` set).
        users: the population's stable user ids.
        initial: the initial model, every array in order.
        names: the arrays' names (default "0", "1", …).
        identity: where the ids come from, for the report (a plain loop's own ids: "user-id").

    Returns:
        The frozen `RunPlan`.
    """
    from corrflow.run.noise_shards import check_ray_address

    check_ray_address(cfg.ray_address)  # before the factorization and the registry are touched
    planner, item_home, bounding = build_planner(cfg, sorted(users))
    if bounding.get("dropped"):
        log.warning(
            "contribution bounding (k_u = %d) dropped %d of %d items",
            cfg.max_items_per_user,
            bounding["dropped"],
            bounding["items"],
        )
    fac = load_or_build_factorization(cfg, Path(cfg.state_dir))
    check_workload_matches(fac.workload, cfg.momentum, cfg.cooldown_fraction)
    notes = mechanism_notes(cfg, fac)
    for note in notes:
        log.warning("corrflow: %s", note)
    privacy = plan_privacy(cfg, fac, planner)
    privacy = replace(privacy, accountant={**privacy.accountant, "contribution_bounding": bounding})
    if privacy.amplified:
        log.info(
            "corrflow: amplified ε assumes the cohorts stay secret: they are drawn from a private "
            "key (not schedule-seed), kept 0600 in %s, and the ledger there names who trained; "
            "keep it private",
            Path(cfg.state_dir) / "state",
        )
    layout = ModelLayout.of(initial, names)
    # The training's share of the budget: the guard's target and the δ the training is accounted at.
    accounting = RunAccounting.of(
        fac, privacy, cfg.delta if privacy.delta is None else privacy.delta, privacy.target_epsilon
    )
    return RunPlan(
        cfg,
        layout,
        fac,
        planner,
        accounting,
        MomentumServerOptimizer(fac.workload, cfg.num_rounds, cfg.server_lr),
        item_home,
        identity,
        tuple(notes),
        check_learnable(
            fac, privacy.noise_multiplier, layout.trainable_arrays(initial), planner.expected
        ),
    )


def _begin(
    plan: RunPlan,
    params: list[np.ndarray],
    initial_sha256: str,
    noise_key: bytes | None,
    registry: ReleaseRegistry,
    initial_metrics: dict,
    received,
) -> tuple[RunState, RunSecrets, NoiseStream, Recorder, RunStore]:
    """The state, new secrets, noise stream, recorder and store of a new run from the trainable
    ``params``, its id claimed in the release registry (see `Run.start`)."""
    noise = open_noise(plan.cfg, plan.factorization, plan.layout.trainable_shapes, noise_key)
    state = RunState(
        params,
        [np.zeros_like(p) for p in params],
        sensitivity=IncrementalSensitivity(plan.factorization.encoder),
    )
    keys = RunSecrets.new(plan.accounting.plan.amplified, initial_sha256)
    recorder = Recorder(plan, state, keys, noise, registry, initial_metrics)
    recorder.received = received
    registry.claim(keys.run_id, recorder.run_dir)
    return state, keys, noise, recorder, RunStore(recorder)


def _resume(
    plan: RunPlan,
    resume: ResumePoint,
    initial_sha256: str,
    noise_key: bytes | None,
    registry: ReleaseRegistry,
    initial_metrics: dict,
    received,
) -> tuple[RunState, RunSecrets, NoiseStream, Recorder, RunStore]:
    """The state, secrets, noise stream, recorder and store of the checkpoint ``resume`` names,
    with what a kill left undone completed: the registry's and the journal's last release, then the
    report and metrics (see `Run.start`)."""
    # A new key segment from the checkpoint's next round on: rounds after a restart never repeat
    # the noise of an earlier start (corrflow.noise.segments).
    noise = open_noise(
        plan.cfg,
        plan.factorization,
        plan.layout.trainable_shapes,
        noise_key,
        resume.checkpoint,
    )
    state, keys, ledger_log = restore(plan, resume.checkpoint, noise, initial_sha256)
    last = resume.journal[-1].hash if resume.journal else GENESIS
    recorder = Recorder(plan, state, keys, noise, registry, initial_metrics, ledger_log)
    recorder.received = received
    store = RunStore(recorder, resume.checkpoint, last)
    registry.check(keys.run_id, recorder.run_dir, len(resume.journal))
    recorder.adoptions = registry.adoptions(keys.run_id)
    _complete_releases(
        store, registry, resume, keys.run_id, recorder.disclosure, state.metrics_history
    )
    # The report and metrics are complete every REPORT_EVERY rounds: after a kill they may lag
    # the journal by up to REPORT_EVERY − 1 rounds; a restart completes them first.
    recorder.write_report()
    recorder.write_metrics()
    return state, keys, noise, recorder, store


def _complete_releases(
    store: RunStore,
    registry: ReleaseRegistry,
    resume: ResumePoint,
    run_id: str,
    disclosure: Disclosure,
    metrics_history: list[dict],
) -> None:
    """Finish the release a kill interrupted: a journal entry the registry has not recorded, a
    round checkpointed but not yet journaled (released now with the noise in its checkpoint), and
    the operator's ``rounds.jsonl`` line of a released round."""
    # Killed between the journal's append and the registry's record: record it now.
    for entry in resume.journal[registry.released(run_id) :]:
        registry.record(run_id, entry.round, entry.noise_round, entry.hash)
    if resume.unreleased_round is not None:  # checkpointed, killed before its journal entry
        store.release(resume.unreleased_round, resume.checkpoint)
        log.info(
            "round %d was checkpointed but not released before the restart; released now",
            resume.unreleased_round + 1,
        )
    # killed after a release, before its operator line (`RunStore.commit` writes it last)
    disclosure.complete_rounds(metrics_history)


class Run:
    """A run in progress (see the module docstring). Build it with `start`."""

    def __init__(
        self,
        plan: RunPlan,
        state: RunState,
        keys: RunSecrets,
        noise: NoiseStream,
        recorder: Recorder,
        store: RunStore,
        evaluate: Callable[[list[np.ndarray]], dict] | None,
        on_round_end: Callable[[dict], None] | None,
    ):
        self._plan, self._state, self._keys, self._noise = plan, state, keys, noise
        self._recorder, self._store = recorder, store
        self._evaluate, self._on_round_end = evaluate, on_round_end
        # the round `plan_next` issued last: (round, users, overrides, its realised privacy)
        self._planned: tuple | None = None
        #: where reply-level events go (operator-only in an amplified run)
        self.log = operator_log(recorder.disclosure)

    @classmethod
    def start(
        cls,
        plan: RunPlan,
        initial: Sequence[np.ndarray],
        resume: ResumePoint,
        *,
        noise_key: bytes | None = None,
        evaluate: Callable[[list[np.ndarray]], dict] | None = None,
        on_round_end: Callable[[dict], None] | None = None,
        received=None,
    ) -> Run:
        """A new run from the model ``initial`` (all its arrays, in order), or the run the
        checkpoint ``resume`` names (its unreleased round is released now with the noise in its
        checkpoint; the rounds after it draw their noise with a fresh key: every start does).

        Args:
            plan: the run's plan (`prepare`).
            initial: the initial model; a resumed run refuses another one.
            resume: what the run directory resumes from (`open_run_directory`).
            noise_key: the key of this start's noise rows — a new run's, a resumed run's from its
                checkpoint on (tests and audits; default a fresh secret from the OS).
            evaluate: server-side evaluation of the trainable float32 arrays, whose metrics join
                each round's.
            on_round_end: called with each round's published metrics.
            received: under secure aggregation, the record of every reply the server received
                (`corrflow.strategies.wire.WireRecord`: ``to_dict()`` gives message type → kind →
                count), from which every report written derives ``secure_aggregation.server_saw``.

        Returns:
            The run, at its next round.
        """
        params = plan.layout.trainable_arrays(initial)
        initial_sha256 = arrays_sha256(initial)
        registry = ReleaseRegistry(plan.cfg.release_registry or None)
        initial_metrics = {"round": -1, **(evaluate(params) if evaluate else {})}
        if resume.checkpoint is None:
            state, keys, noise, recorder, store = _begin(
                plan, params, initial_sha256, noise_key, registry, initial_metrics, received
            )
        else:
            state, keys, noise, recorder, store = _resume(
                plan, resume, initial_sha256, noise_key, registry, initial_metrics, received
            )
        if keys.sampler_key is not None:
            plan.planner.seed_privately(keys.sampler_key)
        return cls(plan, state, keys, noise, recorder, store, evaluate, on_round_end)

    # -- reading -----------------------------------------------------------------------------------
    @property
    def plan(self) -> RunPlan:
        return self._plan

    @property
    def state(self) -> RunView:
        """The state, read-only: a view that reads through (nothing is copied)."""
        return RunView(self._state)

    @property
    def run_id(self) -> str:
        return self._keys.run_id

    @property
    def report_salt(self) -> bytes:
        """The salt of the hashed user ids the report and logs show."""
        return self._keys.salt

    @property
    def initial_sha256(self) -> str:
        return self._keys.initial_sha256

    @property
    def noise(self) -> NoiseView:
        """The noise stream's facts, read-only: only a round draws its rows."""
        return NoiseView(self._noise)

    @property
    def noise_node(self) -> NoiseNodeStream | None:
        """The noise node's side of the run's noise when a noise node adds it inside the secure sum
        (the secure driver hands it each round's recipe and receipts; it holds no key), else
        None."""
        return self._noise if isinstance(self._noise, NoiseNodeStream) else None

    @property
    def disclosure(self) -> DisclosureView:
        """What the run publishes and what only its operator sees, read-only: only the run writes
        the operator's files."""
        return DisclosureView(self._recorder.disclosure)

    def show_outside_guarantee(self, names: Iterable[str]) -> None:
        """List metrics the caller shows outside the DP release — a wrapped app's aggregated
        metrics ("train.NAME", "evaluate.NAME") — under the report's ``outside_guarantee``.

        Args:
            names: the metrics' names, as shown.
        """
        self._recorder.app_metrics.update(names)

    @property
    def done(self) -> bool:
        """All planned rounds are released, or the run stopped."""
        return self._state.next_round >= self._plan.cfg.num_rounds or bool(
            self._state.stopped_reason
        )

    def report(self) -> dict:
        """The privacy report so far.

        Returns:
            The report (docs "Conventions", Privacy report) as the operator holds it (before an
            amplified run's redactions of the published file).
        """
        return self._recorder.report()

    def learning(self) -> dict:
        """Whether the run learns.

        Returns:
            The report's learning section (losses, ρ, the verdict).
        """
        return self._recorder.learning()

    def write_report(self) -> Path:
        """Write ``privacy_report.json`` as published.

        Returns:
            Its path.
        """
        return self._recorder.write_report()

    def write_metrics(self) -> Path:
        """Write ``metrics.json`` (the initial model as round −1, then each round) as published.

        Returns:
            Its path.
        """
        return self._recorder.write_metrics()

    # -- driving -----------------------------------------------------------------------------------
    def plan_next(self) -> RoundPlan | None:
        """The next round's plan, before anything of it is committed.

        Returns:
            The sampled items and operator overrides after the separation policy, not yet routed to
            nodes (`route`); None once the run is complete or stopped — also when the budget guard
            stops it here (``state.stopped_reason`` says why).
        """
        s = self._state
        if self.done:
            return None
        t = s.next_round
        plan = plan_round(
            self._plan, t, s.ledger.selected, s.pending_overrides.get(t, []), self.log.warning
        )
        # the realised privacy after the round: the guard's, then the round's record (`step`)
        privacy = self._plan.accounting.after_round(
            s.ledger.selected, [*s.ledger.overrides, *plan.overrides], t, plan.users, s.sensitivity
        )
        reason = budget_reason(self._plan, plan, privacy.epsilon)
        if reason is not None:
            self._apply(Stop(reason))
            return None
        self._planned = (t, plan.users, plan.overrides, privacy)
        return plan

    def step(self, plan: RoundPlan, replies: Iterable[Reply] | SummedReplies) -> RoundRecord | None:
        """Release round ``plan.round``: clip and sum the replies, add the round's correlated
        noise, step the server optimizer, check the new model is finite — all in memory, with the
        ε `plan_next` computed for this plan — then commit (ledger log → checkpoint → journal →
        registry → the operator's round line; `RunStore.commit`) and write the report and metrics
        when due.

        Args:
            plan: the round's routed plan (`plan_next`, then `route`).
            replies: one `Reply` per answer, in any order; or a `SummedReplies` already clipped and
                summed (a secure-aggregation adapter's), which enters the same path after the sum.

        Returns:
            The round's `RoundRecord`; None when the round is refused because its model is not
            finite (NaN or Inf), or its noise could not be drawn (a noise worker lost for good):
            the run stops, nothing of the round is released.

        Raises:
            InvalidArgumentError: a plan that is not the run's next round, or a stopped run.
        """
        started, s = time.perf_counter(), self._state
        if plan.round != s.next_round or s.stopped_reason:
            raise InvalidArgumentError(
                "plan",
                f"the plan of round {s.next_round + 1}, the run's next (and a run not stopped)",
                plan.round + 1,
            )
        summed = (
            replies
            if isinstance(replies, SummedReplies)
            else collect(self._plan, plan, replies, s.params, self.log.warning)
        )
        # the guard's privacy when this is the plan it was computed for (else computed again)
        planned, self._planned = self._planned, None
        privacy = None
        if planned is not None and planned[:3] == (plan.round, plan.users, plan.overrides):
            privacy = planned[3]
        try:
            record = release(
                self._plan,
                plan,
                summed,
                s,
                self._noise,
                lambda: time.perf_counter() - started,
                privacy,
            )
        except NoiseWorkerLostError as lost:  # nothing of the round was released
            self._apply(Stop(str(lost)))
            return None
        # Nothing non-finite is ever released: the update's noise, a client update near float32's
        # range or a large server learning rate can overflow, and a NaN model would be checkpointed,
        # journaled and sent — training would go on from garbage without a word.
        if not all(np.isfinite(a).all() for a in (*record.params, *record.momentum)):
            self._apply(
                Stop(
                    f"round {plan.round + 1} of {self._plan.cfg.num_rounds} produced a non-finite "
                    f"model (NaN or Inf: server-lr {self._plan.cfg.server_lr:g}, σ·clip "
                    f"{self._plan.sigma * self._plan.cfg.clip_norm:g}); nothing of that round was "
                    "released"
                )
            )
            return None
        if self._evaluate is not None:
            record.metrics.update(self._evaluate(record.params))
        self._apply(record)
        return record

    def stop(self, reason: str) -> None:
        """Stop the run before its planned rounds (an interrupt), on the record.

        Args:
            reason: why, as the report's ``stopped_reason`` will say.
        """
        self._apply(Stop(reason))

    def override(self, round_index: int, items: Sequence[str]) -> None:
        """Operator override: add items to a future round's cohort (they pass through the separation
        monitor like sampled items; every override is listed in the privacy report, and an
        amplified run's report switches to post-hoc accounting).

        Args:
            round_index: a future round, 0-based.
            items: item ids known to the planner.
        """
        nxt = self._state.next_round
        require(round_index >= nxt, "round", f"a future round (≥ {nxt})", round_index)
        unknown = [i for i in items if i not in self._plan.planner.index]
        require(not unknown, "items", "item ids known to the planner", unknown)
        self._apply(Override(int(round_index), list(items)))

    # -- the one place state changes ---------------------------------------------------------------
    def _apply(self, change: RoundRecord | Stop | Override) -> None:
        """Apply a completed round (then its commit, the report and metrics), a stop, or an
        override."""
        s = self._state
        if isinstance(change, Override):
            s.pending_overrides.setdefault(int(change.round), []).extend(change.items)
        elif isinstance(change, Stop):
            s.stopped_reason = change.reason
            log.warning("training stops: %s", change.reason)
            self._recorder.write_report()
        else:
            self._apply_round(change)

    def _apply_round(self, r: RoundRecord) -> None:
        """O(cohort) appends to the state, then its commit (`RunStore.commit`)."""
        s, cfg = self._state, self._plan.cfg
        # only a round's own override records can leave the sampler's pattern
        followed_before = bool(r.overrides) and pattern_followed(s.ledger.overrides)
        if s.next_round != r.round or self._noise.next_round != r.noise_position:
            raise IntegrityError(
                f"round {r.round + 1} does not follow the run's state (next round "
                f"{s.next_round + 1}, noise at {self._noise.next_round})"
            )
        s.pending_overrides.pop(r.round, None)
        s.sensitivity.add(s.ledger.selected, r.round, r.users)  # reads the patterns before it
        s.ledger.record_round(r.round, r.users, r.accepted, r.rejections, r.overrides, r.epsilon)
        s.params, s.momentum, s.next_round = r.params, r.momentum, r.round + 1
        s.metrics_history.append(r.metrics)
        if r.asked:
            s.empty_streak = 0 if r.accepted else s.empty_streak + 1
        # ledger log → checkpoint (which vouches for the log's new position) → journal → registry
        # → the operator's round line
        self._store.commit(r)
        if (
            followed_before
            and not pattern_followed(s.ledger.overrides)
            and self._plan.accounting.plan.private
        ):
            why = (
                "min-sep broken and accepted (policy accept-and-account)"
                if any(o["action"] == "accepted-and-accounted" for o in r.overrides)
                else "an operator override"
            )
            log.warning(
                "round %d: %s: the report now uses post-hoc accounting of the realised "
                "participation, ε = %.4f",
                r.round + 1,
                why,
                r.epsilon,
            )
        if cfg.max_empty_rounds and s.empty_streak >= cfg.max_empty_rounds:
            s.stopped_reason = self._recorder.disclosure.stop_reason(
                self._empty_reason(),
                f"no valid replies in {s.empty_streak} consecutive rounds (the reasons are in the "
                "operator log)",
            )
            log.error("training stops: %s", s.stopped_reason)
        # The report and metrics list every user and round: written every REPORT_EVERY rounds, at
        # the last round and at every stop (the ledger log and journal hold each round at once).
        if s.next_round % REPORT_EVERY == 0 or self.done:
            self._recorder.write_report()
            self._recorder.write_metrics()
        if self._on_round_end is not None:
            self._on_round_end(self._recorder.disclosure.public_metrics(r.metrics))

    def _empty_reason(self) -> str:
        s = self._state
        first = s.next_round - s.empty_streak
        reasons: dict[str, int] = {}
        for r in s.ledger.rejections:
            if r["round"] >= first:
                why = reason_class(r["reason"])
                reasons[why] = reasons.get(why, 0) + 1
        top = ", ".join(
            f"{why} ×{n}" for why, n in sorted(reasons.items(), key=lambda kv: -kv[1])[:3]
        )
        return (
            f"no valid replies in {s.empty_streak} consecutive rounds "
            f"({first + 1}–{s.next_round}): {top or 'no replies arrived'}"
        )
