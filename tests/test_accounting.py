import json
import math
import subprocess
import sys

import dp_accounting as dpa
import numpy as np
import pytest
from scipy.stats import binom, norm

from corrflow.accounting import (
    SamplingSpec,
    account,
    calibrate_on_grid,
    epsilon_of,
    unamplified_event,
)
from corrflow.accounting.mechanisms import CyclicPoisson
from corrflow.accounting.montecarlo import (
    MonteCarloAccountant,
    bernoulli_kl,
    log_likelihood_ratio,
    minimum_samples,
    sample_participations,
)
from corrflow.accounting.participation import ParticipationSummary, user_entry
from corrflow.accounting.posthoc import pattern_sensitivity, realized_sensitivity
from corrflow.accounting.report import (
    hash_user_id,
    participation_section,
    privacy_report,
    write_report,
)
from corrflow.errors import InvalidArgumentError
from corrflow.factorization import Participation, factorize, participation_for
from corrflow.factorization.encoders import DenseEncoder
from corrflow.factorization.sensitivity import brute_force_sensitivity


def band_of(c, n):
    return np.array([[c[k] if i + k < n else 0.0 for k in range(len(c))] for i in range(n)])


@pytest.mark.parametrize("z, eps", [(0.341, 17.648), (0.600, 8.841), (2.231, 2.000)])
def test_table3_mf_column(z, eps):
    # 000 Table 3, MF column: one Gaussian at δ = 1e-6 (digest recomputation 17.6476, 8.8405,
    # 1.9995).
    got = epsilon_of(unamplified_event(z), 1e-6)
    assert got == pytest.approx(eps, abs=1.5e-3)
    # analytic Gaussian (Balle–Wang)
    assert got == pytest.approx(dpa.get_epsilon_gaussian(z, 1e-6), rel=1e-3)


def test_calibration_returns_smallest_grid_sigma():
    target, delta = 2.0, 1e-6
    sigma, eps = calibrate_on_grid(lambda s: dpa.get_epsilon_gaussian(s, delta), target, guess=1.0)
    assert eps <= target < dpa.get_epsilon_gaussian(sigma / 1.001, delta)
    assert sigma == pytest.approx(2.231, abs=3e-3)  # 000 Table 3
    fac = factorize("dpsgd", participation_for(8, 1))
    res = account(fac, delta=delta, target_epsilon=target)
    assert (
        res["epsilon"]
        <= target
        < epsilon_of(unamplified_event(res["noise_multiplier"] / 1.001), delta)
    )


def test_cyclic_poisson_equals_reduced_dpsgd():
    # 001 Prop. 2.1: n = 64 rounds, 8 bands, cycle = min-sep 16, N = 16000, B = 100 → q = 0.1, 4
    # compositions.
    fac = factorize("toeplitz", participation_for(64, 4, 16, kind="min-sep"), bands=8)
    res = account(
        fac, delta=1e-5, noise_multiplier=1.3, sampling=SamplingSpec("cyclic-poisson", 16000, 100)
    )
    col = np.linalg.norm(fac.encoder.matrix(), axis=0).max()
    independent = (
        dpa.pld.PLDAccountant()
        .compose(
            dpa.SelfComposedDpEvent(
                dpa.PoissonSampledDpEvent(16 * 100 / 16000, dpa.GaussianDpEvent(1.3 / col)),
                64 // 16,
            )
        )
        .get_epsilon(1e-5)
    )
    assert res["epsilon"] == pytest.approx(independent, rel=1e-9)
    assert res["accountant"]["compositions"] == 4 and res["accountant"][
        "sampling_probability"
    ] == pytest.approx(0.1)


