"""``corrflow compare``: the same federated task trained in several arms at each (ε, δ) of a sweep,
over several seeds. A seed fixes the data, the model initialisation, the evaluation set and the
participation order, shared by every arm; the noise key is never seeded (each run draws a fresh
secret key).

The arms at each ε:

* ``nonprivate`` — no noise (trained once per seed, the same at every ε);
* ``dpsgd`` — DP-SGD with fixed-epoch participation (each user in k rounds n/k apart), unamplified
  accounting;
* ``dpsgd-poisson`` — DP-SGD as Flower, Opacus and TF-Privacy users run it: every user sampled with
  probability q = cohort/population in every round, accounted with dp-accounting's PLD of the
  Poisson-subsampled Gaussian (the cyclic-Poisson reduction of "Scaling up the Banded Matrix
  Factorization Mechanism for Differentially Private ML" (R. McKenna, arXiv 2405.15913; 001), Prop.
  2.1, with separation b = 1);
* one arm per correlated-noise kind asked for, fixed-epoch and unamplified, as before;
* with ``amplified``, ``<kind>-amplified``: the kind under the cyclic Poisson sampler its registry
  entry allows, with its own separation b < population/cohort chosen by the planner (at b =
  population/cohort the sampling probability is 1 and nothing is amplified);
* ``plan`` — the recipe ``corrflow plan`` recommends for the same population, cohort, rounds, ε and
  δ, run as is; it ranks by the closed-loop error of the final model with κ measured on public proxy
  data (the synthetic generator with another seed for the presets, ``--proxy-data`` for ``--data``;
  `preset_damping`).

Every private arm's ε is the ε its run verified at δ (its privacy report), shown next to the target.
Calibrations are shared: one plan per ε (cached in ``OUT/cache``, or ``$CORRFLOW_HOME/cache``) gives
σ for every arm — the unamplified σ depends on ε and δ alone, as every stored factorization has
sensitivity 1.

Reports per ε the final held-out accuracy and loss per arm (means and per seed), the fraction of the
gap between the best DP-SGD arm and non-private training each arm closes (000 Fig. 3 measures the
same on StackOverflow), the planner's score (RMSE at the target ε) of the planned arms, per-round
curves and plots, and across ε the plots accuracy_vs_epsilon.png and loss_vs_epsilon.png (mean and
min–max over seeds, as in 001 Fig. 1). Each ε's verdict (`corrflow.server.verdict`) says whether
the comparison decides anything — *inconclusive* when non-private training does not beat every
private arm or two arms sit inside their paired seed interval, *unpaired* with one seed — in the
table, the JSON and the plots.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import resource
import sys
import textwrap
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from corrflow.accounting.mechanisms import MAX_EPSILON, MIN_EPSILON, check_epsilon
from corrflow.clients.tasks import task_for
from corrflow.config import RunConfig
from corrflow.data.federated import data_format
from corrflow.errors import require
from corrflow.factorization.base import Factorization
from corrflow.factorization.registry import KINDS, REGISTRY
from corrflow.fileio import save_figure, write_json, write_text
from corrflow.planning.cache import PlanCache, default_cache_dir
from corrflow.planning.candidates import (
    DEFAULT_KINDS,
    PlanRequest,
    make_plan,
    score_summary,
    write_plan,
)
from corrflow.planning.learnability import THRESHOLD, evaluated_entries
from corrflow.planning.recipe import install_factorization, load_recipe
from corrflow.planning.resources import check_fits, estimate
from corrflow.planning.run import training_budget
from corrflow.planning.score import Damping
from corrflow.run.journal import JOURNAL
from corrflow.server.arm_pool import check_jobs, run_in_processes
from corrflow.server.proxy import COHORT_CLIENTS, damping_for
from corrflow.server.simulation import RunStoppedEarlyError, check_data_population, simulate
from corrflow.server.verdict import DECIDED, undecided, verdict, verdict_lines

log = logging.getLogger("corrflow")


@dataclass(frozen=True)
class Preset:
    """One comparison's task and schedule: ``users`` split into rounds/epochs fixed-epoch groups
    (the cohort)."""

    name: str
    users: int
    rounds: int
    epochs: int
    seeds: int
    epsilon: float = 8.0
    delta: float = 1e-5
    client: str = "nextword"
    clip_norm: float = 1.0
    server_lr: float = 3.0
    momentum: float = 0.9
    local_lr: float = 2.0
    local_steps: int = 2
    # a real-format dataset file (--data) and its vocabulary (--vocab); "": synthetic
    data_path: str = ""
    vocab_path: str = ""
    # the planner's κ (plan arm): declared, or measured on PUBLIC proxy data (a file in the format
    # of --data and its vocabulary); neither: measured on the synthetic generator with another seed
    # for a synthetic task, assumed (planning.score.DEFAULT_KAPPA) for --data
    kappa: float | None = None
    proxy_data: str = ""
    proxy_vocab: str = ""
    eval_every: int = 1  # evaluate the held-out set every N-th round (and the last)

    @property
    def cohort(self) -> int:
        return self.users // (self.rounds // self.epochs)


# quick: 1000 users, cohort 100, 40 rounds, each user in 4 rounds 10 apart — all arms × 3 seeds in a
# few minutes on 2 cores. tiny: the same recipe scaled down for the test suite (well under a
# minute). large: the papers' ratio of cohort to population (000 §5.3 and 001 train 1,000 of
# 342,477 StackOverflow users per round, q ≈ 0.003) at the smallest size that keeps it — 50,000
# users, cohort 500, q = 0.01 — so each user trains once (k = 1, b = 100; the papers' k = 6 would
# need 600 rounds): a run costs ~2.5 CPU-minutes, and the evidence sweep (ε ∈ {2, 8}, 2 seeds, 22
# runs) about an hour of CPU. δ = 1e-6 < 1/population, the papers' δ.
PRESETS = {
    "quick": Preset("quick", users=1000, rounds=40, epochs=4, seeds=3),
    "tiny": Preset("tiny", users=160, rounds=16, epochs=4, seeds=1, local_steps=1),
    "large": Preset("large", users=50_000, rounds=100, epochs=1, seeds=2, delta=1e-6),
    # stackoverflow: 000's schedule (n = 2,052 rounds, k = 6 epochs, b = 342, δ = 1e-6) with the
    # nextword model (d = 6,732) and the cohort that puts its per-round noise-to-signal σ·√d/m at
    # ε = 8 near the papers' ≈ 1.2 (corrflow.planning.regime; docs/reference/presets.md):
    # m = 44, so 342·44 = 15,048 users.
    # Server learning rate 0.5: at this noise level the quick preset's 3.0 diverges (held-out loss
    # 18 by round 19), 1.0 stalls near 4.9, 0.5 reaches 3.78 by round 300 (momentum 0.9).
    "stackoverflow": Preset(
        "stackoverflow",
        users=15_048,
        rounds=2052,
        epochs=6,
        seeds=1,
        delta=1e-6,
        server_lr=0.5,
        eval_every=19,
    ),
}

DPSGD_ARMS = ("dpsgd", "dpsgd-poisson")
AMPLIFIED_SUFFIX = "-amplified"

LABELS = {
    "nonprivate": "non-private",
    "dpsgd": "DP-SGD (fixed-epoch, unamplified)",
    "dpsgd-poisson": "DP-SGD (Poisson sampling, amplified)",
    "plan": "corrflow plan's recipe",
    "toeplitz": "banded Toeplitz MF",
    "dense": "dense (optimal multi-epoch) MF",
    "banded": "BandMF",
    "bifr": "γ-BIFR",
    "bisr": "BISR",
    "blt": "BLT",
}


def label(name: str) -> str:
    if name.endswith(AMPLIFIED_SUFFIX):
        kind = name[: -len(AMPLIFIED_SUFFIX)]
        return f"{LABELS.get(kind, kind)} (cyclic Poisson, amplified)"
    return LABELS.get(name, name)


def fingerprint(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(str((a.dtype.str, a.shape)).encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def epsilon_key(epsilon: float) -> str:
    """The sweep's key for ε (``8``, ``0.5``) in JSON and file names."""
    return f"{epsilon:g}"


