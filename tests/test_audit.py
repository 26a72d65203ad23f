"""Empirical privacy auditing (`corrflow audit`): the statistics against published and independently
computed values, the whitened estimator on a Gaussian toy where the true ε is known (the production
correlated-noise engine, a momentum server optimizer), and end-to-end audits of correct runs and of
mechanisms broken by patching the public noise API ``CorrelatedNoise.next`` in the test only."""

import json
import math

import numpy as np
import pytest
from typer.testing import CliRunner

from corrflow.accounting import audit as st
from corrflow.config import RunConfig
from corrflow.factorization.build import factorize, participation_for
from corrflow.factorization.workloads import Workload
from corrflow.noise import CorrelatedNoise
from corrflow.run.optimizer import MomentumServerOptimizer
from corrflow.run.reading import participation_users
from corrflow.server.audit import run_audit
from corrflow.strategies.canaries import optimizer_map

DELTA = 1e-5


# -- statistics ------------------------------------------------------------------------------------
def test_gaussian_epsilon_matches_balle_wang_values():
    # ε_G(1) and ε_G(0.5) at δ = 1e-5 (exact Gaussian mechanism, Balle & Wang 1805.06530), and a
    # fitted ratio.
    assert st.gaussian_epsilon(1.0, DELTA) == pytest.approx(4.3772, abs=1e-4)
    assert st.gaussian_epsilon(0.5, DELTA) == pytest.approx(1.9931, abs=1e-4)
    assert st.gaussian_epsilon(6.858863e-3 / 6.992453e-3, DELTA) == pytest.approx(4.2806, abs=1e-4)
    # δ(ε_G(μ)) is δ, and the definition agrees with brute-force privacy-loss integration.
    mu = 0.7
    eps = st.gaussian_epsilon(mu, 1e-3)
    x = np.linspace(-12, 12, 400_001)
    p, q = np.exp(-((x - mu) ** 2) / 2), np.exp(-(x**2) / 2)
    brute = np.sum(np.maximum(p - np.exp(eps) * q, 0)) * (x[1] - x[0]) / math.sqrt(2 * math.pi)
    assert brute == pytest.approx(1e-3, rel=1e-4)
    assert st.gaussian_epsilon(0.0, DELTA) == 0.0


@pytest.mark.parametrize(
    ("m", "r", "v", "delta", "expected"),
    [
        (1000, 100, 100, 0.0, 3.492965),  # all correct: ln(q/(1−q)), q = 0.05^(1/100)
        (1000, 100, 90, 1e-5, 1.626143),
        (1000, 100, 90, 0.0, 1.630823),
        (10000, 500, 400, 1e-6, 1.197969),
        (2000, 200, 180, 1e-5, 1.793677),
    ],
)
def test_one_run_bound_matches_jax_privacy_values(m, r, v, delta, expected):
    """Steinke et al. 2305.08846 at 95%: values jax-privacy's `_epsilon_one_run` gives for these
    counts."""
    assert st.one_run_epsilon(m, r, v, delta, 0.05) == pytest.approx(expected, abs=2e-6)
    q = 0.05 ** (1 / 100)
    assert st.one_run_epsilon(1000, 100, 100, 0.0) == pytest.approx(math.log(q / (1 - q)), abs=1e-6)


def test_one_run_bound_cross_check_with_jax_privacy():
    try:  # the `peer` extra; jax-privacy's package import needs jax and a matching optax
        from jax_privacy import auditing
    except Exception as exc:  # noqa: BLE001 - any import failure means the peer is not usable here
        pytest.skip(f"jax-privacy not importable: {exc}")
    for m, r, v, delta in ((1000, 100, 90, 1e-5), (2000, 200, 180, 1e-5)):
        for eps in (0.5, 1.0, 2.0):
            assert st.one_run_p_value(m, r, v, eps, delta) == pytest.approx(
                auditing._one_run_p_value(m, r, v, eps, delta), rel=1e-6
            )


def test_lower_bound_is_zero_without_signal_and_saturates_with_perfect_separation():
    rng = np.random.default_rng(5)
    inserted = st.canary_coins(1, 200)
    assert st.one_run_lower_bound(rng.standard_normal(200), inserted, DELTA).epsilon < 0.5
    separated = np.where(inserted, 10.0, 0.0) + 0.01 * rng.standard_normal(200)
    lb = st.one_run_lower_bound(separated, inserted, DELTA)
    # Guesses are fixed in advance (100 "in", 100 "out"); the coins inserted about, not exactly,
    # half.
    assert lb.guesses_in + lb.guesses_out == 200 and lb.correct == 200 - abs(
        int(inserted.sum()) - 100
    )
    # "about ε 4 at 200 canaries"
    assert 3.0 < lb.epsilon <= st.lower_bound_ceiling(200, delta=DELTA) < 4.0