def _brute_llr(y, c, sigma, b, p, warm, k_u=1):
    """ln P(y)/Q(y) by enumerating every participation vector of the b-min-sep chain (004 §1.5,
    §6.2)."""
    n = len(y)
    C = np.zeros((n, n))
    for j in range(n):
        for k, v in enumerate(c):
            if j + k < n:
                C[j + k, j] = v
    starts = (
        [(0, 1 / (1 + (b - 1) * p))] + [(s, p / (1 + (b - 1) * p)) for s in range(1, b)]
        if warm
        else [(0, 1)]
    )
    total = 0.0
    for s0, w0 in starts:

        def rec(i, avail_at, prob, x):  # prob starts at the initial state's weight
            nonlocal total
            if i == n:
                mean = C @ np.array(x, dtype=float)
                total += prob * np.exp((2 * mean @ y - mean @ mean) / (2 * sigma**2))
                return
            if i < avail_at:
                rec(i + 1, avail_at, prob, x + [0])
                return
            for j in range(k_u + 1):
                pj = binom.pmf(j, k_u, p)
                rec(i + 1, i + b if j else avail_at, prob * pj, x + [j])

        rec(0, s0, w0, [])
    return math.log(total)


@pytest.mark.parametrize(
    "y, c, warm, expected",
    [
        ((1, 1, 1), [1], False, 0.6070560625306676),
        ((1, 1, 1), [1, 0.5], False, 0.9239798890121712),
        ((1, 1, 1), [1, 0.5], True, 0.8329398380809252),
        ((0, 1, 1), [1, 0.5], False, 0.4155349444473233),
    ],
)
def test_004_check_values_small(y, c, warm, expected):
    # 004 digest §6.2 (b = 2, n = 3, p = 0.5, σ = 1), from the reference tests; also brute force.
    y = np.array(y, dtype=float)
    got = log_likelihood_ratio(y[:, None], band_of(c, 3), 1.0, 2, 0.5, warm)[0]
    assert got == pytest.approx(expected, abs=1e-12)
    assert _brute_llr(y, c, 1.0, 2, 0.5, warm) == pytest.approx(expected, abs=1e-12)


C3 = np.array([1, 0.5, 0.375]) / np.linalg.norm([1, 0.5, 0.375])
Y6 = np.array([0.5, -0.2, 1.0, 0.3, 0.0, 0.7])


@pytest.mark.parametrize(
    "c, b, warm, k_u, expected",
    [
        (C3, 3, False, 1, 0.226573576859),
        (C3, 3, True, 1, 0.248850846530),
        (C3, 3, False, 2, 0.017281323705),
        (C3, 3, False, 3, -0.322359365629),
        (np.array([1, 0.5]) / np.linalg.norm([1, 0.5]), 3, False, 1, 0.060087549851),
        (np.array([1.0]), 1, False, 1, -0.075589681233),
    ],
)
def test_004_check_values_multi_attribution(c, b, warm, k_u, expected):
    # 004 digest §6.2 (n = 6, p = 0.3, σ = 0.8), brute force agrees.
    got = log_likelihood_ratio(Y6[:, None], band_of(c, 6), 0.8, b, 0.3, warm, k_u)[0]
    assert got == pytest.approx(expected, abs=1e-10)
    assert _brute_llr(Y6, c, 0.8, b, 0.3, warm, k_u) == pytest.approx(expected, abs=1e-10)


def test_llr_float32_and_batch_agree(rng):
    y = rng.normal(size=(12, 50))
    band = band_of(C3, 12)
    a = log_likelihood_ratio(y, band, 0.7, 4, 0.2, True)
    b = log_likelihood_ratio(y.astype(np.float32), band, 0.7, 4, 0.2, True)
    np.testing.assert_allclose(a, b, atol=2e-5)
    assert log_likelihood_ratio(y[:, :7], band, 0.7, 4, 0.2, True) == pytest.approx(
        a[:7], abs=1e-12
    )


def test_monte_carlo_matches_exact_poisson():
    # b = 1, c = [1] is Poisson DP-SGD: its exact δ(ε) (PLD) must lie within the Monte Carlo
    # confidence interval.
    mc = MonteCarloAccountant(band_of([1.0], 100), 1, 0.05, warm=False)
    est = mc.sample_losses(1.0, 120_000, seed=3, workers=1)
    exact = dpa.pld.PLDAccountant().compose(
        dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.05, dpa.GaussianDpEvent(1.0)), 100)
    )
    for eps in (0.5, 1.0, 2.0):
        d, se = est.delta(eps)
        assert abs(d - exact.get_delta(eps)) <= 4 * se, (eps, d, exact.get_delta(eps), se)
    exact_eps = exact.get_epsilon(1e-2)
    lo, hi = est.epsilon(1e-2, z=-4), est.epsilon(1e-2, z=4)
    assert lo <= exact_eps <= hi


