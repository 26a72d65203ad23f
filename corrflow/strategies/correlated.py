"""The correlated-noise Flower strategy (Message API; flwr 1.41/1.42).

A round is a short sequence of named steps (README "Conventions"), and state changes happen once, after the checks:

1. **plan** (no state change): the cohort planner (fixed-epoch schedule, b-min-sep or multi-attribution sampler,
   004) picks round t's items — SuperNodes (cross-device) or examples held by silos (cross-silo) — plus operator
   overrides; the separation monitor checks every user behind them against the design min-sep under the policy
   (``reject``, or ``accept-and-account``: include and switch to post-hoc accounting); the budget guard refuses a
   round that would exceed the target ε.
2. **collect**: replies are validated, zeroed if ℓ∞ > zeroing·clip (000 App. F.3) and clipped to ℓ2 ≤ clip on the
   server (a cross-silo sum of m per-item-clipped updates must already be within m·clip, or it is rejected).
3. **commit**: the ledger records the selections (silent or rejected users count as participating), replies,
   rejections and overrides.
4. **aggregate and step**: g_t = Σ clipped (summed in id order, so a restart reproduces it bit for bit);
   x̂_t = (g_t + σ·clip·(C⁻¹Z)_t) / planned cohort size (expected batch for samplers); the workload's server
   optimizer takes the step.
5. **record**: evaluation, then checkpoint → release-journal entry → privacy report → release of the model.

A round interrupted (SIGINT/SIGTERM) while replies are awaited is abandoned: nothing of it is committed or
released, and a restart redoes it. The run stops — on the record, in ``stopped_reason`` — at the budget guard, on an
operator interrupt, or after ``max_empty_rounds`` consecutive rounds without an accepted reply.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from corrflow.accounting.report import hash_user_id, participation_section, privacy_report, write_report
from corrflow.accounting.tracking import PrivacyPlan, RealizedPrivacy, RunPrivacy
from corrflow.errors import IntegrityError, InvalidArgumentError, require
from corrflow.factorization.base import Factorization
from corrflow.noise import CorrelatedNoise
from corrflow.noise.engine import restore_state, save_state
from corrflow.noise.prng import new_secret
from corrflow.participation.planner import CohortPlanner, SeparationMonitor
from corrflow.strategies.checkpoint import SAMPLER_KEY, SECRET, load_arrays, manifest_digest, write_checkpoint
from corrflow.strategies.config import StrategyConfig
from corrflow.strategies.journal import GENESIS, JOURNAL, ReleaseJournal, cohort_digest
from corrflow.strategies.ledger import Ledger
from corrflow.strategies.model import ModelLayout
from corrflow.strategies.run_state import ResumePoint, settings_conflict
from corrflow.strategies.server_optimizer import MomentumServerOptimizer, check_workload_matches
from corrflow.strategies.validation import RejectedReplyError, zero_or_clip

log = logging.getLogger("corrflow")

INTERRUPTED = "interrupted by the operator (SIGINT/SIGTERM)"


@dataclass
class RoundPlan:
    """Round t before anything is committed: included items, the users behind them (with multiplicity), the
    override/separation records and the rejections found so far, and which node trains which item(s)."""
    round: int
    items: list[str]
    users: list[str]
    overrides: list[dict] = field(default_factory=list)
    rejections: list[tuple[str, str]] = field(default_factory=list)      # (item or user, reason)
    expected: dict[int, str | list[str]] = field(default_factory=dict)   # node -> item (or items, cross-silo)


@dataclass
class RoundOutcome:
    accepted: dict[str, list[np.ndarray]]
    counts: dict[str, int]
    rejections: list[tuple[str | None, str]]
    contents: list[RecordDict]                 # the accepted replies, for the inner strategy's metrics


def exchange(grid: Grid, messages: list[Message], timeout: float, stop: threading.Event) -> list[Message] | None:
    """Push ``messages`` and pull their replies until all arrived, ``timeout`` passed or ``stop`` was set (then
    None: the round is abandoned). Flower's ``send_and_receive`` cannot be interrupted."""
    if not messages:
        return []
    pending = set(grid.push_messages(messages))
    if getattr(grid, "synchronous", False):
        return list(grid.pull_messages(pending))
    replies: list[Message] = []
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        if stop.is_set():
            return None
        got = list(grid.pull_messages(pending))
        replies.extend(got)
        pending.difference_update(m.metadata.reply_to_message_id for m in got)
        if pending:
            stop.wait(0.05)
    return None if stop.is_set() else replies


