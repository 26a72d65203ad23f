"""corrflow plan: candidates ranked by the score they report, budgets, the recipe in simulate
--plan, plots, cache; and the registry of factorization kinds agrees with the noise engine and the
CLI."""

import json
import subprocess
import sys

import numpy as np
import pytest

from corrflow.accounting import SamplingSpec, account
from corrflow.factorization import Factorization, factorize, participation_for
from corrflow.factorization.registry import KINDS, REGISTRY
from corrflow.noise import CorrelatedNoise
from corrflow.noise.engine import default_mode
from corrflow.planning.cache import PlanCache
from corrflow.planning.candidates import PlanRequest, make_plan, write_plan

SMALL = [
    "--rounds",
    "24",
    "--users",
    "60",
    "--cohort",
    "10",
    "--target-epsilon",
    "4",
    "--delta",
    "1e-5",
    "--model-dim",
    "1000",
    "--kinds",
    "dpsgd,toeplitz,bifr,dense",
    "--accountants",
    "unamplified,cyclic-poisson",
    "--quiet",
]


def run(*args):
    return subprocess.run(
        [sys.executable, "-m", "corrflow.server.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan")
    docs = []
    for _ in range(2):
        r = run("plan", *SMALL, "--out", str(out), "--json")
        assert r.returncode == 0, r.stderr
        docs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    return out, docs[1], [d["seconds"] for d in docs]


def test_plan_ranks_by_reported_score_and_recomputes(planned):
    out, doc, _ = planned
    cands = doc["candidates"]
    fitting = [c for c in cands if c["fits"]]
    assert [c["rank"] for c in fitting] == list(range(1, len(fitting) + 1))
    # ranked by the closed-loop score (tests/test_plan_score.py recomputes it), with the plain-RMSE
    # rank of each beside it
    assert doc["score"]["name"] == "closed-loop final error" and doc["score"]["kappa"] == 0.1
    assert [c["score"] for c in fitting] == sorted(c["score"] for c in fitting)
    assert [c["rmse"] for c in sorted(fitting, key=lambda c: c["rmse_rank"])] == sorted(
        c["rmse"] for c in fitting
    )
    assert doc["participation"] == {
        **doc["participation"],
        "min_sep": 6,
        "epochs": 4,
        "fixed_epoch": True,
    }
    # b = 6 → powers of two 1, 2, 4, b itself, and the rule of thumb ε√n/k = 4.9 → 5, 8 → 6 (capped
    # at b)
    assert doc["participation"]["band_grid"] == [1, 2, 4, 5, 6]
    rec = doc["recommended"]
    assert rec["kind"] == fitting[0]["kind"] and rec["rmse"] == fitting[0]["rmse"]
    assert rec["score"]["value"] == fitting[0]["score"]
    fac = Factorization.load(out / "factorization.npz")
    assert fac.sha256() == rec["factorization_sha256"]
    # RMSE at the target: σ × √(Σ‖B_i‖²/n) from the written file; ε at that σ within the target
    assert rec["rmse"] == pytest.approx(
        rec["noise_multiplier"] * np.sqrt(fac.per_query_error().mean()), rel=1e-9
    )
    assert (
        account(fac, delta=1e-5, noise_multiplier=rec["noise_multiplier"])["epsilon"] <= 4.0 + 1e-9
    )
    # the pick beats DP-SGD, and every DP-SGD ratio is relative to the best DP-SGD candidate
    dp = min(c["rmse"] for c in cands if c["kind"] == "dpsgd")
    assert all(c["rmse_ratio_vs_dpsgd"] == pytest.approx(c["rmse"] / dp) for c in cands)
    assert rec["rmse"] < dp
    assert rec["score"]["value"] < min(c["score"] for c in cands if c["kind"] == "dpsgd")
    assert {s.get("accountant") for s in doc["skipped"]} >= {"mmcc", "monte-carlo"}


def test_repeated_plan_is_cached(planned):
    _, doc, (first, second) = planned
    assert doc["cache"]["misses"] == 0 and doc["cache"]["hits"] > 0
    # the plan's own time (building, calibrating, plotting), not interpreter start-up
    assert second < 0.1 * first


def test_plots_are_pngs(planned):
    import matplotlib.pyplot as plt

    out, doc, _ = planned
    for name in ("rmse_vs_bands", "per_iterate_error", "epsilon_vs_sigma"):
        path = out / doc["files"][name]
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        img = plt.imread(path)
        assert img.shape[0] > 100 and img.shape[1] > 100 and img.std() > 0


def test_plan_runs_in_simulate(planned, tmp_path):
    out, doc, _ = planned
    r = run(
        "simulate",
        "--plan",
        str(out / "recipe.json"),
        "--backend",
        "inprocess",
        "--out",
        str(tmp_path / "run"),
        "--json",
    )
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout.strip().splitlines()[-1])
    rec = doc["recommended"]
    assert report["noise_multiplier"] == pytest.approx(rec["noise_multiplier"])
    assert report["mechanism"]["kind"] == rec["kind"] and report["rounds_completed"] == 24
    reloaded = Factorization.load(tmp_path / "run" / "factorization.npz")
    assert reloaded.sha256() == rec["factorization_sha256"]
    assert json.dumps(report).count(rec["factorization_sha256"]) >= 1
    bad = run(
        "simulate",
        "--plan",
        str(out / "recipe.json"),
        "--backend",
        "inprocess",
        "--out",
        str(tmp_path / "run2"),
        "--accountant",
        "mmcc",
        "--rounds",
        "30",
    )
    assert bad.returncode == 2 and "--accountant: plan 'unamplified', run 'mmcc'" in bad.stderr
    assert "--rounds: plan 24, run 30" in bad.stderr
    # the plan's population (its cohort and sampling probability) is not a default to override
    users = run(
        "simulate",
        "--plan",
        str(out / "recipe.json"),
        "--out",
        str(tmp_path / "run3"),
        "--users",
        str(rec["population"] + 7),
    )
    assert users.returncode == 2, users.stderr
    assert f"--users: plan {rec['population']}, run {rec['population'] + 7}" in users.stderr
    assert not (tmp_path / "run3").exists()