def test_sampler_rates_and_separation(rng):
    # 004 §1.5: gaps ≥ b, and the participation rate of the stationary chain is p0 with 1/p0 = 1/p +
    # (b − 1).
    n, b, p = 4000, 8, 0.05
    rows, pos, _ = sample_participations(3000, n, b, p, rng, warm=True)
    order = np.lexsort((pos, rows))
    r, q = rows[order], pos[order]
    same = r[1:] == r[:-1]
    assert np.all(np.diff(q)[same] >= b)
    p0 = 1 / (1 / p + b - 1)
    assert len(pos) / (3000 * n) == pytest.approx(p0, rel=0.02)


def test_evr_bounds():
    # 004 digest §6.5 (reference tests): exp(−s·KL(δ'‖τδ')) and the sample count for δ_t = 1e-3.
    for s, tau, d, expected in [
        (3, 2, 1 / 3, 1 / 2),
        (6, 2, 1 / 3, 1 / 4),
        (2, 3, 1 / 4, 1 / 3),
        (4, 3, 1 / 4, 1 / 9),
    ]:
        assert math.exp(-s * bernoulli_kl(d, tau * d)) == pytest.approx(expected, rel=1e-12)
    assert minimum_samples(0.5e-3, 1e-3) == 75_013


def test_bminsep_beats_unamplified_and_calibrates(rng):
    fac = factorize("toeplitz", participation_for(48, 4, 12, kind="min-sep"), bands=4)
    spec = SamplingSpec("bminsep", 48_000, 400)
    res = account(fac, delta=1e-3, noise_multiplier=1.0, sampling=spec, seed=1)
    unamp = account(fac, delta=1e-3, noise_multiplier=1.0)["epsilon"]
    acc = res["accountant"]
    # The pair printed is verified at the target δ: EVR's failure budget is inside it.
    assert acc["verification_passed"] and res["delta"] == 1e-3 and res["guarantee"] is True
    assert acc["selected"] == "monte-carlo" and {b["accountant"] for b in acc["bounds"]} == {
        "monte-carlo",
        "unamplified",
    }
    assert acc["slack"] == pytest.approx(acc["verifier_failure_budget"]) == pytest.approx(5e-5)
    assert acc["epsilon_estimate"] < res["epsilon"]
    assert res["epsilon"] < unamp
    cal = account(fac, delta=1e-3, target_epsilon=3.0, sampling=spec, mc_samples=20_000, seed=2)
    acc = cal["accountant"]
    assert cal["noise_multiplier"] <= acc["fallback_noise_multiplier"] and cal["guarantee"] is True
    # 20 000 samples per candidate verify only δ = overall_delta > 1e-3: the fallback σ is released,
    # named.
    assert (
        acc["released"] == "fallback"
        and cal["noise_multiplier"] == acc["fallback_noise_multiplier"]
    )
    assert acc["monte_carlo_noise_multiplier"] < acc["fallback_noise_multiplier"]
    ok = account(
        fac,
        delta=1e-3,
        target_epsilon=3.0,
        sampling=spec,
        mc_samples=20_000,
        seed=2,
        verify_target=True,
        max_candidates=2,
    )
    assert ok["guarantee"] is True and ok["delta"] == 1e-3
    assert ok["noise_multiplier"] < ok["accountant"]["fallback_noise_multiplier"]


