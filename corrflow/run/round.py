"""One round of correlated-noise training as pure steps on value types (docs "Conventions", data
flow); nothing here changes the run's state:

1. `plan_round` — the sampled items plus operator overrides, after the separation policy, and
   `RoundPlan.route` — which node trains which item(s) (a new plan: a plan is never changed);
2. `collect` — each `Reply`, as it arrives, validated, zeroed if ℓ∞ > zeroing·clip (000 App.
   F.3) and clipped to ℓ2 ≤ clip on the server (a cross-silo sum of m per-item-clipped updates must
   already be within m·clip), and added at once into g_t = Σ clipped, an exact int64 fixed-point
   sum (`corrflow.run.clipping.ExactSum`: the same bits for any arrival order, so a restart
   reproduces it bit for bit; memory O(model), not O(cohort · model)) — a `SummedReplies`, which a
   secure-aggregation adapter may hand in instead (a sum arriving instead of individual replies);
3. `release` — x̂_t = (g_t + σ·clip·(C⁻¹Z)_t) / planned cohort size, the workload's server
   optimizer step, and the `RoundRecord` that `corrflow.run.core.Run.step` applies.

Drawing (C⁻¹Z)_t advances the noise stream; nothing else is changed here. A failure after the draw
ends the run before anything is applied, and a restart replays the stream from the checkpoint's
noise state.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import numpy as np

from corrflow.accounting.tracking import RealizedPrivacy
from corrflow.run.clipping import ExactSum, RejectedReplyError
from corrflow.run.noise import NoiseStream
from corrflow.run.plan import RunPlan

_FROZEN_EMPTY: Mapping = MappingProxyType({})


@dataclass(frozen=True)
class Reply:
    """One client's answer to the round's training request, whatever carried it.

    ``node``: the node the request was sent to (a reply is matched by the request it answers).
    ``user``: who is behind that node (the node directory's user id; None when unknown).
    ``names``/``arrays``: every array of the model, in order (read-only views are fine: they are
    never written). ``metrics``: the reply's metrics (cross-silo: ``num-items``). ``error``: why the
    transport says it is unusable (a client error, a timeout, a malformed envelope) — then nothing
    else is read; ``undecodable``: why its arrays could not be decoded (rejected when its turn
    comes, so a later duplicate of the same id can still count).
    """

    node: int
    user: str | None = None
    names: Sequence[str] = ()
    arrays: Sequence[np.ndarray] = ()
    metrics: Mapping[str, Any] = field(default_factory=dict)
    error: str | None = None
    details: str | None = None  # a multi-line client traceback, logged with the rejection
    undecodable: str | None = None


@dataclass(frozen=True)
class RoundPlan:
    """Round t before anything is committed: included items, the users behind them (with
    multiplicity), the override/separation records, the rejections found so far, the planned
    cohort size, and — once routed — which node trains which item(s) (``expected``: node → item, or
    items cross-silo) and who is behind each of those nodes."""

    round: int
    items: tuple[str, ...]
    users: tuple[str, ...]
    overrides: tuple[dict, ...] = ()
    rejections: tuple[tuple[str | None, str], ...] = ()  # (item or user, reason)
    expected: Mapping[int, str | tuple[str, ...]] = field(default_factory=lambda: _FROZEN_EMPTY)
    owners: Mapping[int, str] = field(default_factory=lambda: _FROZEN_EMPTY)  # node → user behind
    #: the denominator of x̂_t, the planned cohort size (None: `RunPlan.planned_cohort`)
    planned_cohort: np.float32 | None = None

    def route(
        self,
        user_to_node: Mapping[str, int],
        online: Collection[int],
        item_home: Mapping[str, str] | None = None,
    ) -> RoundPlan:
        """This plan with its items assigned to nodes: an item's user's node (cross-silo: its
        silo's, which trains all of its items); an item whose node is offline is rejected ("offline
        when selected"). This plan is left as it is.

        Args:
            user_to_node: each user's node.
            online: the nodes online now.
            item_home: cross-silo, each item's silo (``RunPlan.item_home``).

        Returns:
            A new plan, with ``expected`` (node → item or items) and ``owners`` (node → user).
        """
        targets: dict[int, list[str]] = {}
        owners: dict[int, str] = {}
        offline = []
        for item in self.items:
            user = item if item_home is None else item_home[item]
            node = user_to_node.get(user)
            if node is None or node not in online:
                offline.append((item, "offline when selected"))
                continue
            targets.setdefault(node, []).append(item)
            owners[node] = user
        expected = {
            n: (items[0] if item_home is None else tuple(items)) for n, items in targets.items()
        }
        return replace(
            self,
            rejections=(*self.rejections, *offline),
            expected=MappingProxyType(expected),
            owners=MappingProxyType(owners),
        )


@dataclass
class SummedReplies:
    """A round's accepted contributions, clipped and summed: the accepted item (or silo) ids in id
    order, the sum of their clipped updates (float32, model-shaped), per-action counts, rejections,
    and the positions (in the replies handed in) of the accepted replies. A secure-aggregation
    adapter builds one from its sum and the ids it vouches for."""

    accepted: list[str]
    total: list[np.ndarray]
    counts: dict[str, int]
    rejections: list[tuple[str | None, str]]
    accepted_replies: list[int] = field(default_factory=list)

    @classmethod
    def empty(cls, shapes: Sequence[tuple[int, ...]]) -> SummedReplies:
        """A sum of nothing yet.

        Args:
            shapes: the trainable arrays' shapes (``ModelLayout.trainable_shapes``).

        Returns:
            Zero float32 arrays, nothing accepted, no counts.
        """
        return cls(
            [],
            [np.zeros(s, dtype=np.float32) for s in shapes],
            {"kept": 0, "clipped": 0, "zeroed": 0, "rejected": 0},
            [],
        )


@dataclass(frozen=True)
class RoundRecord:
    """What a completed round changes, applied by `step`: the ledger
    delta (selected users with multiplicity, accepted keys, rejections, override records), the
    released model and optimizer state, the noise position after the round, its metrics, and the
    positions of the accepted replies (for a transport's own metric aggregation)."""

    round: int
    users: tuple[str, ...]
    accepted: tuple[str, ...]
    rejections: tuple[tuple[str | None, str], ...]
    overrides: tuple[dict, ...]
    params: list[np.ndarray]
    momentum: list[np.ndarray]
    noise_position: int
    epsilon: float | None
    metrics: dict
    asked: bool  # the round asked someone (an empty sample neither breaks nor extends a streak)
    accepted_replies: tuple[int, ...] = ()


def plan_round(
    run: RunPlan,
    t: int,
    selected: Mapping[str, Sequence[int]],
    forced: Sequence[str],
    log_warning: Callable[..., None],
) -> RoundPlan:
    """Sampled items plus operator overrides (``forced``), after the separation policy (``reject``:
    an item whose users would break min-sep is left out; ``accept-and-account``: included and
    recorded)."""
    planner, monitor = run.planner, run.monitor
    sampled = planner.cohort(t)
    forced = [i for i in forced if i not in sampled]
    items, users, overrides, rejections = [], [], [], []
    for item in sampled + forced:
        owners = planner.users_of(item)
        gaps = {u: g for u in owners if (g := monitor.violates(selected, u, t)) is not None}
        source = "override" if item in forced else "sampler"
        if gaps or source == "override":
            action = (
                "included"
                if not gaps
                else ("rejected" if run.cfg.policy == "reject" else "accepted-and-accounted")
            )
            overrides.append(
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
                rejections.append(
                    (
                        item,
                        f"separation: gap {min(gaps.values())} < min-sep "
                        f"{run.planner.min_sep} (policy reject)",
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
        items.append(item)
        users.extend(owners)
    # the planned cohort, not the number of replies, is x̂_t's denominator
    cohort = len(sampled) if planner.kind == "fixed-epoch" else planner.expected
    return RoundPlan(
        t,
        tuple(items),
        tuple(users),
        tuple(overrides),
        tuple(rejections),
        planned_cohort=np.float32(cohort),
    )


def budget_reason(run: RunPlan, plan: RoundPlan, epsilon: float | None) -> str | None:
    """Why round ``plan.round`` must not happen — ``epsilon``, the realised ε after it
    (`corrflow.accounting.policy.RunAccounting.realized_after`), would exceed the target — else
    None."""
    if not run.accounting.over_budget(epsilon):
        return None
    return (
        f"budget guard: round {plan.round + 1} of {run.cfg.num_rounds} would spend ε = "
        f"{epsilon:.4f} > target {run.accounting.target_epsilon:g}"
        + (
            ""
            if run.accounting.target_epsilon == run.cfg.target_epsilon
            else f" (training's share of {run.cfg.target_epsilon:g})"
        )
    )


def check_reply(plan: RoundPlan, reply: Reply) -> tuple[str, int]:
    """(item or silo id, items it sums) of a reply whose envelope is well formed, else
    `RejectedReplyError`. Its arrays are checked when it is added."""
    expected = plan.expected.get(reply.node)
    if expected is None:
        raise RejectedReplyError(f"unexpected sender node {reply.node} (not selected this round)")
    key = expected if isinstance(expected, str) else plan.owners[reply.node]
    if reply.error is not None:
        raise RejectedReplyError(reply.error)
    items = 1
    if not isinstance(expected, str):  # cross-silo: the reply must sum exactly the items sent
        items = len(expected)
        got = reply.metrics.get("num-items")
        if got != items:
            raise RejectedReplyError(
                f"metric num-items = {got!r}, expected {items} (the item ids sent)"
            )
    return key, items


def collect(
    run: RunPlan,
    plan: RoundPlan,
    replies: Iterable[Reply],
    params: Sequence[np.ndarray],
    log_warning: Callable[..., None],
) -> SummedReplies:
    """Validate, zero or clip each reply as it arrives and add it at once into the round's exact sum
    (`ExactSum`: the same bits for any arrival order), keeping nothing of it: ``replies`` may be a
    generator that pulls them from a transport, and memory stays O(model). The first reply of an id
    that is accepted counts; any later one is a duplicate, and a rejected one never enters the sum.
    A node that was sent a request (``plan.expected``) and did not answer is recorded as timed out.
    Accepted ids are listed in id order, rejections in (who, reason) order. Changes no state."""
    layout = run.layout
    exact = ExactSum(layout.trainable_shapes, run.sum_scale, layout.trainable_names)
    counts = {"kept": 0, "clipped": 0, "zeroed": 0, "rejected": 0}
    rejections: list[tuple[str | None, str]] = []
    model_sent = layout.sent(params) if run.replies_are_weights else None
    answered: set[int] = set()
    accepted: dict[str, int] = {}  # id → the position of the reply that counts
    take = _Take(run, plan, exact, model_sent, counts, rejections, log_warning)
    index = 0  # not enumerate: its cached tuple would hold the last reply during the next pull
    for reply in replies:
        answered.add(reply.node)
        take(index, reply, accepted)
        index += 1  # noqa: SIM113
        reply = None  # noqa: PLW2901 - its buffers go before the transport is asked for the next
    rejections.sort(key=lambda r: (r[0] is None, str(r[0]), r[1]))
    for node in sorted(set(plan.expected) - answered):
        expected = plan.expected[node]
        who = expected if isinstance(expected, str) else plan.owners.get(node)
        _reject(
            counts,
            rejections,
            who,
            f"timed out: no reply within node-timeout {run.cfg.node_timeout:g} s",
            plan.round,
            node,
            log_warning,
        )
    keys = sorted(accepted)
    total = exact.total()
    del exact
    return SummedReplies(keys, total, counts, rejections, [accepted[k] for k in keys])


@dataclass
class _Take:
    """Checks one reply and adds it into the round's exact sum, or records why not."""

    run: RunPlan
    plan: RoundPlan
    exact: ExactSum
    model_sent: Sequence[np.ndarray] | None
    counts: dict[str, int]
    rejections: list[tuple[str | None, str]]
    log_warning: Callable[..., None]

    def __call__(self, index: int, reply: Reply, accepted: dict[str, int]) -> None:
        run, t, warn = self.run, self.plan.round, self.log_warning
        try:
            key, items = check_reply(self.plan, reply)
        except RejectedReplyError as exc:
            _reject(
                self.counts,
                self.rejections,
                reply.user,
                exc.reason,
                t,
                reply.node,
                warn,
                reply.details,
            )
            return
        silo, clip = run.item_home is not None, run.cfg.clip_norm
        try:
            if key in accepted:
                raise RejectedReplyError("duplicate reply")
            # cross-silo sums of per-item-clipped updates: allow float32 rounding, then re-check
            # the bound (a silo's update is never clipped by the server)
            action = self.exact.add(
                run.layout.reply_arrays(reply.names, reply.arrays, reply.undecodable),
                self.model_sent,
                items * clip * (1 + 1e-5 if silo else 1),
                run.cfg.zeroing_factor * clip,
                allow_clip=not silo,
            )
        except RejectedReplyError as exc:
            reason = exc.reason
            if reason == "needs clipping":
                reason = (
                    f"per-item clipping not honoured: the sum of {items} items exceeds "
                    f"{items} × clip-norm = {items * clip:g}"
                )
            _reject(self.counts, self.rejections, key, reason, t, reply.node, warn)
            return
        if action == "zeroed":
            warn(
                "round %d: zeroed reply from %s: ℓ∞ above %g × clip-norm (000 App. F.3)",
                t + 1,
                key,
                run.cfg.zeroing_factor,
            )
        self.counts[action] += 1
        accepted[key] = index


def _reject(
    counts: dict[str, int],
    rejections: list[tuple[str | None, str]],
    who: str | None,
    reason: str,
    t: int,
    node: int,
    log_warning: Callable[..., None],
    details: str | None = None,
) -> None:
    counts["rejected"] += 1
    rejections.append((who, reason))
    log_warning(
        "round %d: rejected reply from node %d: %s%s",
        t + 1,
        node,
        reason,
        f"\n{details}" if details and "\n" in str(details) else "",
    )


def noisy_update(
    run: RunPlan, plan: RoundPlan, summed: SummedReplies, noise: NoiseStream
) -> list[np.ndarray]:
    """x̂_t = (Σ clipped + σ·clip·(C⁻¹Z)_t) / planned cohort size, formed in the sum (which it takes
    over); draws round t's noise."""
    cohort = run.planned_cohort(plan.round) if plan.planned_cohort is None else plan.planned_cohort
    total = summed.total
    if run.sigma > 0:
        noise.add(total, plan.round, np.float32(run.sigma * run.cfg.clip_norm))
    else:
        noise.skip(plan.round)  # non-private baseline
    for g in total:
        g /= cohort
    return total


def release(
    run: RunPlan,
    plan: RoundPlan,
    summed: SummedReplies,
    state: Any,
    noise: NoiseStream,
    seconds: Callable[[], float],
    privacy: RealizedPrivacy | None = None,
) -> RoundRecord:
    """The round's record: its noisy update through the server optimizer, the realised ε after it,
    and its metrics. ``state``: the run's state before the round (read only: a
    `RunState` or its view); ``seconds``: the time the round has taken so
    far (a metric); ``privacy``: the realised privacy after the round when the budget guard has
    computed it for this plan (`corrflow.run.core.Run.plan_next`), else computed here."""
    ledger = state.ledger
    new_params, new_m = run.optimizer.step(
        state.params, state.momentum, noisy_update(run, plan, summed, noise), plan.round
    )
    if privacy is None:
        privacy = run.accounting.after_round(
            ledger.selected,
            [*ledger.overrides, *plan.overrides],
            plan.round,
            plan.users,
            getattr(state, "sensitivity", None),
        )
    eps = privacy.epsilon
    rejections = (*plan.rejections, *summed.rejections)
    reasons = Counter(reason_class(r) for _, r in rejections)
    metrics = {
        "round": plan.round,
        "replies": len(summed.accepted),
        "accepted": len(summed.accepted),
        "cohort": float(
            run.planned_cohort(plan.round) if plan.planned_cohort is None else plan.planned_cohort
        ),
        **summed.counts,
        "rejected": len(rejections),
        "top_rejection": reasons.most_common(1)[0][0] if reasons else None,
        "aggregation_seconds": seconds(),
    }
    if eps is not None:
        metrics["epsilon"] = eps
    return RoundRecord(
        plan.round,
        tuple(plan.users),
        tuple(summed.accepted),
        rejections,
        tuple(plan.overrides),
        new_params,
        new_m,
        noise.next_round,
        eps,
        metrics,
        bool(plan.items),
        tuple(summed.accepted_replies),
    )


def reason_class(reason: str) -> str:
    """A rejection reason without its per-reply details (array index, node id, counts), for
    counting."""
    if reason.startswith("array "):
        reason = reason.split(":", 1)[-1].strip()
    return re.sub(r"\d+(\.\d+)?", "#", reason)
