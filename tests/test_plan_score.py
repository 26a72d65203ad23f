"""The planner's score: the closed-loop error of the final model (arXiv 2310.06771) against an
independent closed form and a Monte Carlo simulation of noisy training on a quadratic, κ measured
on an update map with a known spectrum and on the synthetic proxy, and what ``corrflow plan``
prints and records about it."""

import json
import subprocess
import sys

import numpy as np
import pytest

from corrflow.errors import InvalidArgumentError
from corrflow.factorization import Participation, Workload, factorize
from corrflow.planning.cache import PlanCache
from corrflow.planning.candidates import PlanRequest, make_plan, score_summary
from corrflow.planning.score import (
    Damping,
    closed_loop_error,
    closed_loop_response,
    estimate_damping,
    loss_weighted_kappa,
)

WORKLOAD = Workload.sgd_momentum(0.9, 0.25)


def _closed_form(workload: Workload, n: int, kappa: float) -> np.ndarray:
    """x = A (w − κ S x) with S the one-round shift, so x = (I + κ A S)⁻¹ A w: the last row."""
    A = workload.matrix(n)
    S = np.eye(n, k=-1)
    return np.linalg.solve(np.eye(n) + kappa * A @ S, A)[-1]


@pytest.mark.parametrize("kappa", [0.0, 0.01, 0.1, 0.5])
def test_response_matches_the_closed_form(kappa):
    n = 30
    r = closed_loop_response(WORKLOAD, n, kappa)
    np.testing.assert_allclose(r, _closed_form(WORKLOAD, n, kappa), rtol=1e-10, atol=1e-12)
    if kappa == 0:  # open loop: the last row of the workload A
        np.testing.assert_allclose(r, WORKLOAD.matrix(n)[-1], rtol=1e-12)


def test_closed_loop_error_matches_simulated_training():
    """Train a quadratic (curvature h, server lr η: κ = η·h) with the momentum-and-cooldown
    optimizer and the mechanism's correlated noise C⁻¹Z: the final model's standard deviation over
    20,000 runs is the score's σ·‖C⁻ᵀ r_κ‖ (3% Monte Carlo tolerance)."""
    n, k, kappa = 24, 4, 0.2
    fac = factorize("toeplitz", Participation.fixed_epoch(n, k), WORKLOAD, bands=4)
    predicted = closed_loop_error(fac, closed_loop_response(WORKLOAD, n, kappa))
    rng = np.random.default_rng(5)
    runs = 20_000
    noise = fac.encoder.solve(rng.normal(size=(n, runs)))  # (C⁻¹ Z)_t, one column per run
    eta = WORKLOAD.learning_rates(n)
    x, m = np.zeros(runs), np.zeros(runs)
    for t in range(n):
        m = WORKLOAD.momentum * m + (-kappa * x + noise[t])
        x = x + eta[t] * m
    assert x.std() == pytest.approx(predicted, rel=0.03)
    # DP-SGD (C diagonal): the same score from a dense inverse
    dp = factorize("dpsgd", Participation.fixed_epoch(n, k), WORKLOAD)
    r = closed_loop_response(WORKLOAD, n, kappa)
    C = dp.encoder.matrix()
    assert closed_loop_error(dp, r) == pytest.approx(np.linalg.norm(r @ np.linalg.inv(C)))