def test_multi_attribution_monte_carlo():
    """004 Thm 6.1 through ``account``: more items per user cost more ε at the same σ; every run
    stays below the unamplified ε of its k_u-fold sensitivity; calibration never exceeds that
    fallback σ."""
    fac = factorize("toeplitz", participation_for(48, 4, 12, kind="min-sep"), bands=4)
    eps = {}
    for k_u in (1, 2):
        spec = SamplingSpec("multi-attribution", 48_000, 400, items_per_user=k_u)
        res = account(fac, delta=1e-2, noise_multiplier=2.0, sampling=spec, seed=1)
        acc = res["accountant"]
        assert acc["items_per_user"] == k_u and acc["warm_start"] is False
        eps[k_u] = res["epsilon"]
        unamplified = account(fac, delta=1e-2, noise_multiplier=2.0 / k_u)["epsilon"]
        assert eps[k_u] < unamplified
    assert eps[2] > eps[1]
    cal = account(
        fac,
        delta=1e-3,
        target_epsilon=3.0,
        mc_samples=5_000,
        seed=2,
        max_candidates=8,
        sampling=SamplingSpec("multi-attribution", 48_000, 400, items_per_user=2),
    )
    fallback = cal["accountant"]["fallback_noise_multiplier"]
    assert fallback == pytest.approx(
        2 * account(fac, delta=1e-3, target_epsilon=3.0)["noise_multiplier"], rel=2e-3
    )
    assert cal["noise_multiplier"] <= fallback
    with pytest.raises(InvalidArgumentError, match="items_per_user"):
        SamplingSpec("bminsep", 100, 10, items_per_user=2)


def test_balls_in_bins_equals_warm_bminsep_p1():
    fac = factorize("toeplitz", participation_for(32, 4, 8, kind="min-sep"), bands=4)
    res = account(
        fac,
        delta=1e-3,
        noise_multiplier=1.0,
        seed=5,
        sampling=SamplingSpec("balls-in-bins", 800, 100, accountant="monte-carlo"),
    )
    assert res["accountant"]["min_sep"] == 8 and res["accountant"]["sampling_probability"] == 1.0


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(delta=0.0, noise_multiplier=1.0), "delta"),
        (dict(delta=1.0, noise_multiplier=1.0), "delta"),
        (dict(delta=1e-5, target_epsilon=0.0), "target_epsilon"),
        (dict(delta=1e-5, noise_multiplier=-1.0), "noise_multiplier"),
        (dict(delta=1e-5), "noise_multiplier"),
        (dict(delta=1e-5, noise_multiplier=1.0, sampling=SamplingSpec("none")), None),
    ],
)
def test_bad_accounting_input(kwargs, field):
    fac = factorize("toeplitz", participation_for(16, 2))
    if field is None:
        assert account(fac, **kwargs)["epsilon"] > 0
        return
    with pytest.raises(InvalidArgumentError) as e:
        account(fac, **kwargs)
    assert e.value.field == field


def test_bad_sampling_input():
    with pytest.raises(InvalidArgumentError, match="dataset_size"):
        SamplingSpec("bminsep")
    with pytest.raises(InvalidArgumentError, match="expected_batch_size"):
        SamplingSpec("cyclic-poisson", 100)
    dense = factorize("dense", participation_for(16, 2))
    with pytest.raises(InvalidArgumentError, match="banded encoder"):
        account(
            dense,
            delta=1e-5,
            noise_multiplier=1.0,
            sampling=SamplingSpec("bminsep", 1000, 10, accountant="monte-carlo"),
        )
    # With no accountant named, a dense encoder gets the bound that applies (unamplified, ⌈n/b⌉
    # participations).
    res = account(
        dense, delta=1e-5, noise_multiplier=1.0, sampling=SamplingSpec("bminsep", 1000, 10)
    )
    assert res["guarantee"] and res["accountant"]["selected"] == "unamplified"
    assert res["accountant"]["skipped"][0]["accountant"] == "monte-carlo"
    # still banded; make C negative by hand below
    neg = factorize("bsr", participation_for(16, 2), gamma=0.9)
    band = -neg.encoder.band_array()
    with pytest.raises(InvalidArgumentError, match="non-negative"):
        MonteCarloAccountant(band, 8, 0.1)
    with pytest.raises(InvalidArgumentError, match="bands"):
        MonteCarloAccountant(np.ones((16, 4)), 2, 0.1)
    with pytest.raises(InvalidArgumentError, match="expected_batch_size"):
        CyclicPoisson(16, 8, 100, 50)