@dataclass(frozen=True)
class Arm:
    """One arm at one ε: its run settings beyond the preset's, and the planned recipe it runs (if
    any).

    ``settings``: `corrflow.config.RunConfig` fields; ``recipe``: a ``recipe.json`` written
    by `corrflow.planning.candidates.write_plan` whose factorization is installed in the run's
    directory; ``rmse``: the planner's score of the arm's mechanism (RMSE at the target ε per unit
    clip norm)."""

    name: str
    kind: str
    settings: dict
    recipe: str | None = None
    rmse: float | None = None
    description: str = ""


@dataclass
class ArmPlan:
    """The arms at one ε and what the planner said about them."""

    epsilon: float
    arms: list[Arm]
    planner: dict = field(default_factory=dict)
    skipped: list[dict] = field(default_factory=list)


def _preset_settings(preset: Preset, seed: int, out: Path) -> dict:
    return dict(
        num_users=preset.users,
        num_rounds=preset.rounds,
        epochs=preset.epochs,
        delta=preset.delta,
        clip_norm=preset.clip_norm,
        server_lr=preset.server_lr,
        momentum=preset.momentum,
        local_lr=preset.local_lr,
        local_steps=preset.local_steps,
        eval_every=preset.eval_every,
        client=preset.client,
        seed=seed,
        state_dir=str(out),
    )


def arm_config(preset: Preset, arm: Arm, seed: int, out: Path):
    """The run settings of ``arm`` for ``seed`` in ``out``: the preset's task and optimizer, the
    arm's mechanism."""

    return RunConfig(
        **{**_preset_settings(preset, seed, out), **data_settings(preset), **arm.settings}
    )


def data_settings(preset: Preset) -> dict:
    """The run settings of a comparison on a dataset file (``--data``): the file and its vocabulary
    (a StackOverflow-format file: `_checked_comparison` refuses arXiv lines)."""
    if not preset.data_path:
        return {}
    return {"data_path": preset.data_path, "vocab_path": preset.vocab_path}


NONPRIVATE = Arm(
    "nonprivate", "none", {"kind": "toeplitz", "non_private": True}, description="no noise"
)


def plan_request(preset: Preset, epsilon: float, delta: float | None = None, **kw):
    """The ``corrflow plan`` request for the preset's population, cohort, rounds and optimizer at
    ``epsilon`` and ``delta`` (default: the preset's δ) — the training's share of the budget."""

    return PlanRequest(
        rounds=preset.rounds,
        population=preset.users,
        cohort_size=preset.cohort,
        target_epsilon=epsilon,
        delta=preset.delta if delta is None else delta,
        momentum=preset.momentum,
        **kw,
    )


def _recipe_arm(
    name: str, cand, plan, out: Path, epsilon: float, description: str, delta: float
) -> Arm:
    """An arm that runs the planner's candidate ``cand`` as is (recipe + factorization written to
    ``out``). ``epsilon``, ``delta``: the run's total budget (the recipe was planned for training's
    share; the run takes a DP vocabulary's share out of the total itself)."""

    write_plan(replace(plan, recommended=cand), out, plots=False)
    recipe, _ = load_recipe(out / "recipe.json")
    # the total: the run's budget guard subtracts a DP vocabulary's share
    settings = {**recipe.strategy_settings(), "target_epsilon": epsilon, "delta": delta}
    return Arm(
        name,
        cand.kind,
        settings,
        recipe=str(out / "recipe.json"),
        rmse=cand.rmse,
        description=f"{description}: {cand.label()}",
    )


def plan_arms(
    preset: Preset,
    kinds: list[str],
    epsilon: float,
    amplified: bool,
    root: Path,
    cache,
    progress=None,
    training: tuple[float, float] | None = None,
    damping: Damping | None = None,
) -> ArmPlan:
    """The arms at ``epsilon`` (see the module docstring), from one ``corrflow plan`` run (plus, for
    an amplified kind the default plan leaves out, a plan of that kind) sharing ``cache``.
    ``training``: the (ε, δ) left for training after a DP vocabulary
    (`corrflow.planning.run.training_budget`, as ``simulate`` calibrates); default (ε, δ).
    ``damping``: the κ the plan ranks by (`preset_damping`; None: by RMSE)."""

    started = time.perf_counter()
    budget = training or (epsilon, preset.delta)
    req = plan_request(preset, *budget, damping=damping)
    plan = make_plan(req, cache, quiet=True)
    require(
        plan.recommended is not None, "plan", "a recommended recipe", "none (no candidate fits)"
    )
    base = root / "recipes"
    arms = _fixed_epoch_arms(preset, kinds, plan, base, epsilon)
    skipped = []
    for kind in kinds if amplified else ():
        arm = _amplified_arm(preset, kind, plan, req.min_sep, cache, budget, base, epsilon)
        if isinstance(arm, Arm):
            arms.append(arm)
        else:
            skipped.append({"arm": kind + AMPLIFIED_SUFFIX, "reason": arm})
    arms.append(
        _recipe_arm(
            "plan",
            plan.recommended,
            plan,
            base / "plan",
            epsilon,
            "corrflow plan's recipe",
            preset.delta,
        )
    )
    for entry in skipped:
        if progress is not None:
            progress(f"ε = {epsilon:g}: skipped {entry['arm']}: {entry['reason']}")
    return ArmPlan(epsilon, arms, _planner_summary(plan, arms, cache, started), skipped)


