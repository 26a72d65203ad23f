"""MMCC / Generalized-MMCC (002) against DP-SGD, the cyclic Poisson reduction, an independent
reference, and its monotonicity; the accountant interface; Monte Carlo's verify-target mode."""

import json
import subprocess
import sys

import dp_accounting as dpa
import numpy as np
import pytest

from corrflow.accounting import (
    Accountant,
    AccountingResult,
    SamplingSpec,
    account,
    accountant_for,
    epsilon_of,
    unamplified_event,
)
from corrflow.accounting.mmcc import block_problem, mmcc_epsilon, row_pmf, tail_bounds
from corrflow.errors import InvalidArgumentError
from corrflow.factorization import factorize, participation_for


def toeplitz(coef, n):
    coef = np.asarray(coef, dtype=float)
    return sum(np.diag(np.full(n - k, coef[k]), -k) for k in range(len(coef)))


C4 = np.array([1, 0.5, 0.25, 0.125]) / np.linalg.norm([1, 0.5, 0.25, 0.125])


def test_identity_equals_dpsgd():
    # 002 App. F.5: n = 128, p = 1/128, σ = 1, δ = 1e-6 → DP-SGD composition ε = 0.806.
    fac = factorize("dpsgd", participation_for(128, 1))  # C = I: sensitivity 1 per participation
    res = account(
        fac, delta=1e-6, noise_multiplier=1.0, sampling=SamplingSpec("poisson", 12_800, 100)
    )
    dpsgd = (
        dpa.pld.PLDAccountant()
        .compose(
            dpa.SelfComposedDpEvent(
                dpa.PoissonSampledDpEvent(1 / 128, dpa.GaussianDpEvent(1.0)), 128
            )
        )
        .get_epsilon(1e-6)
    )
    assert dpsgd == pytest.approx(0.806396, abs=1e-6)
    assert res["epsilon"] == pytest.approx(dpsgd, rel=1e-3) and res["epsilon"] >= dpsgd - 1e-6
    acc = res["accountant"]
    assert acc["name"] == "mmcc" and acc["tail_bound_pairs"] == 0 and acc["delta_pld"] == 1e-6
    assert (
        acc["distinct_rows"] == 1
        and acc["rows"] == 128
        and res["delta"] == 1e-6
        and res["guarantee"]
    )


def test_generalized_banded_equals_cyclic_poisson_composition():
    # Digest check 7: b = 4-banded Toeplitz, unit column norm, n = 64, p = 1/64, σ = 1 → 16 ×
    # Poisson(1/16): 2.7587.
    run = mmcc_epsilon(toeplitz(C4, 64), 4 / 64, 1.0, 1e-6, cycle=4, groups=[0])
    assert (
        run.epsilon == pytest.approx(2.758746, rel=1e-4)
        and run.delta1 == 0
        and run.distinct_rows == 1
    )
    # Through the interface: Generalized-MMCC and the 001 Prop. 2.1 accountant agree on a b-banded
    # encoder.
    fac = factorize("toeplitz", participation_for(32, 8, 4, kind="min-sep"), bands=4)
    spec = dict(kind="cyclic-poisson", dataset_size=8000, expected_batch_size=100)
    mm = account(
        fac, delta=1e-6, noise_multiplier=2.0, sampling=SamplingSpec(**spec, accountant="mmcc")
    )
    cp = account(fac, delta=1e-6, noise_multiplier=2.0, sampling=SamplingSpec(**spec))
    assert (
        mm["accountant"]["variant"].startswith("Generalized") and cp["accountant"]["name"] == "pld"
    )
    assert mm["epsilon"] == pytest.approx(cp["epsilon"], rel=2e-3)


@pytest.mark.parametrize("sigma, expected", [(8.0, 0.1445), (4.0, 0.5250)])
def test_mmcc_poisson_matches_reference(sigma, expected):
    # 002 digest §2.5 (an independent reference implementation of App. F): 4-banded Toeplitz with
    # coefficients ∝ (1, .5, .25, .125), unit column norm, n = 64, Poisson p = 1/64 in every round,
    # δ = 1e-6.
    run = mmcc_epsilon(toeplitz(C4, 64), 1 / 64, sigma, 1e-6)
    assert run.epsilon == pytest.approx(expected, rel=0.01)
    assert (
        run.delta1 == pytest.approx(5e-7) and run.tail_bound_pairs > 0 and run.max_p_tilde > 1 / 64
    )


