"""Canary clients for empirical privacy auditing, and the audit of a finished run (Andrew et al.,
"One-shot Empirical Privacy Estimation for Federated Learning", arXiv 2302.03098; Steinke, Nasr,
Jagielski, "Privacy Auditing with One (1) Training Run", arXiv 2305.08846). Simulation only.

A canary is a SuperNode whose ClientApp does no training: in every round it is asked, it returns the
model it was sent plus ζ·c_j, its fixed unit direction scaled to the clip norm ζ. The server treats
it as any user — scheduled, clipped, noised and accounted on the production code path — so the audit
sees the mechanism as it runs. In ``corrflow audit`` the canaries are nodes of the in-process grid;
around a user's strategy (``DifferentialPrivacyCorrelatedNoise(..., canaries=N)``)
`CanaryGrid` adds them to a simulation's grid. The statistics are
`corrflow.accounting.audit`'s; `analyse` applies them to the released models.
"""

from __future__ import annotations

import math
import uuid
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)

from corrflow.accounting import audit as stats
from corrflow.config import RunConfig
from corrflow.errors import require
from corrflow.fileio import atomic_file
from corrflow.protocol import PROBE_ACTION, PROBE_KEY, REPLY_KEY, node_identity

#: node-config key that marks a canary SuperNode of the in-process grid (value: the candidate's
# index).
CANARY_KEY = "corrflow-canary"
#: The fewest candidate canaries: fewer cannot fit a Gaussian on each side nor bound anything.
MIN_CANARIES = 20


@dataclass(frozen=True)
class CanaryPlan:
    """The audit's public randomness: ``count`` candidates, their coins, and the seed of their
    directions."""

    count: int
    seed: int
    inserted: np.ndarray  # bool, per candidate

    @classmethod
    def draw(cls, count: int, seed: int) -> CanaryPlan:
        require(
            count >= MIN_CANARIES, "canaries", f"at least {MIN_CANARIES} candidate canaries", count
        )
        coins = stats.canary_coins(seed, count)
        require(
            2 <= coins.sum() <= count - 2,
            "canaries",
            "more candidates (the coins left fewer than two on a side)",
            count,
        )
        return cls(int(count), int(seed), coins)

    @property
    def inserted_ids(self) -> list[int]:
        return [int(j) for j in np.flatnonzero(self.inserted)]

    def direction(self, j: int, dim: int) -> np.ndarray:
        return stats.canary_direction(self.seed, j, dim)


def canary_arrays(
    arrays: list[np.ndarray], plan: CanaryPlan, j: int, clip_norm: float, replies: str = "weights"
) -> list[np.ndarray]:
    """Canary ``j``'s reply to the model ``arrays``: the model plus ζ·c_j over its floating-point
    arrays (or ζ·c_j alone when ``replies`` is "delta"), each in its array's dtype.

    Args:
        arrays: the model sent, in model order.
        plan: the audit's canaries.
        j: the canary's candidate index.
        clip_norm: ζ.
        replies: "weights" or "delta" (the run's reply kind).

    Returns:
        The reply's arrays, in model order.
    """
    floats = [i for i, a in enumerate(arrays) if np.issubdtype(a.dtype, np.floating)]
    c = plan.direction(int(j), sum(arrays[i].size for i in floats)) * clip_norm
    out, at = list(arrays), 0
    for i in floats:
        a = arrays[i]
        step = c[at : at + a.size].reshape(a.shape)
        out[i] = (step if replies == "delta" else a.astype(np.float64) + step).astype(a.dtype)
        at += a.size
    return out