def test_kappa_of_a_known_spectrum():
    """U(x) = −H x: κ_w = η·tr(H²)/tr(H) — exact for H = h·I, within Monte Carlo error for a
    spread spectrum."""
    d, lr = 400, 3.0
    iso = estimate_damping(lambda x, t: -0.02 * x, np.ones(d), WORKLOAD, 8, lr)
    assert iso.kappa == pytest.approx(0.06) and iso.source == "proxy"
    h = np.where(np.arange(d) < d // 4, 0.1, 0.001)  # a quarter of the directions curve 100× more
    est = estimate_damping(lambda x, t: -h * x, np.ones(d), WORKLOAD, 8, lr, directions=40)
    want = lr * (h**2).sum() / h.sum()
    assert est.kappa == pytest.approx(want, rel=0.15)
    assert est.details["isotropic_mean_kappa"] == pytest.approx(lr * h.mean(), rel=0.15)
    # no damping measured (an expanding map): the open loop, κ = 0
    assert estimate_damping(lambda x, t: 0.01 * x, np.ones(d), WORKLOAD, 4, lr).kappa == 0
    assert loss_weighted_kappa([]) == 0


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf")])
def test_damping_refuses_bad_kappa(bad):
    with pytest.raises(InvalidArgumentError) as exc:
        Damping(bad, "declared")
    assert exc.value.field == "kappa"


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    cache = PlanCache(tmp_path_factory.mktemp("cache"))
    base = dict(rounds=24, population=60, cohort_size=10, target_epsilon=4.0, delta=1e-5)
    kinds = ("dpsgd", "toeplitz", "dense")
    open_loop = make_plan(PlanRequest(**base, kinds=kinds), cache, quiet=True)
    closed = make_plan(
        PlanRequest(**base, kinds=kinds, damping=Damping(0.1, "declared")), cache, quiet=True
    )
    return open_loop, closed


def test_plan_ranks_by_the_closed_loop_error(plans):
    open_loop, closed = plans
    fitting = [c for c in closed.candidates if c.fits]
    assert [c.score for c in fitting] == sorted(c.score for c in fitting)
    r = _closed_form(closed.request.workload, 24, 0.1)
    for c in fitting:  # recomputed from the stored factorization with a dense inverse
        fac = closed.factorizations[c.key()]
        C = fac.encoder.matrix()
        want = c.noise_multiplier * fac.sensitivity.value * np.linalg.norm(r @ np.linalg.inv(C))
        assert c.score == c.closed_loop_error == pytest.approx(want, rel=1e-8)
    # the plain-RMSE ranks are those of the open-loop plan, which still ranks by RMSE
    assert [c.rmse for c in sorted(fitting, key=lambda c: c.rmse_rank)] == sorted(
        c.rmse for c in fitting
    )
    assert open_loop.recommended.score == open_loop.recommended.rmse
    assert open_loop.recommended.rmse == min(c.rmse for c in open_loop.candidates if c.fits)
    # with training's feedback the dense optimum of the open-loop RMSE is not the pick
    assert open_loop.recommended.kind == "dense" and closed.recommended.kind != "dense"


def test_score_summary_names_a_runner_up_with_other_noise(plans):
    _, closed = plans
    s = score_summary(closed)
    best, runner = closed.recommended, s["runner_up"]
    assert s["recommended"]["candidate"] == best.label() and s["kappa"] == 0.1
    assert runner["score"] >= best.score and runner["candidate"] != best.label()
    assert s["margin"] == pytest.approx(runner["score"] / best.score - 1)
    assert [e["rmse_rank"] for e in s["rmse_ranking"]] == list(range(1, len(s["rmse_ranking"]) + 1))
    assert s["assumes"] and "κ" in s["formula"]


def _plan(tmp_path, *extra):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "corrflow.server.cli",
            "plan",
            "--rounds",
            "24",
            "--users",
            "60",
            "--cohort",
            "10",
            "--target-epsilon",
            "4",
            "--kinds",
            "dpsgd,toeplitz",
            "--accountants",
            "unamplified,cyclic-poisson",
            "--no-plots",
            "--quiet",
            "--out",
            str(tmp_path / "plan"),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_plan_prints_why_and_records_the_score(tmp_path):
    r = _plan(tmp_path)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "κ = 0.1, ASSUMED" in out
    rec = next(line for line in out.splitlines() if line.startswith("why"))
    assert ": closed-loop final error" in rec and "runner-up" in rec
    assert rec.count(" at b = ") == 2  # the pick's and the runner-up's sampler separation
    assert out.count("assumes        ") == 3 and "plain RMSE     ranks 1." in out
    recipe = json.loads((tmp_path / "plan" / "recipe.json").read_text())
    assert recipe["score"]["kappa"] == 0.1 and recipe["score"]["kappa_source"] == "default"
    assert recipe["score"]["value"] == recipe["score"]["closed_loop_error"] > 0
    r = _plan(tmp_path, "--kappa", "0.03", "--json")
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert doc["score"]["kappa"] == 0.03 and doc["score"]["kappa_source"] == "declared"


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--kappa", "-1"], "--kappa"),
        (["--proxy-data", "missing.sqlite"], "--proxy-data"),
        (["--proxy-vocab", "v.txt"], "--proxy-data"),
    ],
)
def test_plan_refuses_bad_score_inputs(tmp_path, extra, flag):
    r = _plan(tmp_path, *extra)
    assert r.returncode == 2 and flag in r.stderr and "Traceback" not in r.stderr