def test_posthoc_sensitivity_matches_brute_force(rng):
    C = np.tril(rng.uniform(-0.3, 1, (10, 10))) + np.eye(10)
    enc = DenseEncoder(C)
    for pattern in ([0, 3, 7], [1, 2], [4], [0, 2, 4, 6, 8]):
        s = pattern_sensitivity(enc, pattern)
        brute = brute_force_sensitivity(
            C[:, pattern], Participation.fixed_epoch(len(pattern), len(pattern))
        )
        if s.exact:
            assert s.value == pytest.approx(brute, rel=1e-12)
        else:
            assert s.value >= brute * (1 - 1e-12)


def test_posthoc_early_return_raises_epsilon():
    # fixed-epoch b = 8, bands 8: planned sensitivity 1
    fac = factorize("toeplitz", participation_for(32, 4))
    planned = account(fac, delta=1e-6, noise_multiplier=3.0)["epsilon"]
    on_plan = {"a": [0, 8, 16, 24], "b": [3, 11, 19, 27]}
    s, _ = realized_sensitivity(fac.encoder, on_plan)
    assert s.exact and s.value == pytest.approx(1.0)
    early = dict(on_plan, c=[5, 9, 17, 25])  # came back 4 rounds early once
    s2, worst = realized_sensitivity(fac.encoder, early)
    assert worst == "c" and s2.value > 1.0
    realized = epsilon_of(unamplified_event(3.0, s2.value), 1e-6)
    assert realized > planned
    C = fac.encoder.matrix()
    assert s2.value == pytest.approx(np.linalg.norm(C[:, [5, 9, 17, 25]].sum(axis=1)), rel=1e-12)


def test_report_schema_and_hashing(tmp_path):
    fac = factorize("toeplitz", participation_for(16, 2))
    salt = b"s" * 16
    entries = [
        user_entry(hash_user_id(u, salt), rs)
        for u, rs in {"partition-0": [8, 0], "partition-1": [1, 9, 9]}.items()
    ]
    store = {"store": "participation.sqlite", "table": "users", "rows": 2, "digest": "0" * 64}
    part = participation_section(ParticipationSummary.of(entries), store, policy="reject")
    rep = privacy_report(
        factorization=fac,
        noise_multiplier=1.0,
        clip_norm=0.5,
        delta=1e-5,
        target_epsilon=4.0,
        accountant={"name": "pld", "sampling": "none", "slack": 0.0},
        planned={"sensitivity": 1.0, "epsilon": 3.0, "participation": {}},
        realized={
            "sensitivity": 1.0,
            "sensitivity_exact": True,
            "epsilon": 3.0,
            "participation": part,
        },
        rounds_completed=16,
    )
    path = write_report(rep, tmp_path / "privacy_report.json")
    back = json.loads(path.read_text())
    assert set(back) >= {
        "mechanism",
        "noise_multiplier",
        "clip_norm",
        "delta",
        "target_epsilon",
        "accountant",
        "planned",
        "realized",
        "rounds_completed",
    }
    assert set(back["mechanism"]) >= {
        "kind",
        "rounds",
        "epochs",
        "min_sep",
        "bands",
        "workload",
        "factorization_sha256",
    }
    part = back["realized"]["participation"]
    assert "partition-0" not in path.read_text() and hash_user_id("partition-0", salt) not in str(
        back
    )  # each user's entry is the store's, never the report's
    assert entries[0].rounds == (0, 8) and entries[1].min_gap == 8  # equal rounds make no gap
    assert (part["min_gap"], part["max_participations"], part["user_count"]) == (8, 3, 2)
    assert part["participations"] == {"2": 1, "3": 1} and part["per_user"] == store
    assert part["min_gap_quantiles"] == {"p0": 8, "p10": 8, "p50": 8, "p90": 8, "p100": 8}
    assert back["delta"] == 1e-5 and back["guarantee"] is True
    # A Monte Carlo accountant that verified only a larger δ: the report's δ is that one, with
    # guarantee false.
    mc = privacy_report(
        factorization=fac,
        noise_multiplier=1.0,
        clip_norm=0.5,
        delta=1e-5,
        target_epsilon=None,
        accountant={"name": "monte-carlo", "delta": 1.47e-4, "guarantee": False},
        planned={},
        realized={},
        rounds_completed=16,
    )
    assert mc["delta"] == 1.47e-4 and mc["target_delta"] == 1e-5 and mc["guarantee"] is False