def canary_reply(
    msg: Message, plan: CanaryPlan, j: int, clip_norm: float, replies: str = "weights"
) -> Message:
    """Canary ``j``'s answer to a train message: `canary_arrays` of the model sent, under the
    model's own array names. The server clips it to ζ: it is already there (float32 rounding
    aside)."""
    record = msg.content["arrays"]
    keys = list(record.keys())
    out = canary_arrays(record.to_numpy_ndarrays(), plan, j, clip_norm, replies)
    content = ArrayRecord(
        OrderedDict(
            (k, Array(np.require(a, requirements="C"))) for k, a in zip(keys, out, strict=True)
        )
    )
    return Message(
        content=RecordDict({"arrays": content, "metrics": MetricRecord({"num-examples": 1})}),
        reply_to=msg,
    )


def canary_handlers(
    handlers: dict, plan: CanaryPlan, clip_norm: float, replies: str = "weights"
) -> dict:
    """The task's ClientApp handlers, with ``train`` answering for canary nodes (node config
    `CANARY_KEY`) by `canary_reply`."""
    real_train = handlers["train"]

    def train(msg: Message, context: Context) -> Message:
        j = context.node_config.get(CANARY_KEY)
        if j is None:
            return real_train(msg, context)
        return canary_reply(msg, plan, int(j), clip_norm, replies)

    return {**handlers, "train": train}


class CanaryGrid:
    """A simulation's grid plus one virtual SuperNode per inserted canary, answered here: train
    messages by `canary_reply`, corrflow's identity probe with ``partition-id`` =
    ``first_partition + r``. Every other message goes to the real grid, so the server's code path is
    the production one."""

    synchronous = False

    def __init__(
        self, grid, plan: CanaryPlan, clip_norm: float, replies: str, first_partition: int
    ):
        self._grid = grid
        self.synchronous = bool(getattr(grid, "synchronous", False))
        self.plan, self.clip_norm, self.replies = plan, float(clip_norm), replies
        top = (1 << 63) - 1
        self.canary_nodes = {
            top - 7919 * r: (j, first_partition + r) for r, j in enumerate(plan.inserted_ids)
        }
        self._replies: list[Message] = []

    def canary_users(self) -> dict[int, str]:
        """Inserted candidate → the user id corrflow gives its node (``partition-<id>``)."""
        return {j: f"partition-{p}" for j, p in self.canary_nodes.values()}

    def get_node_ids(self) -> Iterable[int]:
        return [*self._grid.get_node_ids(), *self.canary_nodes]

    def _answer(self, msg: Message) -> Message:
        j, partition = self.canary_nodes[int(msg.metadata.dst_node_id)]
        kind = msg.metadata.message_type
        if kind == f"query.{PROBE_ACTION}":
            value, error = node_identity(
                str(msg.content["config"][PROBE_KEY]), {"partition-id": partition}
            )
            record = ConfigRecord({"value": value} if value is not None else {"error": error})
            return Message(content=RecordDict({REPLY_KEY: record}), reply_to=msg)
        if kind.split(".")[0] == "train":
            return canary_reply(msg, self.plan, j, self.clip_norm, self.replies)
        return Message(
            Error(code=2, reason=f"a canary answers train messages only, not {kind}"), reply_to=msg
        )

    def _split(self, messages: Iterable[Message]) -> tuple[list[Message], list[Message]]:
        mine, theirs = [], []
        for m in messages:
            (mine if int(m.metadata.dst_node_id) in self.canary_nodes else theirs).append(m)
        return mine, theirs

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        mine, theirs = self._split(messages)
        ids = list(self._grid.push_messages(theirs)) if theirs else []
        for m in mine:
            m.metadata.__dict__["_message_id"] = str(uuid.uuid4())
            ids.append(m.metadata.message_id)
            self._replies.append(self._answer(m))
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        wanted = set(message_ids)
        mine = [r for r in self._replies if r.metadata.reply_to_message_id in wanted]
        self._replies = [r for r in self._replies if r.metadata.reply_to_message_id not in wanted]
        rest = wanted - {r.metadata.reply_to_message_id for r in mine}
        return [*mine, *(self._grid.pull_messages(rest) if rest else [])]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        mine, theirs = self._split(messages)
        out = list(self._grid.send_and_receive(theirs, timeout=timeout)) if theirs else []
        return [*out, *(self._answer(m) for m in mine)]

    def __getattr__(self, name: str):
        return getattr(self._grid, name)