def test_epsilon_decreases_in_sigma_and_coarser_grid_is_pessimistic():
    c = np.array([1.0, 0.5]) / np.linalg.norm([1.0, 0.5])
    C = toeplitz(c, 8)
    eps = [mmcc_epsilon(C, 1 / 8, s, 1e-6, grid=c[0] / 32).epsilon for s in (5.0, 8.0, 12.0)]
    assert eps[0] > eps[1] > eps[2]
    coarse = mmcc_epsilon(C, 1 / 8, 8.0, 1e-6, grid=c[0] / 10).epsilon
    assert coarse >= eps[1] - 1e-9


def test_tail_bounds_properties():
    # p̃ = q at the first non-zero of each column, p̃ ≥ q elsewhere, p̃ → q as σ grows (002 digest
    # §6.2).
    C = toeplitz([1.0, 0.7, 0.4], 10)
    H, Cb = block_problem(C, 0, 1)
    q = 0.1
    pt, pairs = tail_bounds(H, Cb, 1, q, 2.0, 1e-6)
    assert pairs == int((C > 0).sum()) - 10
    assert np.allclose(np.diag(pt), q) and np.all(pt[C > 0] >= q)
    far, _ = tail_bounds(H, Cb, 1, q, 1e4, 1e-6)
    assert np.all(far[C > 0] - q < 1e-3) and far[C > 0].max() < pt[C > 0].max()


def test_row_pmf_matches_brute_force():
    idx, probs = np.array([3, 1, 2]), np.array([0.2, 0.5, 0.9])
    support, masses = row_pmf(idx, probs)
    brute = {}
    for bits in range(8):
        on = [(bits >> k) & 1 for k in range(3)]
        w = np.prod([p if o else 1 - p for o, p in zip(on, probs, strict=True)])
        s = int(np.dot(on, idx))
        brute[s] = brute.get(s, 0.0) + w
    assert dict(zip(support.tolist(), masses.tolist(), strict=True)) == pytest.approx(brute)


def test_more_bands_than_cycle_is_amplified():
    # An 8-band Toeplitz encoder (non-negative, decaying) under cyclic Poisson with cycle 4: the 001
    # reduction needs bands ≤ cycle; the unamplified ε (fixed-epoch pattern k, k + 4, …: for C ≥ 0
    # the sum of those columns) ignores sampling; Generalized-MMCC amplifies at a small sampling
    # rate (002 Fig. 4's regime).
    n, b, sigma = 32, 4, 3.0
    C = toeplitz(0.7 ** np.arange(8), n)
    C /= np.linalg.norm(C[:, 0])
    sens = max(np.linalg.norm(C[:, k::b].sum(axis=1)) for k in range(b))
    unamp = epsilon_of(unamplified_event(sigma, sens), 1e-6)
    run = mmcc_epsilon(C, b * 100 / 40_000, sigma, 1e-6, cycle=b, groups=[0])
    assert run.epsilon < 0.5 * unamp and run.tail_bound_pairs > 0 and run.delta1 == 5e-7
    every = mmcc_epsilon(C, b * 100 / 40_000, sigma, 1e-6, cycle=b)  # worst over all 4 groups
    assert every.groups_analysed == 4 and every.epsilon == pytest.approx(run.epsilon, rel=1e-6)


