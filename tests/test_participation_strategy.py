"""Participation control in the strategy: planner, separation monitor and its policies, operator
overrides, users with several devices, b-min-sep cohorts with Monte Carlo planning, cross-silo
multi-attribution on arXiv-style data with user-level caps."""

import json
import logging
import os
import stat

import numpy as np
import pytest
from checkpoint_support import secret_file
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from strategy_support import HANDLERS, KEY, forget_last_release, request_for
from strategy_support import small_config as _cfg

from corrflow.accounting import epsilon_of, realized_sensitivity, unamplified_event
from corrflow.data.arxiv import ArxivReader, ArxivSpec, arxiv_attribution, generate_arxiv
from corrflow.data.partition import make_manifest, write_manifest
from corrflow.errors import InvalidArgumentError
from corrflow.factorization import Factorization
from corrflow.participation.planner import CohortPlanner, SeparationMonitor
from corrflow.run.reading import participation_users
from corrflow.server.app import run_server
from corrflow.server.inprocess import InProcessGrid


def _recompute(tmp_path, strategy):
    """ε of the realised pattern, recomputed from the ledger with the accounting layer alone."""
    fac = Factorization.load(tmp_path / "factorization.npz")
    sens, _ = realized_sensitivity(fac.encoder, strategy.ledger.selected)
    return epsilon_of(unamplified_event(strategy.sigma, sens.value), strategy.cfg.delta)


# ----------------------------------------------------------------------------------------------
# planner (pure)


def test_planner_fixed_epoch_and_samplers():
    ids = [f"partition-{i}" for i in range(12)]
    p = CohortPlanner("fixed-epoch", ids, [[i] for i in range(12)], ids, rounds=6, min_sep=3)
    rounds = {i: [t for t in range(6) if i in p.cohort(t)] for i in ids}
    assert all(len(r) == 2 and r[1] - r[0] == 3 for r in rounds.values()) and p.expected == 4
    assert p.planned_rounds(ids[0]) == rounds[ids[0]]
    q = CohortPlanner(
        "bminsep",
        ids * 1 + [f"x{i}" for i in range(188)],
        [[i] for i in range(200)],
        ids + [f"x{i}" for i in range(188)],
        rounds=400,
        min_sep=5,
        rate=0.1,
        seed=3,
    )
    sizes = [len(q.cohort(t)) for t in range(400)]
    assert abs(np.mean(sizes) - 20) < 1.0 and q.summary().sampling_probability == pytest.approx(
        0.1 / 0.6
    )
    again = CohortPlanner(
        "bminsep", q.items, q.item_users, q.users, rounds=400, min_sep=5, rate=0.1, seed=3
    )
    assert again.cohort(250) == q.cohort(250)  # replay from the seed
    # Multi-attribution: every user's distinct rounds are ≥ b apart although items share users.
    rng = np.random.default_rng(0)
    item_users = [
        sorted(set(rng.integers(0, 30, size=rng.integers(1, 4)).tolist())) for _ in range(120)
    ]
    m = CohortPlanner(
        "multi-attribution",
        [f"e{i}" for i in range(120)],
        item_users,
        [f"u{j}" for j in range(30)],
        rounds=60,
        min_sep=4,
        rate=0.05,
        seed=1,
    )
    seen: dict[str, list[int]] = {}
    for t in range(60):
        for item in m.cohort(t):
            for u in m.users_of(item):
                seen.setdefault(u, []).append(t)
    gaps = [np.diff(np.unique(r)).min() for r in seen.values() if len(set(r)) > 1]
    assert gaps and min(gaps) >= 4
    with pytest.raises(InvalidArgumentError, match="participation-rate"):
        CohortPlanner("bminsep", ids, [[i] for i in range(12)], ids, rounds=6, min_sep=3, rate=0.5)