def test_plan_refuses_proxy_data_for_a_client_without_text(tmp_path):
    """The numpy client (plan's default) trains on synthetic regression data: a proxy file would be
    silently ignored, so it is refused, naming --client."""
    (tmp_path / "p.sqlite").write_text("x")
    (tmp_path / "v.txt").write_text("the\n")
    r = _plan(
        tmp_path,
        "--proxy-data",
        str(tmp_path / "p.sqlite"),
        "--proxy-vocab",
        str(tmp_path / "v.txt"),
    )
    assert r.returncode == 2 and "--client" in r.stderr and "Traceback" not in r.stderr


def test_kappa_on_the_synthetic_proxy_is_deterministic():
    """The tiny preset's proxy (the generator with another seed): the same κ twice, inside the range
    where the quick-preset sweep's order of arms holds (docs/explanation/evidence.md)."""
    from corrflow.server.compare import NONPRIVATE, PRESETS, arm_config
    from corrflow.server.proxy import proxy_damping

    p = PRESETS["tiny"]
    cfg = arm_config(p, NONPRIVATE, 0, "unused")
    a = proxy_damping(cfg, p.users, p.cohort)
    b = proxy_damping(cfg, p.users, p.cohort)
    assert a.kappa == b.kappa and a.details["measured_kappa"] == b.details["measured_kappa"]
    assert 0.05 < a.kappa < 0.5 and a.source == "proxy"
    assert a.details["isotropic_mean_kappa"] < a.kappa  # curvature-weighted ≥ the isotropic mean


def test_kappa_on_the_cohort_engine_matches_the_client_apps():
    """The proxy run on the cohort engine: the same users, data order and float64 arithmetic as the
    ClientApps, so the same κ (the probes difference nearby models; the replies agree up to their
    float32 rounding)."""
    from corrflow.server.compare import NONPRIVATE, PRESETS, arm_config
    from corrflow.server.proxy import proxy_damping

    p = PRESETS["tiny"]
    cfg = arm_config(p, NONPRIVATE, 0, "unused")
    a = proxy_damping(cfg, p.users, p.cohort)
    b = proxy_damping(cfg, p.users, p.cohort, backend="cohort")
    assert b.kappa == a.kappa
    assert b.details["measured_kappa"] == pytest.approx(a.details["measured_kappa"], rel=1e-6)


@pytest.mark.parametrize(
    "extra", [("--backend", "flower"), ("--backend", "cohort", "--client", "keras")]
)
def test_plan_refuses_a_proxy_engine_it_cannot_train_on(tmp_path, extra):
    """κ's proxy run trains in this process, on ClientApps or (numpy and nextword) the cohort
    engine: anything else is refused before anything is written, naming --backend."""
    r = _plan(tmp_path, *extra)
    assert r.returncode == 2, r.stderr
    assert "--backend" in r.stderr and "Traceback" not in r.stderr