# -- the estimator under correlated noise: a Gaussian toy with a known ε ---------------------------
def _toy(kind: str, sigma: float, seed: int, noise=None, candidates: int = 600, dim: int = 6000):
    """The matrix mechanism in the clear: X̃ = ζ Σ_in u_j c_j + σζ (C⁻¹Z) from corrflow's noise
    engine, released through a momentum server optimizer (D = M X̃). Inserted canaries all take the
    worst fixed-epoch pattern."""
    rounds, epochs = 8, 2
    fac = factorize(kind, participation_for(rounds, epochs), Workload.prefix())
    b = rounds // epochs
    C = fac.encoder.matrix()
    patterns = np.zeros((b, rounds))
    for g in range(b):
        patterns[g, g::b] = 1
    norms = np.linalg.norm(patterns @ C.T, axis=1)
    worst = int(np.argmax(norms))
    gen = CorrelatedNoise(fac, [(dim,)], 1.0, key=bytes(range(16)))
    Z = np.stack([(noise or gen.next)(t)[0] for t in range(rounds)]).astype(np.float64)
    inserted = st.canary_coins(seed, candidates)
    rng = np.random.default_rng(seed)
    groups = np.where(inserted, worst, rng.integers(0, b, candidates))
    u = patterns[groups]
    dirs = np.stack([st.canary_direction(seed, j, dim) for j in range(candidates)])
    X = (u[inserted].T @ dirs[inserted]) + sigma * Z
    M = optimizer_map(
        MomentumServerOptimizer(Workload.sgd_momentum(0.9, 0.25), rounds, 1.0), rounds
    )
    D = M @ X
    scores = st.whitened_scores(D, dirs @ D.T, u @ M.T)
    return scores, inserted, norms[worst], D, dirs


@pytest.mark.parametrize("kind", ["dpsgd", "toeplitz"])
def test_whitened_estimate_recovers_the_true_epsilon_of_the_matrix_mechanism(kind):
    sigma = 1.0
    scores, inserted, worst, D, dirs = _toy(kind, sigma, seed=11)
    assert worst == pytest.approx(1.0, abs=1e-6)  # the factorization's sensitivity is realised
    truth = st.gaussian_epsilon(worst / sigma, DELTA)  # 4.377
    est = st.one_shot_estimate(scores[inserted], scores[~inserted], DELTA, resamples=200)
    assert abs(est.epsilon - truth) < 0.7, (est, truth)
    assert est.interval[0] < truth < est.interval[1]
    assert est.null_mean == pytest.approx(0, abs=0.2) and est.null_std == pytest.approx(1, abs=0.15)
    assert st.one_run_lower_bound(scores, inserted, DELTA).epsilon <= truth
    # The final-model statistic only sees Σ_t D_t: it stays below the all-iterates ε.
    cos = st.final_model_cosines(D.sum(0), dirs @ D.sum(0))
    assert st.gaussian_fit_epsilon(cos[inserted], DELTA) < truth


def test_whitened_estimate_sees_noise_reused_across_two_rounds():
    """Noise repeated in rounds 0 and 1: the final-model cosine cannot see it; the whitened
    statistic does."""
    fac = factorize("toeplitz", participation_for(8, 2), Workload.prefix())
    gen = CorrelatedNoise(fac, [(6000,)], 1.0, key=bytes(range(16)))
    first = []

    def reused(t):
        out = gen.next(t)
        if t == 0:
            first.append(out)
        return first[0] if t == 1 else out

    sigma = 4.0
    truth = st.gaussian_epsilon(1 / sigma, DELTA)
    scores, inserted, _, _, _ = _toy("toeplitz", sigma, seed=12, noise=reused)
    assert st.gaussian_fit_epsilon(scores[inserted], DELTA) > 2 * truth