def test_separation_monitor():
    mon = SeparationMonitor(3)
    included = {"a": [0, 0, 3], "b": [1]}
    assert mon.violates(included, "a", 5) == 2 and mon.violates(included, "a", 6) is None
    assert mon.violates(included, "b", 4) is None and mon.violates(included, "c", 0) is None
    assert mon.gap(included, "a", 3) == 3  # same-round multiplicity is not a gap


# ----------------------------------------------------------------------------------------------
# policies


def _early_return(strategy, metrics):
    """Operator script: after round 0, bring one of its users back in round 1 (gap 1 < min-sep
    3)."""
    if metrics["round"] == 0:
        strategy.override(1, [strategy.planner.cohort(0)[0]])


def test_early_return_rejected_by_default(tmp_path, caplog):
    cfg = _cfg(tmp_path)
    with caplog.at_level(logging.WARNING, logger="corrflow"):
        s = run_server(
            InProcessGrid(HANDLERS, 12), cfg, noise_key=KEY, quiet=True, on_round_end=_early_return
        )
    report = json.loads((tmp_path / "privacy_report.json").read_text())
    part = report["realized"]["participation"]
    assert part["policy"] == "reject" and len(part["overrides"]) == 1
    o = part["overrides"][0]
    assert (
        o["round"] == 1
        and o["gap"] == 1
        and o["source"] == "override"
        and o["action"] == "rejected"
    )
    assert part["min_gap"] == 3 and part["max_participations"] == 2  # the plan was kept
    assert report["realized"]["epsilon"] == pytest.approx(report["planned"]["epsilon"], rel=1e-9)
    assert report["realized"]["epsilon"] == pytest.approx(_recompute(tmp_path, s), rel=1e-12)
    assert any("separation: gap 1 < min-sep 3" in r["reason"] for r in s.ledger.rejections)
    assert "breaks min-sep" in caplog.text


def test_early_return_accept_and_account(tmp_path, caplog):
    cfg = _cfg(tmp_path, policy="accept-and-account")
    with caplog.at_level(logging.WARNING, logger="corrflow"):
        s = run_server(
            InProcessGrid(HANDLERS, 12), cfg, noise_key=KEY, quiet=True, on_round_end=_early_return
        )
    report = json.loads((tmp_path / "privacy_report.json").read_text())
    part = report["realized"]["participation"]
    # The early return (gap 1), and then the user's scheduled round 3 comes too soon after it (gap
    # 2): both are accepted and accounted.
    assert [(o["round"], o["source"], o["gap"], o["action"]) for o in part["overrides"]] == [
        (1, "override", 1, "accepted-and-accounted"),
        (3, "sampler", 2, "accepted-and-accounted"),
    ]
    assert part["min_gap"] == 1
    assert part["max_participations"] == 3
    assert report["realized"]["accounting"].startswith("post-hoc")
    # The post-hoc ε holds at the run's δ (one Gaussian, PLD), and the report says so.
    assert report["realized"]["delta"] == report["target_delta"] == report["delta"]
    assert report["realized"]["guarantee"] is True and report["guarantee"] is True
    eps = report["realized"]["epsilon"]
    assert eps == pytest.approx(_recompute(tmp_path, s), rel=1e-12)  # the post-hoc recomputation
    assert eps > report["planned"]["epsilon"] * 1.01  # and above the plan
    assert caplog.text.count("policy accept-and-account") == 1  # warned once, with the new ε
    assert f"ε = {s.ledger.epsilon_history[1]:.4f}" in caplog.text  # ε right after the first one


