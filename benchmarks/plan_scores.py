"""Which error score ranks the planner's candidates in the order of their trained accuracy? A
diagnostic for the ``compare`` preset's plan (population, cohort, rounds and momentum of ``corrflow
compare --preset quick``).

For each candidate of the plan at each ε it prints, at the candidate's calibrated σ (per unit clip
norm and coordinate, DESIGN "Errors": B = A C⁻¹, per-iterate error = the row norms of B):

- the planner's score, RMSE over all n iterates, and the max error;
- open-loop errors of the *released* model: the last row of B (the final iterate) and the root-mean
  over the last 10% and 25% of the iterates;
- the final-model error under *closed-loop* training on a quadratic with curvature h: the server
  optimizer's update is the noisy gradient at the current (noisy) model, so noise injected in round
  s is damped by the training itself before round n. With κ = server_lr·h the model error is x_n =
  r_κᵀ C⁻¹ z, where r_κ is the last row of the closed-loop response of the momentum-with-cooldown
  optimizer (r_0 = the last row of A). This is the linear-regression analysis of Choquette-Choo,
  Dvijotham, Pillutla, Ganesh, Steinke, Thakurta, "Correlated Noise Provably Beats Independent Noise
  for Differentially Private Learning" (arXiv 2310.06771), applied to a finite factorization. κ is a
  property of the task, not of the mechanism: the script sweeps it.

Usage: python benchmarks/plan_scores.py [--epsilons 2,8] [--preset quick] [--kappas
0,0.003,0.01,0.03,0.1,0.3] [--cache DIR]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from corrflow.planning.cache import PlanCache
from corrflow.planning.candidates import make_plan
from corrflow.planning.score import closed_loop_error, closed_loop_response
from corrflow.server.compare import PRESETS, parse_epsilons, plan_request


def scores(plan, kappas: list[float]) -> list[dict]:
    n, wl = plan.request.rounds, plan.request.workload
    # the planner's own score (corrflow.planning.score) at each κ
    responses = {k: closed_loop_response(wl, n, k) for k in kappas}
    rows = []
    for c in plan.candidates:
        fac = plan.factorizations[c.key()]
        sigma, sens = c.noise_multiplier, fac.sensitivity.value
        e = fac.per_query_error() * sens**2
        closed = {f"{k:g}": float(sigma * closed_loop_error(fac, r)) for k, r in responses.items()}
        rows.append(
            {
                "candidate": c.label(),
                "rank": c.rank,
                "noise_multiplier": sigma,
                "rmse": c.rmse,
                "max_error": c.max_error,
                "final_error": float(sigma * np.sqrt(e[-1])),
                "last10_rms": float(sigma * np.sqrt(e[-max(1, n // 10) :].mean())),
                "last25_rms": float(sigma * np.sqrt(e[-max(1, n // 4) :].mean())),
                "closed_loop_final_error": closed,
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epsilons", default="2,8")
    ap.add_argument("--preset", default="quick", choices=sorted(PRESETS))
    ap.add_argument("--kappas", default="0,0.003,0.01,0.03,0.1,0.3")
    ap.add_argument("--cache", default=None, help="plan cache directory (default: a temporary one)")
    args = ap.parse_args()
    kappas = [float(k) for k in args.kappas.split(",")]
    cache = PlanCache(Path(args.cache or tempfile.mkdtemp(prefix="corrflow-plan-scores-")))
    preset = PRESETS[args.preset]
    out = {}
    for eps in parse_epsilons(args.epsilons):
        plan = make_plan(plan_request(preset, eps), cache, quiet=True)
        out[f"{eps:g}"] = {
            "recommended": plan.recommended.label(),
            "candidates": scores(plan, kappas),
        }
    print(
        json.dumps(
            {
                "benchmark": "plan_scores",
                "preset": args.preset,
                "users": preset.users,
                "cohort": preset.cohort,
                "rounds": preset.rounds,
                "momentum": preset.momentum,
                "kappas": kappas,
                "epsilons": out,
            }
        )
    )


if __name__ == "__main__":
    main()