def test_budgets(tmp_path):
    cache = PlanCache(tmp_path / "cache")
    base = dict(
        rounds=24,
        population=70,
        cohort_size=10,
        target_epsilon=4.0,
        delta=1e-5,
        model_params=1000,
        kinds=("dpsgd", "toeplitz", "bifr", "dense"),
        accountants=("unamplified", "cyclic-poisson"),
    )
    # b = 7, k = 4: b·k ≠ n, so min-sep participation and no dense candidate (it needs fixed-epoch)
    res = make_plan(PlanRequest(**base, memory_budget=0), cache, quiet=True)
    assert any(s.get("kind") == "dense" and "fixed-epoch" in s["reason"] for s in res.skipped)
    best = res.recommended
    assert best.noise_state_bytes == 0 and REGISTRY[best.kind].noise_mode in (
        "identity",
        "banded-inverse",
    )
    fac = res.factorizations[best.key()]
    assert CorrelatedNoise(fac, [(1000,)]).buffer_bytes == 0
    # the better banded C is excluded
    assert any(not c.fits and c.kind == "toeplitz" for c in res.candidates)
    # room for 2 buffers of d floats: a banded C with at most 3 bands, whose engine buffer is what
    # the plan says
    res = make_plan(PlanRequest(**base, memory_budget=2 * 4 * 1000), cache, quiet=True)
    for c in res.candidates:
        f = res.factorizations[c.key()]
        assert c.noise_state_bytes == CorrelatedNoise(f, [(1000,)]).buffer_bytes
        assert c.fits == (c.noise_state_bytes <= 8000)
    assert res.recommended.noise_state_bytes <= 8000
    assert res.recommended.rmse == min(c.rmse for c in res.candidates if c.fits)
    # a noise-time budget below one draw per round excludes everything: no recipe, and write_plan
    # says so
    res = make_plan(PlanRequest(**base, noise_time_budget=0.0), cache, quiet=True)
    assert res.recommended is None
    doc = write_plan(res, tmp_path / "none", plots=False)
    assert doc["recommended"] is None and "no candidate fits" in doc["error"]