def test_user_with_two_devices(tmp_path):
    """Items are SuperNodes; persons own two each. The item schedule is right, the user-level
    pattern is not: the monitor catches it; k_u = 2 doubles the planned sensitivity."""
    graph = tmp_path / "devices.csv"
    graph.write_text("item,user\n" + "".join(f"partition-{i},person-{i // 2}\n" for i in range(12)))
    runs = {}
    for policy in ("reject", "accept-and-account"):
        d = tmp_path / policy
        cfg = _cfg(d, attribution_path=str(graph), policy=policy)
        s = run_server(InProcessGrid(HANDLERS, 12), cfg, noise_key=KEY, quiet=True)
        runs[policy] = (s, json.loads((d / "privacy_report.json").read_text()))
        rep = runs[policy][1]
        assert rep["planned"]["sensitivity"] == pytest.approx(2.0)
        assert rep["planned"]["epsilon"] == pytest.approx(
            epsilon_of(unamplified_event(0.7 / 2, 1.0), cfg.delta), rel=1e-6
        )
        assert len(participation_users(rep, d)) == 6
        assert rep["realized"]["epsilon"] == pytest.approx(_recompute(d, s), rel=1e-12)
    split = [
        o
        for o in runs["reject"][1]["realized"]["participation"]["overrides"]
        if o["source"] == "sampler"
    ]
    assert split and all(o["action"] == "rejected" for o in split)
    assert (runs["reject"][1]["realized"]["participation"]["min_gap"] or 3) >= 3
    assert runs["accept-and-account"][1]["realized"]["participation"]["min_gap"] < 3


# ----------------------------------------------------------------------------------------------
# b-min-sep


def test_bminsep_cohorts_with_monte_carlo_plan(tmp_path):
    cfg = _cfg(
        tmp_path,
        num_users=40,
        num_rounds=12,
        epochs=4,
        participation="bminsep",
        participation_rate=0.2,
        accountant="monte-carlo",
        mc_samples=4000,
        noise_multiplier=1.5,
        kind="toeplitz",
        delta=1e-3,
    )
    s = run_server(InProcessGrid(HANDLERS, 40), cfg, noise_key=KEY, quiet=True)
    rep = json.loads((tmp_path / "privacy_report.json").read_text())
    assert rep["accountant"]["name"] == "monte-carlo" and rep["accountant"]["min_sep"] == 3
    assert rep["planned"]["participation"]["expected_cohort"] == pytest.approx(8.0)
    assert "users" not in rep["realized"]["participation"]  # secret cohorts: operator-only
    part = json.loads((tmp_path / "operator" / "participation.json").read_text())["realized"][
        "participation"
    ]
    assert part["min_gap"] >= 3 and part["overrides"] == []
    # the sampler's pattern was followed
    assert rep["realized"]["epsilon"] == rep["planned"]["epsilon"]
    # amplification
    assert rep["planned"]["epsilon"] < epsilon_of(unamplified_event(1.5, 1.0), cfg.delta)
    assert all(m["cohort"] == pytest.approx(8.0) for m in s.metrics_history)
    # The selections are exactly the sampler's, replayed from the private key in the checkpoint
    # (0600) — and not from the public schedule seed, which would let anyone who knows it name the
    # cohorts.
    key_file = secret_file(tmp_path, "sampler_secret.key")
    key = key_file.read_bytes()
    assert len(key) == 32 and stat.S_IMODE(os.stat(key_file).st_mode) == 0o600

    def replay(private_key):
        again = CohortPlanner(
            "bminsep",
            s.planner.items,
            s.planner.item_users,
            s.planner.users,
            12,
            3,
            rate=0.2,
            seed=cfg.schedule_seed,
        )
        if private_key is not None:
            again.seed_privately(private_key)
        selected: dict[str, list[int]] = {}
        for t in range(12):
            for item in again.cohort(t):
                selected.setdefault(item, []).append(t)
        return selected

    assert replay(key) == s.ledger.selected and replay(None) != s.ledger.selected