def test_bad_input():
    neg = toeplitz([1.0, -0.3], 6)
    with pytest.raises(InvalidArgumentError, match=r"C\[1, 0\] = -0.3.*non-negative kind") as e:
        mmcc_epsilon(neg, 0.1, 1.0, 1e-6)
    assert e.value.field == "factorization"
    with pytest.raises(InvalidArgumentError) as e:
        mmcc_epsilon(np.eye(4), 1.5, 1.0, 1e-6)
    assert e.value.field == "sampling_probability"
    with pytest.raises(InvalidArgumentError) as e:
        mmcc_epsilon(toeplitz(C4, 8), 0.1, 1.0, 1e-6, grid=0.5)
    assert e.value.field == "mmcc_grid"
    with pytest.raises(InvalidArgumentError) as e:
        SamplingSpec("poisson", 100, 10, sampling_probability=0.0)
    assert e.value.field == "sampling_probability"
    with pytest.raises(InvalidArgumentError) as e:
        SamplingSpec("poisson", 100, 10, accountant="cyclic-poisson")
    assert e.value.field == "accountant"
    # A dense multi-epoch encoder (k ≥ 2) has negative entries: refused with the entry named.
    dense = factorize("dense", participation_for(8, 2))
    assert dense.encoder.matrix().min() < 0
    with pytest.raises(InvalidArgumentError, match="most negative entry"):
        account(dense, delta=1e-6, noise_multiplier=1.0, sampling=SamplingSpec("poisson", 800, 10))


def test_noise_multiplier_too_small_is_refused_before_pld():
    fac = factorize("toeplitz", participation_for(16, 2))
    for spec in (
        SamplingSpec(),
        SamplingSpec("poisson", 1600, 10),
        SamplingSpec("bminsep", 1600, 10),
    ):
        with pytest.raises(InvalidArgumentError, match="noise_multiplier: expected at least") as e:
            account(fac, delta=1e-5, noise_multiplier=1e-6, sampling=spec)
        assert e.value.field == "noise_multiplier"
    with pytest.raises(InvalidArgumentError):
        epsilon_of(unamplified_event(1e-6), 1e-5)


def test_interface_and_registry():
    for spec, name in [
        (SamplingSpec(), "unamplified"),
        (SamplingSpec("cyclic-poisson", 100, 10), "tightest"),
        (SamplingSpec("cyclic-poisson", 100, 10, accountant="cyclic-poisson"), "cyclic-poisson"),
        (SamplingSpec("cyclic-poisson", 100, 10, accountant="mmcc"), "mmcc"),
        (SamplingSpec("poisson", 100, 10), "tightest"),
        (SamplingSpec("bminsep", 100, 10), "tightest"),
        (SamplingSpec("poisson", 100, 10, accountant="monte-carlo"), "monte-carlo"),
        (SamplingSpec("bminsep", 100, 10, accountant="monte-carlo"), "monte-carlo"),
    ]:
        acc = accountant_for(spec)
        assert isinstance(acc, Accountant) and acc.name == name
    fac = factorize("toeplitz", participation_for(16, 2))
    res = accountant_for(SamplingSpec()).epsilon(fac, 0.6, 1e-6)
    assert isinstance(res, AccountingResult) and res.delta == 1e-6 and res.guarantee
    with pytest.raises(AttributeError):
        res.epsilon = 0.0  # frozen
    cal = accountant_for(SamplingSpec()).noise_multiplier(fac, res.epsilon, 1e-6)
    assert cal.epsilon <= res.epsilon and cal.noise_multiplier <= 0.6 * 1.0011
    assert (
        cal.to_dict()["accountant"]["name"] == "unamplified"
        and cal.to_dict()["target_epsilon"] == res.epsilon
    )


def test_mmcc_calibration_hits_target():
    fac = factorize("toeplitz", participation_for(16, 4, 4, kind="min-sep"), bands=4)
    spec = SamplingSpec("cyclic-poisson", 1600, 20, accountant="mmcc")
    cal = account(fac, delta=1e-5, target_epsilon=2.0, sampling=spec)
    assert cal["epsilon"] <= 2.0
    assert (
        account(fac, delta=1e-5, noise_multiplier=cal["noise_multiplier"] / 1.01, sampling=spec)[
            "epsilon"
        ]
        > 2.0
    )


