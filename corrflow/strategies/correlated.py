"""The correlated-noise Flower strategy (Message API; flwr 1.41/1.42).

Each round t (0-based, DESIGN.md data flow): the fixed-epoch schedule picks the cohort S_t (by stable user id, sent
to those users' nodes); replies are validated, zeroed if ℓ∞ > zeroing·clip (000 App. F.3) and clipped to ℓ2 ≤ clip
on the server; g_t = Σ clipped (summed in user-id order, so a restart reproduces it bit for bit);
x̂_t = (g_t + σ·clip·(C⁻¹Z)_t) / planned cohort size; the server optimizer of the workload takes the step; the
ledger records selections (silent or rejected users count as participating) and the realised ε; the privacy report
is rewritten; and the whole state is checkpointed atomically before the new model is released.
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

from corrflow.accounting.report import participation_section, privacy_report, write_report
from corrflow.errors import IntegrityError, InvalidArgumentError, require
from corrflow.factorization.base import Factorization
from corrflow.noise import CorrelatedNoise
from corrflow.noise.engine import restore_state, save_state
from corrflow.noise.prng import new_secret
from corrflow.strategies.checkpoint import current_checkpoint, load_arrays, write_checkpoint
from corrflow.strategies.config import StrategyConfig
from corrflow.strategies.ledger import Ledger, PrivacyTracker
from corrflow.strategies.schedule import FixedEpochSchedule
from corrflow.strategies.server_optimizer import MomentumServerOptimizer, check_workload_matches
from corrflow.strategies.validation import RejectedReplyError, check_arrays, zero_or_clip

log = logging.getLogger("corrflow")


class CorrelatedNoiseStrategy(Strategy):
    """DP-FTRL / matrix-factorization training with correlated noise (see the module docstring)."""

    def __init__(self, config: StrategyConfig, factorization: Factorization, initial: list[np.ndarray],
                 directory: dict[int, str], *, noise_multiplier: float, planned_epsilon: float | None,
                 noise_key: bytes | None = None, out_dir: str | Path | None = None, on_round_end=None):
        require(factorization.rounds == config.num_rounds, "factorization",
                f"{config.num_rounds} rounds (num-rounds)", factorization.rounds)
        require(factorization.participation.kind == "fixed-epoch"
                and factorization.participation.epochs == config.epochs, "factorization",
                f"fixed-epoch participation with {config.epochs} epochs", factorization.participation.describe())
        check_workload_matches(factorization.workload, config.momentum, config.cooldown_fraction)
        self.cfg, self.fac = config, factorization
        self.sigma = float(noise_multiplier)
        self.planned_epsilon = None if planned_epsilon is None else float(planned_epsilon)
        self.shapes = [tuple(a.shape) for a in initial]
        self.node_to_user = {int(k): str(v) for k, v in directory.items()}
        self.user_to_node = {u: n for n, u in self.node_to_user.items()}
        self.schedule = FixedEpochSchedule(sorted(self.user_to_node), config.num_rounds, config.epochs,
                                           config.schedule_seed)
        self.tracker = PrivacyTracker(factorization, self.sigma, config.delta)
        self.state_dir = Path(config.state_dir)
        self.out_dir = Path(out_dir) if out_dir is not None else self.state_dir
        self.on_round_end = on_round_end
        self.metrics_history: list[dict] = []
        self._expected: dict[int, str] = {}
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

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        t = self.next_round
        self._expected = {}
        if t >= self.cfg.num_rounds or self.stopped_reason:
            return []
        cohort = self.schedule.cohort(t)
        if self.cfg.target_epsilon > 0:  # budget guard: refuse a round that would exceed the target
            prospective = {u: list(r) for u, r in self.ledger.selected.items()}
            for u in cohort:
                prospective.setdefault(u, []).append(t)
            _, eps, _ = self.tracker.realized(prospective)
            if eps is not None and eps > self.cfg.target_epsilon * (1 + 1e-9):
                self.stopped_reason = f"round {t} would spend ε = {eps:.4f} > target {self.cfg.target_epsilon}"
                log.warning("budget guard: %s; training stops", self.stopped_reason)
                return []
        self.ledger.select(t, cohort)  # selected counts as participating, whether or not the user replies
        online = set(int(n) for n in grid.get_node_ids())
        cfg = ConfigRecord({"server-round": t, "local-lr": self.cfg.local_lr, "local-steps": self.cfg.local_steps,
                            "clip-norm": self.cfg.clip_norm})
        if self.cfg.data_path:  # clients read their user's examples from the same dataset file
            cfg.update({"data-path": self.cfg.data_path, "vocab-path": self.cfg.vocab_path,
                        "seq-len": self.cfg.seq_len})
        messages = []
        for user in cohort:
            node = self.user_to_node.get(user)
            if node is None or node not in online:
                self.ledger.reject(t, user, "offline when selected")
                continue
            self._expected[node] = user
            messages.append(Message(content=RecordDict({"arrays": arrays, "config": cfg}),
                                    message_type=MessageType.TRAIN, dst_node_id=node))
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        t = self.next_round
        if t >= self.cfg.num_rounds or self.stopped_reason:
            return None, None
        started = time.perf_counter()
        accepted: dict[str, list[np.ndarray]] = {}
        counts = {"kept": 0, "clipped": 0, "zeroed": 0, "rejected": 0}
        for msg in replies:
            user = None
            try:
                user, update = self._validate(msg, accepted)
            except RejectedReplyError as exc:
                counts["rejected"] += 1
                self.ledger.reject(t, user or self._sender_user(msg), exc.reason)
                log.warning("round %d: rejected reply from %s: %s", t, user or msg.metadata.src_node_id, exc.reason)
                continue
            update, action = zero_or_clip(update, self.cfg.clip_norm, self.cfg.zeroing_factor)
            counts[action] += 1
            accepted[user] = update
            self.ledger.accept(t, user)
        total = [np.zeros(s, dtype=np.float32) for s in self.shapes]
        for user in sorted(accepted):
            for acc, u in zip(total, accepted[user], strict=True):
                acc += u
        cohort = np.float32(len(self.schedule.cohort(t)))  # the planned size, not the number of replies
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
        metrics = {"round": t, "replies": len(accepted), "cohort": int(cohort), **counts,
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

    def _validate(self, msg: Message, accepted: dict) -> tuple[str, list[np.ndarray]]:
        node = int(msg.metadata.src_node_id)
        user = self._expected.get(node)
        if user is None:
            raise RejectedReplyError(f"unexpected sender node {node} (not selected this round)")
        if msg.has_error():
            raise RejectedReplyError(f"client error: {msg.error.reason}")
        if user in accepted:
            raise RejectedReplyError("duplicate reply")
        content = msg.content
        keys = set(content.keys())
        if keys != {"arrays", "metrics"}:
            raise RejectedReplyError(f"reply records {sorted(keys)}, expected ['arrays', 'metrics']")
        if not isinstance(content["arrays"], ArrayRecord) or not isinstance(content["metrics"], MetricRecord):
            raise RejectedReplyError("'arrays' must be an ArrayRecord and 'metrics' a MetricRecord")
        try:
            arrays = content["arrays"].to_numpy_ndarrays()
        except Exception as exc:  # undecodable array payloads of any kind
            raise RejectedReplyError(f"undecodable arrays ({exc})") from exc
        return user, check_arrays(arrays, self.shapes)

    def report(self) -> dict:
        sens, eps, _ = self.tracker.realized(self.ledger.selected)
        planned_part = self.schedule.to_dict()
        return privacy_report(
            factorization=self.fac, noise_multiplier=self.sigma, clip_norm=self.cfg.clip_norm, delta=self.cfg.delta,
            target_epsilon=self.cfg.target_epsilon or None,
            accountant={"name": "pld", "sampling": "none (fixed-epoch schedule, unamplified)",
                        "normalisation": "sensitivity 1 under the planned participation", "slack": 0.0},
            planned={"sensitivity": self.fac.sensitivity.value, "sensitivity_exact": self.fac.sensitivity.exact,
                     "epsilon": self.planned_epsilon, "participation": planned_part},
            realized={"sensitivity": sens.value, "sensitivity_exact": sens.exact, "epsilon": eps,
                      "participation": participation_section(self.ledger.selected, self.salt, self.cfg.policy,
                                                             self.ledger.overrides),
                      "rejections": len(self.ledger.rejections)},
            rounds_completed=self.next_round, stopped_reason=self.stopped_reason)

    def _checkpoint(self) -> None:
        public = {"next_round": self.next_round, "config_fingerprint": self.cfg.fingerprint(),
                  "factorization_sha256": self.fac.sha256(), "ledger": self.ledger.to_dict(),
                  "noise_multiplier": self.sigma, "planned_epsilon": self.planned_epsilon,
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
        self.salt = (ckpt / "report_salt").read_bytes()
        self.next_round = int(public["next_round"])
        if self.noise.next_round != self.next_round:
            raise IntegrityError(f"{ckpt}: noise state is at round {self.noise.next_round}, model at "
                                 f"{self.next_round}")
        log.info("corrflow: resumed from %s at round %d", ckpt.name, self.next_round)