def test_a_run_naming_no_accountant_uses_the_tightest_verified_bound(tmp_path, caplog):
    """No accountant named: the run goes through the same selection as ``corrflow account``
    (TightestAccountant). b-min-sep: Monte Carlo (004) and the unamplified bound of ⌈n/b⌉
    participations are both computed; the run's ε is the smaller verified one, each recomputed here
    on another path (the Monte Carlo accountant called directly with the run's seed; the unamplified
    bound by dp-accounting's Gaussian PLD). Poisson with DP-SGD: MMCC is exact (Monte Carlo skipped,
    saying why) and equals dp-accounting's Poisson-subsampled Gaussian composed n times."""
    import math

    from dp_accounting.pld import privacy_loss_distribution as pld

    from corrflow.accounting.accountant import (
        AccountingOptions,
        MonteCarloEVRAccountant,
        SamplingSpec,
    )
    from corrflow.planning.run import selection_line

    cfg = _cfg(
        tmp_path / "b",
        num_users=40,
        num_rounds=12,
        epochs=4,
        participation="bminsep",
        participation_rate=0.2,
        mc_samples=4000,
        noise_multiplier=1.5,
        kind="toeplitz",
        delta=1e-3,
    )
    assert cfg.accountant is None
    with caplog.at_level(logging.INFO, logger="corrflow"):
        s = run_server(InProcessGrid(HANDLERS, 40), cfg, noise_key=KEY, quiet=True)
    rep = json.loads((tmp_path / "b" / "privacy_report.json").read_text())
    acc = rep["accountant"]
    bounds = {b["accountant"]: b for b in acc["bounds"]}
    assert set(bounds) == {"monte-carlo", "unamplified"} and all(
        b["verified"] for b in bounds.values()
    )
    assert acc["selected"] == "monte-carlo" == acc["name"] and acc["skipped"] == []
    assert rep["planned"]["epsilon"] == min(b["epsilon"] for b in bounds.values())
    assert rep["realized"]["epsilon"] == rep["planned"]["epsilon"]  # amplified, pattern followed
    fac = Factorization.load(tmp_path / "b" / "factorization.npz")
    spec = SamplingSpec(
        "bminsep",
        40,
        s.planner.expected,
        sampling_probability=s.planner.p,
        accountant="monte-carlo",
    )
    direct = MonteCarloEVRAccountant(
        spec, AccountingOptions(mc_samples=4000, seed=cfg.schedule_seed)
    )
    assert direct.verified_epsilon(fac, 1.5, 1e-3).epsilon == rep["planned"]["epsilon"]
    sens = math.sqrt(math.ceil(12 / 3)) * float(fac.encoder.column_norms().max())
    gaussian = pld.from_gaussian_mechanism(
        standard_deviation=1.5 / sens, value_discretization_interval=1e-4
    )
    assert bounds["unamplified"]["epsilon"] == pytest.approx(
        gaussian.get_epsilon_for_delta(1e-3), rel=1e-3
    )
    assert rep["planned"]["epsilon"] < 0.7 * bounds["unamplified"]["epsilon"]
    line = selection_line(acc)
    assert line.startswith("accountant monte-carlo: the tightest") and "unamplified ε" in line
    assert any(line in r.getMessage() for r in caplog.records)
    # σ calibrated with too few samples per candidate to verify the target δ: the line says the
    # fallback stands.
    from corrflow.accounting import account

    cal = account(
        fac,
        delta=1e-3,
        target_epsilon=3.0,
        mc_samples=2000,
        seed=0,
        sampling=SamplingSpec("bminsep", 40, s.planner.expected, sampling_probability=s.planner.p),
    )
    assert cal["accountant"]["released"] == "fallback"
    assert "monte-carlo (released its fallback, unamplified)" in selection_line(cal["accountant"])
    # The same in a run: the bound used is the sampler's unamplified one, so the run is planned
    # unamplified — public cohorts and post-hoc accounting of the realised pattern (recomputed from
    # the ledger).
    cfg = _cfg(
        tmp_path / "u",
        num_users=40,
        num_rounds=12,
        epochs=4,
        participation="bminsep",
        participation_rate=0.2,
        mc_samples=2000,
        noise_multiplier=None,
        target_epsilon=3.0,
        kind="toeplitz",
        delta=1e-3,
    )
    s = run_server(InProcessGrid(HANDLERS, 40), cfg, noise_key=KEY, quiet=True)
    rep = json.loads((tmp_path / "u" / "privacy_report.json").read_text())
    assert (
        rep["accountant"]["name"] == "unamplified"
        and rep["accountant"]["selected"] == "monte-carlo"
    )
    assert rep["accountant"]["sampling"].startswith("none (bminsep, unamplified")
    assert rep["noise_multiplier"] == pytest.approx(cal["noise_multiplier"], rel=1e-12)
    assert rep["realized"]["accounting"].startswith("post-hoc") and participation_users(
        rep, tmp_path / "u"
    )
    assert rep["realized"]["epsilon"] == pytest.approx(_recompute(tmp_path / "u", s), rel=1e-12)
    assert rep["realized"]["epsilon"] <= rep["planned"]["epsilon"] * (1 + 1e-9)

    cfg = _cfg(
        tmp_path / "p",
        num_users=12,
        num_rounds=6,
        participation="poisson",
        min_sep=1,
        participation_rate=0.25,
        kind="dpsgd",
        noise_multiplier=1.0,
        delta=1e-3,
        target_epsilon=50.0,
    )
    s = run_server(InProcessGrid(HANDLERS, 12), cfg, noise_key=KEY, quiet=True)
    acc = json.loads((tmp_path / "p" / "privacy_report.json").read_text())["accountant"]
    assert acc["selected"] == "mmcc" and [b["accountant"] for b in acc["bounds"]] == ["mmcc"]
    assert [k["accountant"] for k in acc["skipped"]] == ["monte-carlo"] and "exact" in acc[
        "skipped"
    ][0]["reason"]
    fac = Factorization.load(tmp_path / "p" / "factorization.npz")
    subsampled = pld.from_gaussian_mechanism(
        standard_deviation=1.0 / float(fac.encoder.column_norms().max()),
        sampling_prob=s.planner.p,
        value_discretization_interval=1e-4,
    )
    assert acc["bounds"][0]["epsilon"] == pytest.approx(
        subsampled.self_compose(6).get_epsilon_for_delta(1e-3), rel=1e-3
    )


