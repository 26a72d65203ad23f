"""``corrflow audit``: one training run with canary clients, and what the released models show about its ε.

The run is an ordinary in-process simulation (:class:`~corrflow.server.inprocess.InProcessGrid`, the production
server code path from sampling to release) whose population holds, besides the real users, the *inserted* canaries:
one SuperNode each, scheduled, clipped, noised and accounted exactly like a real user. A canary's ClientApp does no
training: it returns the model it was sent plus ζ·c_j, its fixed unit direction c_j scaled to the clip norm ζ, in
every round it is asked (Andrew et al., arXiv 2302.03098). The *held-out* canaries — the candidates whose coin came up
"out" (Steinke et al., arXiv 2305.08846) — never take part; their directions are the null.

After the run, the per-round model changes D_t = θ_{t+1} − θ_t (what an adversary who sees every released model
sees) are scored per canary with the whitened matched filter of :mod:`corrflow.accounting.audit`, and the report
gives the run's own claimed ε, the one-shot estimate ε̂ with a bootstrap interval, the one-run 95% lower bound ε_lo,
the final-model (cosine) estimate of Andrew et al., and a PNG of the score histograms.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict

from corrflow.accounting import audit as stats
from corrflow.config import RunConfig
from corrflow.errors import require
from corrflow.fileio import write_json

log = logging.getLogger("corrflow")

#: node-config key that marks a canary SuperNode of the in-process grid (value: the candidate's index).
CANARY_KEY = "corrflow-canary"
#: The fewest candidate canaries: fewer cannot fit a Gaussian on each side nor bound anything.
MIN_CANARIES = 20


@dataclass(frozen=True)
class CanaryPlan:
    """The audit's public randomness: ``count`` candidates, their coins, and the seed of their directions."""
    count: int
    seed: int
    inserted: np.ndarray        # bool, per candidate

    @classmethod
    def draw(cls, count: int, seed: int) -> CanaryPlan:
        require(count >= MIN_CANARIES, "canaries", f"at least {MIN_CANARIES} candidate canaries", count)
        coins = stats.canary_coins(seed, count)
        require(2 <= coins.sum() <= count - 2, "canaries", "more candidates (the coins left fewer than two on a "
                "side)", count)
        return cls(int(count), int(seed), coins)

    @property
    def inserted_ids(self) -> list[int]:
        return [int(j) for j in np.flatnonzero(self.inserted)]

    def direction(self, j: int, dim: int) -> np.ndarray:
        return stats.canary_direction(self.seed, j, dim)


def canary_handlers(handlers: dict, plan: CanaryPlan, clip_norm: float) -> dict:
    """The task's ClientApp handlers, with ``train`` answering for canary nodes (node config :data:`CANARY_KEY`):
    the model sent plus ζ·c_j over the floating-point arrays (the server clips it to ζ — it is already there)."""
    real_train = handlers["train"]

    def train(msg: Message, context: Context) -> Message:
        j = context.node_config.get(CANARY_KEY)
        if j is None:
            return real_train(msg, context)
        arrays = msg.content["arrays"].to_numpy_ndarrays()
        floats = [i for i, a in enumerate(arrays) if np.issubdtype(a.dtype, np.floating)]
        c = plan.direction(int(j), sum(arrays[i].size for i in floats)) * clip_norm
        out, at = list(arrays), 0
        for i in floats:
            a = arrays[i]
            out[i] = (a.astype(np.float64) + c[at:at + a.size].reshape(a.shape)).astype(a.dtype)
            at += a.size
        return Message(content=RecordDict({"arrays": ArrayRecord(out), "metrics": MetricRecord(
            {"num-examples": 1, "canary": 1})}), reply_to=msg)

    return {**handlers, "train": train}


@dataclass
class _Capture:
    """The released models, round by round (the all-iterates adversary's view)."""
    models: list[np.ndarray]
    rounds: list[int]
    strategy: object = None
    scores: dict | None = None      # the scores behind the plot, filled by :func:`analyse`

    def __call__(self, strategy, metrics) -> None:
        self.strategy = strategy
        self.rounds.append(int(metrics["round"]))
        self.models.append(np.concatenate([p.ravel() for p in strategy.params]).astype(np.float64))


def optimizer_map(optimizer, rounds: int) -> np.ndarray:
    """M (rounds × rounds): the model change of round t per unit private update of round s, from the run's own
    server optimizer applied to impulses (D = M·x̃; lower triangular)."""
    out = np.zeros((rounds, rounds))
    for s in range(rounds):
        p, m = [np.zeros(1, np.float32)], [np.zeros(1, np.float32)]
        for t in range(rounds):
            new, m = optimizer.step(p, m, [np.full(1, 1.0 if t == s else 0.0, np.float32)], t)
            out[t, s] = float(new[0][0] - p[0][0])
            p = new
    return out


