"""Utility at equal (ε, δ) across a sweep of ε: ``corrflow compare`` on the synthetic
StackOverflow-style next-word task (numpy bigram model) — non-private, DP-SGD with fixed-epoch
participation (unamplified), DP-SGD with Poisson sampling (amplified, the standard baseline), banded
Toeplitz MF (fixed-epoch and, with --amplified, under the cyclic Poisson sampler with the planner's
separation) and the recipe ``corrflow plan`` recommends — same users, data, initialisation,
evaluation set, optimizer and clipping per seed.

Targets (the evidence against DP-SGD, and a plan that trains best): at each ε the ``plan``
arm runs the configuration of the best-mean private arm, or its mean accuracy is within 0.01 of
that arm's, or within the two-sided 95% interval of the paired per-seed differences (Student t with
seeds − 1 degrees of freedom: seeds spread ±0.03, so a bare max over arms is biased up); its mean
accuracy is at least the best DP-SGD arm's less 0.01; and at ε = 8 it closes at least half of the
gap between the best DP-SGD arm and non-private training (moonshot: two thirds; 000 Fig. 3 measures
the same gap on StackOverflow; 001 Fig. 1 plots accuracy against ε).

With ``--preset stackoverflow`` (the papers' schedule: 2,052 rounds, k = 6, b = 342, δ = 1e-6, at
the cohort that puts the per-round noise-to-signal near the papers' ≈ 1.2; docs/explanation/
stackoverflow-regime.md) the arms train on the cohort engine (``--backend cohort``), the kinds are
banded Toeplitz and BLT, and the regime's targets are reported (``regime``): at every ε the best
correlated arm beats Poisson-sampled DP-SGD in mean held-out loss and in accuracy, outside the
paired 95% seed interval at ε ≤ 8; the plan arm lies within the paired interval of the best
private arm; the whole sweep, planning included, takes ≤ 120 CPU-minutes. BandMF (the ``banded``
kind) is left out there: its n = 2,052 optimization is a dense n × n problem per band count, which
the plan's dense candidate already prices at about 120 L-BFGS iterations (minutes per arm).

With ``--preset large`` (50,000 users, cohort 500: the papers' q ≈ 0.01 of 000 §5.3 and 001) the
large-scale targets are reported too (``correlated_beats_poisson``, ``every_private_arm_learned``):
at ε = 2 and 8 a correlated-noise arm beats Poisson-sampled DP-SGD, and at ε = 8 every private arm
learns (000 Fig. 1, 001 Fig. 1 report both at StackOverflow scale).

Prints one JSON object: per ε each arm's final held-out accuracy and loss (means and per seed), σ,
verified (ε, δ), the gap each arm closes, whether the targets hold, and the wall and CPU seconds of
the whole sweep (the budgets: ≤ 60 CPU-minutes on 2 cores for quick, ≤ 90 for large). ``reduced``
says when the sweep is smaller than the preset's full one (`FULL`: quick ε ∈ {1, 2, 4, 8, 16} × 3
seeds, large ε ∈ {2, 8} × 2 seeds, the preset's rounds). A rerun with the same --out keeps the arms
already trained.

Usage: python benchmarks/utility.py [--preset quick|large|stackoverflow] [--epsilons 1,2,4,8,16]
[--seeds 3] [--rounds N] [--kinds toeplitz] [--no-amplified] [--backend B] [--eval-every N]
[--jobs N] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
from scipy.stats import t as student_t

from corrflow.server.compare import (
    PRESETS,
    compare,
    epsilon_key,
    parse_epsilons,
    stderr_progress,
    table,
    with_overrides,
)
from corrflow.server.simulation import RunInterruptedError, quiet_native_logs

#: The full sweep per preset (smaller ones are ``reduced``): quick's five ε over 3 seeds; large's
#: ε ∈ {2, 8} over 2 seeds (about an hour of CPU at the measured per-round cost).
FULL = {
    "quick": {"epsilons": (1.0, 2.0, 4.0, 8.0, 16.0), "seeds": 3},
    "large": {"epsilons": (2.0, 8.0), "seeds": 2},
    "stackoverflow": {"epsilons": (2.0, 8.0, 16.0), "seeds": 3},
}
#: Per preset: the kinds, backend and evaluation period a sweep uses unless told otherwise.
DEFAULTS = {
    "stackoverflow": {"kinds": "toeplitz,blt", "backend": "cohort", "eval_every": 50},
}
REGIME_CPU_MINUTES = 120  # the stackoverflow sweep's budget, planning included
TOLERANCE = 0.01  # the plan arm may trail the best DP-SGD arm by this much accuracy
GAP_AT_8 = 0.5  # ... and must close half of the gap at ε = 8
MOONSHOT_AT_8 = 2 / 3


def same_configuration(a: dict, b: dict) -> bool:
    """Two arms run the same mechanism: kind, bands, sampler separation, accountant and σ."""
    keys = ("kind", "bands", "min_sep", "accountant")
    return all(a.get(k) == b.get(k) for k in keys) and math.isclose(
        a["noise_multiplier"], b["noise_multiplier"], rel_tol=1e-9
    )


def paired_interval(plan: list[float], best: list[float]) -> tuple[float, float] | None:
    """The two-sided 95% Student-t interval of the mean per-seed difference plan − best (None with
    fewer than two seeds)."""
    d = np.asarray(plan, float) - np.asarray(best, float)
    if len(d) < 2:
        return None
    half = student_t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d))
    return float(d.mean() - half), float(d.mean() + half)


def targets(result: dict) -> dict:
    """Per ε: the plan arm against the best-mean private arm (same configuration, within 0.01, or
    within the paired 95% interval) and against the best DP-SGD arm (accuracy margin, gap closed),
    whether each target holds, and the planner's score of its recipe against the runner-up."""
    out = {}
    for key, entry in result["epsilons"].items():
        arms, best = entry["arms"], entry["best_dpsgd"]
        private = {n: a for n, a in arms.items() if n != "nonprivate"}
        top = max(private, key=lambda n: private[n]["accuracy"])
        plan = arms["plan"]
        margin = plan["accuracy"] - arms[best]["accuracy"]
        gap = entry["gap_closed"]["plan"]
        seeds = {n: [r["accuracy"] for r in a["per_seed"]] for n, a in private.items()}
        interval = paired_interval(seeds["plan"], seeds[top])
        same = top == "plan" or same_configuration(plan, private[top])
        score = entry["planner"].get("score") or {}
        out[key] = {
            "best_private": top,
            "plan_is_best_configuration": same,
            "plan_minus_best_private": plan["accuracy"] - private[top]["accuracy"],
            "paired_95_interval": interval,
            "within_best_private": same
            or plan["accuracy"] >= private[top]["accuracy"] - TOLERANCE
            or (interval is not None and interval[1] >= 0),
            "best_dpsgd": best,
            "plan_minus_best_dpsgd": margin,
            "plan_gap_closed": gap,
            "within_tolerance": margin >= -TOLERANCE,
            "closes_half_gap": None
            if entry["epsilon"] != 8
            else (gap is not None and gap >= GAP_AT_8),
            "moonshot_two_thirds": None
            if entry["epsilon"] != 8
            else (gap is not None and gap >= MOONSHOT_AT_8),
            "score": {k: score.get(k) for k in ("name", "kappa", "kappa_source", "margin")}
            | {
                "recommended": (score.get("recommended") or {}).get("candidate"),
                "runner_up": (score.get("runner_up") or {}).get("candidate"),
            },
            **correlated_against_poisson(entry),
        }
    return out