def test_cyclic_poisson_recipe_matches_run_accounting(tmp_path):
    """A cyclic-Poisson candidate's σ gives the same ε through the strategy's own accounting
    path."""
    cache = PlanCache(tmp_path / "cache")
    req = PlanRequest(
        rounds=16,
        population=110,
        cohort_size=20,
        target_epsilon=2.0,
        delta=1e-5,
        model_params=10,
        kinds=("toeplitz",),
        accountants=("cyclic-poisson",),
    )
    res = make_plan(req, cache, quiet=True)
    # the best with the cyclic sampler at b = ⌊P/B⌋
    c = next(c for c in res.candidates if c.min_sep == 5)
    assert c.participation == "cyclic-poisson" and c.participation_rate == pytest.approx(20 / 110)
    fac = res.factorizations[c.key()]
    # what the strategy builds
    assert fac.participation == participation_for(16, 4, 5, kind="min-sep")
    # b = ⌊110/20⌋ = 5: each round samples its fifth of the users with q = 5·20/110 (the strategy's
    # CohortPlanner)
    spec = SamplingSpec(
        "cyclic-poisson", 110, 20.0, sampling_probability=5 * 20 / 110, accountant="cyclic-poisson"
    )
    eps = account(fac, delta=1e-5, noise_multiplier=c.noise_multiplier, sampling=spec)["epsilon"]
    assert eps == pytest.approx(c.epsilon) and eps <= 2.0
    assert (
        c.rmse
        < account(fac, delta=1e-5, target_epsilon=2.0)["noise_multiplier"] * c.rmse_unit_sigma
    )  # q < 1