def run_audit(cfg: RunConfig, canaries: int, audit_seed: int | None = None, *, noise_key: bytes | None = None,
              quiet: bool = False, verbose: bool = False, plot: bool = True) -> dict:
    """Train ``cfg`` in its run directory (always a fresh run; an earlier one there is moved aside) with
    ``canaries`` candidate canaries, and return the audit (also written to ``audit.json`` there).
    ``noise_key``: for tests only (a real audit draws a fresh secret key, like every run)."""
    from corrflow.clients.tasks import get_task
    from corrflow.paths import run_directory
    from corrflow.server.app import run_server
    from corrflow.server.inprocess import InProcessGrid
    from corrflow.server.simulation import RunInterruptedError, engine_output, stop_on_signals

    require(cfg.mode == "cross-device", "mode", "cross-device (a canary is a SuperNode)", cfg.mode)
    require(cfg.target_epsilon is not None or cfg.noise_multiplier is not None, "target-epsilon",
            "a private run (the audit compares against its ε)")
    seed = secrets.randbits(32) if audit_seed is None else int(audit_seed)
    plan = CanaryPlan.draw(canaries, seed)
    inserted = plan.inserted_ids
    real = int(cfg.num_users)
    out = run_directory(cfg.state_dir)
    cfg = cfg.replace(state_dir=str(out), num_users=real + len(inserted))
    out.mkdir(parents=True, exist_ok=True)
    task = get_task(cfg.client, cfg.model_dim, cfg.data_path, cfg.vocab_path, cfg.seq_len, cfg.seed)
    node_config = {real + r: {CANARY_KEY: j} for r, j in enumerate(inserted)}
    grid = InProcessGrid(canary_handlers(task.handlers, plan, float(cfg.clip_norm)), cfg.num_users,
                         node_config=lambda p: node_config.get(p, {}))
    initial = np.concatenate([np.asarray(a, np.float64).ravel() for a in task.initial_weights()
                              if np.issubdtype(np.asarray(a).dtype, np.floating)])
    capture = _Capture([initial], [])
    started = time.perf_counter()
    with stop_on_signals() as stop, engine_output(out / "engine.log", verbose):
        strategy = run_server(grid, cfg, noise_key=noise_key, quiet=quiet, on_round_end=capture, fresh=True,
                              stop_event=stop)
    report = json.loads((out / "privacy_report.json").read_text())
    if stop.is_set() and report["rounds_completed"] < cfg.num_rounds:
        raise RunInterruptedError(report.get("stopped_reason") or "interrupted")
    require(report["rounds_completed"] >= 1, "rounds", "a run that released at least one round to audit",
            report.get("stopped_reason"))
    result = analyse(report, strategy, capture, plan, real, cfg)
    result["seconds"] = time.perf_counter() - started
    if plot:
        result["plot"] = str(write_plot(result, capture.scores, out / "audit.png"))
    write_json(out / "audit.json", result, sort_keys=True)
    return result


def _patterns(strategy, plan: CanaryPlan, real: int, rounds: int) -> tuple[np.ndarray, str]:
    """u_j (candidates × rounds): the public rounds of each candidate. Fixed-epoch: an inserted canary's group
    from the public schedule, a held-out one's a group drawn uniformly (keyed by the audit seed), so that the
    pattern does not depend on the coin; random samplers (amplified ε, secret cohorts): every round."""
    planner = strategy.planner
    u = np.zeros((plan.count, rounds))
    if planner.kind != "fixed-epoch":
        u[:] = 1.0
        return u, "every round (the cohorts are secret: the amplified ε assumes the adversary does not know them)"
    b = planner.min_sep
    groups = np.random.default_rng([plan.seed, 3]).integers(0, b, plan.count)
    for r, j in enumerate(plan.inserted_ids):
        groups[j] = planner.planned_rounds(f"partition-{real + r}")[0]
    for j, g in enumerate(groups):
        u[j, int(g)::b] = 1.0
    return u, "the canary's fixed-epoch rounds (public schedule; held-out canaries: a group drawn at random)"