def _dpsgd_candidates(plan, preset: Preset, epsilon: float) -> tuple:
    """The plan's DP-SGD candidates: fixed-epoch unamplified, and Poisson-sampled (b = 1)
    with cyclic-Poisson accounting.

    Raises:
        InvalidArgumentError: the plan has no such candidate (``plan``), or the population is
            the cohort (``users``: nothing to sample from).
    """
    cands = plan.candidates
    unamplified = next(
        (c for c in cands if c.kind == "dpsgd" and c.accountant == "unamplified"), None
    )
    require(
        unamplified is not None, "plan", "a DP-SGD candidate with unamplified accounting", epsilon
    )
    poisson = next(
        (
            c
            for c in cands
            if c.kind == "dpsgd" and c.accountant == "cyclic-poisson" and c.min_sep == 1
        ),
        None,
    )
    require(
        poisson is not None,
        "users",
        f"a population above the cohort ({preset.cohort}) so that users can be "
        "Poisson-sampled with probability cohort/population < 1",
        preset.users,
    )
    return unamplified, poisson


def _fixed_epoch_arms(
    preset: Preset, kinds: list[str], plan, base: Path, epsilon: float
) -> list[Arm]:
    """DP-SGD (fixed-epoch, and Poisson-sampled) and each of ``kinds`` fixed-epoch, unamplified,
    at the unamplified DP-SGD candidate's σ."""
    unamplified, poisson = _dpsgd_candidates(plan, preset, epsilon)
    # One σ for every fixed-epoch unamplified arm: the ε of a sensitivity-1 Gaussian depends on σ
    # and δ alone.
    fixed = {"noise_multiplier": unamplified.noise_multiplier, "target_epsilon": epsilon}
    arms = [
        Arm(
            "dpsgd",
            "dpsgd",
            {"kind": "dpsgd", **fixed},
            rmse=unamplified.rmse,
            description="DP-SGD, fixed-epoch, unamplified",
        ),
        _recipe_arm(
            "dpsgd-poisson",
            poisson,
            plan,
            base / "dpsgd-poisson",
            epsilon,
            "DP-SGD, Poisson sampling q = cohort/population, PLD",
            preset.delta,
        ),
    ]
    for kind in kinds:
        arms.append(
            Arm(
                kind, kind, {"kind": kind, **fixed}, description=f"{kind}, fixed-epoch, unamplified"
            )
        )
    return arms


def _amplified_arm(
    preset: Preset,
    kind: str,
    plan,
    min_sep: int,
    cache,
    budget: tuple[float, float],
    base: Path,
    epsilon: float,
) -> Arm | str:
    """``kind``'s amplified arm: its best cyclic-Poisson candidate with a sampler separation b
    below population/cohort (``min_sep``), from ``plan`` or, for a kind the default plan leaves
    out, a plan of its own at the training ``budget`` (ε, δ); or why there is none."""
    if "cyclic-poisson" not in REGISTRY[kind].accountants:
        return (
            f"{kind}'s registry entry allows no cyclic-Poisson accounting (its encoder is not "
            "banded): no amplified variant"
        )
    if kind not in DEFAULT_KINDS:
        own_req = plan_request(preset, *budget, kinds=(kind,), accountants=("cyclic-poisson",))
        plan = make_plan(own_req, cache, quiet=True)
    own = [
        c
        for c in plan.candidates
        if c.kind == kind and c.accountant == "cyclic-poisson" and c.min_sep < min_sep
    ]
    if not own:
        return f"no {kind} candidate with a sampler separation b < population/cohort = {min_sep}"
    return _recipe_arm(
        kind + AMPLIFIED_SUFFIX,
        min(own, key=lambda c: c.rmse),
        plan,
        base / (kind + AMPLIFIED_SUFFIX),
        epsilon,
        "amplified, planner's b",
        preset.delta,
    )


def _planner_summary(plan, arms: list[Arm], cache, started: float) -> dict:
    """What the comparison records of the planner: its pick, its score (without the probes), the
    seconds it took, each arm's RMSE and the factorization cache's hits."""
    summary = score_summary(plan)
    summary["kappa_details"] = {
        k: v for k, v in (summary["kappa_details"] or {}).items() if k != "probes"
    }
    return {
        "recommended": plan.recommended.label(),
        "score": summary,
        "seconds": time.perf_counter() - started,
        "rmse": {a.name: a.rmse for a in arms if a.rmse is not None},
        "cache": {"hits": cache.hits, "misses": cache.misses},
    }


#: The comparison's settings in its --out: a rerun with the same settings continues it.
SETTINGS_FILE = "compare_settings.json"


def settings_differences(out: Path, settings: dict) -> list[str] | None:
    """What differs between ``settings`` and those of the comparison in ``out`` (empty: the same,
    it may continue); None when ``out`` holds no comparison, or one without recorded settings."""
    path = out / SETTINGS_FILE
    if not path.exists():
        return None
    old = json.loads(path.read_text())
    new = json.loads(json.dumps(settings))  # the same JSON types as the stored copy
    diffs = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += [
                f"{key}.{k}: {a.get(k)!r} then, {b.get(k)!r} now"
                for k in sorted(set(a) | set(b))
                if a.get(k) != b.get(k)
            ]
        elif a != b:
            diffs.append(f"{key}: {a!r} then, {b!r} now")
    return diffs


#: The file a finished arm's result is kept in (inside its run directory): a rerun keeps the arm.
ARM_RESULT = "arm_result.json"