def correlated_against_poisson(entry: dict) -> dict:
    """The large preset's targets at one ε (after 000 Fig. 1 and 001): the best
    correlated-noise arm (mean accuracy) against Poisson-sampled DP-SGD, in accuracy and loss, and
    whether every private arm learned (final held-out loss below the initial model's) in every
    seed."""
    arms = entry["arms"]
    correlated = [n for n in arms if n not in ("nonprivate", "dpsgd", "dpsgd-poisson")]
    best = max(correlated, key=lambda n: arms[n]["accuracy"])
    poisson = arms["dpsgd-poisson"]
    return {
        "best_correlated": best,
        "best_correlated_minus_poisson": arms[best]["accuracy"] - poisson["accuracy"],
        "correlated_beats_poisson": arms[best]["accuracy"] > poisson["accuracy"],
        "correlated_loss_below_poisson": min(arms[n]["loss"] for n in correlated) < poisson["loss"],
        "every_private_arm_learned": all(
            a["learned_seeds"] == len(a["per_seed"]) for n, a in arms.items() if n != "nonprivate"
        ),
    }


def regime_targets(result: dict, cpu_seconds: float) -> dict:
    """The stackoverflow preset's targets: per ε, the best correlated arm (by mean loss) against
    Poisson-sampled DP-SGD in mean loss and accuracy, and at ε ≤ 8 outside the paired 95% seed
    interval of their per-seed differences; the plan arm within the paired interval of the best
    private arm (`targets`); the sweep's CPU against `REGIME_CPU_MINUTES`."""
    out = {}
    for key, entry in result["epsilons"].items():
        arms = entry["arms"]
        correlated = [n for n in arms if n not in ("nonprivate", "dpsgd", "dpsgd-poisson")]
        best = min(correlated, key=lambda n: arms[n]["loss"])
        per = {
            m: (
                [r[m] for r in arms[best]["per_seed"]],
                [r[m] for r in arms["dpsgd-poisson"]["per_seed"]],
            )
            for m in ("loss", "accuracy")
        }
        loss_iv = paired_interval(*per["loss"])  # best − poisson: below 0 is better
        acc_iv = paired_interval(*per["accuracy"])  # above 0 is better
        beats = (
            arms[best]["loss"] < arms["dpsgd-poisson"]["loss"]
            and arms[best]["accuracy"] > arms["dpsgd-poisson"]["accuracy"]
        )
        outside = None
        if entry["epsilon"] <= 8:
            outside = (
                loss_iv is not None and acc_iv is not None and loss_iv[1] < 0 and acc_iv[0] > 0
            )
        out[key] = {
            "best_correlated_by_loss": best,
            "loss_minus_poisson": arms[best]["loss"] - arms["dpsgd-poisson"]["loss"],
            "accuracy_minus_poisson": arms[best]["accuracy"] - arms["dpsgd-poisson"]["accuracy"],
            "paired_95_loss": loss_iv,
            "paired_95_accuracy": acc_iv,
            "beats_poisson": beats,
            "outside_paired_interval": outside,
        }
    return {
        "per_epsilon": out,
        "cpu_minutes": cpu_seconds / 60,
        "within_cpu_budget": cpu_seconds / 60 <= REGIME_CPU_MINUTES,
    }