@dataclass
class RoundCapture:
    """The released models, round by round (the all-iterates adversary's view): an ``on_round_end``
    callback."""

    models: list[np.ndarray]
    rounds: list[int]
    strategy: object = None
    scores: dict | None = None  # the scores behind the plot, filled by `analyse`

    def __call__(self, strategy, metrics) -> None:
        self.strategy = strategy
        self.rounds.append(int(metrics["round"]))
        self.models.append(np.concatenate([p.ravel() for p in strategy.params]).astype(np.float64))


def optimizer_map(optimizer, rounds: int) -> np.ndarray:
    """M (rounds × rounds): the model change of round t per unit private update of round s, from the
    run's own server optimizer applied to impulses (D = M·x̃; lower triangular)."""
    out = np.zeros((rounds, rounds))
    for s in range(rounds):
        p, m = [np.zeros(1, np.float32)], [np.zeros(1, np.float32)]
        for t in range(rounds):
            new, m = optimizer.step(p, m, [np.full(1, 1.0 if t == s else 0.0, np.float32)], t)
            out[t, s] = float(new[0][0] - p[0][0])
            p = new
    return out


def _patterns(
    strategy, plan: CanaryPlan, users: dict[int, str], rounds: int
) -> tuple[np.ndarray, str]:
    """u_j (candidates × rounds): the public rounds of each candidate. Fixed-epoch: an inserted
    canary's group from the public schedule, a held-out one's a group drawn uniformly (keyed by the
    audit seed), so that the pattern does not depend on the coin; random samplers (amplified ε,
    secret cohorts): every round."""
    planner = strategy.planner
    u = np.zeros((plan.count, rounds))
    if planner.kind != "fixed-epoch":
        u[:] = 1.0
        return (
            u,
            "every round (the cohorts are secret: the amplified ε assumes the adversary does not "
            "know them)",
        )
    b = planner.min_sep
    groups = np.random.default_rng([plan.seed, 3]).integers(0, b, plan.count)
    for j, user in users.items():
        groups[j] = planner.planned_rounds(user)[0]
    for j, g in enumerate(groups):
        u[j, int(g) :: b] = 1.0
    return (
        u,
        "the canary's fixed-epoch rounds (public schedule; held-out canaries: a group drawn at "
        "random)",
    )


def analyse(
    report: dict,
    strategy,
    capture: RoundCapture,
    plan: CanaryPlan,
    users: dict[int, str],
    real: int,
    cfg: RunConfig,
) -> dict:
    """The audit's numbers from the released models (see the module docstring)."""
    scored = _score(strategy, capture, plan, users, cfg)
    ins = plan.inserted
    delta = float(report["delta"])
    claimed = report["realized"]["epsilon"]
    estimate = stats.one_shot_estimate(
        scored.scores[ins], scored.scores[~ins], delta, seed=plan.seed
    )
    final = stats.one_shot_estimate(
        scored.cosines[ins], scored.cosines[~ins], delta, seed=plan.seed
    )
    lower = stats.one_run_lower_bound(scored.scores, ins, delta)
    capture.scores = {
        "whitened": (scored.scores[ins], scored.scores[~ins]),
        "cosine": (scored.cosines[ins], scored.cosines[~ins]),
        "claimed": claimed,
        "estimate": estimate.epsilon,
        "lower": lower.epsilon,
        "final": final.epsilon,
        "kind": report["mechanism"]["kind"],
    }
    return {
        "epsilon_claimed": claimed,
        "delta": delta,
        "epsilon_estimate": estimate.epsilon,
        "epsilon_estimate_interval": list(estimate.interval),
        "epsilon_lower": lower.epsilon,
        "confidence": lower.confidence,
        "verdict": _verdict(claimed, estimate, lower),
        "canaries": _canaries_section(plan, real, delta, scored.pattern_rule),
        "statistics": _statistics_section(estimate, lower, final, scored),
        "run": _run_section(report, strategy, cfg, len(capture.rounds)),
    }