# -- end to end: `corrflow audit` ------------------------------------------------------------------
def _config(kind: str, out) -> RunConfig:
    """The `tiny` preset's task at half the size (48 users, 8 rounds, each user in 2), claimed ε =
    1."""
    return RunConfig(
        num_users=48,
        num_rounds=8,
        epochs=2,
        kind=kind,
        target_epsilon=1.0,
        delta=DELTA,
        client="nextword",
        local_steps=1,
        seed=0,
        state_dir=str(out),
    )


def _audit(kind: str, out, **kw) -> dict:
    return run_audit(_config(kind, out), 100, audit_seed=3, noise_key=bytes(16), quiet=True, **kw)


def _break(monkeypatch, how: str) -> None:
    real = CorrelatedNoise.next
    held = {}

    def broken(self, round_index, **kw):
        out = real(self, round_index, **kw)
        if how == "zeros":
            return [np.zeros_like(a) for a in out]
        if how == "scaled":
            return [a / np.float32(10) for a in out]
        held.setdefault(0, [a.copy() for a in out])  # reuse: round 1 releases round 0's noise again
        return [a.copy() for a in held[0]] if round_index == 1 else out

    monkeypatch.setattr(CorrelatedNoise, "next", broken)


@pytest.mark.parametrize("kind", ["dpsgd", "dense"])
def test_correct_runs_audit_below_their_claim(kind, tmp_path):
    res = _audit(kind, tmp_path / kind, plot=False)
    assert res["epsilon_claimed"] == pytest.approx(1.0, abs=0.01)
    assert res["epsilon_lower"] <= res["epsilon_claimed"]
    assert res["epsilon_estimate_interval"][0] <= res["epsilon_claimed"]
    w = res["statistics"]["whitened"]
    assert abs(w["null_mean"]) < 0.35 and 0.7 < w["null_std"] < 1.3  # the held-out null is N(0, 1)
    assert res["canaries"]["inserted"] + res["canaries"]["held_out"] == 100
    assert res["run"]["rounds_completed"] == 8
    report = json.loads((tmp_path / kind / "privacy_report.json").read_text())
    users = participation_users(report, tmp_path / kind)
    assert len(users) == 48 + res["canaries"]["inserted"]


@pytest.mark.parametrize("how", ["scaled", "reused"])
def test_broken_noise_gives_an_estimate_above_the_claim(how, tmp_path, monkeypatch):
    _break(monkeypatch, how)
    res = _audit("toeplitz", tmp_path / how, plot=False)
    assert res["epsilon_estimate"] > res["epsilon_claimed"]
    assert res["epsilon_estimate_interval"][0] > res["epsilon_claimed"]


def _cli(tmp_path, name: str, epsilon: str = "1") -> tuple[int, dict, str]:
    from corrflow.server.cli import app

    args = [
        "audit",
        "--canaries",
        "100",
        "--audit-seed",
        "3",
        "--users",
        "48",
        "--rounds",
        "8",
        "--epochs",
        "2",
        "--client",
        "nextword",
        "--local-steps",
        "1",
        "--target-epsilon",
        epsilon,
        "--kind",
        "toeplitz",
        "--json",
        "--out",
        str(tmp_path / name),
    ]
    res = CliRunner().invoke(app, args)
    lines = [line for line in res.stdout.splitlines() if line.startswith("{")]
    return res.exit_code, json.loads(lines[-1]) if lines else {}, res.output


def test_cli_audit_of_the_default_mechanism(tmp_path, monkeypatch):
    # a reproducible noise key
    monkeypatch.setattr("corrflow.run.noise.new_secret", lambda: bytes(16))
    code, res, output = _cli(tmp_path, "ok")
    assert code == 0, output
    for key in (
        "epsilon_claimed",
        "delta",
        "epsilon_estimate",
        "epsilon_lower",
        "canaries",
        "statistics",
    ):
        assert key in res
    assert res["delta"] == DELTA and res["run"]["kind"] == "toeplitz"
    assert res["epsilon_lower"] <= res["epsilon_claimed"]
    assert (tmp_path / "ok" / "audit.png").stat().st_size > 10_000
    assert (
        json.loads((tmp_path / "ok" / "audit.json").read_text())["epsilon_lower"]
        == res["epsilon_lower"]
    )


def test_cli_audit_proves_omitted_noise(tmp_path, monkeypatch):
    _break(monkeypatch, "zeros")
    code, res, output = _cli(tmp_path, "zeros")
    assert code == 4, output  # a violation at 95% confidence
    assert res["epsilon_lower"] > res["epsilon_claimed"]
    assert res["epsilon_estimate"] > res["epsilon_claimed"]
    assert "VIOLATION" in res["verdict"]