def test_cli_account(tmp_path):
    path = factorize("toeplitz", participation_for(16, 2)).save(tmp_path / "f.npz")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "corrflow.server.cli",
            "account",
            "--factorization",
            str(path),
            "--delta",
            "1e-6",
            "--noise-multiplier",
            "0.6",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    obj = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(obj) >= {
        "epsilon",
        "delta",
        "noise_multiplier",
        "sensitivity",
        "sampling",
        "accountant",
    }
    assert obj["epsilon"] == pytest.approx(8.8405, abs=2e-3)  # 000 Table 3
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "corrflow.server.cli",
            "account",
            "--factorization",
            str(path),
            "--delta",
            "1e-6",
            "--noise-multiplier",
            "1",
            "--participation",
            "bminsep",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "--dataset-size" in bad.stderr


def test_gaussian_closed_form_consistency():
    # Balle–Wang: δ(ε) = Φ(−εz + 1/(2z)) − e^ε Φ(−εz − 1/(2z)) for one Gaussian (000 digest §6).
    z, eps = 0.6, 8.8405
    delta = norm.cdf(-eps * z + 1 / (2 * z)) - math.exp(eps) * norm.cdf(-eps * z - 1 / (2 * z))
    assert delta == pytest.approx(1e-6, rel=2e-3)


def _forward_llr(y, C, sigma, b, p, warm):
    """ln P(y)/Q(y) for 004's b-min-sep chain by the forward algorithm over the hidden state d =
    rounds since the last participation (capped at b), written from the sampler's definition and the
    dense C — independent of the library's backward recursion and band layout."""
    n = len(y)
    alpha = np.zeros(b + 1)
    # stationary start: available w.p. 1/(1 + (b−1)p), else barred for U{1..b−1} more rounds
    if warm:
        alpha[b] = 1.0 / (1.0 + (b - 1) * p)
        if b > 1:
            alpha[: b - 1] = (1.0 - alpha[b]) / (b - 1)
    else:
        alpha[b] = 1.0
    for i in range(n):
        new = np.zeros(b + 1)
        for d, a in enumerate(alpha):
            if d + 1 >= b:
                new[0] += a * p
                new[b] += a * (1 - p)
            else:
                new[d + 1] += a
        for d in range(b):
            j = i - d
            mu = C[i, j] if j >= 0 else 0.0
            new[d] *= math.exp((2 * y[i] * mu - mu * mu) / (2 * sigma**2))
        alpha = new
    return math.log(alpha.sum())


@pytest.mark.parametrize("warm", [False, True])
def test_monte_carlo_band_is_cut_at_round_n(warm, rng):
    # A Toeplitz encoder's band layout repeats θ past row n; with bands close to n the late
    # columns' squared norms must count only the rows that exist (0.125 rather than 0.238 for the
    # 5-band encoder over 7 rounds below).
    from corrflow.factorization.encoders import ToeplitzEncoder

    n, b, p, sigma = 7, 5, 0.3, 0.9
    enc = ToeplitzEncoder([1.0, 0.6, 0.4, 0.3, 0.2], n)
    C = enc.matrix()
    ys = rng.normal(scale=1.2, size=(n, 6)) + C[:, [n - 1]]
    got = log_likelihood_ratio(ys, enc.band_array(), sigma, b, p, warm)
    want = [_forward_llr(ys[:, s], C, sigma, b, p, warm) for s in range(ys.shape[1])]
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)
    mc = MonteCarloAccountant(enc.band_array(), b, p, warm=warm)
    np.testing.assert_allclose(
        np.sqrt((mc.band**2).sum(axis=1)), np.linalg.norm(C, axis=0), rtol=1e-12
    )


