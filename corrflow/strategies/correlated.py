"""The correlated-noise Flower strategy (Message API; flwr 1.41/1.42).

Each round t (0-based, DESIGN.md data flow): the cohort planner (fixed-epoch schedule, b-min-sep or multi-attribution
sampler, 004) picks the items of round S_t — SuperNodes (cross-device) or examples held by silos (cross-silo) — and
the separation monitor checks every user behind them against the design min-sep, applying the policy (``reject``,
or ``accept-and-account``: include and switch to post-hoc accounting). Replies are validated, zeroed if
ℓ∞ > zeroing·clip (000 App. F.3) and clipped to ℓ2 ≤ clip on the server (a cross-silo sum of m per-item-clipped
updates must already be within m·clip, or it is rejected); g_t = Σ clipped (summed in id order, so a restart
reproduces it bit for bit); x̂_t = (g_t + σ·clip·(C⁻¹Z)_t) / planned cohort size (expected batch for samplers);
the server optimizer of the workload takes the step; the ledger records selections (silent or rejected users count
as participating) and the realised ε; the privacy report is rewritten; and the whole state is checkpointed
atomically before the new model is released.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from corrflow.accounting.report import hash_user_id, participation_section, privacy_report, write_report
from corrflow.errors import IntegrityError, InvalidArgumentError, require
from corrflow.factorization.base import Factorization
from corrflow.noise import CorrelatedNoise
from corrflow.noise.engine import restore_state, save_state
from corrflow.noise.prng import new_secret
from corrflow.participation.planner import CohortPlanner, SeparationMonitor
from corrflow.strategies.checkpoint import current_checkpoint, load_arrays, write_checkpoint
from corrflow.strategies.config import StrategyConfig
from corrflow.strategies.ledger import Ledger, PrivacyTracker
from corrflow.strategies.server_optimizer import MomentumServerOptimizer, check_workload_matches
from corrflow.strategies.validation import RejectedReplyError, check_arrays, zero_or_clip

log = logging.getLogger("corrflow")


class CorrelatedNoiseStrategy(Strategy):
    """DP-FTRL / matrix-factorization training with correlated noise (see the module docstring)."""

    def __init__(self, config: StrategyConfig, factorization: Factorization, initial: list[np.ndarray],
                 directory: dict[int, str], *, noise_multiplier: float, planned_epsilon: float | None,
                 noise_key: bytes | None = None, out_dir: str | Path | None = None, on_round_end=None,
                 planner: CohortPlanner | None = None, item_home: dict[str, str] | None = None,
                 planned_accounting: dict | None = None):
        require(factorization.rounds == config.num_rounds, "factorization",
                f"{config.num_rounds} rounds (num-rounds)", factorization.rounds)
        check_workload_matches(factorization.workload, config.momentum, config.cooldown_fraction)
        self.cfg, self.fac = config, factorization
        self.sigma = float(noise_multiplier)
        self.planned_epsilon = None if planned_epsilon is None else float(planned_epsilon)
        self.shapes = [tuple(a.shape) for a in initial]
        self.node_to_user = {int(k): str(v) for k, v in directory.items()}
        self.user_to_node = {u: n for n, u in self.node_to_user.items()}
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
        self.planned_accounting = planned_accounting or {
            "name": "pld", "sampling": f"none ({planner.kind}, unamplified)",
            "normalisation": "sensitivity 1 under the planned participation", "slack": 0.0}
        self._pending_overrides: dict[int, list[str]] = {}
        self._round_users: list[str] = []     # users behind round t's included items (with multiplicity)
        self._warned_posthoc = False
        self.tracker = PrivacyTracker(factorization, self.sigma, config.delta)
        self.state_dir = Path(config.state_dir)
        self.out_dir = Path(out_dir) if out_dir is not None else self.state_dir
        self.on_round_end = on_round_end
        self.metrics_history: list[dict] = []
        self._expected: dict[int, str | list[str]] = {}   # node -> item (cross-device) or items (cross-silo)
        self.stopped_reason: str | None = None
        ckpt = current_checkpoint(self.state_dir)
        if ckpt is None:
            self.params = [np.asarray(a, dtype=np.float32).copy() for a in initial]
            self.optimizer = MomentumServerOptimizer(factorization.workload, config.num_rounds, config.server_lr,
                                                     self.shapes)
            self.noise = CorrelatedNoise(factorization, self.shapes, 1.0, key=noise_key or new_secret())
            self.ledger = Ledger()
            self.salt = new_secret()
            self.next_round = 0
        else:
            self._restore(ckpt)

    # -- Flower Strategy API --------------------------------------------------------------------------------------
    @property
    def remaining_rounds(self) -> int:
        return self.cfg.num_rounds - self.next_round

    def initial_arrays(self) -> ArrayRecord:
        return ArrayRecord([p.copy() for p in self.params])

    def override(self, round_index: int, items: list[str]) -> None:
        """Operator override: add ``items`` to round ``round_index``'s cohort. They pass through the separation
        monitor like sampled items, and every override is listed in the privacy report."""
        require(round_index >= self.next_round, "round", f"a future round (≥ {self.next_round})", round_index)
        unknown = [i for i in items if i not in self.planner.index]
        require(not unknown, "items", "item ids known to the planner", unknown)
        self._pending_overrides.setdefault(int(round_index), []).extend(items)

    def _plan_round(self, t: int) -> list[str]:
        """Sampled items plus operator overrides, after the separation policy; records selections."""
        sampled = self.planner.cohort(t)
        forced = [i for i in self._pending_overrides.pop(t, []) if i not in sampled]
        included, users = [], []
        for item in sampled + forced:
            owners = self.planner.users_of(item)
            gaps = {u: g for u in owners if (g := self.monitor.violates(self.ledger.selected, u, t)) is not None}
            source = "override" if item in forced else "sampler"
            if gaps or source == "override":
                action = "included" if not gaps else ("rejected" if self.cfg.policy == "reject"
                                                      else "accepted-and-accounted")
                self.ledger.overrides.append({"round": t, "item": item, "source": source, "users": owners,
                                              "gap": min(gaps.values()) if gaps else None, "action": action})
                if action == "rejected":
                    self.ledger.reject(t, item, f"separation: gap {min(gaps.values())} < min-sep "
                                                f"{self.planner.min_sep} (policy reject)")
                    log.warning("round %d: %s item %s breaks min-sep for %d user(s); rejected", t, source, item,
                                len(gaps))
                    continue
            included.append(item)
            users.extend(owners)
        self._round_users = users
        return included

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        t = self.next_round
        self._expected = {}
        if t >= self.cfg.num_rounds or self.stopped_reason:
            return []
        n_overrides, n_rejections = len(self.ledger.overrides), len(self.ledger.rejections)
        cohort = self._plan_round(t)
        if self.cfg.target_epsilon > 0:  # budget guard: refuse a round that would exceed the target
            prospective = {u: list(r) for u, r in self.ledger.selected.items()}
            for u in self._round_users:
                prospective.setdefault(u, []).append(t)
            eps = self._realized(prospective)[1]
            if eps is not None and eps > self.cfg.target_epsilon * (1 + 1e-9):
                del self.ledger.overrides[n_overrides:]      # the round does not happen
                del self.ledger.rejections[n_rejections:]
                self.stopped_reason = f"round {t} would spend ε = {eps:.4f} > target {self.cfg.target_epsilon}"
                log.warning("budget guard: %s; training stops", self.stopped_reason)
                return []
        self.ledger.select(t, self._round_users)  # selected counts as participating, whether or not it replies
        if not self._warned_posthoc and self.sigma > 0 and self._posthoc_active():
            self._warned_posthoc = True
            log.warning("round %d: min-sep broken and accepted (policy accept-and-account): the report now uses "
                        "post-hoc accounting of the realised participation, ε = %.4f", t, self._realized(
                            self.ledger.selected)[1])
        online = set(int(n) for n in grid.get_node_ids())
        cfg = ConfigRecord({"server-round": t, "local-lr": self.cfg.local_lr, "local-steps": self.cfg.local_steps,
                            "clip-norm": self.cfg.clip_norm, "seed": self.cfg.seed})
        if self.cfg.data_path:  # clients read their user's examples from the same dataset file
            cfg.update({"data-path": self.cfg.data_path, "vocab-path": self.cfg.vocab_path,
                        "seq-len": self.cfg.seq_len})
        targets: dict[int, list[str]] = {}
        for item in cohort:
            home = item if self.item_home is None else self.item_home[item]
            node = self.user_to_node.get(home)
            if node is None or node not in online:
                self.ledger.reject(t, item, "offline when selected")
                continue
            targets.setdefault(node, []).append(item)
        messages = []
        for node, items in targets.items():
            content = {"arrays": arrays, "config": cfg}
            if self.item_home is None:
                self._expected[node] = items[0]
            else:  # cross-silo: the silo trains on exactly these examples, clipping each
                self._expected[node] = items
                content["config"] = ConfigRecord({**dict(cfg), "item-ids": list(items)})
            messages.append(Message(content=RecordDict(content), message_type=MessageType.TRAIN, dst_node_id=node))
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        t = self.next_round
        if t >= self.cfg.num_rounds or self.stopped_reason:
            return None, None
        started = time.perf_counter()
        accepted: dict[str, list[np.ndarray]] = {}
        counts = {"kept": 0, "clipped": 0, "zeroed": 0, "rejected": 0}
        for msg in replies:
            key = None
            try:
                key, update, items = self._validate(msg, accepted)
                # Cross-silo sums of per-item-clipped updates: allow float32 rounding, then re-check the bound.
                bound = items * self.cfg.clip_norm * (1 + 1e-5 if self.item_home is not None else 1)
                update, action = zero_or_clip(update, bound, self.cfg.zeroing_factor * self.cfg.clip_norm / bound)
                if self.item_home is not None and action == "clipped":
                    raise RejectedReplyError(f"per-item clipping not honoured: the sum of {items} items exceeds "
                                             f"{items} × clip-norm = {items * self.cfg.clip_norm:g}")
            except RejectedReplyError as exc:
                counts["rejected"] += 1
                self.ledger.reject(t, key or self._sender_user(msg), exc.reason)
                log.warning("round %d: rejected reply from %s: %s", t, key or msg.metadata.src_node_id, exc.reason)
                continue
            counts[action] += 1
            accepted[key] = update
            self.ledger.accept(t, key)
        total = [np.zeros(s, dtype=np.float32) for s in self.shapes]
        for key in sorted(accepted):
            for acc, u in zip(total, accepted[key], strict=True):
                acc += u
        # The planned size, not the number of replies: the fixed-epoch group, or the sampler's expected batch.
        cohort = np.float32(len(self.planner.cohort(t)) if self.planner.kind == "fixed-epoch"
                            else self.planner.expected)
        if self.sigma > 0:
            noise = self.noise.next(t)
            scale = np.float32(self.sigma * self.cfg.clip_norm)
            update = [(g + scale * w) / cohort for g, w in zip(total, noise, strict=True)]
        else:  # non-private baseline
            self.noise.skip_round()
            update = [g / cohort for g in total]
        self.params = self.optimizer.step(self.params, update, t)
        self.next_round = t + 1
        self.ledger.rounds_completed = self.next_round
        report = self.report()
        self.ledger.epsilon_history.append(report["realized"]["epsilon"])
        metrics = {"round": t, "replies": len(accepted), "cohort": float(cohort), **counts,
                   "aggregation_seconds": time.perf_counter() - started}
        if report["realized"]["epsilon"] is not None:
            metrics["epsilon"] = report["realized"]["epsilon"]
        self.metrics_history.append(metrics)
        self._checkpoint()
        write_report(report, self.out_dir / "privacy_report.json")
        if self.on_round_end is not None:
            self.on_round_end(self, metrics)
        return ArrayRecord([p.copy() for p in self.params]), MetricRecord(
            {k: float(v) for k, v in metrics.items()})

    def configure_evaluate(self, server_round, arrays, config, grid):
        return []

    def aggregate_evaluate(self, server_round, replies):
        return None

    def summary(self) -> None:
        log.info("corrflow: %d rounds completed, realised ε = %.4f (δ = %g)", self.next_round,
                 self.ledger.epsilon_history[-1] if self.ledger.epsilon_history else 0.0, self.cfg.delta)

    # -- helpers ------------------------------------------------------------------------------------------------
    def _sender_user(self, msg: Message) -> str | None:
        return self.node_to_user.get(int(msg.metadata.src_node_id))

    def _validate(self, msg: Message, accepted: dict) -> tuple[str, list[np.ndarray], int]:
        """(item or silo id, update, items it sums) of a well-formed reply, else RejectedReplyError."""
        node = int(msg.metadata.src_node_id)
        expected = self._expected.get(node)
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
        try:
            arrays = content["arrays"].to_numpy_ndarrays()
        except Exception as exc:  # undecodable array payloads of any kind
            raise RejectedReplyError(f"undecodable arrays ({exc})") from exc
        return key, check_arrays(arrays, self.shapes), items

    def _posthoc_active(self) -> bool:
        return any(o["action"] == "accepted-and-accounted" for o in self.ledger.overrides)

    def _realized(self, selected: dict[str, list[int]]):
        """(sensitivity, ε, worst user) of the realised pattern: post-hoc (000 App. D.2 on the realised
        sensitivity) — except under an amplified plan that was followed, where the planned ε stands."""
        sens, eps, worst = self.tracker.realized(selected)
        if self.planned_accounting.get("name") == "monte-carlo" and not self._posthoc_active():
            eps = self.planned_epsilon
        return sens, eps, worst

    def report(self) -> dict:
        sens, eps, _ = self._realized(self.ledger.selected)
        posthoc = self.planned_accounting.get("name") != "monte-carlo" or self._posthoc_active()
        overrides = [{**o, "item": hash_user_id(o["item"], self.salt),
                      "users": [hash_user_id(u, self.salt) for u in o["users"]]} for o in self.ledger.overrides]
        return privacy_report(
            factorization=self.fac, noise_multiplier=self.sigma, clip_norm=self.cfg.clip_norm, delta=self.cfg.delta,
            target_epsilon=self.cfg.target_epsilon or None, accountant=self.planned_accounting,
            planned={"sensitivity": float(self.planner.items_per_user) * self.fac.sensitivity.value,
                     "sensitivity_exact": self.fac.sensitivity.exact and self.planner.items_per_user == 1,
                     "epsilon": self.planned_epsilon,
                     "participation": {**self.planner.to_dict(), "mode": self.cfg.mode}},
            realized={"sensitivity": sens.value, "sensitivity_exact": sens.exact, "epsilon": eps,
                      "accounting": "post-hoc (unamplified, realised pattern)" if posthoc
                      else "as planned (the sampler's pattern was followed)",
                      "participation": participation_section(self.ledger.selected, self.salt, self.cfg.policy,
                                                             overrides),
                      "rejections": len(self.ledger.rejections)},
            rounds_completed=self.next_round, stopped_reason=self.stopped_reason)

    def _checkpoint(self) -> None:
        public = {"next_round": self.next_round, "config_fingerprint": self.cfg.fingerprint(),
                  "factorization_sha256": self.fac.sha256(), "ledger": self.ledger.to_dict(),
                  "noise_multiplier": self.sigma, "planned_epsilon": self.planned_epsilon,
                  "pending_overrides": {str(k): v for k, v in self._pending_overrides.items()},
                  "metrics_history": self.metrics_history}
        write_checkpoint(self.state_dir, f"round-{self.next_round:06d}",
                         {"model": self.params, "optimizer": self.optimizer.m}, public,
                         {"report_salt": self.salt}, save_extra=lambda d: save_state(self.noise, d / "noise"))

    def _restore(self, ckpt: Path) -> None:
        public = json.loads((ckpt / "state.json").read_text())
        if public["config_fingerprint"] != self.cfg.fingerprint():
            raise IntegrityError(f"{ckpt}: the checkpoint belongs to a different run configuration")
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
        self._pending_overrides = {int(k): list(v) for k, v in public.get("pending_overrides", {}).items()}
        self._warned_posthoc = self._posthoc_active()
        self.salt = (ckpt / "report_salt").read_bytes()
        self.next_round = int(public["next_round"])
        if self.noise.next_round != self.next_round:
            raise IntegrityError(f"{ckpt}: noise state is at round {self.noise.next_round}, model at "
                                 f"{self.next_round}")
        log.info("corrflow: resumed from %s at round %d", ckpt.name, self.next_round)