@dataclass(frozen=True)
class _Scored:
    """Each candidate canary's scores on the released model changes."""

    scores: np.ndarray  # (m,) whitened matched filter
    cosines: np.ndarray  # (m,) final-model cosine
    pattern_rule: str
    dim: int
    rounds_scored: int


def _score(strategy, capture: RoundCapture, plan: CanaryPlan, users, cfg: RunConfig) -> _Scored:
    """Score every candidate canary on the released model changes D (T', d): the whitened matched
    filter against its expected trace a_j = M u_j and the cosine with θ_T − θ_0 (module
    docstring)."""
    models = np.stack(capture.models)  # (T + 1, d)
    released = len(capture.rounds)
    require(
        capture.rounds == list(range(released)),
        "rounds",
        "rounds released in order",
        capture.rounds,
    )
    deltas = np.diff(models, axis=0)  # (T, d)
    dim = deltas.shape[1]
    M = optimizer_map(strategy.run.plan.optimizer, cfg.num_rounds)[:released, :released]
    moving = np.abs(np.diag(M)) > 0  # rounds at learning rate 0 release nothing new
    D, M = deltas[moving], M[moving]
    u, pattern_rule = _patterns(strategy, plan, users, cfg.num_rounds)
    a = u[:, :released] @ M.T
    proj = np.stack([D @ plan.direction(j, dim) for j in range(plan.count)])  # (m, n')
    return _Scored(
        stats.whitened_scores(D, proj, a),
        stats.final_model_cosines(D.sum(axis=0), proj.sum(axis=1)),
        pattern_rule,
        dim,
        int(moving.sum()),
    )


def _canaries_section(plan: CanaryPlan, real: int, delta: float, pattern_rule: str) -> dict:
    ins = plan.inserted
    return {
        "candidates": plan.count,
        "inserted": int(ins.sum()),
        "held_out": int((~ins).sum()),
        "audit_seed": plan.seed,
        "real_users": real,
        "population_share": len(plan.inserted_ids) / (real + len(plan.inserted_ids)),
        "lower_bound_ceiling": stats.lower_bound_ceiling(plan.count, delta=delta),
        "rounds": pattern_rule,
    }


def _statistics_section(estimate, lower, final, scored: _Scored) -> dict:
    return {
        "threat_model": (
            "all iterates: the adversary sees every released model (the claimed ε covers them)"
        ),
        "score": (
            "whitened matched filter a_jᵀΣ̂⁻¹p_j/√(a_jᵀΣ̂⁻¹a_j), Σ̂ = DDᵀ/d from the released "
            "model changes"
        ),
        "estimator": (
            "one-shot Gaussian fit ε_G(μ̂/σ̂; δ) (Andrew et al., arXiv 2302.03098), 95% "
            "percentile bootstrap interval"
        ),
        "whitened": estimate.to_dict(),
        "lower_bound": lower.to_dict(),
        "final_model": {
            **final.to_dict(),
            "score": "cosine ⟨c_j, θ_T − θ_0⟩/‖θ_T − θ_0‖ (Andrew et al.), null N(0, 1/d)",
            "expected_null_std": 1 / math.sqrt(scored.dim),
        },
        "model_dim": scored.dim,
        "rounds_scored": scored.rounds_scored,
    }