# ----------------------------------------------------------------------------------------------
# cross-silo arXiv


def _arxiv_setup(tmp_path, silos=3):
    data = tmp_path / "arxiv.jsonl"
    generate_arxiv(data, ArxivSpec(users=150, seed=5))
    manifest = write_manifest(make_manifest(data, partitions=silos), tmp_path / "manifest.json")
    return data, manifest


def test_cross_silo_arxiv_multi_attribution_end_to_end(tmp_path):
    data, manifest = _arxiv_setup(tmp_path)
    cfg = _cfg(
        tmp_path,
        num_users=3,
        num_rounds=12,
        epochs=3,
        participation="multi-attribution",
        participation_rate=0.06,
        mode="cross-silo",
        attribution_path=str(data),
        manifest_path=str(manifest),
        max_items_per_user=2,
        noise_multiplier=2.0,
        accountant="unamplified",
    )
    s = run_server(InProcessGrid(HANDLERS, 3), cfg, noise_key=KEY, quiet=True)
    rep = json.loads((tmp_path / "privacy_report.json").read_text())
    assert (
        rep["rounds_completed"] == 12
        and rep["planned"]["epsilon"] > 0
        and rep["realized"]["epsilon"] > 0
    )
    bounding = rep["accountant"]["contribution_bounding"]
    assert bounding["dropped"] > 0 and bounding["max_items_per_user"] == 2
    graph = arxiv_attribution(ArxivReader(data))
    assert bounding["items"] == graph.num_items
    # User-level caps and separation held for every author.
    per_user = np.zeros(len(s.planner.users), dtype=int)
    for us in s.planner.item_users:
        per_user[us] += 1
    assert per_user.max() <= 2 and s.planner.items_per_user <= 2
    for rounds in s.ledger.selected.values():
        distinct = np.unique(rounds)
        assert np.all(np.diff(distinct) >= 4) and max(np.unique(rounds, return_counts=True)[1]) <= 2
    assert rep["realized"]["epsilon"] <= rep["planned"]["epsilon"] * (1 + 1e-9)
    assert rep["realized"]["epsilon"] == pytest.approx(_recompute(tmp_path, s), rel=1e-12)
    assert sum(m["rejected"] for m in s.metrics_history) == 0
    assert sum(m["replies"] for m in s.metrics_history) > 0


