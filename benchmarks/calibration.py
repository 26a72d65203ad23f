"""Calibration and planning timings: the PLD grid search that σ calibration used to be
against what corrflow does now, measured in the same run, plus plan cold/warm and the README demo's
accounting share.

Sections (one JSON object on stdout, with ratios ``old / new``):

* ``unamplified``: σ for a target ε of an unamplified banded Toeplitz F (n = 2052, k = 6, 64 bands):
  dp-accounting's PLD on the 1.001 grid (the old path) vs the exact Gaussian curve (Balle & Wang
  2018, arXiv 1805.06530); σ_new must be ≤ σ_old. Also ε at a fixed σ: PLD vs exact.
* ``cyclic``: cyclic-Poisson σ (q < 1, n = 2052): the old grid search at full precision vs the Brent
  search on log σ with coarse probes and a full-precision verification.
* ``mmcc``: Generalized-MMCC σ for a small Toeplitz encoder: the old 1.01 grid vs the Brent search.
* ``cli``: CPU seconds (user + sys, start-up included) of ``corrflow account --factorization F
  --target-epsilon 8 --delta 1e-6`` for the n = 2052 F (target ≤ 2 s).
* ``plan``: ``corrflow plan --rounds 20 --users 100 --cohort 10 --target-epsilon 8 --delta
  1e-5``: two cold runs (fresh $CORRFLOW_HOME each) and one warm: CPU seconds (target ≤ 15 s cold)
  and whether the recipes agree.
* ``demo``: the README demo (``corrflow simulate --users 100 --rounds 20 --epochs 2 --target-epsilon
  8 --backend inprocess``) under cProfile: the share of its time inside privacy accounting (target <
  10%).

Usage: python benchmarks/calibration.py [--sections unamplified,cyclic,mmcc,cli,plan,demo] CPU
seconds of subprocesses come from getrusage(RUSAGE_CHILDREN); wall seconds inflate on a loaded
machine.
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import dp_accounting as dpa

from corrflow.accounting import SamplingSpec, account, calibrate_on_grid
from corrflow.accounting.accountant import MMCCAccountant
from corrflow.accounting.mechanisms import CyclicPoisson
from corrflow.factorization import factorize, participation_for

SECTIONS = ("unamplified", "cyclic", "mmcc", "cli", "plan", "demo")
CLI = [sys.executable, "-m", "corrflow.cli"]


def timed(fn):
    t0 = time.process_time()
    w0 = time.perf_counter()
    out = fn()
    return out, time.process_time() - t0, time.perf_counter() - w0


def pld_epsilon(event, delta, vdi=1e-4) -> float:
    return float(
        dpa.pld.PLDAccountant(value_discretization_interval=vdi).compose(event).get_epsilon(delta)
    )


def f2052():
    return factorize("toeplitz", participation_for(2052, 6), bands=64)


def unamplified(fac) -> dict:
    sens, out = fac.sensitivity.value, {"rounds": fac.rounds, "bands": fac.bands, "cases": []}
    for eps, delta in ((8.0, 1e-6), (2.0, 1e-6), (1.0, 1e-5)):
        guess = sens * dpa.get_sigma_gaussian(eps, delta)
        (old, _), c_old, w_old = timed(
            lambda eps=eps, delta=delta, guess=guess: calibrate_on_grid(
                lambda s: pld_epsilon(dpa.GaussianDpEvent(s / sens), delta),
                eps,
                guess=guess,
                ratio=1.001,
            )
        )
        new, c_new, w_new = timed(
            lambda eps=eps, delta=delta: account(fac, delta=delta, target_epsilon=eps)
        )
        out["cases"].append(
            {
                "target_epsilon": eps,
                "delta": delta,
                "sigma_pld_grid": old,
                "sigma_exact": new["noise_multiplier"],
                "sigma_ratio": new["noise_multiplier"] / old,
                "sigma_exact_le_pld": new["noise_multiplier"] <= old,
                "cpu_pld_grid": c_old,
                "cpu_exact": c_new,
                "cpu_ratio_old_over_new": c_old / c_new,
                "wall_pld_grid": w_old,
                "wall_exact": w_new,
            }
        )
        print(json.dumps(out["cases"][-1]), file=sys.stderr, flush=True)
    e_pld, c_old, _ = timed(lambda: pld_epsilon(dpa.GaussianDpEvent(0.6 / sens), 1e-6))
    e_new, c_new, _ = timed(lambda: account(fac, delta=1e-6, noise_multiplier=0.6)["epsilon"])
    out["epsilon_at_sigma_0.6"] = {
        "pld": e_pld,
        "exact": e_new,
        "exact_le_pld": e_new <= e_pld,
        "cpu_pld": c_old,
        "cpu_exact": c_new,
        "cpu_ratio_old_over_new": c_old / c_new,
    }
    return out


def cyclic(fac) -> dict:
    fac = factorize("toeplitz", participation_for(2052, 6, 342, kind="min-sep"), bands=64)
    spec = SamplingSpec("cyclic-poisson", 100_000, 100)  # q = 342·100/1e5 = 0.342, 6 compositions
    cp = CyclicPoisson(fac.rounds, 342, 100_000, 100)
    col = float(fac.encoder.column_norms().max())
    out = {
        "rounds": 2052,
        "bands": 64,
        "cycle": 342,
        "sampling_probability": cp.sampling_probability,
        "cases": [],
    }
    for eps in (8.0, 2.0):
        guess = fac.sensitivity.value * dpa.get_sigma_gaussian(eps, 1e-6)
        calls = {"n": 0}

        def old_eps(s, calls=calls):
            calls["n"] += 1
            return pld_epsilon(cp.event(s, col), 1e-6)

        (old, _), c_old, _ = timed(
            lambda eps=eps, guess=guess, f=old_eps: calibrate_on_grid(
                f, eps, guess=guess, ratio=1.001
            )
        )
        new, c_new, _ = timed(
            lambda eps=eps: account(fac, delta=1e-6, target_epsilon=eps, sampling=spec)
        )
        cal = new["accountant"]["calibration"]
        out["cases"].append(
            {
                "target_epsilon": eps,
                "sigma_old_grid": old,
                "sigma_new": new["noise_multiplier"],
                "sigma_ratio": new["noise_multiplier"] / old,
                "epsilon_new": new["epsilon"],
                "old_calls": calls["n"],
                "new_probes": cal["probes"],
                "new_verifications": cal["verifications"],
                "cpu_old": c_old,
                "cpu_new": c_new,
                "cpu_ratio_old_over_new": c_old / c_new,
            }
        )
        print(json.dumps(out["cases"][-1]), file=sys.stderr, flush=True)
    return out


def mmcc() -> dict:
    fac = factorize("toeplitz", participation_for(64, 4, 16, kind="min-sep"), bands=8)
    spec = SamplingSpec("cyclic-poisson", 6400, 40, accountant="mmcc")  # q = 16·40/6400 = 0.1
    acc = MMCCAccountant(spec)
    guess = fac.sensitivity.value * dpa.get_sigma_gaussian(2.0, 1e-5)
    calls = {"n": 0}

    def old_eps(s):
        calls["n"] += 1
        return acc.epsilon(fac, s, 1e-5).epsilon

    (old, _), c_old, _ = timed(lambda: calibrate_on_grid(old_eps, 2.0, guess=guess, ratio=1.01))
    new, c_new, _ = timed(lambda: account(fac, delta=1e-5, target_epsilon=2.0, sampling=spec))
    cal = new["accountant"]["calibration"]
    return {
        "rounds": 64,
        "bands": 8,
        "sampling_probability": 0.1,
        "target_epsilon": 2.0,
        "sigma_old_grid": old,
        "sigma_new": new["noise_multiplier"],
        "sigma_ratio": new["noise_multiplier"] / old,
        "old_calls": calls["n"],
        "new_probes": cal["probes"],
        "new_verifications": cal["verifications"],
        "cpu_old": c_old,
        "cpu_new": c_new,
        "cpu_ratio_old_over_new": c_old / c_new,
    }


def child_cpu(
    cmd: list[str], env: dict | None = None
) -> tuple[subprocess.CompletedProcess, float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    w0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    wall = time.perf_counter() - w0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall


def cli(fac, tmp: Path) -> dict:
    path = tmp / "F2052.npz"
    fac.save(path)
    r, cpu, wall = child_cpu(
        CLI
        + [
            "account",
            "--factorization",
            str(path),
            "--target-epsilon",
            "8",
            "--delta",
            "1e-6",
            "--json",
        ]
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    return {
        "cpu_seconds": cpu,
        "wall_seconds": wall,
        "target_cpu_seconds": 2.0,
        "meets_target": cpu <= 2.0,
        "noise_multiplier": doc["noise_multiplier"],
        "epsilon": doc["epsilon"],
        "accountant": doc["accountant"]["name"],
    }


PLAN = [
    "plan",
    "--rounds",
    "20",
    "--users",
    "100",
    "--cohort",
    "10",
    "--target-epsilon",
    "8",
    "--delta",
    "1e-5",
    "--quiet",
    "--json",
]
#: recipe fields measured on this machine (not part of the mechanism)
VOLATILE = ("noise_seconds_per_round",)


def plan(tmp: Path) -> dict:
    runs = []
    for name, home in (("cold_1", "h1"), ("cold_2", "h2"), ("warm", "h2")):
        env = {**os.environ, "CORRFLOW_HOME": str(tmp / home)}
        r, cpu, wall = child_cpu(CLI + PLAN + ["--out", str(tmp / name)], env)
        assert r.returncode == 0, r.stderr
        rec = json.loads((tmp / name / "recipe.json").read_text())
        runs.append(
            {
                "run": name,
                "cpu_seconds": cpu,
                "wall_seconds": wall,
                "recommended": f"{rec['kind']}[{rec.get('bands')}] / {rec['accountant']}",
                "noise_multiplier": rec["noise_multiplier"],
                "recipe": {k: v for k, v in rec.items() if k not in VOLATILE},
            }
        )
        print(
            json.dumps({k: v for k, v in runs[-1].items() if k != "recipe"}),
            file=sys.stderr,
            flush=True,
        )
    same = runs[0]["recipe"] == runs[1]["recipe"] == runs[2]["recipe"]
    for r in runs:
        r.pop("recipe")
    return {
        "runs": runs,
        "same_recipe": same,
        "target_cold_cpu_seconds": 15.0,
        "meets_target": max(r["cpu_seconds"] for r in runs[:2]) <= 15.0,
        "warm_over_cold_cpu": runs[2]["cpu_seconds"] / runs[0]["cpu_seconds"],
    }


def demo(tmp: Path) -> dict:
    prof = tmp / "demo.prof"
    cmd = [
        sys.executable,
        "-m",
        "cProfile",
        "-o",
        str(prof),
        "-m",
        "corrflow.cli",
        "simulate",
        "--users",
        "100",
        "--rounds",
        "20",
        "--epochs",
        "2",
        "--target-epsilon",
        "8",
        "--backend",
        "inprocess",
        "--out",
        str(tmp / "demo"),
    ]
    r, cpu, wall = child_cpu(cmd)
    assert r.returncode == 0, r.stderr
    st = pstats.Stats(str(prof))
    total = max(v[3] for v in st.stats.values())  # the outermost call's cumulative time

    # time inside accounting: entries into corrflow/accounting or dp_accounting from outside both
    # (no double counting). Module imports are reported apart: they load numpy/scipy that the rest
    # of the run needs too.
    def inside(key) -> bool:
        return "corrflow/accounting" in key[0] or "dp_accounting" in key[0]

    calls = imports = 0.0
    for key, (_, _, _, _cum, callers) in st.stats.items():
        if inside(key):
            t = sum(
                c[3]
                for ck, c in callers.items()
                if not inside(ck)
                and ck[2] != "<module>"
                and "importlib" not in ck[0]
                and ck[0] != "~"
            )
            if key[2] == "<module>":
                continue
            calls += t
    for key, v in st.stats.items():
        if key[0].endswith("corrflow/accounting/__init__.py") and key[2] == "<module>":
            imports = v[3]
    return {
        "profiled_seconds": total,
        "accounting_call_seconds": calls,
        "accounting_share": calls / total,
        "accounting_import_seconds": imports,
        "accounting_share_with_imports": (calls + imports) / total,
        "target_share": 0.10,
        "meets_target": calls / total < 0.10,
        "cpu_seconds": cpu,
        "wall_seconds": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default=",".join(SECTIONS))
    args = ap.parse_args()
    sections = [s for s in args.sections.split(",") if s]
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        ap.error(f"--sections: expected names from {SECTIONS}, got {bad}")
    res: dict = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        fac = f2052() if {"unamplified", "cli"} & set(sections) else None
        for s in sections:
            print(f"calibration benchmark: {s}", file=sys.stderr, flush=True)
            if s == "unamplified":
                res[s] = unamplified(fac)
            elif s == "cyclic":
                res[s] = cyclic(fac)
            elif s == "mmcc":
                res[s] = mmcc()
            elif s == "cli":
                res[s] = cli(fac, tmp)
            elif s == "plan":
                res[s] = plan(tmp)
            else:
                res[s] = demo(tmp)
    print(
        json.dumps(
            {
                "benchmark": "calibration",
                "cpus": os.cpu_count(),
                "load_average": os.getloadavg(),
                **res,
            }
        )
    )


if __name__ == "__main__":
    main()