# --- exact Gaussian curve (Balle & Wang 2018, arXiv 1805.06530) and few-probe calibration ---


def _mp_delta(eps, mu):
    """δ(ε) of the Gaussian mechanism in 60-digit arithmetic: an independent evaluation of Balle &
    Wang Thm. 8."""
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 60
    eps, mu = mpmath.mpf(eps), mpmath.mpf(mu)
    return mpmath.ncdf(mu / 2 - eps / mu) - mpmath.exp(eps) * mpmath.ncdf(-mu / 2 - eps / mu)


@pytest.mark.parametrize(
    "sigma, sens, delta",
    [
        (0.341, 1.0, 1e-6),
        (0.6, 1.0, 1e-5),
        (2.231, 1.0, 1e-6),
        (300.0, 1.0, 1e-6),
        (1.7, 2.0, 1e-8),
        (25.0, 1.0, 1e-5),
    ],
)
def test_exact_gaussian_epsilon_is_a_tight_upper_bound(sigma, sens, delta):
    from corrflow.accounting.mechanisms import gaussian_epsilon

    eps = gaussian_epsilon(sigma, sens, delta)
    # a verified bound: δ(ε) ≤ δ in high precision, and ε is the root to ~1e-9 relative (δ just
    # below is violated)
    assert _mp_delta(eps, sens / sigma) <= delta
    assert _mp_delta(eps * (1 - 1e-7), sens / sigma) > delta
    # dp-accounting's PLD is pessimistic: never below the exact value, above it by its
    # discretisation only
    pld = float(
        dpa.pld.PLDAccountant(value_discretization_interval=1e-4)
        .compose(dpa.GaussianDpEvent(sigma / sens))
        .get_epsilon(delta)
    )
    assert eps <= pld <= eps + 2e-3
    assert eps == pytest.approx(dpa.get_epsilon_gaussian(sigma / sens, delta), rel=1e-9)


def test_unamplified_sigma_is_exact_and_at_most_the_pld_grid_sigma():
    fac = factorize("toeplitz", participation_for(24, 3), bands=8)
    res = account(fac, delta=1e-6, target_epsilon=8.0)
    sigma, sens = res["noise_multiplier"], fac.sensitivity.value
    assert res["accountant"]["name"] == "unamplified" and res["epsilon"] <= 8.0
    assert _mp_delta(8.0, sens / sigma) <= 1e-6 < _mp_delta(8.0, sens / (sigma * (1 - 1e-7)))
    # the PLD path this replaced: the smallest σ on the 1.001 grid whose PLD ε meets the target (a
    # 1e-3 discretisation finds the same grid point here as 1e-4, at a tenth of the CPU)
    pld_sigma, _ = calibrate_on_grid(
        lambda s: float(
            dpa.pld.PLDAccountant(value_discretization_interval=1e-3)
            .compose(dpa.GaussianDpEvent(s / sens))
            .get_epsilon(1e-6)
        ),
        8.0,
        guess=sigma,
    )
    assert sigma <= pld_sigma <= sigma * 1.01
    # multi-attribution: k_u = 3 items per user triple the sensitivity, and σ with it (σ/Δ is what
    # the curve sees)
    from corrflow.accounting.mechanisms import gaussian_noise_multiplier

    assert gaussian_noise_multiplier(8.0, 1e-6, 3 * sens) == pytest.approx(3 * sigma, rel=1e-11)