def test_cross_silo_arxiv_with_monte_carlo_plan(tmp_path):
    """The 004 §7.3 setting in miniature: multi-attribution sampling with k_u = 2, planned by Monte
    Carlo (Thm 6.1) — amplified below the unamplified ε of sensitivity k_u; followed, so the
    realised ε is the planned one."""
    data, manifest = _arxiv_setup(tmp_path)
    cfg = _cfg(
        tmp_path,
        num_users=3,
        num_rounds=12,
        epochs=3,
        participation="multi-attribution",
        participation_rate=0.06,
        mode="cross-silo",
        attribution_path=str(data),
        manifest_path=str(manifest),
        max_items_per_user=2,
        noise_multiplier=2.0,
        accountant="monte-carlo",
        mc_samples=5000,
        delta=1e-3,
    )  # Monte Carlo verifies the target δ: 1e-3 keeps it to ~1e5 samples
    run_server(InProcessGrid(HANDLERS, 3), cfg, noise_key=KEY, quiet=True)
    rep = json.loads((tmp_path / "privacy_report.json").read_text())
    acc = rep["accountant"]
    assert (
        acc["name"] == "monte-carlo" and acc["items_per_user"] == 2 and acc["warm_start"] is False
    )
    assert acc["sampling_probability"] == pytest.approx(0.06 / (1 - 0.06 * 3))
    assert rep["planned"]["epsilon"] < epsilon_of(unamplified_event(2.0 / 2, 1.0), cfg.delta)
    assert rep["realized"]["epsilon"] == rep["planned"]["epsilon"]
    assert rep["realized"]["accounting"].startswith("as planned")


def test_cross_silo_reply_over_the_item_bound_is_rejected(tmp_path, caplog):
    data, manifest = _arxiv_setup(tmp_path)

    def inflate(replies):  # a silo that skips per-item clipping: returns 10 × the bound
        out = []
        for r in replies:
            arrays = r.content["arrays"].to_numpy_ndarrays()
            n = int(r.content["metrics"]["num-items"])
            big = [np.full_like(a, 10.0 * n) for a in arrays]  # ‖·‖ ≥ 10·n > n·clip (clip = 1)
            out.append(
                Message(
                    RecordDict(
                        {"arrays": ArrayRecord(big), "metrics": MetricRecord({"num-items": n})}
                    ),
                    reply_to=request_for(r),
                )
            )
        return out

    cfg = _cfg(
        tmp_path,
        num_users=3,
        num_rounds=4,
        epochs=2,
        participation="multi-attribution",
        participation_rate=0.1,
        mode="cross-silo",
        attribution_path=str(data),
        manifest_path=str(manifest),
        max_items_per_user=2,
        noise_multiplier=2.0,
        zeroing_factor=0.0,
        accountant="unamplified",
    )
    with caplog.at_level(logging.WARNING, logger="corrflow"):
        s = run_server(InProcessGrid(HANDLERS, 3, tamper=inflate), cfg, noise_key=KEY, quiet=True)
    # Every reply of every round is rejected: the run stops after max-empty-rounds (3), saying why.
    assert s.next_round == 3 and sum(m["replies"] for m in s.metrics_history) == 0
    assert (
        "no valid replies in 3 consecutive rounds" in s.stopped_reason
        and "per-item clipping" in s.stopped_reason
    )
    assert any("per-item clipping not honoured" in r["reason"] for r in s.ledger.rejections)


