"""compare's verdict: a comparison where non-private training loses, where two arms sit inside their
paired seed interval, or where one seed gives no interval is marked as such (table, JSON, plots),
with the reason and the settings that would decide it. The arms' results are constructed directly:
what is tested is the reading of finished results, not training."""

import json
import math

import numpy as np
import pytest

from corrflow.server.compare import gaps, json_summary, plot_rounds, plot_sweep, table
from corrflow.server.verdict import paired_interval, seeds_to_separate, undecided, verdict

#: t quantile of the two-sided 95% interval at 2 degrees of freedom (3 seeds), from tables.
T_975_2DF = 4.302652729911275


def _arm(accuracy: list[float], loss: list[float], **kw) -> dict:
    per_seed = [
        {
            "seed": s,
            "accuracy": a,
            "loss": lo,
            "curve": [
                {"round": -1, "accuracy": 0.0, "loss": 5.0},
                {"round": 0, "accuracy": a, "loss": lo},
            ],
        }
        for s, (a, lo) in enumerate(zip(accuracy, loss, strict=True))
    ]
    return {
        "accuracy": float(np.mean(accuracy)),
        "loss": float(np.mean(loss)),
        "kind": kw.get("kind", "dpsgd"),
        "accountant": "none",
        "sampling": "none",
        "min_sep": 5,
        "noise_multiplier": 1.0,
        "epsilon": 8.0,
        "delta": 1e-5,
        "noise_to_signal": 0.5,
        "rmse": 1.0,
        "learned_seeds": len(accuracy),
        "verified": True,
        "stopped": [],
        "per_seed": per_seed,
    }


def _result(arms_by_eps: dict[float, dict], rounds=20, users=727, seeds=2) -> dict:
    result = {
        "preset": "text",
        "client": "nextword",
        "delta": 1e-5,
        "cohort": 20,
        "seeds": seeds,
        "users": users,
        "rounds": rounds,
        "epochs": 1,
        "kinds": ["toeplitz"],
        "amplified": False,
        "plots": [],
        "seconds": 1.0,
        "cpu_seconds": 1.0,
        "skipped": [],
        "unverified": [],
        "stopped": [],
        "epsilons": {},
    }
    for eps, arms in arms_by_eps.items():
        entry = {"epsilon": eps, "arms": arms, **gaps(arms), "planner": {"recommended": "x"}}
        entry["verdict"] = verdict(entry, rounds=rounds, users=users, epsilon=eps)
        result["epsilons"][f"{eps:g}"] = entry
    result["inconclusive"] = undecided(result)
    return result


def _losing_nonprivate() -> dict:
    """The real-format commit-text run: 727 authors, 20 rounds, 2 seeds, non-private 0.070 below
    fixed-epoch DP-SGD's 0.108 (per-seed values around those means)."""
    return {
        "nonprivate": _arm([0.068, 0.072], [5.10, 5.06]),
        "dpsgd": _arm([0.105, 0.111], [4.90, 4.86]),
        "dpsgd-poisson": _arm([0.070, 0.074], [5.08, 5.04]),
        "plan": _arm([0.087, 0.091], [4.98, 4.95]),
        "toeplitz": _arm([0.088, 0.092], [4.97, 4.95]),
    }


def test_a_run_where_nonprivate_training_loses_is_inconclusive_everywhere(tmp_path):
    result = _result({8.0: _losing_nonprivate()})
    v = result["epsilons"]["8"]["verdict"]
    assert v["status"] == "inconclusive"
    assert v["nonprivate_beaten_by"]["accuracy"] == ["dpsgd", "dpsgd-poisson", "plan", "toeplitz"]
    assert v["nonprivate_beaten_by"]["loss"] == ["dpsgd", "dpsgd-poisson", "plan", "toeplitz"]
    assert v["ranking"] == ["dpsgd", "toeplitz", "plan", "dpsgd-poisson"]
    assert "too few rounds or users for this data" in v["reasons"][0]
    assert "in accuracy (0.0700) dpsgd (0.1080), dpsgd-poisson (0.0720)" in v["reasons"][0]
    assert "in loss (5.0800) dpsgd (4.8800)" in v["reasons"][0]
    assert any("--rounds 40" in s and "--users 1454" in s for s in v["suggestions"])
    # the table says it under the ε's arms; the JSON carries the verdict and the summary line
    text = table(result)
    assert "verdict: INCONCLUSIVE" in text and "to decide: train longer" in text
    summary = json.loads(json.dumps(json_summary(result)))
    assert summary["inconclusive"] == ["ε = 8: inconclusive"]
    assert summary["epsilons"]["8"]["verdict"]["status"] == "inconclusive"
    # the plots are drawn with the verdict under the axes (and differ from a decided one's)
    marked = plot_rounds(result, result["epsilons"]["8"], tmp_path, "8")
    marked += plot_sweep(result, tmp_path)
    assert len(marked) == 4 and all((tmp_path / p).stat().st_size > 1000 for p in marked)