def test_cli_audit_suspect_exits_5_and_names_the_ceiling(tmp_path, monkeypatch):
    """Zero noise at a claim of ε = 8 — above what 200 canaries can ever prove (ε_lo ≤
    3.80) — is SUSPECT, and a pipeline sees it in the exit code; the note says no count helps."""
    _break(monkeypatch, "zeros")
    code, res, output = _cli(tmp_path, "suspect", epsilon="8")
    assert "SUSPECT" in res["verdict"], output
    assert code == 5, output
    assert res["epsilon_lower"] <= res["canaries"]["lower_bound_ceiling"] < 8
    assert "cannot prove a violation" in output and "no number of candidates" in output


def test_cli_audit_refuses_bad_arguments(tmp_path):
    from corrflow.server.cli import app

    for args, flag in (
        (["--canaries", "4"], "--canaries"),
        (["--preset", "huge"], "--preset"),
        (["--canaries", "100", "--users", "0"], "--users"),
    ):
        res = CliRunner().invoke(app, ["audit", *args, "--out", str(tmp_path / "bad")])
        assert res.exit_code == 2, res.output
        assert flag in res.output


def test_wrapper_audits_a_users_strategy_in_simulation(tmp_path, monkeypatch):
    """DifferentialPrivacyCorrelatedNoise(..., canaries=N) around FedAvg on a simulation grid:
    canary SuperNodes join the grid, the run is accounted with them, and the audit lands beside the
    privacy report."""
    from flwr.app import ArrayRecord, ConfigRecord
    from flwr.serverapp.strategy import FedAvg

    from corrflow.clients.tasks import get_task
    from corrflow.server.inprocess import InProcessGrid
    from corrflow.strategies.wrapper import DifferentialPrivacyCorrelatedNoise

    monkeypatch.setattr("corrflow.run.noise.new_secret", lambda: bytes(16))
    task = get_task("nextword", seed=0)
    strategy = DifferentialPrivacyCorrelatedNoise(
        FedAvg(fraction_evaluate=0.0),
        clipping_norm=1.0,
        target_epsilon=1.0,
        delta=DELTA,
        epochs=2,
        kind="dpsgd",
        num_users=48,
        state_dir=str(tmp_path / "w"),
        canaries=100,
        audit_seed=3,
    )
    strategy.start(
        grid=InProcessGrid(task.handlers, 48),
        initial_arrays=ArrayRecord(task.initial_weights()),
        num_rounds=8,
        train_config=ConfigRecord({"local-lr": 2.0, "local-steps": 1, "seed": 0}),
    )
    audit = strategy.audit
    assert audit["epsilon_claimed"] == pytest.approx(1.0, abs=0.01)
    assert audit["epsilon_lower"] <= audit["epsilon_claimed"]
    assert 0.7 < audit["statistics"]["whitened"]["null_std"] < 1.3
    report = strategy.privacy_report()
    users = participation_users(report, strategy.run_dir)
    assert len(users) == 48 + audit["canaries"]["inserted"]
    assert (tmp_path / "w" / "audit.json").exists() and (tmp_path / "w" / "audit.png").exists()
    with pytest.raises(Exception, match="canaries"):
        DifferentialPrivacyCorrelatedNoise(FedAvg(), clipping_norm=1.0, canaries=5)


def test_wrapper_canaries_refused_outside_simulation(tmp_path):
    from flwr.app import ArrayRecord
    from flwr.serverapp.strategy import FedAvg

    from corrflow.clients.tasks import get_task
    from corrflow.errors import InvalidArgumentError
    from corrflow.server.inprocess import InProcessGrid
    from corrflow.strategies.wrapper import DifferentialPrivacyCorrelatedNoise

    # any grid that is not a simulation engine's: node-key identities
    class DeviceGrid(InProcessGrid):
        pass

    task = get_task("nextword", seed=0)
    strategy = DifferentialPrivacyCorrelatedNoise(
        FedAvg(fraction_evaluate=0.0),
        clipping_norm=1.0,
        epochs=2,
        num_users=8,
        state_dir=str(tmp_path / "d"),
        canaries=40,
    )
    with pytest.raises(InvalidArgumentError, match="canaries"):
        strategy.start(
            grid=DeviceGrid(task.handlers, 8),
            initial_arrays=ArrayRecord(task.initial_weights()),
            num_rounds=4,
        )