def test_banded_kinds_are_also_planned_with_their_own_sampler_separation(tmp_path):
    """A p-banded Toeplitz C with p < ⌊P/B⌋ is also planned under the cyclic Poisson sampler with b
    = p bands apart (q = p·B/P < 1, so the sampling amplifies; at b = ⌊P/B⌋, q ≈ 1): the strategy's
    accounting path gives the candidate's ε, within the target, and the best of them beats the
    unamplified σ's error at b = ⌊P/B⌋."""
    req = PlanRequest(
        rounds=16,
        population=110,
        cohort_size=20,
        target_epsilon=2.0,
        delta=1e-5,
        model_params=10,
        kinds=("toeplitz",),
        accountants=("cyclic-poisson",),
    )
    res = make_plan(req, PlanCache(tmp_path / "cache"), quiet=True)
    own = [c for c in res.candidates if c.min_sep < req.min_sep]
    assert sorted(c.min_sep for c in own) == [1, 2, 3, 4] and all(c.bands == c.min_sep for c in own)
    for c in own:
        b = c.min_sep
        fac = res.factorizations[c.key()]
        # what the run builds
        assert fac.participation == participation_for(16, -(-16 // b), b, kind="min-sep")
        spec = SamplingSpec(
            "cyclic-poisson",
            110,
            20.0,
            sampling_probability=b * 20 / 110,
            accountant="cyclic-poisson",
        )
        eps = account(fac, delta=1e-5, noise_multiplier=c.noise_multiplier, sampling=spec)[
            "epsilon"
        ]
        assert eps == pytest.approx(c.epsilon) and eps <= 2.0
    at_p_over_b = min(c.rmse for c in res.candidates if c.min_sep == req.min_sep)
    assert min(c.rmse for c in own) < at_p_over_b


def test_dpsgd_is_also_planned_with_poisson_sampling(tmp_path):
    """DP-SGD under Poisson sampling in every round (b = 1, q = B/P): n compositions of the
    subsampled Gaussian."""
    import dp_accounting as dpa

    req = PlanRequest(
        rounds=16,
        population=110,
        cohort_size=20,
        target_epsilon=2.0,
        delta=1e-5,
        model_params=10,
        kinds=("dpsgd",),
        accountants=("unamplified", "cyclic-poisson"),
    )
    res = make_plan(req, PlanCache(tmp_path / "cache"), quiet=True)
    pois = next(c for c in res.candidates if c.min_sep == 1)
    assert pois.participation == "cyclic-poisson" and pois.label().endswith("(Poisson, b=1)")
    assert res.recommended is pois
    # the normalised C = I/√n (sensitivity 1 over n rounds): each round adds σ·√n·z for a clip-1
    # update
    fac = res.factorizations[pois.key()]
    assert np.allclose(fac.encoder.column_norms(), 1 / 4)
    event = dpa.SelfComposedDpEvent(
        dpa.PoissonSampledDpEvent(20 / 110, dpa.GaussianDpEvent(4 * pois.noise_multiplier)), 16
    )
    acc = dpa.pld.PLDAccountant(value_discretization_interval=1e-4)
    assert acc.compose(event).get_epsilon(1e-5) == pytest.approx(pois.epsilon, rel=2e-3)


@pytest.mark.parametrize("kind", KINDS)
def test_registry_matches_engine(kind):
    spec = REGISTRY[kind]
    part = participation_for(12, 2)
    fac = factorize(kind, part, bands=3 if spec.takes_bands else None)
    assert fac.encoder.structure == spec.structure
    mode = default_mode(fac)
    assert mode == spec.noise_mode
    gen = CorrelatedNoise(fac, [(50,)])
    assert (
        gen.buffer_bytes == spec.noise_state_bytes(spec.size_of(fac.encoder), 50, 12)
        or spec.noise_mode == "dense"
    )


def test_plan_bad_arguments(tmp_path):
    r = run(
        "plan",
        "--rounds",
        "24",
        "--users",
        "5",
        "--cohort",
        "10",
        "--target-epsilon",
        "4",
        "--delta",
        "1e-5",
        "--out",
        str(tmp_path),
    )
    assert r.returncode == 2 and "--users" in r.stderr
    r = run("plan", *SMALL[:10], "--kinds", "toeplitz,nope", "--out", str(tmp_path))
    assert r.returncode == 2 and "--kinds" in r.stderr and "nope" in r.stderr
    r = run("plan", *SMALL[:10], "--memory-budget", "lots", "--out", str(tmp_path))
    assert r.returncode == 2 and "--memory-budget" in r.stderr


def test_wrapper_loads_the_plan(planned, tmp_path):
    from flwr.app import ArrayRecord
    from flwr.serverapp.strategy import FedAvg

    from corrflow import DifferentialPrivacyCorrelatedNoise
    from corrflow.clients.tasks import get_task
    from corrflow.errors import InvalidArgumentError
    from corrflow.server.inprocess import InProcessGrid

    out, doc, _ = planned
    rec = doc["recommended"]
    with pytest.raises(
        InvalidArgumentError, match="participation: plan 'fixed-epoch', run 'cyclic-poisson'"
    ):
        DifferentialPrivacyCorrelatedNoise(
            FedAvg(),
            clipping_norm=1.0,
            plan=out / "recipe.json",
            participation="cyclic-poisson",
            state_dir=tmp_path / "x",
        )
    strategy = DifferentialPrivacyCorrelatedNoise(
        FedAvg(fraction_evaluate=0.0),
        clipping_norm=1.0,
        plan=out / "recipe.json",
        state_dir=tmp_path / "w",
    )
    with pytest.raises(InvalidArgumentError, match="num_rounds"):
        strategy.config(num_rounds=30)
    task = get_task("numpy", 20)
    strategy.start(
        grid=InProcessGrid(task.handlers, 60),
        initial_arrays=ArrayRecord(task.initial_weights()),
        num_rounds=24,
    )
    report = json.loads((tmp_path / "w" / "privacy_report.json").read_text())
    assert report["rounds_completed"] == 24
    assert report["noise_multiplier"] == pytest.approx(rec["noise_multiplier"])
    assert (
        Factorization.load(tmp_path / "w" / "factorization.npz").sha256()
        == rec["factorization_sha256"]
    )


def test_an_edited_calibration_is_recomputed_not_printed(tmp_path):
    """A cached σ/ε that fails the calibration's own checks (here: ε above the target, as an edit
    could make it) is recomputed; a valid entry is served."""
    cache = PlanCache(tmp_path)
    calls = []

    def compute():
        calls.append(1)
        return {"noise_multiplier": 0.9, "epsilon": 7.9}

    def valid(r):
        return r["noise_multiplier"] > 0 and r["epsilon"] <= 8.0

    params = {"accountant": "pld", "target_epsilon": 8.0}
    assert cache.calibration(params, compute, valid) == (
        {"noise_multiplier": 0.9, "epsilon": 7.9},
        False,
    )
    (path,) = tmp_path.glob("cal-*.json")
    stored = json.loads(path.read_text())
    stored["result"]["epsilon"] = 80.0
    path.write_text(json.dumps(stored))
    assert cache.calibration(params, compute, valid)[0]["epsilon"] == 7.9 and len(calls) == 2
    # the rewritten entry is served
    assert cache.calibration(params, compute, valid)[1] is True and len(calls) == 2


def test_same_inputs_same_recipe_and_the_time_budget_only_aborts(tmp_path):
    from corrflow.planning.candidates import PlanStoppedError, dense_iterations

    req = PlanRequest(
        rounds=24,
        population=60,
        cohort_size=10,
        target_epsilon=4.0,
        delta=1e-5,
        model_params=1000,
        kinds=("dpsgd", "toeplitz", "dense"),
        accountants=("unamplified", "cyclic-poisson"),
    )
    runs = [
        make_plan(req, PlanCache(tmp_path / f"cache{i}"), quiet=True) for i in range(2)
    ]  # both cold

    def table(res):
        return [
            (c.key(), c.noise_multiplier, c.rmse, c.factorization_sha256) for c in res.candidates
        ]

    assert (
        table(runs[0]) == table(runs[1]) and runs[0].recommended.key() == runs[1].recommended.key()
    )
    dense = next(c for c in runs[0].candidates if c.kind == "dense")
    assert dense.notes["max_iterations"] == dense_iterations(24) == 10_000 and np.isfinite(
        dense.notes["relative_gap"]
    )
    assert dense_iterations(2052) == 116
    # a wall-clock budget that runs out stops the plan instead of changing it: an error, and no
    # recipe written
    with pytest.raises(PlanStoppedError, match="no recipe written"):
        make_plan(
            PlanRequest(**{**req.__dict__, "time_budget": 1e-9}),
            PlanCache(tmp_path / "cache2"),
            quiet=True,
        )
    out = tmp_path / "stopped"
    r = run("plan", *SMALL, "--out", str(out), "--time-budget", "0.000001", "--no-plots")
    assert r.returncode == 1 and "--time-budget" in r.stderr and "no recipe written" in r.stderr
    assert not (out / "recipe.json").exists()
    bad = run("plan", *SMALL, "--out", str(out), "--dense-iterations", "0")
    assert bad.returncode == 2 and "--dense-iterations" in bad.stderr


def test_a_cached_unamplified_sigma_is_re_derived(tmp_path):
    # an edit that lowers the cached σ but keeps the ε it claims is caught: the exact ε of the
    # cached σ is recomputed
    req = PlanRequest(
        rounds=12,
        population=40,
        cohort_size=10,
        target_epsilon=4.0,
        delta=1e-5,
        model_params=1000,
        kinds=("toeplitz",),
        accountants=("unamplified",),
    )
    first = make_plan(req, PlanCache(tmp_path), quiet=True)
    edited = 0
    for path in tmp_path.glob("cal-*.json"):
        stored = json.loads(path.read_text())
        if stored["params"].get("accountant") == "unamplified":
            stored["result"]["noise_multiplier"] *= 0.5
            path.write_text(json.dumps(stored))
            edited += 1
    assert edited >= 1
    again = make_plan(req, PlanCache(tmp_path), quiet=True)
    assert [c.noise_multiplier for c in again.candidates] == [
        c.noise_multiplier for c in first.candidates
    ]


def test_plan_table_shows_each_candidates_min_sep(planned):
    """Two candidates with the same kind, bands and accountant but another min-sep b (a sampler's
    own b) are told apart by the table's b column (trial report)."""
    from corrflow.server.cli import _plan_table

    out, doc, _ = planned
    lines = _plan_table(doc, out, top=len(doc["candidates"])).splitlines()
    header = next(line for line in lines if line.lstrip().startswith("rank"))
    assert header.split()[:3] == ["rank", "candidate", "b"]
    rows = [line for line in lines if line[:4].strip().isdigit() or line[:4].strip() == "-"]
    assert len(rows) == len(doc["candidates"])
    for row, c in zip(rows, doc["candidates"], strict=True):
        assert row[37:43].strip() == str(c["min_sep"]), row


def test_plan_plots_give_each_kind_one_colour_and_draw_identical_curves_once(tmp_path):
    """One colour per factorization kind across panels and files; two candidates with the same
    per-iterate error are one line whose label names both; the legend sits under the axes."""
    from types import SimpleNamespace

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from corrflow.factorization.registry import KINDS
    from corrflow.planning import plots

    assert len({plots.kind_colour(k) for k in KINDS}) == len(KINDS)

    def cand(kind, acc, sigma, err):
        fac = SimpleNamespace(rounds=len(err), per_query_error=lambda e=err: np.asarray(e))
        return SimpleNamespace(
            kind=kind,
            accountant=acc,
            noise_multiplier=sigma,
            label=lambda: f"{kind} / {acc}",
            key=lambda: (kind, acc),
            fac=fac,
        )

    cands = [
        cand("toeplitz", "unamplified", 2.0, [1.0, 0.5, 0.25]),
        cand("toeplitz", "cyclic-poisson", 1.0, [4.0, 2.0, 1.0]),  # the same σ√error curve
        cand("dense", "unamplified", 1.0, [1.0, 2.0, 3.0]),
        cand("dpsgd", "unamplified", 1.0, [1.0, 1.0, 1.0]),
    ]
    result = SimpleNamespace(
        candidates=cands,
        factorizations={c.key(): c.fac for c in cands},
        request=SimpleNamespace(target_epsilon=8.0),
    )
    figs = []
    recorder = SimpleNamespace(subplots=plt.subplots, close=figs.append)
    plots._per_iterate(recorder, result, tmp_path / "per_iterate_error.png")
    ax = figs[0].axes[0]
    lines = {line.get_label(): line.get_color() for line in ax.get_lines()}
    assert lines == {
        "toeplitz / unamplified = toeplitz / cyclic-poisson": plots.kind_colour("toeplitz"),
        "dense / unamplified": plots.kind_colour("dense"),
        "dpsgd / unamplified": "black",
    }
    anchor = ax.get_legend().get_bbox_to_anchor().transformed(ax.transAxes.inverted())
    assert anchor.y1 < 0  # under the axes: it hides no line
    plt.close(figs[0])


def test_plan_says_what_it_does_and_lists_its_plots(planned):
    """Rerun on the cached plan, for people: a plain progress line per candidate on stderr (a
    progress bar shows only on a terminal), σ in both conventions and the three PNGs written."""
    out, _, _ = planned
    r = run("plan", *[a for a in SMALL if a != "--quiet"], "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "plan: candidate 1 of " in r.stderr and "plan: drawing 3 plots" not in r.stdout
    plots = next(line for line in r.stdout.splitlines() if line.startswith("plots "))
    for name in ("rmse_vs_bands.png", "per_iterate_error.png", "epsilon_vs_sigma.png"):
        assert str(out / name) in plots and (out / name).is_file()
    sigma = next(line for line in r.stdout.splitlines() if line.startswith("σ "))
    assert "σ (corrflow, sensitivity-1 C) = " in sigma and "per participation (the papers'" in sigma