def test_monte_carlo_verify_target():
    # ε for a σ always verifies the target δ: the released pair is at the target, whatever
    # --mc-samples (which only sizes the first batch); a budget too small to verify falls back to
    # the unamplified bound, named.
    fac = factorize("toeplitz", participation_for(24, 4, 6, kind="min-sep"), bands=3)
    spec = SamplingSpec("bminsep", 24_000, 400, accountant="monte-carlo")
    res = account(fac, delta=1e-2, noise_multiplier=1.0, sampling=spec, mc_samples=5_000, seed=3)
    acc = res["accountant"]
    assert res["delta"] == 1e-2 and res["guarantee"] is True and acc["verification_passed"]
    assert acc["delta_mechanism"] + acc["verifier_failure_budget"] == pytest.approx(1e-2)
    assert sum(a["failure_share"] for a in acc["attempts"]) <= acc["verifier_failure_budget"]
    capped = account(
        fac,
        delta=1e-2,
        noise_multiplier=1.0,
        sampling=spec,
        mc_samples=200,
        seed=3,
        max_samples=400,
    )
    assert capped["guarantee"] is True and capped["delta"] == 1e-2
    assert (
        capped["accountant"]["released"] == "fallback"
        and capped["accountant"]["name"] == "unamplified"
    )
    assert capped["accountant"]["monte_carlo"]["verification_passed"] is False
    assert capped["epsilon"] > res["epsilon"]


def test_cli_account_mmcc(tmp_path):
    path = factorize("dpsgd", participation_for(32, 1)).save(tmp_path / "f.npz")
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
            "1.0",
            "--participation",
            "poisson",
            "--accountant",
            "mmcc",
            "--dataset-size",
            "3200",
            "--expected-batch-size",
            "100",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    obj = json.loads(r.stdout.strip().splitlines()[-1])
    dpsgd = (
        dpa.pld.PLDAccountant()
        .compose(
            dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(1 / 32, dpa.GaussianDpEvent(1.0)), 32)
        )
        .get_epsilon(1e-6)
    )
    assert obj["epsilon"] == pytest.approx(dpsgd, rel=2e-3) and obj["accountant"]["name"] == "mmcc"
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
            "1.0",
            "--participation",
            "poisson",
            "--accountant",
            "mmcc",
            "--dataset-size",
            "3200",
            "--expected-batch-size",
            "100",
            "--mmcc-grid",
            "0.5",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "--mmcc-grid" in bad.stderr


def test_planner_poisson_and_cyclic_poisson():
    from corrflow.participation import CohortPlanner

    n = 400
    ids = [f"u{i}" for i in range(n)]
    pois = CohortPlanner(
        "poisson", ids, [[i] for i in range(n)], ids, rounds=60, min_sep=1, rate=0.05, seed=1
    )
    sizes = [len(pois.cohort(t)) for t in range(60)]
    assert pois.p == 0.05 and pois.max_participations == 60
    assert abs(np.mean(sizes) - 20) < 3 * np.sqrt(20 * 0.95 / 60)
    cyc = CohortPlanner(
        "cyclic-poisson", ids, [[i] for i in range(n)], ids, rounds=60, min_sep=4, rate=0.05, seed=1
    )
    assert cyc.p == pytest.approx(0.2) and cyc.max_participations == 15
    seen: dict[str, list[int]] = {}
    for t in range(60):
        for item in cyc.cohort(t):
            seen.setdefault(item, []).append(t)
    # an item trains only in its part's rounds
    assert all(len({r % 4 for r in rs}) == 1 for rs in seen.values())
    assert abs(sum(map(len, seen.values())) / 60 - 20) < 3 * np.sqrt(100 * 0.2 * 0.8 / 60)
    with pytest.raises(InvalidArgumentError, match="min-sep"):
        CohortPlanner("poisson", ids, [[i] for i in range(n)], ids, rounds=60, min_sep=2, rate=0.05)


def test_strategy_config_accountant_checks():
    from corrflow.config import RunConfig

    base = dict(num_users=50, num_rounds=8, epochs=8, noise_multiplier=4.0)
    RunConfig(**base, participation="poisson", min_sep=1, accountant="mmcc")
    RunConfig(**base, participation="cyclic-poisson", min_sep=2, accountant="mmcc")
    RunConfig(**base, participation="poisson", min_sep=1, accountant="monte-carlo")
    for bad in (
        dict(participation="fixed-epoch", accountant="monte-carlo"),
        dict(participation="bminsep", min_sep=2, accountant="mmcc"),
        dict(participation="fixed-epoch", accountant="mmcc"),
    ):
        with pytest.raises(InvalidArgumentError) as e:
            RunConfig(**base, **bad)
        assert e.value.field == "accountant"