class CorrelatedNoiseStrategy(Strategy):
    """DP-FTRL / matrix-factorization training with correlated noise (see the module docstring)."""

    def __init__(self, config: StrategyConfig, factorization: Factorization,
                 initial: ArrayRecord | list[np.ndarray],
                 directory: dict[int, str], *, privacy: PrivacyPlan,
                 noise_key: bytes | None = None, out_dir: str | Path | None = None, on_round_end=None,
                 planner: CohortPlanner | None = None, item_home: dict[str, str] | None = None,
                 resume: ResumePoint | None = None,
                 identity: str = "partition-id", evaluate: Callable[[list[np.ndarray]], dict] | None = None,
                 resolve_nodes: Callable[[list[int]], dict[int, str]] | None = None,
                 stop_event: threading.Event | None = None, inner: Strategy | None = None,
                 report_extra: Callable[[CorrelatedNoiseStrategy], dict] | None = None):
        require(factorization.rounds == config.num_rounds, "factorization",
                f"{config.num_rounds} rounds (num-rounds)", factorization.rounds)
        check_workload_matches(factorization.workload, config.momentum, config.cooldown_fraction)
        self.cfg, self.fac = config, factorization
        self.privacy_plan = privacy
        self.sigma = float(privacy.noise_multiplier)
        self.planned_epsilon = privacy.epsilon
        self.layout = ModelLayout.of(initial)
        self.shapes = self.layout.trainable_shapes
        self.inner = inner   # the wrapper's strategy: its train config and metric aggregation are kept
        self.node_to_user = {int(k): str(v) for k, v in directory.items()}
        self.user_to_node = {u: n for n, u in self.node_to_user.items()}
        self.identity = identity
        self._resolve_nodes = resolve_nodes
        self._unmapped: set[int] = set()
        if planner is None:  # every node is an item and its own user
            ids = sorted(self.user_to_node)
            planner = CohortPlanner(config.participation, ids, [[i] for i in range(len(ids))], ids,
                                    config.num_rounds, config.b, rate=config.participation_rate,
                                    seed=config.schedule_seed)
        part = factorization.participation
        require(part.min_sep == planner.min_sep and part.epochs >= planner.max_participations
                and (part.kind == "fixed-epoch") == (planner.kind == "fixed-epoch"), "factorization",
                f"{planner.kind} participation with min-sep {planner.min_sep} and ≤ {planner.max_participations} "
                "participations", part.describe())
        self.planner = planner
        self.item_home = item_home           # cross-silo: item id -> the silo's identity
        require((item_home is not None) == (config.mode == "cross-silo"), "mode",
                "an item → silo map exactly in cross-silo mode")
        self.monitor = SeparationMonitor(planner.min_sep)
        self._pending_overrides: dict[int, list[str]] = {}
        self._pending: RoundPlan | None = None
        self._warned_posthoc = False
        self._warned_inner_config = False
        self.privacy = RunPrivacy(factorization, privacy, config.delta)
        self.state_dir = Path(config.state_dir)
        self.out_dir = Path(out_dir) if out_dir is not None else self.state_dir
        self.journal = ReleaseJournal(self.out_dir / JOURNAL)
        self.on_round_end = on_round_end
        self.evaluate = evaluate
        self.report_extra = report_extra  # sections the session adds to the report (the learning verdict)
        self.stop_event = stop_event or threading.Event()
        self.metrics_history: list[dict] = []
        self.stopped_reason: str | None = None
        self.empty_streak = 0
        resume = resume or ResumePoint(None, [], None)
        self._last_hash = resume.journal[-1].hash if resume.journal else GENESIS
        if resume.checkpoint is None:
            self.params = self.layout.trainable_arrays(initial)
            self.optimizer = MomentumServerOptimizer(factorization.workload, config.num_rounds, config.server_lr,
                                                     self.shapes)
            self.noise = CorrelatedNoise(factorization, self.shapes, 1.0, key=noise_key or new_secret())
            self.ledger = Ledger()
            self.salt = secrets.token_bytes(32)
            self.secret = secrets.token_bytes(32)
            self.sampler_key = secrets.token_bytes(32) if privacy.amplified else None
            self.run_id = secrets.token_hex(8)
            self.next_round = 0
        else:
            self._restore(resume.checkpoint)
            if resume.unreleased_round is not None:  # checkpointed, then killed before its journal entry
                self._journal(resume.unreleased_round, resume.checkpoint)
                log.info("round %d was checkpointed but not released before the restart; released now",
                         resume.unreleased_round)
        if self.sampler_key is not None:
            self.planner.seed_privately(self.sampler_key)

    # -- Flower Strategy API --------------------------------------------------------------------------------------
    def initial_arrays(self) -> ArrayRecord:
        return self.layout.record(self.params)

    def override(self, round_index: int, items: list[str]) -> None:
        """Operator override: add ``items`` to round ``round_index``'s cohort. They pass through the separation
        monitor like sampled items, and every override is listed in the privacy report."""
        require(round_index >= self.next_round, "round", f"a future round (≥ {self.next_round})", round_index)
        unknown = [i for i in items if i not in self.planner.index]
        require(not unknown, "items", "item ids known to the planner", unknown)
        self._pending_overrides.setdefault(int(round_index), []).extend(items)

    def start(self, grid: Grid, initial_arrays: ArrayRecord | None = None, num_rounds: int | None = None,
              timeout: float | None = None, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None, evaluate_fn=None) -> Result:
        """Run the remaining rounds (a resumed run continues where its checkpoint stands), each followed by the
        optional centralized ``evaluate_fn(round, arrays)`` and the inner strategy's federated evaluation. Replies
        are awaited in an interruptible loop; an interrupt abandons the round in flight unreleased."""
        timeout = self.cfg.node_timeout if timeout is None else timeout
        last = self.cfg.num_rounds if num_rounds is None else min(self.cfg.num_rounds, self.next_round + num_rounds)
        arrays = self.initial_arrays()
        result = Result(arrays=arrays)   # a finished or resumed run returns its current model
        while self.next_round < last and not self.stopped_reason and not self.stop_event.is_set():
            server_round = self.next_round + 1
            messages = list(self.configure_train(server_round, arrays, train_config or ConfigRecord(), grid))
            if self.stopped_reason:
                break
            replies = exchange(grid, messages, timeout, self.stop_event)
            if replies is None:
                self._pending = None   # abandoned: nothing of this round is committed or released
                break
            new_arrays, metrics = self.aggregate_train(server_round, replies)
            if new_arrays is None:
                continue
            arrays = result.arrays = new_arrays
            result.train_metrics_clientapp[server_round] = metrics
            if evaluate_fn is not None and (res := evaluate_fn(server_round, arrays)) is not None:
                result.evaluate_metrics_serverapp[server_round] = res
            evaluation = list(self.configure_evaluate(server_round, arrays, evaluate_config or ConfigRecord(), grid))
            ev = exchange(grid, evaluation, timeout, self.stop_event) if evaluation else None
            if ev is not None and (agg := self.aggregate_evaluate(server_round, ev)) is not None:
                result.evaluate_metrics_clientapp[server_round] = agg
        if self.stop_event.is_set() and not self.stopped_reason and self.next_round < self.cfg.num_rounds:
            self._stop(f"{INTERRUPTED} before round {self.next_round + 1} of {self.cfg.num_rounds}; nothing of that "
                       "round was released")
        return result

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        t = self.next_round
        if t >= self.cfg.num_rounds or self.stopped_reason:
            return []
        self._map_new_nodes(grid)
        plan = self._plan_round(t)
        if (reason := self._budget_guard(plan)) is not None:
            self._stop(reason)
            return []
        messages = self._messages(plan, arrays, config, grid)
        self._pending = plan
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        plan, self._pending = self._pending, None
        if plan is None or plan.round != self.next_round or self.stopped_reason:
            return None, None
        started = time.perf_counter()
        outcome = self._collect(plan, replies)
        self._commit(plan, outcome)
        update = self._aggregate(plan, outcome)
        self.params = self.optimizer.step(self.params, update, plan.round)
        self.next_round = plan.round + 1
        self.ledger.rounds_completed = self.next_round
        metrics = self._record(plan, outcome, time.perf_counter() - started)
        record = MetricRecord({k: float(v) for k, v in metrics.items() if isinstance(v, int | float)})
        if self.inner is not None and outcome.contents:   # the user's strategy aggregates the replies' metrics
            record = self._inner_metrics(outcome.contents) or record
        return self.layout.record(self.params), record

    def configure_evaluate(self, server_round, arrays, config, grid):
        """Federated evaluation is the inner strategy's (its metrics are computed on clients' data and are not
        covered by the DP guarantee, as with Flower's own DP wrappers); corrflow alone evaluates server-side."""
        return [] if self.inner is None else self.inner.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round, replies):
        return None if self.inner is None else self.inner.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        log.info("corrflow: %d rounds completed, realised ε = %.4f (δ = %g)", self.next_round,
                 self.ledger.epsilon_history[-1] if self.ledger.epsilon_history else 0.0, self.cfg.delta)

    # -- round steps ----------------------------------------------------------------------------------------------
    def _plan_round(self, t: int) -> RoundPlan:
        """Sampled items plus operator overrides, after the separation policy. Changes no state."""
        sampled = self.planner.cohort(t)
        forced = [i for i in self._pending_overrides.get(t, []) if i not in sampled]
        plan = RoundPlan(t, [], [])
        for item in sampled + forced:
            owners = self.planner.users_of(item)
            gaps = {u: g for u in owners if (g := self.monitor.violates(self.ledger.selected, u, t)) is not None}
            source = "override" if item in forced else "sampler"
            if gaps or source == "override":
                action = "included" if not gaps else ("rejected" if self.cfg.policy == "reject"
                                                      else "accepted-and-accounted")
                plan.overrides.append({"round": t, "item": item, "source": source, "users": owners,
                                       "gap": min(gaps.values()) if gaps else None, "action": action})
                if action == "rejected":
                    plan.rejections.append((item, f"separation: gap {min(gaps.values())} < min-sep "
                                                  f"{self.planner.min_sep} (policy reject)"))
                    log.warning("round %d: %s item %s breaks min-sep for %d user(s); rejected", t, source, item,
                                len(gaps))
                    continue
            plan.items.append(item)
            plan.users.extend(owners)
        return plan

    def _budget_guard(self, plan: RoundPlan) -> str | None:
        """Why round ``plan.round`` must not happen (it would exceed the target ε), else None."""
        if self.cfg.target_epsilon <= 0:
            return None
        prospective = {u: list(r) for u, r in self.ledger.selected.items()}
        for u in plan.users:
            prospective.setdefault(u, []).append(plan.round)
        eps = self._realized(prospective, plan.overrides).epsilon
        if eps is not None and eps > self.cfg.target_epsilon * (1 + 1e-9):
            return (f"budget guard: round {plan.round + 1} of {self.cfg.num_rounds} would spend ε = {eps:.4f} > "
                    f"target {self.cfg.target_epsilon}")
        return None

    def _messages(self, plan: RoundPlan, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> list[Message]:
        online = set(int(n) for n in grid.get_node_ids())
        cfg = ConfigRecord({"server-round": plan.round, "local-lr": self.cfg.local_lr,
                            "local-steps": self.cfg.local_steps, "clip-norm": self.cfg.clip_norm, "seed": self.cfg.seed,
                            **self._user_config(plan.round + 1, arrays, config, grid)})
        if self.cfg.data_path:  # clients read their user's examples from the same dataset file
            cfg.update({"data-path": self.cfg.data_path, "vocab-path": self.cfg.vocab_path,
                        "seq-len": self.cfg.seq_len})
        targets: dict[int, list[str]] = {}
        for item in plan.items:
            home = item if self.item_home is None else self.item_home[item]
            node = self.user_to_node.get(home)
            if node is None or node not in online:
                plan.rejections.append((item, "offline when selected"))
                continue
            targets.setdefault(node, []).append(item)
        messages = []
        for node, items in targets.items():
            content = {"arrays": arrays, "config": cfg}
            if self.item_home is None:
                plan.expected[node] = items[0]
            else:  # cross-silo: the silo trains on exactly these examples, clipping each
                plan.expected[node] = items
                content["config"] = ConfigRecord({**dict(cfg), "item-ids": list(items)})
            messages.append(Message(content=RecordDict(content), message_type=MessageType.TRAIN, dst_node_id=node))
        return messages

    def _collect(self, plan: RoundPlan, replies: Iterable[Message]) -> RoundOutcome:
        """Validate, zero or clip every reply. Changes no state."""
        t = plan.round
        accepted: dict[str, list[np.ndarray]] = {}
        counts = {"kept": 0, "clipped": 0, "zeroed": 0, "rejected": 0}
        rejections: list[tuple[str | None, str]] = []
        contents: list[RecordDict] = []
        for msg in replies:
            key = None
            try:
                key, update, items = self._validate(msg, plan.expected, accepted)
                # Cross-silo sums of per-item-clipped updates: allow float32 rounding, then re-check the bound.
                bound = items * self.cfg.clip_norm * (1 + 1e-5 if self.item_home is not None else 1)
                update, action = zero_or_clip(update, bound, self.cfg.zeroing_factor * self.cfg.clip_norm / bound)
                if self.item_home is not None and action == "clipped":
                    raise RejectedReplyError(f"per-item clipping not honoured: the sum of {items} items exceeds "
                                             f"{items} × clip-norm = {items * self.cfg.clip_norm:g}")
            except RejectedReplyError as exc:
                counts["rejected"] += 1
                rejections.append((key or self._sender_user(msg), exc.reason))
                log.warning("round %d: rejected reply from %s: %s", t, key or msg.metadata.src_node_id, exc.reason)
                continue
            if action == "zeroed":
                log.warning("round %d: zeroed reply from %s: ℓ∞ above %g × clip-norm (000 App. F.3)", t, key,
                            self.cfg.zeroing_factor)
            counts[action] += 1
            accepted[key] = update
            contents.append(msg.content)
        return RoundOutcome(accepted, counts, rejections, contents)

    def _commit(self, plan: RoundPlan, outcome: RoundOutcome) -> None:
        """The round happens: record it in the ledger (selected counts as participating, whether or not it
        replied)."""
        t = plan.round
        self._pending_overrides.pop(t, None)
        self.ledger.overrides.extend(plan.overrides)
        self.ledger.select(t, plan.users)
        for who, reason in plan.rejections + outcome.rejections:
            self.ledger.reject(t, who, reason)
        for key in sorted(outcome.accepted):
            self.ledger.accept(t, key)
        if not self._warned_posthoc and self.sigma > 0 and self._posthoc_active():
            self._warned_posthoc = True
            log.warning("round %d: min-sep broken and accepted (policy accept-and-account): the report now uses "
                        "post-hoc accounting of the realised participation, ε = %.4f", t, self._realized(
                            self.ledger.selected).epsilon)

    def _aggregate(self, plan: RoundPlan, outcome: RoundOutcome) -> list[np.ndarray]:
        """x̂_t = (Σ clipped + σ·clip·(C⁻¹Z)_t) / planned cohort size."""
        total = [np.zeros(s, dtype=np.float32) for s in self.shapes]
        for key in sorted(outcome.accepted):
            for acc, u in zip(total, outcome.accepted[key], strict=True):
                acc += u
        cohort = self._planned_cohort(plan.round)
        if self.sigma > 0:
            noise = self.noise.next(plan.round)
            scale = np.float32(self.sigma * self.cfg.clip_norm)
            return [(g + scale * w) / cohort for g, w in zip(total, noise, strict=True)]
        self.noise.skip_round()   # non-private baseline
        return [g / cohort for g in total]

    def _planned_cohort(self, t: int) -> np.float32:
        # The planned size, not the number of replies: the fixed-epoch group, or the sampler's expected batch.
        return np.float32(len(self.planner.cohort(t)) if self.planner.kind == "fixed-epoch"
                          else self.planner.expected)

    def _record(self, plan: RoundPlan, outcome: RoundOutcome, seconds: float) -> dict:
        """Evaluate, checkpoint, journal, report — in that order, before the model leaves the server."""
        t = plan.round
        eps = self._realized(self.ledger.selected).epsilon
        self.ledger.epsilon_history.append(eps)
        reasons = Counter(_reason_class(r) for _, r in plan.rejections + outcome.rejections)
        metrics = {"round": t, "replies": len(outcome.accepted), "accepted": len(outcome.accepted),
                   "cohort": float(self._planned_cohort(t)), **outcome.counts,
                   "rejected": len(plan.rejections) + outcome.counts["rejected"],
                   "top_rejection": reasons.most_common(1)[0][0] if reasons else None,
                   "aggregation_seconds": seconds}
        if eps is not None:
            metrics["epsilon"] = eps
        if self.evaluate is not None:
            metrics.update(self.evaluate(self.params))
        self.metrics_history.append(metrics)
        if plan.items:   # a round that asked nobody (an empty sample) neither breaks nor extends a streak
            self.empty_streak = 0 if outcome.accepted else self.empty_streak + 1
        ckpt = self._checkpoint()
        self._journal(t, ckpt)
        if self.cfg.max_empty_rounds and self.empty_streak >= self.cfg.max_empty_rounds:
            self.stopped_reason = self._empty_reason()
            log.error("training stops: %s", self.stopped_reason)
        self.write_report()
        if self.on_round_end is not None:
            self.on_round_end(self, metrics)
        return metrics

    def _empty_reason(self) -> str:
        first = self.next_round - self.empty_streak
        reasons = Counter(_reason_class(r["reason"]) for r in self.ledger.rejections if r["round"] >= first)
        top = ", ".join(f"{why} ×{n}" for why, n in reasons.most_common(3)) or "no replies arrived"
        return f"no valid replies in {self.empty_streak} consecutive rounds ({first + 1}–{self.next_round}): {top}"

    def _stop(self, reason: str) -> None:
        self.stopped_reason = reason
        log.warning("training stops: %s", reason)
        self.write_report()

    def _journal(self, t: int, ckpt: Path) -> None:
        users = [hash_user_id(u, self.salt) for u in sorted(u for u, rs in self.ledger.selected.items() if t in rs)]
        entry = self.journal.append(self.secret, run_id=self.run_id, round_index=t, cohort_sha256=cohort_digest(users),
                                    checkpoint=ckpt.name, manifest_sha256=manifest_digest(ckpt),
                                    prev=self._last_hash)
        self._last_hash = entry.hash

    def _user_config(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord | None, grid: Grid) -> dict:
        """The user's train config; with an inner strategy, what its ``configure_train`` would send (e.g. FedProx's
        ``proximal-mu``) — its choice of nodes is discarded, corrflow's schedule decides who trains."""
        user = dict(config or {})
        if self.inner is not None:
            flwr_log = logging.getLogger("flwr")
            level = flwr_log.level
            flwr_log.setLevel(logging.WARNING)   # its "Sampled N nodes" would be wrong: corrflow picks the cohort
            try:
                probe = _ConfigProbeGrid(grid, self.inner)
                for msg in self.inner.configure_train(server_round, arrays, ConfigRecord(user), probe):
                    user.update(dict(msg.content.config_records.get("config", ConfigRecord())))
                    break
                else:
                    if not self._warned_inner_config:
                        log.warning("the inner strategy's configure_train sent no message (fraction_train = 0?): "
                                    "corrflow's cohort trains with the train_config alone")
                        self._warned_inner_config = True
            finally:
                flwr_log.setLevel(level)
        return user

    def _inner_metrics(self, contents: list[RecordDict]) -> MetricRecord | None:
        aggregate = getattr(self.inner, "train_metrics_aggr_fn", None)
        if aggregate is None:
            return None
        try:
            return aggregate(contents, getattr(self.inner, "weighted_by_key", "num-examples"))
        except Exception as exc:  # a user's aggregation function; the round itself is already recorded
            log.warning("the inner strategy's train-metrics aggregation failed: %s", exc)
            return None

    # -- node identities ------------------------------------------------------------------------------------------
    def _map_new_nodes(self, grid: Grid) -> None:
        """A node that was not in the node → user map (a reconnected SuperNode with a new node id) is mapped by
        the declared identity before it can be scheduled; until then it is never selected."""
        online = set(int(n) for n in grid.get_node_ids())
        new = sorted(online - set(self.node_to_user) - self._unmapped)
        if not new or self._resolve_nodes is None:
            return
        for node, user in self._resolve_nodes(new).items():
            old = self.user_to_node.get(user)
            if old is None or (old in online and old != node):
                continue   # not in this run's population, or its identity is in use by a live node
            del self.node_to_user[old]
            self.node_to_user[node], self.user_to_node[user] = user, node
            log.info("node %d is %s again (was node %d)", node, hash_user_id(user, self.salt), old)
        self._unmapped.update(n for n in new if n not in self.node_to_user)

    # -- helpers ------------------------------------------------------------------------------------------------
    def _sender_user(self, msg: Message) -> str | None:
        return self.node_to_user.get(int(msg.metadata.src_node_id))

    def _validate(self, msg: Message, expected_by_node: dict, accepted: dict) -> tuple[str, list[np.ndarray], int]:
        """(item or silo id, update, items it sums) of a well-formed reply, else RejectedReplyError."""
        node = int(msg.metadata.src_node_id)
        expected = expected_by_node.get(node)
        if expected is None:
            raise RejectedReplyError(f"unexpected sender node {node} (not selected this round)")
        key = expected if isinstance(expected, str) else self.node_to_user[node]
        if msg.has_error():
            raise RejectedReplyError(f"client error: {msg.error.reason}")
        if key in accepted:
            raise RejectedReplyError("duplicate reply")
        content = msg.content
        keys = set(content.keys())
        if keys != {"arrays", "metrics"}:
            raise RejectedReplyError(f"reply records {sorted(keys)}, expected ['arrays', 'metrics']")
        if not isinstance(content["arrays"], ArrayRecord) or not isinstance(content["metrics"], MetricRecord):
            raise RejectedReplyError("'arrays' must be an ArrayRecord and 'metrics' a MetricRecord")
        items = 1
        if not isinstance(expected, str):  # cross-silo: the reply must sum exactly the items sent
            items = len(expected)
            got = content["metrics"].get("num-items")
            if got != items:
                raise RejectedReplyError(f"metric num-items = {got!r}, expected {items} (the item ids sent)")
        return key, self.layout.update_from_reply(content["arrays"], self.params, self.cfg.reply_kind), items

    def _posthoc_active(self, extra: list[dict] = ()) -> bool:
        """Whether the sampler's pattern was left: a min-sep break was accounted, or an operator forced an item in
        (amplification assumes participation comes from the sampler's randomness alone)."""
        return any(o["action"] == "accepted-and-accounted" or (o["source"] == "override" and o["action"] != "rejected")
                   for o in [*self.ledger.overrides, *extra])

    def _realized(self, selected: dict[str, list[int]], extra_overrides: list[dict] = ()) -> RealizedPrivacy:
        """ε of the realised pattern (the plan's while an amplified plan's pattern is followed, else post-hoc)."""
        return self.privacy.realized(selected, pattern_followed=not self._posthoc_active(extra_overrides))

    def report(self) -> dict:
        real = self._realized(self.ledger.selected)
        overrides = [{**o, "item": hash_user_id(o["item"], self.salt),
                      "users": [hash_user_id(u, self.salt) for u in o["users"]]} for o in self.ledger.overrides]
        k_u = self.planner.items_per_user
        return privacy_report(
            factorization=self.fac, noise_multiplier=self.sigma, clip_norm=self.cfg.clip_norm, delta=self.cfg.delta,
            target_epsilon=self.cfg.target_epsilon or None, accountant=self.privacy_plan.accountant,
            planned={"sensitivity": float(k_u) * self.fac.sensitivity.value,
                     "sensitivity_exact": self.fac.sensitivity.exact and k_u == 1, "epsilon": self.planned_epsilon,
                     "participation": {**self.planner.to_dict(), "mode": self.cfg.mode}},
            realized={"sensitivity": real.sensitivity, "sensitivity_exact": real.sensitivity_exact,
                      "epsilon": real.epsilon, "accounting": real.accounting,
                      "participation": participation_section(self.ledger.selected, self.salt, self.cfg.policy,
                                                             overrides),
                      "rejections": len(self.ledger.rejections)},
            rounds_completed=self.next_round, rounds_planned=self.cfg.num_rounds,
            stopped_reason=self.stopped_reason, run_id=self.run_id,
            identity={"source": self.identity, "stable_across_restarts": self.identity != "per-launch"},
            **(self.report_extra(self) if self.report_extra is not None else {}))

    def write_report(self) -> Path:
        return write_report(self.report(), self.out_dir / "privacy_report.json")

    def _checkpoint(self) -> Path:
        public = {"next_round": self.next_round, "config_fingerprint": self.cfg.fingerprint(),
                  "settings": self.cfg.run_settings(), "run_id": self.run_id, "identity": self.identity,
                  "factorization_sha256": self.fac.sha256(), "ledger": self.ledger.to_dict(),
                  "noise_multiplier": self.sigma, "planned_epsilon": self.planned_epsilon,
                  "pending_overrides": {str(k): v for k, v in self._pending_overrides.items()},
                  "metrics_history": self.metrics_history, "empty_streak": self.empty_streak}
        return write_checkpoint(self.state_dir, f"round-{self.next_round:06d}",
                                {"model": self.params, "optimizer": self.optimizer.m}, public,
                                {"report_salt": self.salt, SECRET: self.secret,
                                 **({SAMPLER_KEY: self.sampler_key} if self.sampler_key is not None else {})},
                                save_extra=lambda d: save_state(self.noise, d / "noise"))

    def _restore(self, ckpt: Path) -> None:
        public = json.loads((ckpt / "state.json").read_text())
        if public["config_fingerprint"] != self.cfg.fingerprint():
            diff = settings_conflict(self.state_dir, self.cfg.run_settings()) or "unrecorded settings"
            raise IntegrityError(f"{ckpt / 'state.json'}: the checkpoint belongs to a run with other settings "
                                 f"({diff}); resume with the same settings, or start a new run with --fresh")
        if public["factorization_sha256"] != self.fac.sha256():
            raise IntegrityError(f"{ckpt}: the checkpoint was made with another factorization")
        if public["noise_multiplier"] != self.sigma:
            raise InvalidArgumentError("noise-multiplier", f"{public['noise_multiplier']} (the checkpoint's)",
                                       self.sigma)
        self.params = load_arrays(ckpt, "model")
        if [tuple(p.shape) for p in self.params] != self.shapes:
            raise IntegrityError(f"{ckpt}: model shapes differ from the model being trained")
        self.optimizer = MomentumServerOptimizer(self.fac.workload, self.cfg.num_rounds, self.cfg.server_lr,
                                                 self.shapes)
        self.optimizer.m = load_arrays(ckpt, "optimizer")
        self.noise = restore_state(ckpt / "noise", self.fac)
        self.ledger = Ledger.from_dict(public["ledger"])
        self.metrics_history = public["metrics_history"]
        self.empty_streak = int(public.get("empty_streak", 0))
        self._pending_overrides = {int(k): list(v) for k, v in public.get("pending_overrides", {}).items()}
        self._warned_posthoc = self._posthoc_active()
        self.salt = (ckpt / "report_salt").read_bytes()
        self.secret = (ckpt / SECRET).read_bytes()
        self.sampler_key = self._restore_sampler_key(ckpt)
        self.run_id = public["run_id"]
        self.next_round = int(public["next_round"])
        if self.noise.next_round != self.next_round:
            raise IntegrityError(f"{ckpt}: noise state is at round {self.noise.next_round}, model at "
                                 f"{self.next_round}")
        log.info("corrflow: resumed from %s at round %d", ckpt.name, self.next_round)

    def _restore_sampler_key(self, ckpt: Path) -> bytes | None:
        """The private key the amplified plan's cohorts are drawn from (its earlier rounds replay from it)."""
        if not self.privacy_plan.amplified:
            return None
        path = ckpt / SAMPLER_KEY
        if not path.is_file():
            raise IntegrityError(f"{path}: missing from a checkpoint its manifest vouches for (written by a corrflow "
                                 "that drew amplified cohorts from the public schedule seed): the amplified ε would "
                                 "not hold for its cohorts. Start a new run with --fresh")
        return path.read_bytes()


class _ConfigProbeGrid:
    """The grid an inner strategy sees when corrflow asks it only for its train config. It lists at least the nodes
    the inner strategy's ``min_available_nodes`` / ``min_train_nodes`` ask for: Flower's ``sample_nodes`` would
    otherwise wait (logging at INFO only, which corrflow mutes here) for nodes corrflow's population does not have,
    and the run would hang without a word. The node choice is discarded; everything else is the real grid."""

    def __init__(self, grid: Grid, inner: Strategy):
        self._grid = grid
        self._needed = max(int(getattr(inner, "min_available_nodes", 0) or 0),
                           int(getattr(inner, "min_train_nodes", 0) or 0))

    def get_node_ids(self) -> list[int]:
        nodes = list(self._grid.get_node_ids())
        top = max(nodes, default=0)
        return nodes + [top + 1 + i for i in range(self._needed - len(nodes))]

    def __getattr__(self, name: str):
        return getattr(self._grid, name)


def _reason_class(reason: str) -> str:
    """A rejection reason without its per-reply details (array index, node id, counts), for counting."""
    if reason.startswith("array "):
        reason = reason.split(":", 1)[-1].strip()
    return re.sub(r"\d+(\.\d+)?", "#", reason)
