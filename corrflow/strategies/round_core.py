"""One round of correlated-noise training as pure steps that change no run state (docs
"Conventions", data flow):

1. `plan_round` — the sampled items plus operator overrides, after the separation policy;
2. `collect` — every reply validated, zeroed if ℓ∞ > zeroing·clip (000 App. F.3) and clipped
   to ℓ2 ≤ clip on the server (a cross-silo sum of m per-item-clipped updates must already be within
   m·clip), and summed in place into g_t = Σ clipped (in id order, so a restart reproduces it bit
   for bit);
3. `release` — x̂_t = (g_t + σ·clip·(C⁻¹Z)_t) / planned cohort size, the workload's server
   optimizer step, and the `RoundRecord` that the recorder applies in one place.

Drawing (C⁻¹Z)_t advances the noise stream; nothing else is changed here. A failure after the draw
ends the run before anything is applied, and a restart replays the stream from the checkpoint's
noise state.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

from corrflow.accounting.policy import RunAccounting, with_round
from corrflow.config import RunConfig
from corrflow.noise import CorrelatedNoise
from corrflow.participation.planner import CohortPlanner, SeparationMonitor
from corrflow.strategies.model import ModelLayout
from corrflow.strategies.server_optimizer import MomentumServerOptimizer
from corrflow.strategies.validation import ClippedSum, RejectedReplyError

_BLOCK = 1 << 16


@dataclass
class RoundPlan:
    """Round t before anything is committed: included items, the users behind them (with
    multiplicity), the override/separation records and the rejections found so far, and which node
    trains which item(s)."""

    round: int
    items: list[str]
    users: list[str]
    overrides: list[dict] = field(default_factory=list)
    rejections: list[tuple[str, str]] = field(default_factory=list)  # (item or user, reason)
    expected: dict[int, str | list[str]] = field(
        default_factory=dict
    )  # node -> item (or items, cross-silo)


@dataclass
class RoundOutcome:
    """The replies of a round: the accepted item (or silo) ids in id order, the sum of their clipped
    updates (float32, model-shaped), per-action counts, rejections, and the accepted replies'
    contents (for an inner strategy's metric aggregation)."""

    accepted: list[str]
    total: list[np.ndarray]
    counts: dict[str, int]
    rejections: list[tuple[str | None, str]]
    contents: list[RecordDict]


@dataclass(frozen=True)
class RoundRecord:
    """What a completed round changes, applied by
    `apply`: the ledger delta (selected users with
    multiplicity, accepted keys, rejections, override records), the released model and optimizer
    state, the noise position after the round, and its metrics."""

    round: int
    users: list[str]
    accepted: list[str]
    rejections: list[tuple[str | None, str]]
    overrides: list[dict]
    params: list[np.ndarray]
    momentum: list[np.ndarray]
    noise_position: int
    epsilon: float | None
    metrics: dict
    asked: bool  # the round asked someone (an empty sample neither breaks nor extends a streak)


@dataclass(frozen=True)
class RoundContext:
    """What a round reads and never changes: the settings, model layout, cohort planner, accounting,
    optimizer schedule, the noise stream, σ and, cross-silo, the silo of each item."""

    cfg: RunConfig
    layout: ModelLayout
    planner: CohortPlanner
    accounting: RunAccounting
    optimizer: MomentumServerOptimizer
    noise: CorrelatedNoise
    sigma: float
    item_home: dict[str, str] | None = None

    @property
    def monitor(self) -> SeparationMonitor:
        return SeparationMonitor(self.planner.min_sep)

    def planned_cohort(self, t: int) -> np.float32:
        """The planned size, not the number of replies: the fixed-epoch group, or the sampler's
        expected batch."""
        return np.float32(
            len(self.planner.cohort(t))
            if self.planner.kind == "fixed-epoch"
            else self.planner.expected
        )


def plan_round(
    ctx: RoundContext,
    t: int,
    selected: Mapping[str, Sequence[int]],
    forced: Sequence[str],
    log_warning: Callable[..., None],
) -> RoundPlan:
    """Sampled items plus operator overrides (``forced``), after the separation policy (``reject``:
    an item whose users would break min-sep is left out; ``accept-and-account``: included and
    recorded)."""
    sampled = ctx.planner.cohort(t)
    forced = [i for i in forced if i not in sampled]
    monitor, plan = ctx.monitor, RoundPlan(t, [], [])
    for item in sampled + forced:
        owners = ctx.planner.users_of(item)
        gaps = {u: g for u in owners if (g := monitor.violates(selected, u, t)) is not None}
        source = "override" if item in forced else "sampler"
        if gaps or source == "override":
            action = (
                "included"
                if not gaps
                else ("rejected" if ctx.cfg.policy == "reject" else "accepted-and-accounted")
            )
            plan.overrides.append(
                {
                    "round": t,
                    "item": item,
                    "source": source,
                    "users": owners,
                    "gap": min(gaps.values()) if gaps else None,
                    "action": action,
                }
            )
            if action == "rejected":
                plan.rejections.append(
                    (
                        item,
                        f"separation: gap {min(gaps.values())} < min-sep "
                        f"{ctx.planner.min_sep} (policy reject)",
                    )
                )
                log_warning(
                    "round %d: %s item %s breaks min-sep for %d user(s); rejected",
                    t + 1,
                    source,
                    item,
                    len(gaps),
                )
                continue
        plan.items.append(item)
        plan.users.extend(owners)
    return plan


def budget_reason(
    ctx: RoundContext,
    plan: RoundPlan,
    selected: Mapping[str, Sequence[int]],
    overrides: Sequence[dict],
) -> str | None:
    """Why round ``plan.round`` must not happen (it would exceed the target ε), else None."""
    eps = ctx.accounting.budget_exceeded(
        selected, [*overrides, *plan.overrides], plan.round, plan.users
    )
    if eps is None:
        return None
    return (
        f"budget guard: round {plan.round + 1} of {ctx.cfg.num_rounds} would spend ε = {eps:.4f} > "
        "target "
        f"{ctx.accounting.target_epsilon:g}"
        + (
            ""
            if ctx.accounting.target_epsilon == ctx.cfg.target_epsilon
            else f" (training's share of {ctx.cfg.target_epsilon:g})"
        )
    )


#: Flower's error codes (flwr.common.constant.ErrorCode) and what they mean for a round's reply.
_ERROR_CLASSES = {
    5: "offline: the SuperLink had no heartbeat from the node",
    3: "timed out: the message expired before the node fetched it",
    4: "timed out: the reply expired before the server fetched it",
    1: "crashed: the ClientApp could not be loaded",
    8: "crashed: the ClientApp process died",
}


def error_reason(code: int, reason: str) -> str:
    """One line for a Flower error reply: offline, timed out or crashed, with the first line of the
    client's own message (a multi-line traceback stays in the log)."""
    first = (str(reason).strip().splitlines() or [""])[0][:200]
    if int(code) in _ERROR_CLASSES:
        return _ERROR_CLASSES[int(code)]
    return f"client error: {first}"


def check_reply(
    ctx: RoundContext,
    msg: Message,
    node: int,
    expected_by_node: Mapping[int, str | list[str]],
    node_to_user: Mapping[int, str],
) -> tuple[str, int]:
    """(item or silo id, items it sums) of a reply from ``node`` (the node the message it answers
    was sent to) whose envelope is well formed, else `RejectedReplyError`. Its arrays are
    checked when it is added."""
    expected = expected_by_node.get(node)
    if expected is None:
        raise RejectedReplyError(f"unexpected sender node {node} (not selected this round)")
    key = expected if isinstance(expected, str) else node_to_user[node]
    if msg.has_error():
        raise RejectedReplyError(error_reason(msg.error.code, msg.error.reason))
    if int(msg.metadata.src_node_id) != node:
        raise RejectedReplyError(
            f"a reply from node {int(msg.metadata.src_node_id)} to the message sent to {node}"
        )
    content = msg.content
    keys = set(content.keys())
    if keys != {"arrays", "metrics"}:
        raise RejectedReplyError(f"reply records {sorted(keys)}, expected ['arrays', 'metrics']")
    if not isinstance(content["arrays"], ArrayRecord) or not isinstance(
        content["metrics"], MetricRecord
    ):
        raise RejectedReplyError("'arrays' must be an ArrayRecord and 'metrics' a MetricRecord")
    items = 1
    if not isinstance(expected, str):  # cross-silo: the reply must sum exactly the items sent
        items = len(expected)
        got = content["metrics"].get("num-items")
        if got != items:
            raise RejectedReplyError(
                f"metric num-items = {got!r}, expected {items} (the item ids sent)"
            )
    return key, items


def collect(
    ctx: RoundContext,
    plan: RoundPlan,
    replies: Iterable[Message],
    sent: Mapping[str, int],
    node_to_user: Mapping[int, str],
    params: Sequence[np.ndarray],
    log_warning: Callable[..., None],
) -> RoundOutcome:
    """Validate, zero or clip every reply and sum the clipped updates in place, in id order (so that
    the same replies give the same bits whatever order they arrived in); the first well-formed reply
    of an id counts, any later one is a duplicate. A node that was sent a message and did not answer
    is recorded as timed out. ``sent``: message id → the node it went to (a reply is matched by the
    message it answers, since an error the SuperLink makes for an offline node comes from the
    SuperLink). Changes no state."""
    clip, silo = ctx.cfg.clip_norm, ctx.item_home is not None
    layout = ctx.layout
    shapes = layout.trainable_shapes
    clipped = ClippedSum(shapes, [layout.keys[i] for i in layout.trainable])
    outcome = RoundOutcome(
        [], clipped.total, {"kept": 0, "clipped": 0, "zeroed": 0, "rejected": 0}, [], []
    )
    model_sent = layout.sent(params) if ctx.cfg.reply_kind == "weights" else None
    answered: set[int] = set()
    candidates: dict[str, list[tuple[Message, int, int]]] = {}
    for msg in replies:
        node = sent.get(msg.metadata.reply_to_message_id, int(msg.metadata.src_node_id))
        answered.add(node)
        try:
            key, items = check_reply(ctx, msg, node, plan.expected, node_to_user)
        except RejectedReplyError as exc:
            _reject(
                outcome,
                node_to_user.get(node),
                exc.reason,
                plan.round,
                node,
                log_warning,
                msg.error.reason if msg.has_error() else None,
            )
            continue
        candidates.setdefault(key, []).append((msg, node, items))
    for key in sorted(candidates):
        done = False
        for msg, node, items in candidates[key]:
            try:
                if done:
                    raise RejectedReplyError("duplicate reply")
                # Cross-silo sums of per-item-clipped updates: allow float32 rounding, then re-check
                # the bound.
                bound = items * clip * (1 + 1e-5 if silo else 1)
                try:
                    action = clipped.add(
                        layout.reply_arrays(msg.content["arrays"]),
                        model_sent,
                        bound,
                        ctx.cfg.zeroing_factor * clip,
                        allow_clip=not silo,
                    )
                except RejectedReplyError as exc:
                    if exc.reason != "needs clipping":
                        raise
                    raise RejectedReplyError(
                        f"per-item clipping not honoured: the sum of {items} items exceeds "
                        f"{items} × clip-norm = {items * clip:g}"
                    ) from None
            except RejectedReplyError as exc:
                _reject(outcome, key, exc.reason, plan.round, node, log_warning)
                continue
            done = True
            if action == "zeroed":
                log_warning(
                    "round %d: zeroed reply from %s: ℓ∞ above %g × clip-norm (000 App. F.3)",
                    plan.round + 1,
                    key,
                    ctx.cfg.zeroing_factor,
                )
            outcome.counts[action] += 1
            outcome.accepted.append(key)
            outcome.contents.append(msg.content)
    for node in sorted(set(sent.values()) - answered):
        expected = plan.expected.get(node)
        who = expected if isinstance(expected, str) else node_to_user.get(node)
        _reject(
            outcome,
            who,
            f"timed out: no reply within node-timeout {ctx.cfg.node_timeout:g} s",
            plan.round,
            node,
            log_warning,
        )
    return outcome


def _reject(
    outcome: RoundOutcome,
    who: str | None,
    reason: str,
    t: int,
    node: int,
    log_warning: Callable[..., None],
    details: str | None = None,
) -> None:
    outcome.counts["rejected"] += 1
    outcome.rejections.append((who, reason))
    log_warning(
        "round %d: rejected reply from node %d: %s%s",
        t + 1,
        node,
        reason,
        f"\n{details}" if details and "\n" in str(details) else "",
    )


def noisy_update(ctx: RoundContext, plan: RoundPlan, outcome: RoundOutcome) -> list[np.ndarray]:
    """x̂_t = (Σ clipped + σ·clip·(C⁻¹Z)_t) / planned cohort size, formed in the outcome's sum
    (which it takes over); draws round t's noise."""
    cohort = ctx.planned_cohort(plan.round)
    total = outcome.total
    if ctx.sigma > 0:
        noise = ctx.noise.next(plan.round)
        scale = np.float32(ctx.sigma * ctx.cfg.clip_norm)
        for g, w in zip(total, noise, strict=True):
            _add_scaled(g, w, scale)
    else:
        ctx.noise.skip_round()  # non-private baseline
    for g in total:
        g /= cohort
    return total


def _add_scaled(g: np.ndarray, w: np.ndarray, scale: np.float32) -> None:
    """g += scale·w, block by block in cache (w, the noise, is left as it was)."""
    gf, wf = g.reshape(-1), w.reshape(-1)
    tmp = np.empty(min(gf.size, _BLOCK), dtype=np.float32)
    for lo in range(0, gf.size, _BLOCK):
        wb = wf[lo : lo + _BLOCK]
        tb = np.multiply(wb, scale, out=tmp[: wb.size])
        gf[lo : lo + _BLOCK] += tb


def release(
    ctx: RoundContext,
    plan: RoundPlan,
    outcome: RoundOutcome,
    params: Sequence[np.ndarray],
    momentum: Sequence[np.ndarray],
    selected: Mapping[str, Sequence[int]],
    overrides: Sequence[dict],
    evaluate: Callable[[list[np.ndarray]], dict] | None,
    seconds: Callable[[], float],
) -> RoundRecord:
    """The round's record: its noisy update through the server optimizer, the realised ε after it,
    metrics."""
    new_params, new_m = ctx.optimizer.step(
        params, momentum, noisy_update(ctx, plan, outcome), plan.round
    )
    all_overrides = [*overrides, *plan.overrides]
    eps = ctx.accounting.realized(
        with_round(selected, plan.round, plan.users), all_overrides
    ).epsilon
    rejections = [*plan.rejections, *outcome.rejections]
    reasons = Counter(reason_class(r) for _, r in rejections)
    metrics = {
        "round": plan.round,
        "replies": len(outcome.accepted),
        "accepted": len(outcome.accepted),
        "cohort": float(ctx.planned_cohort(plan.round)),
        **outcome.counts,
        "rejected": len(rejections),
        "top_rejection": reasons.most_common(1)[0][0] if reasons else None,
        "aggregation_seconds": seconds(),
    }
    if eps is not None:
        metrics["epsilon"] = eps
    if evaluate is not None:
        metrics.update(evaluate(new_params))
    return RoundRecord(
        plan.round,
        list(plan.users),
        list(outcome.accepted),
        rejections,
        list(plan.overrides),
        new_params,
        new_m,
        ctx.noise.next_round,
        eps,
        metrics,
        bool(plan.items),
    )


def reason_class(reason: str) -> str:
    """A rejection reason without its per-reply details (array index, node id, counts), for
    counting."""
    if reason.startswith("array "):
        reason = reason.split(":", 1)[-1].strip()
    return re.sub(r"\d+(\.\d+)?", "#", reason)