def test_amplified_run_is_audited_without_its_secret_cohorts(tmp_path):
    """Cyclic-Poisson sampling with the amplified ε (001 Prop. 2.1): the cohorts are secret, so
    every canary is scored over all rounds; a correct run stays below its (smaller) amplified
    claim."""
    cfg = _config("toeplitz", tmp_path / "amp").replace(
        participation="cyclic-poisson", accountant="cyclic-poisson", min_sep=4
    )
    res = run_audit(cfg, 100, audit_seed=3, noise_key=bytes(16), quiet=True, plot=False)
    assert res["run"]["participation"] == "cyclic-poisson"
    assert res["canaries"]["rounds"].startswith("every round")
    assert res["epsilon_claimed"] == pytest.approx(1.0, abs=0.01)
    assert res["epsilon_lower"] <= res["epsilon_claimed"]
    assert 0.7 < res["statistics"]["whitened"]["null_std"] < 1.3


def test_candidates_for_ceiling_lifts_the_ceiling_above_the_claim():
    """The count returned is the first grid point whose ceiling exceeds the claim; at δ = 1e-5 the
    ceiling peaks below 8 (200 canaries cap ε_lo at 3.80), so no count proves ε = 8."""
    from corrflow.accounting.audit import candidates_for_ceiling, lower_bound_ceiling

    assert abs(lower_bound_ceiling(200, delta=1e-5) - 3.80) < 0.01
    m = candidates_for_ceiling(5.0, 1e-5)
    assert m is not None and lower_bound_ceiling(m, delta=1e-5) > 5.0
    assert lower_bound_ceiling(m // 2, delta=1e-5) <= 5.0
    assert candidates_for_ceiling(8.0, 1e-5, largest=10**6) is None


def test_consistent_verdict_explains_an_estimate_above_the_claim():
    """ε̂ = 1.04 over a claim of 1 is still consistent when the interval starts below the claim
    and the lower bound is within it; the verdict says so instead of a bare "consistent"."""
    from corrflow.strategies.canaries import _verdict

    est = st.Estimate(1.04, (0.61, 1.52), 2.0, 1.0, 0.0, 1.0)
    lower = st.LowerBound(0.21, 0.95, 200, 10, 10, 19, (0.05,), "test")
    text = _verdict(1.0, est, lower)
    assert text.startswith("consistent: the estimate ε̂ = 1.04 is above the claimed ε = 1")
    assert "interval starts at 0.61" in text and "ε_lo = 0.21" in text
    below = _verdict(1.0, st.Estimate(0.8, (0.4, 1.2), 2.0, 1.0, 0.0, 1.0), lower)
    assert below.startswith("consistent: nothing shown above the claimed ε = 1")
    assert _verdict(1.0, st.Estimate(1.6, (1.1, 2.0), 2.0, 1.0, 0.0, 1.0), lower).startswith(
        "SUSPECT"
    )


def test_cohort_engine_audits_the_same_run(tmp_path):
    """--backend cohort trains the real users together and lets the canaries answer beside them:
    the same released models as the per-client path (within the engines' 1e-5), so the same
    audit."""
    per_client = _audit("dpsgd", tmp_path / "inprocess", plot=False)
    cohort = _audit("dpsgd", tmp_path / "cohort", plot=False, backend="cohort")
    assert cohort["canaries"] == per_client["canaries"]
    assert cohort["epsilon_claimed"] == per_client["epsilon_claimed"]
    for key in ("epsilon_estimate", "epsilon_lower"):
        assert cohort[key] == pytest.approx(per_client[key], rel=1e-3, abs=1e-3)
    w, v = cohort["statistics"]["whitened"], per_client["statistics"]["whitened"]
    assert w["null_mean"] == pytest.approx(v["null_mean"], abs=1e-3)


def test_audit_refuses_an_engine_it_cannot_train_on(tmp_path):
    from corrflow.server.cli import app

    for args, flag in (
        (["--backend", "flower"], "--backend"),
        (["--backend", "cohort", "--client", "keras"], "--client"),
    ):
        out = tmp_path / "bad"
        res = CliRunner().invoke(app, ["audit", "--canaries", "100", *args, "--out", str(out)])
        assert res.exit_code == 2, res.output
        assert flag in res.output
        assert not out.exists()