def _run_section(report: dict, strategy, cfg: RunConfig, released: int) -> dict:
    cohorts = (
        [len(strategy.planner.cohort(t)) for t in range(released)]
        if strategy.planner.kind == "fixed-epoch"
        else None
    )
    return {
        "dir": str(Path(cfg.state_dir)),
        "kind": report["mechanism"]["kind"],
        "participation": report["planned"]["participation"].get("kind"),
        "noise_multiplier": report["noise_multiplier"],
        "clip_norm": report["clip_norm"],
        "accountant": report["accountant"]["name"],
        "rounds_completed": report["rounds_completed"],
        "stopped_reason": report.get("stopped_reason"),
        "cohort_sizes": cohorts,
    }


def _verdict(claimed: float | None, estimate: stats.Estimate, lower: stats.LowerBound) -> str:
    if claimed is None:
        return "no claim to audit (non-private run)"
    if lower.epsilon > claimed:
        return (
            f"VIOLATION: the {lower.confidence:.0%} lower bound ε_lo = {lower.epsilon:.3g} exceeds "
            f"the claimed ε = {claimed:.3g}; the run leaks more than it claims"
        )
    if estimate.interval[0] > claimed:
        return (
            f"SUSPECT: the estimate ε̂ = {estimate.epsilon:.3g} (interval from "
            f"{estimate.interval[0]:.3g}) lies above the claimed ε = {claimed:.3g}; rerun with "
            "more canaries to prove or clear it (a correct run whose estimate sits at its claim "
            "lands here about 1 time in 40)"
        )
    if estimate.epsilon > claimed:
        # The point estimate alone carries sampling error; only its interval's low end (SUSPECT)
        # or the lower bound (VIOLATION) above the claim is evidence against it.
        return (
            f"consistent: the estimate ε̂ = {estimate.epsilon:.3g} is above the claimed "
            f"ε = {claimed:.3g}, but its interval starts at {estimate.interval[0]:.3g} and the "
            f"{lower.confidence:.0%} lower bound is ε_lo = {lower.epsilon:.3g}, both within the "
            "claim: nothing is shown above it (an estimate, not a proof; more canaries narrow "
            "the interval)"
        )
    return (
        f"consistent: nothing shown above the claimed ε = {claimed:.3g} (the estimate "
        f"ε̂ = {estimate.epsilon:.3g} and the {lower.confidence:.0%} lower bound "
        f"ε_lo = {lower.epsilon:.3g} are within it; an estimate, not a proof)"
    )


def write_plot(result: dict, scores: dict, path: Path) -> Path:
    """Histograms of the inserted and held-out canaries' scores: whitened (left) and final-model
    cosine (right)."""
    # matplotlib loads here, not with the module: it takes seconds, and only an audit plots.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in (
        (axes[0], "whitened", "whitened score (all iterates)"),
        (axes[1], "cosine", "cosine with θ_T − θ_0 (final model)"),
    ):
        ins, out = scores[key]
        bins = np.histogram_bin_edges(np.concatenate([ins, out]), bins=30)
        ax.hist(out, bins=bins, alpha=0.6, label=f"held out ({out.size})", color="tab:blue")
        ax.hist(ins, bins=bins, alpha=0.6, label=f"inserted ({ins.size})", color="tab:red")
        ax.set_xlabel(label)
        ax.set_ylabel("canaries")
        ax.legend()
    est = result["statistics"]["final_model"]["epsilon"]
    axes[0].set_title(
        f"ε claimed {_fmt(result['epsilon_claimed'])}, ε̂ {_fmt(result['epsilon_estimate'])}, "
        f"ε_lo {_fmt(result['epsilon_lower'])}"
    )
    axes[1].set_title(f"final-model ε̂ {_fmt(est)} ({scores['kind']})")
    fig.tight_layout()
    with atomic_file(path, "wb") as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)
    return path


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3g}"


__all__ = [
    "CANARY_KEY",
    "MIN_CANARIES",
    "CanaryGrid",
    "CanaryPlan",
    "RoundCapture",
    "analyse",
    "canary_handlers",
    "optimizer_map",
    "write_plot",
]