def test_a_clear_win_with_separated_arms_is_decided():
    arms = {
        "nonprivate": _arm([0.30, 0.31, 0.32], [3.0, 2.9, 2.8]),
        "dpsgd": _arm([0.10, 0.11, 0.12], [4.5, 4.4, 4.3]),
        "dpsgd-poisson": _arm([0.15, 0.17, 0.16], [4.2, 4.1, 4.0]),
        "toeplitz": _arm([0.25, 0.26, 0.28], [3.5, 3.4, 3.3]),
    }
    result = _result({2.0: arms}, seeds=3)
    v = result["epsilons"]["2"]["verdict"]
    assert v["status"] == "decided" and v["ties"] == [] and v["reasons"] == []
    assert v["ranking"] == ["toeplitz", "dpsgd-poisson", "dpsgd"]
    assert result["inconclusive"] == []
    assert "verdict: decided — by mean accuracy" in table(result)


def test_two_arms_inside_their_paired_interval_are_inconclusive_with_the_interval():
    toeplitz, plan = [0.250, 0.262, 0.270], [0.249, 0.252, 0.280]
    arms = {
        "nonprivate": _arm([0.30, 0.31, 0.32], [3.0, 2.9, 2.8]),
        "dpsgd": _arm([0.10, 0.11, 0.12], [4.5, 4.4, 4.3]),
        "dpsgd-poisson": _arm([0.15, 0.17, 0.16], [4.2, 4.1, 4.0]),
        "toeplitz": _arm(toeplitz, [3.5, 3.4, 3.3]),
        "plan": _arm(plan, [3.5, 3.4, 3.3]),
    }
    v = _result({4.0: arms}, seeds=3)["epsilons"]["4"]["verdict"]
    assert v["status"] == "inconclusive" and not v["nonprivate_beaten_by"]
    (tie,) = v["ties"]
    assert tie["arms"] == ["toeplitz", "plan"]
    # independent recomputation of the interval of d = toeplitz − plan per seed
    d = [0.001, 0.010, -0.010]
    mean = sum(d) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 2)
    half = T_975_2DF * sd / math.sqrt(3)
    assert tie["interval"] == pytest.approx([mean - half, mean + half], rel=1e-9, abs=1e-12)
    assert tie["difference"] == pytest.approx(mean, abs=1e-12)
    assert "inside their paired 95% seed interval" in v["reasons"][0]
    assert any("a smaller ε (--epsilons 1)" in s for s in v["suggestions"])


def test_one_seed_gives_an_unpaired_ranking():
    arms = {
        "nonprivate": _arm([0.30], [3.0]),
        "dpsgd": _arm([0.10], [4.5]),
        "dpsgd-poisson": _arm([0.15], [4.2]),
        "toeplitz": _arm([0.25], [3.5]),
    }
    result = _result({8.0: arms}, seeds=1)
    v = result["epsilons"]["8"]["verdict"]
    assert v["status"] == "unpaired" and v["seeds"] == 1
    assert v["ranking"] == ["toeplitz", "dpsgd-poisson", "dpsgd"]
    assert "the ranking is unpaired" in v["reasons"][0]
    assert v["suggestions"] == ["run 3 or more seeds (--seeds 3) for a paired 95% interval"]
    assert "verdict: UNPAIRED" in table(result)
    # one seed and non-private behind: inconclusive, and still said to be unpaired
    arms["nonprivate"] = _arm([0.20], [3.8])
    v = _result({8.0: arms}, seeds=1)["epsilons"]["8"]["verdict"]
    assert v["status"] == "inconclusive" and v["nonprivate_beaten_by"] == {
        "accuracy": ["toeplitz"],
        "loss": ["toeplitz"],
    }
    assert any("unpaired" in r for r in v["reasons"])


def test_paired_interval_and_seeds_to_separate():
    assert paired_interval([0.1], [0.2]) is None and seeds_to_separate([0.1], [0.2]) is None
    # d = (0.01, 0.03): mean 0.02, sd √2·0.01, half-width t(0.975, 1)·0.01 = 0.127062…
    lo, hi = paired_interval([0.11, 0.13], [0.10, 0.10])
    assert (lo + hi) / 2 == pytest.approx(0.02) and (hi - lo) / 2 == pytest.approx(0.1270620, 1e-6)
    assert seeds_to_separate([0.11, 0.13], [0.10, 0.10]) == math.ceil(2 * (0.1270620 / 0.02) ** 2)