def run_arm(
    preset: Preset,
    arm: Arm,
    seed: int,
    out: Path,
    backend: str,
    epsilon: float | None,
    quiet: bool = False,
) -> dict:
    """Train one arm for one seed in ``out``; its final metrics, verified (ε, δ) and curve (also
    written to ``out``/`ARM_RESULT`); ``quiet``: without the run's line per round. A run the
    budget guard (or anything else) stopped early is returned with ``stopped`` saying why. An
    earlier, unfinished run in ``out`` (an interrupted comparison) is moved aside, never deleted,
    and the arm restarts afresh (``restarted``: the rounds it had released)."""

    restarted = None
    if (out / "state").exists():
        # the journal, not metrics.json: that is complete every REPORT_EVERY rounds only
        journal = out / JOURNAL
        restarted = journal.read_bytes().count(b"\n") if journal.exists() else 0
    cfg = arm_config(preset, arm, seed, out)
    if arm.recipe is not None:
        out.mkdir(parents=True, exist_ok=True)
        install_factorization(*load_recipe(arm.recipe), cfg, replace=True)
    task = task_for(cfg, seed)
    started = time.perf_counter()
    stopped = None
    try:
        report = simulate(cfg, backend=backend, fresh=restarted is not None, quiet=quiet)
    except RunStoppedEarlyError as exc:  # the guard kept its promise: reported, not a traceback
        report = exc.report
        stopped = report.get("stopped_reason") or str(exc)
    curve = json.loads((out / "metrics.json").read_text())
    result = {
        "seed": seed,
        "stopped": stopped,
        "rounds_completed": report.get("rounds_completed"),
        "restarted": restarted,
        **_arm_outcome(report, curve),
        **_arm_privacy(report, preset, epsilon, out),
        "participation": cfg.participation,
        "min_sep": cfg.b,
        "bands": report["mechanism"].get("bands"),
        **_arm_cohorts(curve),
        "init_sha256": fingerprint(task.initial_weights()),
        "data_sha256": fingerprint([a for u in range(3) for a in task.user_data(u)]),
        "seconds": time.perf_counter() - started,
        "curve": [
            {"round": m["round"], "loss": m["test_loss"], "accuracy": m.get("test_accuracy")}
            for m in evaluated_entries(curve)
        ],
    }
    write_json(out / ARM_RESULT, result, indent=1)
    return result


def _arm_outcome(report: dict, curve: list[dict]) -> dict:
    """An arm's held-out result: the last evaluated and the initial loss and accuracy, and the
    report's learning verdict."""
    learning = report.get("learning") or {"learned": False, "noise_to_signal": None}
    last = evaluated_entries(curve)[-1]
    return {
        "accuracy": last.get("test_accuracy"),
        "loss": last["test_loss"],
        "learned": learning["learned"],
        "noise_to_signal": learning.get("noise_to_signal"),
        "initial_accuracy": curve[0].get("test_accuracy"),
        "initial_loss": curve[0]["test_loss"],
    }


def _arm_privacy(report: dict, preset: Preset, epsilon: float | None, out: Path) -> dict:
    """An arm's (ε, δ) as its report states them (with a vocabulary: training composed with its
    spend), whether they are within the target (``epsilon``; None: non-private), its accountant,
    σ, and the planner's score of the mechanism it ran: σ·√(mean_i ‖B_i‖²) per unit clip norm."""
    acc = report.get("accountant") or {}
    total = report.get("total") or {}
    eps = total.get("epsilon", report["realized"]["epsilon"])
    delta = total.get("delta", report.get("delta"))
    private = epsilon is not None
    verified = (not private) or (
        eps is not None
        and delta is not None
        and eps <= epsilon * (1 + 1e-9)
        and delta <= preset.delta * (1 + 1e-12)
    )
    rmse = None
    if private:
        fac = Factorization.load(out / "factorization.npz")
        rmse = float(report["noise_multiplier"] * np.sqrt(np.mean(fac.per_query_error())))
    return {
        "epsilon": eps,
        "delta": delta if private else None,
        "target_epsilon": epsilon,
        "verified": verified,
        "accountant": acc.get("name", "none"),
        "sampling": acc.get("sampling", "none"),
        "noise_multiplier": report["noise_multiplier"],
        "rmse": rmse,
    }


def _arm_cohorts(curve: list[dict]) -> dict:
    """An arm's last cohort, mean accepted replies and rejected replies over its rounds."""
    rounds = [m for m in curve if m["round"] >= 0]
    return {
        "cohort": curve[-1].get("cohort"),
        "mean_cohort": _mean(m.get("accepted") for m in rounds),
        "rejected": sum(int(m.get("rejected", 0)) for m in rounds),
    }


def stale_result(res: dict, preset: Preset, arm: Arm, seed: int, out: Path) -> list[str]:
    """What a kept arm result ran that the arm, as planned now, would not: its sampling
    (participation, separation b), target ε, and for a planned recipe its σ and bands — say a
    newer planner recommends another recipe for the same comparison. Empty: the result is the
    arm's."""
    cfg = arm_config(preset, arm, seed, out)
    want = {
        "participation": cfg.participation,
        "min_sep": cfg.b,
        "target_epsilon": arm.settings.get("target_epsilon"),
    }
    if arm.recipe is not None:
        recipe, _ = load_recipe(arm.recipe)
        want["noise_multiplier"] = recipe.noise_multiplier
        if recipe.bands is not None:  # a kind without bands (DP-SGD, dense) reports its own count
            want["bands"] = recipe.bands
    return [
        f"{key} {res.get(key)!r} (now {value!r})"
        for key, value in want.items()
        if res.get(key) != value
    ]


def gap_closed(value: float | None, dpsgd: float | None, nonprivate: float | None) -> float | None:
    """(arm − DP-SGD) / (non-private − DP-SGD): 1 when the arm matches non-private training, 0 when
    it is no better than DP-SGD; null when the two reference arms tie (no gap to close) or a value
    is missing."""
    if value is None or dpsgd is None or nonprivate is None or abs(nonprivate - dpsgd) < 1e-12:
        return None
    return (value - dpsgd) / (nonprivate - dpsgd)