def test_bminsep_restart_replays_the_sampler(tmp_path):
    """A crash after round 4's checkpoint, then a restart: the sampler is replayed from its public
    seed and a pending operator override survives: the cohorts and overrides are those of an
    uninterrupted run, and only the noise after the restart is new."""
    kw = dict(
        num_users=30,
        num_rounds=10,
        epochs=2,
        participation="bminsep",
        participation_rate=0.1,
        policy="accept-and-account",
        accountant="unamplified",
    )

    def script(crash):
        def on_end(strategy, metrics):
            if metrics["round"] == 2:
                strategy.override(6, [strategy.planner.cohort(2)[0]])
            if crash and metrics["round"] == 4:
                raise KeyboardInterrupt

        return on_end

    ref = run_server(
        InProcessGrid(HANDLERS, 30),
        _cfg(tmp_path / "a", **kw),
        noise_key=KEY,
        quiet=True,
        on_round_end=script(False),
    )
    cfg = _cfg(tmp_path / "b", **kw)
    with pytest.raises(KeyboardInterrupt):
        run_server(
            InProcessGrid(HANDLERS, 30), cfg, noise_key=KEY, quiet=True, on_round_end=script(True)
        )
    resumed = run_server(InProcessGrid(HANDLERS, 30), cfg, noise_key=KEY, quiet=True)
    assert resumed.next_round == 10
    # The sampler replays: the same cohorts and overrides as the uninterrupted run; the rounds after
    # the restart carry fresh noise (a new key per process start), so the models differ.
    assert (
        resumed.ledger.selected == ref.ledger.selected
        and resumed.ledger.overrides == ref.ledger.overrides
    )
    assert not all(np.array_equal(p, q) for p, q in zip(ref.params, resumed.params, strict=True))
    assert any(o["source"] == "override" and o["round"] == 6 for o in ref.ledger.overrides)


def test_poisson_run_accounted_by_mmcc_keeps_its_planned_epsilon(tmp_path):
    """An amplified plan (MMCC, 002) stands while the sampler's pattern is followed: the budget
    guard and the report use it, not the post-hoc unamplified ε of the realised (random) pattern,
    which is far larger."""
    from corrflow.accounting.tracking import PrivacyPlan, RunPrivacy

    cfg = _cfg(
        tmp_path,
        num_users=12,
        num_rounds=6,
        participation="poisson",
        min_sep=1,
        participation_rate=0.25,
        accountant="mmcc",
        noise_multiplier=1.0,
        target_epsilon=50.0,
    )
    s = run_server(InProcessGrid(HANDLERS, 12), cfg, noise_key=KEY, quiet=True)
    rep = json.loads((tmp_path / "privacy_report.json").read_text())
    assert s.next_round == 6 and rep["stopped_reason"] is None
    assert (
        rep["accountant"]["name"] == "mmcc"
        and rep["realized"]["epsilon"] == rep["planned"]["epsilon"]
    )
    # a named accountant is honoured: nothing else is computed
    assert "selected" not in rep["accountant"]
    assert rep["realized"]["accounting"].startswith("as planned")
    fac = Factorization.load(tmp_path / "factorization.npz")
    posthoc = RunPrivacy(fac, PrivacyPlan(1.0, rep["planned"]["epsilon"]), 1e-5).realized(
        s.ledger.selected
    )
    assert posthoc.epsilon > rep["planned"]["epsilon"]  # why the amplified plan matters