def test_closed_loop_error_without_the_dense_encoder(monkeypatch):
    """Above the encoders' DENSE_LIMIT the score solves block by block; the same value (a banded
    inverse has no transposed solve)."""
    import corrflow.planning.score as score

    fac = factorize("bifr", Participation.fixed_epoch(40, 4), WORKLOAD, bands=4)
    r = closed_loop_response(WORKLOAD, 40, 0.1)
    dense = closed_loop_error(fac, r)
    monkeypatch.setattr(score, "DENSE_LIMIT", 10)
    monkeypatch.setattr(score, "SOLVE_BLOCK", 7)
    assert closed_loop_error(fac, r) == pytest.approx(dense, rel=1e-12)
    assert dense == pytest.approx(np.linalg.norm(r @ np.linalg.inv(fac.encoder.matrix())))


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--kappa", "-1"], "--kappa"),
        (["--proxy-data", "missing.sqlite", "--proxy-vocab", "missing.txt"], "--proxy-data"),
        (["--proxy-vocab", "v.txt"], "--proxy-data"),
    ],
)
def test_compare_refuses_bad_score_inputs(tmp_path, extra, flag):
    r = subprocess.run(
        [sys.executable, "-m", "corrflow.server.cli", "compare", "--preset", "tiny", *extra]
        + ["--out", str(tmp_path / "cmp")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 2 and flag in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "cmp").exists()  # refused before anything is written


def test_kappa_beyond_the_stable_limit_is_refused():
    """Heavy-ball feedback on a quadratic is stable iff η·κ < 2(1 + β): just below the limit the
    response decays, just above it grows without bound — and a plan refuses that κ, naming the
    flag (declared) or the proxy data (measured)."""
    from corrflow.planning.score import check_kappa, stable_kappa_limit

    limit = stable_kappa_limit(WORKLOAD, 400)
    assert limit == pytest.approx(2 * 1.9)
    assert np.abs(closed_loop_response(WORKLOAD, 400, 0.97 * limit)[:100]).max() < 1e3
    assert np.abs(closed_loop_response(WORKLOAD, 400, 1.03 * limit)[:100]).max() > 1e6
    check_kappa(Damping(0.99 * limit, "declared"), WORKLOAD, 400)
    for source, field in (("declared", "kappa"), ("proxy", "proxy-data")):
        with pytest.raises(InvalidArgumentError) as exc:
            check_kappa(Damping(limit, source), WORKLOAD, 400)
        assert exc.value.field == field and "3.8" in exc.value.expected
    with pytest.raises(InvalidArgumentError):
        PlanRequest(
            rounds=24,
            population=60,
            cohort_size=10,
            target_epsilon=4.0,
            delta=1e-5,
            damping=Damping(5.0, "declared"),
        )


def test_measured_kappa_warns_where_the_score_is_weak():
    assert Damping(0.12, "proxy", {"kappa_per_round": {"9": 0.15, "19": 0.11}}).warnings() == []
    assert Damping(1.6, "default").warnings() == [] == Damping(1.6, "declared").warnings()
    over = Damping(1.6, "proxy").warnings()
    assert len(over) == 1 and "overshoots" in over[0]
    spread = Damping(0.3, "proxy", {"kappa_per_round": {"9": 0.5, "19": 0.2}}).warnings()
    assert len(spread) == 1 and "0.2 to 0.5" in spread[0]


def test_a_one_band_encoder_is_dpsgd_for_the_runner_up(plans):
    """toeplitz[1] adds DP-SGD's noise: the same score at the same separation, so the plan never
    names it as DP-SGD's runner-up (or the reverse)."""
    from corrflow.planning.candidates import _same_mechanism

    _, closed = plans
    for dp in (c for c in closed.candidates if c.kind == "dpsgd"):
        twins = [
            c
            for c in closed.candidates
            if c.kind == "toeplitz"
            and c.bands == 1
            and (c.min_sep, c.accountant) == (dp.min_sep, dp.accountant)
        ]
        for t in twins:
            assert _same_mechanism(t, dp) and t.score == pytest.approx(dp.score, rel=1e-9)
    assert any(c.kind == "toeplitz" and c.bands == 1 for c in closed.candidates)
    s = score_summary(closed)
    best = closed.recommended
    runner = next(c for c in closed.candidates if c.label() == s["runner_up"]["candidate"])
    assert not _same_mechanism(runner, best)


@pytest.mark.parametrize("cmd", ["plan", "compare"])
def test_cli_refuses_an_unstable_kappa(tmp_path, cmd):
    if cmd == "plan":
        r = _plan(tmp_path, "--kappa", "5")
    else:
        r = subprocess.run(
            [sys.executable, "-m", "corrflow.server.cli", "compare", "--preset", "tiny"]
            + ["--kappa", "5", "--out", str(tmp_path / "cmp")],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert not (tmp_path / "cmp").exists()
    limit = "κ < 3 = 2(1 + momentum 0.5)" if cmd == "plan" else "κ < 3.8 = 2(1 + momentum 0.9)"
    assert r.returncode == 2 and "--kappa" in r.stderr and limit in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