def planner_order(result: dict, preset, root: Path) -> dict:
    """Per ε: the private arms ordered by the planner's score (the closed-loop final error
    σ · sens · ‖C⁻ᵀ r_κ‖ at the comparison's κ, recomputed from each arm's own factorization and σ
    in its seed-0 run) and by its RMSE, against the order of their mean held-out loss; the pairs
    each ranking puts the wrong way round: where the score's order matches the trained order and
    where it does not."""
    from corrflow.factorization.base import Factorization
    from corrflow.planning.score import Damping, closed_loop_error, closed_loop_response
    from corrflow.server.compare import plan_request

    out = {}
    for key, entry in result["epsilons"].items():
        kappa = (entry["planner"].get("score") or {}).get("kappa")
        arms = {n: a for n, a in entry["arms"].items() if n != "nonprivate"}
        trained = sorted(arms, key=lambda n: arms[n]["loss"])
        rankings = {"rmse": {n: arms[n]["rmse"] for n in arms if arms[n]["rmse"] is not None}}
        if kappa is not None:
            req = plan_request(preset, entry["epsilon"], damping=Damping(kappa, "proxy"))
            response = closed_loop_response(req.workload, req.rounds, kappa)
            rankings["score"] = {}
            for name, arm in arms.items():
                run = root / f"eps{key}" / "runs" / f"{name}-seed0" / "factorization.npz"
                fac = Factorization.load(run)
                rankings["score"][name] = arm["noise_multiplier"] * closed_loop_error(fac, response)
        out[key] = {"by_loss": trained, "kappa": kappa}
        for what, values in rankings.items():
            order = sorted(values, key=values.get)
            wrong = [
                [a, b]
                for i, a in enumerate(order)
                for b in order[i + 1 :]
                if arms[a]["loss"] > arms[b]["loss"]
            ]
            pairs = len(order) * (len(order) - 1) // 2
            out[key][what] = {
                "order": order,
                "values": values,
                "pairs_wrong": wrong,
                "agreement": 1 - len(wrong) / pairs if pairs else None,
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epsilons", default=None, help="default: the preset's full sweep (FULL)")
    ap.add_argument("--preset", default="quick", choices=sorted(PRESETS))
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="fewer rounds for a reduced run (default: preset's)",
    )
    ap.add_argument("--kinds", default=None, help="default: toeplitz (stackoverflow: toeplitz,blt)")
    ap.add_argument("--backend", default=None, help="default: inprocess (stackoverflow: cohort)")
    ap.add_argument("--eval-every", type=int, default=None, help="default: 1 (stackoverflow: 50)")
    ap.add_argument("--no-amplified", dest="amplified", action="store_false")
    ap.add_argument(
        "--jobs", type=int, default=1, help="arms trained at once, one process each (default 1)"
    )
    ap.add_argument(
        "--out", default=None, help="keep the comparison here (default: a temporary directory)"
    )
    args = ap.parse_args()
    if args.jobs < 1:
        ap.error(f"--jobs: expected a positive integer, got {args.jobs}")
    quiet_native_logs()
    logging.getLogger("corrflow").setLevel(logging.ERROR)
    chosen = PRESETS[args.preset]  # a preset without a full sweep (tiny): its own ε and seeds
    own = DEFAULTS.get(args.preset, {})
    kinds = args.kinds or own.get("kinds", "toeplitz")
    backend = args.backend or own.get("backend", "inprocess")
    eval_every = args.eval_every or own.get("eval_every", 1)
    full = FULL.get(args.preset, {"epsilons": (chosen.epsilon,), "seeds": chosen.seeds})
    epsilons = full["epsilons"] if args.epsilons is None else parse_epsilons(args.epsilons)
    preset = with_overrides(
        PRESETS[args.preset], seeds=args.seeds or full["seeds"], rounds=args.rounds
    )
    preset = replace(preset, eval_every=eval_every)
    root = Path(args.out or tempfile.mkdtemp(prefix="corrflow-utility-"))
    try:
        res = compare(
            preset,
            [k for k in kinds.split(",") if k],
            root,
            backend=backend,
            progress=stderr_progress,
            epsilons=epsilons,
            amplified=args.amplified,
            jobs=args.jobs,
        )
    except (RunInterruptedError, KeyboardInterrupt):
        print(
            f"interrupted: the finished arms are kept in {root}; rerun with --out {root} to "
            "continue (unfinished arms restart afresh)",
            file=sys.stderr,
        )
        raise SystemExit(130) from None
    print(table(res), file=sys.stderr, flush=True)
    reduced = (
        epsilons != full["epsilons"]
        or preset.seeds != full["seeds"]
        or preset.rounds != PRESETS[args.preset].rounds
    )
    results = {
        key: {
            "arms": {
                n: {
                    k: a[k]
                    for k in (
                        "accuracy",
                        "loss",
                        "kind",
                        "accountant",
                        "sampling",
                        "min_sep",
                        "noise_multiplier",
                        "epsilon",
                        "delta",
                        "verified",
                        "rmse",
                        "learned_seeds",
                    )
                }
                | {
                    "accuracy_per_seed": [r["accuracy"] for r in a["per_seed"]],
                    "loss_per_seed": [r["loss"] for r in a["per_seed"]],
                    "seconds_per_seed": [r["seconds"] for r in a["per_seed"]],
                }
                for n, a in e["arms"].items()
            },
            "best_dpsgd": e["best_dpsgd"],
            "gap_closed": e["gap_closed"],
            "recommended": e["planner"]["recommended"],
        }
        for key, e in res["epsilons"].items()
    }
    print(
        json.dumps(
            {
                "benchmark": "utility",
                "preset": args.preset,
                "client": preset.client,
                "users": preset.users,
                "rounds": preset.rounds,
                "epochs": preset.epochs,
                "cohort": preset.cohort,
                "delta": preset.delta,
                "seeds": preset.seeds,
                "epsilons": [epsilon_key(e) for e in epsilons],
                "reduced": reduced,
                "results": results,
                "backend": backend,
                "eval_every": eval_every,
                "targets": targets(res),
                "planner_order": planner_order(res, preset, root),
                "regime": regime_targets(res, res["cpu_seconds"])
                if args.preset == "stackoverflow"
                else None,
                "jobs": args.jobs,
                "wall_seconds": res["seconds"],
                "cpu_seconds": res["cpu_seconds"],
                "plots": res["plots"],
                "out": str(root),
            }
        )
    )


if __name__ == "__main__":
    main()