def test_an_operator_override_ends_amplification(tmp_path):
    """A cyclic-Poisson plan's amplified ε holds only while every participation comes from the
    sampler. An operator who forces an item in (even one that keeps min-sep) ends it: from then on ε
    is post-hoc (unamplified) on the realised pattern, recomputed here from the ledger alone."""
    base = dict(
        num_users=12,
        num_rounds=8,
        participation="cyclic-poisson",
        min_sep=4,
        epochs=2,
        participation_rate=0.25,
        accountant="cyclic-poisson",
    )
    plain = run_server(InProcessGrid(HANDLERS, 12), _cfg(tmp_path / "a", **base), quiet=True)
    assert plain.ledger.overrides == []
    planned = json.loads((tmp_path / "a" / "privacy_report.json").read_text())
    assert planned["realized"]["epsilon"] == pytest.approx(planned["planned"]["epsilon"], rel=1e-12)

    def force(strategy, metrics):
        # a user in neither round 0 nor round 1, forced into round 1 (no gap broken)
        if metrics["round"] == 0:
            p = strategy.planner
            strategy.override(
                1, [next(i for i in sorted(p.items) if i not in p.cohort(0) + p.cohort(1))]
            )

    s = run_server(
        InProcessGrid(HANDLERS, 12), _cfg(tmp_path / "b", **base), quiet=True, on_round_end=force
    )
    report = json.loads((tmp_path / "b" / "privacy_report.json").read_text())
    assert any(o["source"] == "override" and o["action"] == "included" for o in s.ledger.overrides)
    assert report["realized"]["accounting"].startswith("post-hoc")
    assert report["realized"]["epsilon"] == pytest.approx(_recompute(tmp_path / "b", s), rel=1e-12)


def test_amplified_cohorts_come_from_a_private_key_that_survives_a_restart(tmp_path):
    """Cyclic-Poisson amplification (001 Alg. 2, q = b·p0 = 0.4) needs secret cohorts: two runs with
    one schedule seed sample different cohorts. A run killed after round 3's checkpoint but before
    its journal entry resumes with its key: round 3 is released again and all 8 rounds replay from
    the checkpoint's key. Without the key file the run refuses to resume, naming it."""
    from corrflow.errors import IntegrityError
    from corrflow.run.journal import JOURNAL, ReleaseJournal

    base = dict(
        num_users=12,
        num_rounds=8,
        participation="cyclic-poisson",
        min_sep=4,
        epochs=2,
        participation_rate=0.1,
        accountant="cyclic-poisson",
    )
    other = run_server(InProcessGrid(HANDLERS, 12), _cfg(tmp_path / "a", **base), quiet=True)

    def crash(strategy, metrics):
        if metrics["round"] == 3:
            raise KeyboardInterrupt

    cfg = _cfg(tmp_path / "b", **base)
    with pytest.raises(KeyboardInterrupt):
        run_server(InProcessGrid(HANDLERS, 12), cfg, quiet=True, on_round_end=crash)
    journal = tmp_path / "b" / JOURNAL
    # killed before the append
    journal.write_text("".join(journal.read_text().splitlines(keepends=True)[:-1]))
    forget_last_release(tmp_path / "b")
    key = secret_file(tmp_path / "b", "sampler_secret.key").read_bytes()
    s = run_server(InProcessGrid(HANDLERS, 12), cfg, quiet=True)
    assert s.next_round == 8 and [e.round for e in ReleaseJournal(journal).read()] == list(range(8))
    assert s.ledger.selected != other.ledger.selected
    replay = CohortPlanner(
        "cyclic-poisson", s.planner.items, s.planner.item_users, s.planner.users, 8, 4, rate=0.1
    )
    replay.seed_privately(key)
    cohorts = {t: replay.cohort(t) for t in range(8)}
    assert cohorts == {
        t: sorted(i for i, rs in s.ledger.selected.items() if t in rs) for t in range(8)
    }
    # Poisson cohorts: drawn per round, not fixed
    assert len({len(c) for c in cohorts.values()}) > 1

    secret_file(tmp_path / "b", "sampler_secret.key").unlink()
    with pytest.raises(IntegrityError, match="sampler_secret.key"):
        run_server(InProcessGrid(HANDLERS, 12), cfg, quiet=True)