def analyse(report: dict, strategy, capture: _Capture, plan: CanaryPlan, real: int, cfg: RunConfig) -> dict:
    """The audit's numbers from the released models (see the module docstring)."""
    models = np.stack(capture.models)                       # (T + 1, d)
    released = len(capture.rounds)
    require(capture.rounds == list(range(released)), "rounds", "rounds released in order", capture.rounds)
    deltas = np.diff(models, axis=0)                         # (T, d)
    dim = deltas.shape[1]
    M = optimizer_map(strategy.run.round.optimizer, cfg.num_rounds)[:released, :released]
    moving = np.abs(np.diag(M)) > 0                          # rounds at learning rate 0 release nothing new
    D, M = deltas[moving], M[moving]
    u, pattern_rule = _patterns(strategy, plan, real, cfg.num_rounds)
    a = u[:, :released] @ M.T
    proj = np.stack([D @ plan.direction(j, dim) for j in range(plan.count)])   # (m, n')
    scores = stats.whitened_scores(D, proj, a)
    cosines = stats.final_model_cosines(D.sum(axis=0), proj.sum(axis=1))
    ins = plan.inserted
    delta = float(report["delta"])
    claimed = report["realized"]["epsilon"]
    estimate = stats.one_shot_estimate(scores[ins], scores[~ins], delta, seed=plan.seed)
    final = stats.one_shot_estimate(cosines[ins], cosines[~ins], delta, seed=plan.seed)
    lower = stats.one_run_lower_bound(scores, ins, delta)
    capture.scores = {"whitened": (scores[ins], scores[~ins]), "cosine": (cosines[ins], cosines[~ins]),
                      "claimed": claimed, "estimate": estimate.epsilon, "lower": lower.epsilon,
                      "final": final.epsilon, "kind": report["mechanism"]["kind"]}
    cohorts = [len(strategy.planner.cohort(t)) for t in range(released)] \
        if strategy.planner.kind == "fixed-epoch" else None
    canary_share = (len(plan.inserted_ids) / (real + len(plan.inserted_ids)))
    verdict = _verdict(claimed, estimate, lower)
    return {
        "epsilon_claimed": claimed, "delta": delta, "epsilon_estimate": estimate.epsilon,
        "epsilon_estimate_interval": list(estimate.interval), "epsilon_lower": lower.epsilon,
        "confidence": lower.confidence, "verdict": verdict,
        "canaries": {"candidates": plan.count, "inserted": int(ins.sum()), "held_out": int((~ins).sum()),
                     "audit_seed": plan.seed, "real_users": real, "population_share": canary_share,
                     "lower_bound_ceiling": stats.lower_bound_ceiling(plan.count, delta=delta),
                     "rounds": pattern_rule},
        "statistics": {
            "threat_model": "all iterates: the adversary sees every released model (the claimed ε covers them)",
            "score": "whitened matched filter a_jᵀΣ̂⁻¹p_j/√(a_jᵀΣ̂⁻¹a_j), Σ̂ = DDᵀ/d from the released model changes",
            "estimator": "one-shot Gaussian fit ε_G(μ̂/σ̂; δ) (Andrew et al., arXiv 2302.03098), 95% percentile "
                         "bootstrap interval",
            "whitened": estimate.to_dict(), "lower_bound": lower.to_dict(),
            "final_model": {**final.to_dict(), "score": "cosine ⟨c_j, θ_T − θ_0⟩/‖θ_T − θ_0‖ (Andrew et al.), "
                            "null N(0, 1/d)", "expected_null_std": 1 / math.sqrt(dim)},
            "model_dim": dim, "rounds_scored": int(moving.sum()),
        },
        "run": {"dir": str(Path(cfg.state_dir)), "kind": report["mechanism"]["kind"],
                "participation": report["planned"]["participation"].get("kind"),
                "noise_multiplier": report["noise_multiplier"], "clip_norm": report["clip_norm"],
                "accountant": report["accountant"]["name"], "rounds_completed": report["rounds_completed"],
                "stopped_reason": report.get("stopped_reason"), "cohort_sizes": cohorts},
    }


def _verdict(claimed: float | None, estimate: stats.Estimate, lower: stats.LowerBound) -> str:
    if claimed is None:
        return "no claim to audit (non-private run)"
    if lower.epsilon > claimed:
        return (f"VIOLATION: the {lower.confidence:.0%} lower bound ε_lo = {lower.epsilon:.3g} exceeds the claimed "
                f"ε = {claimed:.3g}; the run leaks more than it claims")
    if estimate.interval[0] > claimed:
        return (f"SUSPECT: the estimate ε̂ = {estimate.epsilon:.3g} (interval from {estimate.interval[0]:.3g}) lies "
                f"above the claimed ε = {claimed:.3g}; rerun with more canaries to prove or clear it")
    return f"consistent: nothing shown above the claimed ε = {claimed:.3g} (an estimate, not a proof)"


def write_plot(result: dict, scores: dict, path: Path) -> Path:
    """Histograms of the inserted and held-out canaries' scores: whitened (left) and final-model cosine (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from corrflow.fileio import atomic_file

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "whitened", "whitened score (all iterates)"),
                           (axes[1], "cosine", "cosine with θ_T − θ_0 (final model)")):
        ins, out = scores[key]
        bins = np.histogram_bin_edges(np.concatenate([ins, out]), bins=30)
        ax.hist(out, bins=bins, alpha=0.6, label=f"held out ({out.size})", color="tab:blue")
        ax.hist(ins, bins=bins, alpha=0.6, label=f"inserted ({ins.size})", color="tab:red")
        ax.set_xlabel(label)
        ax.set_ylabel("canaries")
        ax.legend()
    est = result["statistics"]["final_model"]["epsilon"]
    axes[0].set_title(f"ε claimed {_fmt(result['epsilon_claimed'])}, ε̂ {_fmt(result['epsilon_estimate'])}, "
                      f"ε_lo {_fmt(result['epsilon_lower'])}")
    axes[1].set_title(f"final-model ε̂ {_fmt(est)} ({scores['kind']})")
    fig.tight_layout()
    with atomic_file(path, "wb") as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)
    return path


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3g}"


__all__ = ["CANARY_KEY", "MIN_CANARIES", "CanaryPlan", "analyse", "canary_handlers", "optimizer_map", "run_audit"]