def test_cyclic_poisson_calibration_few_probes_verified_and_near_minimal():
    fac = factorize("toeplitz", participation_for(64, 4, 16, kind="min-sep"), bands=8)
    spec = SamplingSpec("cyclic-poisson", 16000, 100)
    cal = account(fac, delta=1e-5, target_epsilon=2.0, sampling=spec)
    c = cal["accountant"]["calibration"]
    assert c["probes"] <= 14 and c["verifications"] <= 3
    sigma = cal["noise_multiplier"]
    # verified at full precision (independent PLD), and σ/(1 + 1e-3) no longer meets the target
    col = np.linalg.norm(fac.encoder.matrix(), axis=0).max()

    def independent(s):
        return (
            dpa.pld.PLDAccountant()
            .compose(
                dpa.SelfComposedDpEvent(
                    dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(s / col)), 4
                )
            )
            .get_epsilon(1e-5)
        )

    assert cal["epsilon"] == pytest.approx(independent(sigma), rel=1e-9) and cal["epsilon"] <= 2.0
    assert independent(sigma / 1.001) > 2.0


def test_cyclic_poisson_at_q1_is_the_exact_composed_gaussian():
    # cycle·B/N = 1: no amplification; ⌈n/b⌉ Gaussians of σ/col compose to one with sensitivity
    # √⌈n/b⌉·col
    fac = factorize("toeplitz", participation_for(20, 2, 10, kind="min-sep"), bands=10)
    res = account(
        fac, delta=1e-5, noise_multiplier=0.9, sampling=SamplingSpec("cyclic-poisson", 100, 10)
    )
    col = float(np.linalg.norm(fac.encoder.matrix(), axis=0).max())
    pld = (
        dpa.pld.PLDAccountant()
        .compose(
            dpa.SelfComposedDpEvent(
                dpa.PoissonSampledDpEvent(1.0, dpa.GaussianDpEvent(0.9 / col)), 2
            )
        )
        .get_epsilon(1e-5)
    )
    assert (
        res["accountant"]["name"] == "unamplified"
        and res["epsilon"] <= pld <= res["epsilon"] + 2e-3
    )
    assert _mp_delta(res["epsilon"], col * np.sqrt(2) / 0.9) <= 1e-5


def test_run_privacy_memoises_and_matches_a_fresh_computation():
    from corrflow.accounting.tracking import PrivacyPlan, RunPrivacy

    fac = factorize("toeplitz", participation_for(12, 3), bands=4)
    rp = RunPrivacy(fac, PrivacyPlan(0.8, 5.0), 1e-5)
    sel = {"a": [0, 4, 8], "b": [1, 5], "c": [2]}
    first = rp.realized(sel)
    assert rp.realized(dict(sel)) is first  # unchanged participation: no recomputation
    sel2 = {**sel, "c": [2, 6]}
    second = rp.realized(sel2)
    fresh = RunPrivacy(fac, PrivacyPlan(0.8, 5.0), 1e-5).realized(sel2)
    assert second == fresh and len(rp._pattern_cache) == 4  # a, b, c and c's new pattern
    sens, _ = realized_sensitivity(fac.encoder, sel2)
    assert second.epsilon == pytest.approx(
        dpa.get_epsilon_gaussian(0.8 / sens.value, 1e-5), rel=1e-9
    )


def test_the_array_path_of_gaussian_plds_gives_dp_accountings_bits():
    """`pld_speed` installs only where its δ(ε) grid equals dp-accounting's bit for bit; then ε of
    a subsampled and a plain Gaussian composition is the same float as with dp-accounting's own
    method (an independent PLD built with the original method restored)."""
    import dp_accounting as dpa
    from dp_accounting.pld.privacy_loss_mechanism import GaussianPrivacyLoss

    from corrflow.accounting import pld_speed

    assert pld_speed.install() and pld_speed._agrees()
    events = [
        dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.05, dpa.GaussianDpEvent(0.9)), 20),
        dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(2.0), 5),
    ]

    def eps(event):
        return dpa.pld.PLDAccountant(value_discretization_interval=1e-3).compose(event)

    fast = [eps(e).get_epsilon(1e-5) for e in events]
    patched = GaussianPrivacyLoss.get_delta_for_epsilon
    try:
        GaussianPrivacyLoss.get_delta_for_epsilon = pld_speed._ORIGINAL
        slow = [eps(e).get_epsilon(1e-5) for e in events]
    finally:
        GaussianPrivacyLoss.get_delta_for_epsilon = patched
    assert fast == slow and all(0 < e < 50 for e in fast)