def _mean(values):
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def _cpu_seconds() -> float:
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def parse_epsilons(text: str) -> tuple[float, ...]:
    """``"1,2,4,8,16"`` → (1.0, 2.0, 4.0, 8.0, 16.0): finite positive ε, sorted, without repeats."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    require(
        bool(values) and all(math.isfinite(v) and MIN_EPSILON <= v <= MAX_EPSILON for v in values),
        "epsilons",
        f"comma-separated finite ε in [{MIN_EPSILON:g}, {MAX_EPSILON:g}] (e.g. 1,2,4,8,16)",
        text,
    )
    return tuple(sorted(set(values)))


def compare(
    preset: Preset,
    kinds: list[str],
    out_dir: str | Path,
    backend: str = "inprocess",
    progress=None,
    *,
    epsilons: tuple[float, ...] | None = None,
    amplified: bool = False,
    settings: dict | None = None,
    jobs: int = 1,
) -> dict:
    """Run every arm at every ε of ``epsilons`` (default: the preset's ε) for seeds
    0..preset.seeds−1, ``jobs`` arms at once (`corrflow.server.arm_pool`); write
    ``comparison.json``, ``curves_eps<ε>.csv``, the per-round plots and the plots against ε."""

    out = Path(out_dir)
    check_jobs(jobs, backend)
    epsilons = _checked_comparison(preset, kinds, epsilons, out)
    training = _training_budgets(preset, epsilons, out)
    started, cpu0 = time.perf_counter(), _cpu_seconds()
    out.mkdir(parents=True, exist_ok=True)
    if settings is not None:  # what a rerun must match to continue this comparison
        write_json(out / SETTINGS_FILE, settings, indent=1)
    cache = PlanCache(default_cache_dir(out))
    damping = preset_damping(preset, out, backend)
    if progress is not None:
        progress(f"planner's score: closed-loop final error at {damping.describe()}")
    plans = {}
    # every ε's arms are planned (and their settings checked) before any arm trains
    for eps in epsilons:
        root = out / f"eps{epsilon_key(eps)}"
        plans[eps] = plan_arms(
            preset,
            kinds,
            eps,
            amplified,
            root,
            cache,
            progress,
            training=training[eps],
            damping=damping,
        )
        for arm in plans[eps].arms:
            arm_config(preset, arm, 0, root / "runs" / arm.name)
        if progress is not None:
            planner = plans[eps].planner
            progress(
                f"ε = {eps:g}: planned {len(plans[eps].arms)} private arms in "
                f"{planner['seconds']:.1f} s (recommended: {planner['recommended']})"
            )
    arm_jobs = _jobs(preset, epsilons, plans, out)
    free, per_seed = _train_jobs(arm_jobs, preset, backend, progress, workers=jobs)
    result = _comparison_result(preset, kinds, backend, amplified, plans, free, per_seed)
    plots = []
    for key, entry in result["epsilons"].items():
        plots += plot_rounds(result, entry, out, key)
        write_curves(entry, out / f"curves_eps{key}.csv")
    plots += plot_sweep(result, out)
    result["plots"] = plots
    result["seconds"] = time.perf_counter() - started
    result["cpu_seconds"] = _cpu_seconds() - cpu0
    write_json(out / "comparison.json", result, indent=1)
    return result


def _checked_comparison(
    preset: Preset, kinds: list[str], epsilons: tuple[float, ...] | None, out: Path
) -> tuple[float, ...]:
    """The comparison's ε values, sorted, once the seeds, the kinds, every ε, every fixed-epoch
    arm's settings, the memory a run needs and the dataset are checked — before anything is
    written, planned or trained.

    Raises:
        InvalidArgumentError: naming the setting that is refused.
    """
    require(preset.seeds >= 1, "seeds", "a positive integer", preset.seeds)
    correlated = [k for k in KINDS if k != "dpsgd"]
    require(
        all(k in correlated for k in kinds) and len(set(kinds)) == len(kinds),
        "kinds",
        f"distinct correlated-noise kinds from {', '.join(correlated)} (nonprivate, dpsgd, "
        "dpsgd-poisson and plan always run)",
        kinds,
    )
    epsilons = tuple(sorted(set(epsilons or (preset.epsilon,))))
    for e in epsilons:
        check_epsilon(e, "epsilons")
    for arm in (
        NONPRIVATE,
        Arm("dpsgd", "dpsgd", {"kind": "dpsgd", "target_epsilon": epsilons[0]}),
        *(Arm(k, k, {"kind": k, "target_epsilon": e}) for k in kinds for e in epsilons),
    ):
        cfg = arm_config(preset, arm, 0, out / "runs" / arm.name)
        check_fits(
            estimate(cfg.num_users, cfg.num_rounds, cfg.kind, cfg.bands or cfg.b, cfg.model_dim),
            {"users": "users", "factorization": "rounds", "noise": "rounds"},
        )
    check_data_population(cfg, "users")
    require(
        not preset.data_path or data_format(preset.data_path) != "arxiv-jsonl",
        "data",
        "a StackOverflow-format SQLite file: on arXiv JSON lines a paper belongs to all its "
        "authors (multi-attribution, 004 §6), which the DP-SGD arms' and the planner's samplers "
        "do not cover and whose accountant gives the fixed-epoch arms another ε, so the arms "
        "would not run at one (ε, δ); train an arXiv file with corrflow simulate --data",
        preset.data_path,
    )
    return epsilons


def _training_budgets(
    preset: Preset, epsilons: tuple[float, ...], out: Path
) -> dict[float, tuple[float, float]]:
    """ε → training's (ε, δ): a DP vocabulary's share comes out of each ε, as simulate
    calibrates (`corrflow.planning.run.training_budget`)."""
    training = {}
    for eps in epsilons:
        arm = Arm("dpsgd", "dpsgd", {"kind": "dpsgd", "target_epsilon": eps})
        budget = training_budget(arm_config(preset, arm, 0, out))
        training[eps] = (budget.epsilon, budget.delta)
    return training


def _jobs(preset: Preset, epsilons: tuple[float, ...], plans: dict, out: Path) -> list[tuple]:
    """(seed, ε or None, arm, run directory) of every run, in training order: per seed, the
    non-private arm, then every ε's planned arms."""
    jobs = []
    for seed in range(preset.seeds):
        jobs.append((seed, None, NONPRIVATE, out / "runs" / f"nonprivate-seed{seed}"))
        for eps in epsilons:
            runs = out / f"eps{epsilon_key(eps)}" / "runs"
            jobs += [(seed, eps, arm, runs / f"{arm.name}-seed{seed}") for arm in plans[eps].arms]
    return jobs


def _train_jobs(
    jobs: list[tuple], preset: Preset, backend: str, progress, workers: int = 1
) -> tuple[list[dict], dict[str, dict[str, list[dict]]]]:
    """Train every job on ``backend``, ``workers`` at once (or keep the result an earlier,
    interrupted try of the same comparison finished, unless it ran another configuration); the
    non-private results and, per ε key and arm, the private ones (in seed order, however the
    arms finished)."""
    results: list[dict | None] = [None] * len(jobs)
    for i, (seed, eps, arm, run_dir) in enumerate(jobs):
        results[i] = _kept_result(preset, arm, seed, eps, run_dir, progress)
        if results[i] is not None:
            _progress(progress, seed, eps, arm.name, results[i], kept=True)
    todo = [i for i, res in enumerate(results) if res is None]
    clock = {"seconds": 0.0, "trained": 0}

    def finished(k: int, res: dict) -> None:
        seed, eps, arm, _ = jobs[todo[k]]
        results[todo[k]] = res
        clock["seconds"] += res["seconds"]
        clock["trained"] += 1
        _progress(progress, seed, eps, arm.name, res)
        left = len(todo) - clock["trained"]
        if progress is not None and left:
            eta = clock["seconds"] / clock["trained"] * left / min(workers, left)
            progress(f"{clock['trained']} of {len(todo)} arms trained, ~{_duration(eta)} left")

    # side by side, the arms' lines per round would interleave unnamed: each arm's own line only
    quiet = workers > 1 and len(todo) > 1
    calls = [
        (preset, arm, seed, run_dir, backend, eps, quiet)
        for seed, eps, arm, run_dir in (jobs[i] for i in todo)
    ]
    if quiet:
        if progress is not None:
            progress(f"training {len(calls)} arms, {min(workers, len(calls))} at once")
        run_in_processes(run_arm, calls, workers, finished)
    else:
        for k, (i, call) in enumerate(zip(todo, calls, strict=True)):
            seed, eps, arm, _ = jobs[i]
            if progress is not None:
                progress(
                    f"arm {i + 1} of {len(jobs)}: {arm.name}, seed {seed}"
                    + ("" if eps is None else f", ε = {eps:g}")
                )
            finished(k, run_arm(*call))
    per_seed: dict[str, dict[str, list[dict]]] = {}
    free: list[dict] = []
    for (_, eps, arm, _), res in zip(jobs, results, strict=True):
        if eps is None:
            free.append(res)
        else:
            per_seed.setdefault(epsilon_key(eps), {}).setdefault(arm.name, []).append(res)
    return free, per_seed


def _kept_result(
    preset: Preset, arm: Arm, seed: int, eps: float | None, run_dir: Path, progress
) -> dict | None:
    """The arm's result finished by an earlier, interrupted try of the same comparison, or None:
    none there, or it ran another configuration than the arm as planned now (then it is set
    aside, renamed, not kept)."""
    if not (run_dir / ARM_RESULT).exists():
        return None
    res = json.loads((run_dir / ARM_RESULT).read_text())
    stale = stale_result(res, preset, arm, seed, run_dir)
    if not stale:
        return res
    aside = run_dir / f"{ARM_RESULT}.stale-{time.strftime('%Y%m%dT%H%M%S')}"
    (run_dir / ARM_RESULT).rename(aside)
    if progress is not None:
        progress(
            f"{arm.name}, seed {seed}"
            + ("" if eps is None else f", ε = {eps:g}")
            + f": its kept result ran another configuration ({'; '.join(stale)}); "
            f"retrained (the old result is {aside.name})"
        )
    return None


def _comparison_result(
    preset: Preset,
    kinds: list[str],
    backend: str,
    amplified: bool,
    plans: dict,
    free: list[dict],
    per_seed: dict[str, dict[str, list[dict]]],
) -> dict:
    """``comparison.json`` before its plots and timings: the preset, and per ε every arm's
    summary over its seeds, the gaps, the verdict, the planner and the skipped arms; the arms not
    verified, stopped early, and the undecided comparisons."""
    result = {
        "preset": preset.name,
        "delta": preset.delta,
        "rounds": preset.rounds,
        "cohort": preset.cohort,
        "seeds": preset.seeds,
        "users": preset.users,
        "epochs": preset.epochs,
        "client": preset.client,
        "backend": backend,
        "config": asdict(preset),
        "kinds": list(kinds),
        "amplified": amplified,
        "epsilons": {},
        "skipped": [],
    }
    for eps, planned in plans.items():
        key = epsilon_key(eps)
        arms = {"nonprivate": _summarise(NONPRIVATE, free)}
        for arm in planned.arms:
            arms[arm.name] = _summarise(arm, per_seed[key][arm.name])
        entry = {"epsilon": eps, "arms": arms, **gaps(arms), "planner": planned.planner}
        entry["verdict"] = verdict(entry, rounds=preset.rounds, users=preset.users, epsilon=eps)
        result["epsilons"][key] = entry
        result["skipped"] += [{**s, "epsilon": eps} for s in planned.skipped]
    arms_at = [
        (name, key, a) for key, e in result["epsilons"].items() for name, a in e["arms"].items()
    ]
    result["unverified"] = [f"{n} at ε = {k}" for n, k, a in arms_at if not a["verified"]]
    result["stopped"] = [f"{n} at ε = {k}, {s}" for n, k, a in arms_at for s in a["stopped"]]
    result["inconclusive"] = undecided(result)
    return result


def preset_damping(preset: Preset, out: Path, backend: str = "inprocess") -> Damping:
    """The κ the comparison's plan arm ranks by: the preset's declared κ; else measured on its
    public proxy file; else, for a synthetic task, on the generator with another seed
    (`corrflow.server.proxy.PROXY_SEED`); else (a private ``--data`` file and no proxy) the
    default assumption — never measured on the data the arms train on. The proxy run trains on
    the cohort engine when the arms do (``backend`` cohort) and it trains the client, else in
    process."""
    cfg = arm_config(preset, NONPRIVATE, 0, out)  # its data files are never read here
    return damping_for(
        cfg,
        preset.users,
        preset.cohort,
        kappa=preset.kappa,
        proxy_data=preset.proxy_data,
        proxy_vocab=preset.proxy_vocab,
        synthetic_proxy=not preset.data_path,
        backend="cohort" if backend == "cohort" and cfg.client in COHORT_CLIENTS else "inprocess",
    )


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def _progress(
    progress, seed: int, eps: float | None, name: str, res: dict, kept: bool = False
) -> None:
    if progress is None:
        return
    if res.get("restarted") is not None and not kept:  # a kept arm's restart is old news
        progress(
            f"seed {seed} {'' if eps is None else f'ε = {eps:g} '}{name}: restarted afresh (an "
            f"interrupted try had released {res['restarted']} rounds; that run was moved aside)"
        )
    if res.get("stopped"):
        progress(
            f"seed {seed} {'' if eps is None else f'ε = {eps:g} '}{name}: STOPPED after "
            f"{res['rounds_completed']} rounds: {res['stopped']}"
        )
    acc = "-" if res["accuracy"] is None else f"{res['accuracy']:.4f}"
    at = "" if eps is None else f"ε = {eps:g} "
    spent = (
        "" if res["epsilon"] is None else f"  ε spent {res['epsilon']:.3f} at δ {res['delta']:.2g}"
    )
    progress(
        f"{'kept ' if kept else ''}seed {seed} {at}{name:<18} accuracy {acc}  loss "
        f"{res['loss']:.4f}  σ {res['noise_multiplier']:.3f}{spent}  "
        f"{'learned' if res['learned'] else 'did not learn'}  ({res['seconds']:.1f} s)"
    )


def _summarise(arm: Arm, runs: list[dict]) -> dict:
    """An arm's means over seeds and its worst verified (ε, δ) (the largest over its seeds)."""
    first = runs[0]
    eps = [r["epsilon"] for r in runs if r["epsilon"] is not None]
    deltas = [r["delta"] for r in runs if r["delta"] is not None]
    return {
        "accuracy": _mean(r["accuracy"] for r in runs),
        "loss": _mean(r["loss"] for r in runs),
        "kind": arm.kind,
        "description": arm.description,
        "noise_multiplier": first["noise_multiplier"],
        "accountant": first["accountant"],
        "sampling": first["sampling"],
        "participation": first["participation"],
        "min_sep": first["min_sep"],
        "bands": first["bands"],
        "epsilon": max(eps) if eps else None,
        "delta": max(deltas) if deltas else None,
        "target_epsilon": first["target_epsilon"],
        "verified": all(r["verified"] for r in runs),
        "rmse": first["rmse"] if arm.rmse is None else arm.rmse,
        "noise_to_signal": first["noise_to_signal"],
        "learned_seeds": sum(bool(r["learned"]) for r in runs),
        "stopped": [
            f"seed {r['seed']} after {r.get('rounds_completed')} rounds: {r['stopped']}"
            for r in runs
            if r.get("stopped")
        ],
        "per_seed": runs,
    }


def gaps(arms: dict) -> dict:
    """The best DP-SGD arm (highest mean accuracy) and the gap each other private arm closes between
    it and non-private training: in accuracy (``gap_closed``) and in loss against the lowest-loss
    DP-SGD arm (``gap_closed_loss``)."""
    acc = {n: arms[n]["accuracy"] for n in DPSGD_ARMS}
    best = max(DPSGD_ARMS, key=lambda n: -math.inf if acc[n] is None else acc[n])
    best_loss = min(DPSGD_ARMS, key=lambda n: arms[n]["loss"])
    names = [n for n in arms if n != "nonprivate"]
    return {
        "best_dpsgd": best,
        "gap_closed": {
            n: gap_closed(
                arms[n]["accuracy"], arms[best]["accuracy"], arms["nonprivate"]["accuracy"]
            )
            for n in names
        },
        "gap_closed_loss": {
            n: gap_closed(arms[n]["loss"], arms[best_loss]["loss"], arms["nonprivate"]["loss"])
            for n in names
        },
    }


def write_curves(entry: dict, path: Path) -> None:
    lines = ["arm,seed,round,loss,accuracy"]
    for name, arm in entry["arms"].items():
        for run in arm["per_seed"]:
            for m in run["curve"]:
                acc = "" if m["accuracy"] is None else f"{m['accuracy']:.6f}"
                lines.append(f"{name},{run['seed']},{m['round']},{m['loss']:.6f},{acc}")
    write_text(path, "\n".join(lines) + "\n")


METRICS = (("accuracy", "held-out next-word accuracy"), ("loss", "held-out loss"))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finish_plot(plt, fig, ax, path: Path, entries: list[dict]) -> str:
    """Legend, the verdict of each of ``entries`` (ε) that is not decided under the axes, layout,
    write ``path`` (PNG) and close the figure; the path written."""
    ax.legend(fontsize=7)
    notes = [
        f"ε = {e['epsilon']:g}: {e['verdict']['status'].upper()} — {e['verdict']['reasons'][0]}"
        for e in entries
        if e["verdict"]["status"] != DECIDED
    ]
    if notes:
        text = "\n".join(textwrap.fill(n, 150) for n in notes)
        fig.text(0.01, 0.01, text, fontsize=6, color="firebrick", va="bottom", ha="left")
        fig.tight_layout(rect=(0, 0.03 + 0.025 * (text.count("\n") + 1), 1, 1))
    else:
        fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return str(path)


def arm_colours(result: dict) -> dict[str, str]:
    """One colour per arm, the same in every plot (per-ε and across ε): non-private black, the
    others matplotlib's cycle in the order the arms first appear over the sweep."""
    names = list(dict.fromkeys(n for e in result["epsilons"].values() for n in e["arms"]))
    others = [n for n in names if n != "nonprivate"]
    return {"nonprivate": "black", **{n: f"C{i % 10}" for i, n in enumerate(others)}}


def plot_rounds(result: dict, entry: dict, out: Path, key: str) -> list[str]:
    """accuracy_eps<ε>.png and loss_eps<ε>.png: held-out metric against round (round −1 = the
    initial model), the mean over seeds as a line and the min–max over seeds as a band, one colour
    per arm."""
    plt = _pyplot()
    paths = []
    for metric, ylabel in METRICS:
        if any(
            m[metric] is None
            for arm in entry["arms"].values()
            for run in arm["per_seed"]
            for m in run["curve"]
        ):
            continue
        fig, ax = plt.subplots(figsize=(7.2, 4.6), dpi=100)
        colours = arm_colours(result)
        for name, arm in entry["arms"].items():
            rows = [[m[metric] for m in run["curve"]] for run in arm["per_seed"]]
            width = max(map(len, rows))  # an arm stopped early has a shorter curve
            curves = np.array([r + [np.nan] * (width - len(r)) for r in rows], dtype=float)
            x = np.arange(width) - 1
            colour = colours[name]
            ax.plot(x, np.nanmean(curves, axis=0), label=label(name), color=colour)
            ax.fill_between(
                x, np.nanmin(curves, axis=0), np.nanmax(curves, axis=0), alpha=0.2, color=colour
            )
        ax.set_xlabel("round")
        ax.set_ylabel(ylabel)
        ax.set_title(
            f"{result['preset']} ({result['client']}): ε = {key}, δ = {result['delta']:g}, "
            f"cohort {result['cohort']}, {result['seeds']} seed(s)" + _verdict_title(entry),
            fontsize=9,
        )
        ax.grid(alpha=0.3)
        paths.append(_finish_plot(plt, fig, ax, out / f"{metric}_eps{key}.png", [entry]))
    return paths


def plot_sweep(result: dict, out: Path) -> list[str]:
    """accuracy_vs_epsilon.png and loss_vs_epsilon.png: final held-out metric against ε (log scale),
    the mean over seeds with the min–max over seeds as error bars and a band, one colour per arm
    (001 Fig. 1); non-private as a horizontal line."""
    from matplotlib.ticker import NullFormatter

    plt = _pyplot()
    entries = sorted(result["epsilons"].values(), key=lambda e: e["epsilon"])
    names = list(entries[0]["arms"])
    paths = []
    for metric, ylabel in METRICS:
        if any(e["arms"][n][metric] is None for e in entries for n in names):
            continue
        fig, ax = plt.subplots(figsize=(7.2, 4.6), dpi=100)
        colours = arm_colours(result)
        x = np.array([e["epsilon"] for e in entries])
        for name in names:
            runs = [[r[metric] for r in e["arms"][name]["per_seed"]] for e in entries]
            mean = np.array([np.mean(v) for v in runs])
            lo, hi = np.array([min(v) for v in runs]), np.array([max(v) for v in runs])
            if name == "nonprivate":
                ax.axhline(
                    mean[0], color=colours[name], linestyle="--", linewidth=1, label=label(name)
                )
                continue
            ax.errorbar(
                x,
                mean,
                yerr=[mean - lo, hi - mean],
                marker="o",
                capsize=3,
                label=label(name),
                color=colours[name],
            )
            ax.fill_between(x, lo, hi, alpha=0.15, color=colours[name])
        ax.set_xscale("log")
        ax.set_xticks(x)
        ax.set_xticklabels([f"{v:g}" for v in x])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(f"ε (δ = {result['delta']:g})")
        ax.set_ylabel(f"final {ylabel}")
        ax.set_title(
            f"{result['preset']} ({result['client']}): {result['users']} users, cohort "
            f"{result['cohort']}, {result['rounds']} rounds, {result['seeds']} seed(s)"
            + "".join(
                f"\nε = {e['epsilon']:g}{_verdict_title(e)}"
                for e in entries
                if e["verdict"]["status"] != DECIDED
            ),
            fontsize=9,
        )
        ax.grid(alpha=0.3, which="both")
        paths.append(_finish_plot(plt, fig, ax, out / f"{metric}_vs_epsilon.png", entries))
    return paths


def _verdict_title(entry: dict) -> str:
    """ " — INCONCLUSIVE" or " — UNPAIRED" for a plot title; "" when the ε is decided."""
    status = entry["verdict"]["status"]
    return "" if status == DECIDED else f" — {status.upper()}"


def table(result: dict) -> str:
    """Per ε: each arm's mechanism, σ, verified (ε, δ), final metrics and the gap it closes, as
    aligned text."""

    def fmt(v, spec=".4f"):
        return "-" if v is None else format(v, spec)

    rows = []
    for key, entry in result["epsilons"].items():
        score = entry["planner"].get("score") or {}
        rows.append(
            f"ε = {key}, δ = {result['delta']:g}: best DP-SGD arm {entry['best_dpsgd']}; planner "
            f"recommends {entry['planner']['recommended']}"
            + (
                f" (closed-loop final error at {score['kappa_described']})"
                if score.get("kappa") is not None
                else ""
            )
        )
        rows += [f"  WARNING: {w}" for w in score.get("warnings") or ()]
        accts = {
            name: (
                "none"
                if arm["accountant"] == "none"
                else f"{arm['accountant']} ({arm['sampling']})"
            ).replace("none (fixed-epoch, unamplified)", "unamplified")
            for name, arm in entry["arms"].items()
        }
        width = max(len("accountant"), *map(len, accts.values()))  # never cut: it names the bound
        rows.append(
            f"  {'arm':<20} {'accountant':<{width}} {'b':>3} {'σ':>7} {'ε':>7} {'δ':>8} {'ρ':>5} "
            f"{'accuracy':>9} "
            f"{'RMSE':>7} {'loss':>8} {'learned':>8} {'gap closed':>11}"
        )
        for name, arm in entry["arms"].items():
            acct = accts[name]
            gap = entry["gap_closed"].get(name)
            mark = ("" if arm["verified"] else "  NOT VERIFIED") + (
                f"  STOPPED ({'; '.join(arm['stopped'])})" if arm.get("stopped") else ""
            )
            rows.append(
                f"  {name:<20} {acct:<{width}} {arm['min_sep']:>3} {arm['noise_multiplier']:>7.3f} "
                f"{fmt(arm['epsilon'], '.3f'):>7} {fmt(arm['delta'], '.1e'):>8} "
                f"{fmt(arm['noise_to_signal'], '.2f'):>5} {fmt(arm['accuracy']):>9} "
                f"{fmt(arm['rmse'], '.2f'):>7} {fmt(arm['loss']):>8} "
                f"{arm['learned_seeds']:>6}/{len(arm['per_seed'])} {fmt(gap, '.0%'):>11}{mark}"
            )
        rows += verdict_lines(entry)
    rows.append(
        "ε, δ: the largest verified pair over the seeds; b: the fewest rounds between a user's "
        f"turns (the sampler's); ρ: the pre-flight noise-to-signal estimate (> {THRESHOLD} warns "
        "that an arm may not learn); learned: seeds whose final held-out loss is below the "
        "initial model's; gap closed: of the accuracy gap between the best DP-SGD arm and "
        "non-private training; RMSE: the workload's RMSE under the arm's mechanism at its σ (per "
        "unit clip norm and coordinate; the planner ranks by the closed-loop error of the final "
        "model, above)."
    )
    for s in result["skipped"]:
        rows.append(f"skipped {s['arm']} at ε = {s['epsilon']:g}: {s['reason']}")
    return "\n".join(rows)


def json_summary(result: dict) -> dict:
    """The ``--json`` object: the sweep per ε (arms with per-seed results, gaps, the planner's
    scores), plots, schedule, time."""
    keep = (
        "preset",
        "delta",
        "rounds",
        "cohort",
        "users",
        "epochs",
        "seeds",
        "client",
        "kinds",
        "amplified",
        "plots",
        "seconds",
        "cpu_seconds",
        "skipped",
        "unverified",
        "stopped",
        "inconclusive",
    )
    eps = {}
    for key, entry in result["epsilons"].items():
        arms = {
            name: {
                **{k: v for k, v in a.items() if k != "per_seed"},
                "per_seed": [{k: v for k, v in r.items() if k != "curve"} for r in a["per_seed"]],
            }
            for name, a in entry["arms"].items()
        }
        eps[key] = {**{k: v for k, v in entry.items() if k != "arms"}, "arms": arms}
    return {**{k: result[k] for k in keep}, "epsilons": eps}


def with_overrides(preset: Preset, **overrides) -> Preset:
    return replace(preset, **{k: v for k, v in overrides.items() if v is not None})


def stderr_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
