"""``corrflow compare --preset tiny --epsilons 2,8 --amplified --backend cohort`` (the default
in-process backend is compared in tests/test_compare_resume.py and tests/test_plan_score.py):
every arm (non-private, both DP-SGD arms, banded Toeplitz fixed-epoch and amplified, the planner's
recipe) shares data, initialisation and evaluation set; each private arm's ε, verified by its run
at the target δ, is within the target and recomputed here without corrflow's accountants; the gap
arithmetic and the planner's scores are right; the plots are valid PNGs; one seed reproduces its
numbers except the noise."""

import json
import math
import struct
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import dp_accounting as dpa
import numpy as np
import pytest
from independent import independent_epsilon

from corrflow.errors import InvalidArgumentError
from corrflow.factorization.base import Factorization
from corrflow.planning.cache import PlanCache
from corrflow.run.reading import participation_users
from corrflow.server.compare import PRESETS, compare, gap_closed, parse_epsilons, plan_arms

ARMS = {"nonprivate", "dpsgd", "dpsgd-poisson", "toeplitz", "toeplitz-amplified", "plan"}
PRIVATE = ARMS - {"nonprivate"}


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """CORRFLOW_HOME for the module: one plan cache shared by every comparison here."""
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, home):
    out = tmp_path_factory.mktemp("compare")
    env = {**__import__("os").environ, "CORRFLOW_HOME": str(home)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "corrflow.server.cli",
            "compare",
            "--preset",
            "tiny",
            "--epsilons",
            "8,2",
            "--amplified",
            "--backend",
            "cohort",
            "--out",
            str(out),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), out, proc.stderr


def test_json_contract_and_shared_setup(tiny):
    result, out, _ = tiny
    p = PRESETS["tiny"]
    assert {
        "epsilons",
        "plots",
        "preset",
        "delta",
        "rounds",
        "cohort",
        "seeds",
        "seconds",
        "cpu_seconds",
    } <= set(result)
    assert (result["preset"], result["rounds"], result["cohort"], result["seeds"]) == (
        "tiny",
        p.rounds,
        p.cohort,
        p.seeds,
    )
    assert set(result["epsilons"]) == {"2", "8"} and result["unverified"] == []
    for entry in result["epsilons"].values():
        assert set(entry["arms"]) == ARMS and set(entry["gap_closed"]) == PRIVATE
        for arm in entry["arms"].values():
            assert {
                "accuracy",
                "loss",
                "noise_multiplier",
                "accountant",
                "epsilon",
                "delta",
                "per_seed",
            } <= set(arm)
            assert len(arm["per_seed"]) == p.seeds
            assert arm["accuracy"] == pytest.approx(
                np.mean([r["accuracy"] for r in arm["per_seed"]])
            )
            assert arm["loss"] == pytest.approx(np.mean([r["loss"] for r in arm["per_seed"]]))
            for r in arm[
                "per_seed"
            ]:  # each run's verdict is its own held-out loss against its initial model's
                assert r["learned"] is (r["loss"] < r["initial_loss"])
        # the samplers: DP-SGD with Poisson sampling in every round; amplified Toeplitz with its own
        # b < P/B
        a = entry["arms"]
        assert (a["dpsgd-poisson"]["participation"], a["dpsgd-poisson"]["min_sep"]) == (
            "cyclic-poisson",
            1,
        )
        assert a["toeplitz-amplified"]["participation"] == "cyclic-poisson"
        assert 1 <= a["toeplitz-amplified"]["min_sep"] < p.users // p.cohort
        assert (a["dpsgd"]["participation"], a["dpsgd"]["min_sep"]) == (
            "fixed-epoch",
            p.rounds // p.epochs,
        )
        assert a["nonprivate"]["epsilon"] is None and a["nonprivate"]["noise_multiplier"] == 0
    for seed in range(p.seeds):
        runs = [
            arm["per_seed"][seed] for e in result["epsilons"].values() for arm in e["arms"].values()
        ]
        # same data, same initial model, same evaluation set (so the same initial held-out metrics),
        # every arm and ε
        assert len({r["data_sha256"] for r in runs}) == 1
        assert len({r["init_sha256"] for r in runs}) == 1
        assert len({(r["initial_loss"], r["initial_accuracy"]) for r in runs}) == 1
    # the non-private arm trains once per seed and stands at every ε
    assert (
        result["epsilons"]["2"]["arms"]["nonprivate"]
        == result["epsilons"]["8"]["arms"]["nonprivate"]
    )
    saved = json.loads((out / "comparison.json").read_text())
    curve = saved["epsilons"]["8"]["arms"]["dpsgd"]["per_seed"][0]["curve"]
    # curves start at the initial model
    assert curve[0]["round"] == -1 and len(curve) == p.rounds + 1


def _independent(
    entry: dict, name: str, run_dir: Path, users: int, cohort: int, rounds: int, delta: float
) -> float:
    """ε of one run recomputed with dp-accounting from its factorization and realized participation:
    the Gaussian of the realized sensitivity (fixed-epoch), or ⌈n/b⌉ compositions of the
    Poisson-subsampled Gaussian at q = b·B/P and σ / max column norm (cyclic Poisson, b = 1: Poisson
    sampling; 001 Prop. 2.1)."""
    arm = entry["arms"][name]
    fac = Factorization.load(run_dir / "factorization.npz")
    sigma = arm["per_seed"][0]["noise_multiplier"]
    if arm["participation"] == "fixed-epoch":
        report = json.loads((run_dir / "privacy_report.json").read_text())
        return independent_epsilon(fac, participation_users(report, run_dir), sigma, delta)
    assert arm["participation"] == "cyclic-poisson"
    b = arm["min_sep"]
    q = b * cohort / users
    col = float(np.linalg.norm(fac.encoder.matrix(), axis=0).max())
    event = dpa.SelfComposedDpEvent(
        dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma / col)), math.ceil(rounds / b)
    )
    return (
        dpa.pld.PLDAccountant(value_discretization_interval=1e-4).compose(event).get_epsilon(delta)
    )


def test_every_private_arm_spends_at_most_its_target_at_delta(tiny):
    result, out, _ = tiny
    p = PRESETS["tiny"]
    for key, entry in result["epsilons"].items():
        eps = float(key)
        for name in PRIVATE:
            arm = entry["arms"][name]
            assert (
                arm["verified"] and arm["delta"] <= p.delta and arm["epsilon"] <= eps * (1 + 1e-9)
            ), (key, name)
            for r in arm["per_seed"]:
                assert r["verified"] and r["epsilon"] <= eps * (1 + 1e-9) and r["delta"] <= p.delta
                assert r["noise_multiplier"] > 0 and r["target_epsilon"] == eps
            if arm["accountant"] == "mmcc":  # no independent implementation of MMCC here
                continue
            again = _independent(
                entry,
                name,
                out / f"eps{key}" / "runs" / f"{name}-seed0",
                p.users,
                p.cohort,
                p.rounds,
                p.delta,
            )
            assert again == pytest.approx(arm["per_seed"][0]["epsilon"], rel=3e-3), (key, name)
            assert again <= eps * 1.003, (key, name)
        # amplification buys noise: at the same ε, the Poisson-sampled DP-SGD adds less noise per
        # round than the fixed-epoch DP-SGD (σ per unit sensitivity: √n·σ against √k·σ)
        a = entry["arms"]
        assert a["dpsgd-poisson"]["noise_multiplier"] * math.sqrt(p.rounds) < a["dpsgd"][
            "noise_multiplier"
        ] * math.sqrt(p.epochs)


def test_gap_closed_and_planner_scores(tiny):
    result, _, stderr = tiny
    for entry in result["epsilons"].values():
        a = entry["arms"]
        best = max(("dpsgd", "dpsgd-poisson"), key=lambda n: a[n]["accuracy"])
        assert entry["best_dpsgd"] == best
        for name in PRIVATE:
            assert entry["gap_closed"][name] == pytest.approx(
                (a[name]["accuracy"] - a[best]["accuracy"])
                / (a["nonprivate"]["accuracy"] - a[best]["accuracy"])
            )
        assert entry["gap_closed"][best] == pytest.approx(0.0)
        # the planner's own score (RMSE at the target ε) for its recipe is at most both DP-SGD arms'
        rmse = entry["planner"]["rmse"]
        assert rmse["plan"] <= min(rmse["dpsgd"], rmse["dpsgd-poisson"]) * (1 + 1e-12)
        assert a["plan"]["rmse"] == rmse["plan"]
        # each run's own score (σ·√mean‖B_i‖² of the factorization it used) is the planner's for
        # planned arms
        for name in ("dpsgd", "dpsgd-poisson", "toeplitz-amplified", "plan"):
            assert a[name]["per_seed"][0]["rmse"] == pytest.approx(rmse[name], rel=1e-9)
        assert a["toeplitz"]["rmse"] == a["toeplitz"]["per_seed"][0]["rmse"] > 0
    # the table, on stderr
    assert "dpsgd-poisson" in stderr and "gap closed" in stderr and "ε = 2" in stderr


def _png_size(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        data = f.read()
    assert (
        data[:8] == b"\x89PNG\r\n\x1a\n"
        and data[12:16] == b"IHDR"
        and data.endswith(b"IEND\xaeB`\x82")
    )
    return struct.unpack(">II", data[16:24])


def test_plots_are_valid_pngs(tiny):
    result, out, _ = tiny
    expected = {
        "accuracy_vs_epsilon.png",
        "loss_vs_epsilon.png",
        "accuracy_eps2.png",
        "loss_eps2.png",
        "accuracy_eps8.png",
        "loss_eps8.png",
    }
    assert sorted(result["plots"]) == sorted(str(out / f) for f in expected)
    for path in result["plots"]:
        width, height = _png_size(path)
        assert width >= 300 and height >= 200


def test_one_seed_reproduces_its_numbers_but_not_its_noise(tiny, tmp_path, home, monkeypatch):
    first, _, _ = tiny
    monkeypatch.setenv("CORRFLOW_HOME", str(home))  # the module's plan cache: planning is a lookup
    # ε: the preset's (8); the backend the module's comparison ran on; two arms at once, each in
    # its own process, give what one at a time gave
    again = compare(PRESETS["tiny"], ["toeplitz"], tmp_path, backend="cohort", jobs=2)
    assert list(again["epsilons"]) == ["8"] and set(again["epsilons"]["8"]["arms"]) == ARMS - {
        "toeplitz-amplified"
    }
    a, b = first["epsilons"]["8"]["arms"], again["epsilons"]["8"]["arms"]
    # no noise: bit for bit
    assert (a["nonprivate"]["accuracy"], a["nonprivate"]["loss"]) == (
        b["nonprivate"]["accuracy"],
        b["nonprivate"]["loss"],
    )
    for name in ("dpsgd", "dpsgd-poisson", "toeplitz", "plan"):
        x, y = a[name]["per_seed"][0], b[name]["per_seed"][0]
        assert (x["data_sha256"], x["init_sha256"], x["initial_loss"], x["noise_multiplier"]) == (
            y["data_sha256"],
            y["init_sha256"],
            y["initial_loss"],
            y["noise_multiplier"],
        )
        assert x["loss"] != y["loss"]  # a fresh secret noise key per run, whatever the seed


def test_an_amplified_arm_needs_a_banded_kind(tmp_path, home, monkeypatch):
    monkeypatch.setenv("CORRFLOW_HOME", str(home))
    arms = plan_arms(PRESETS["tiny"], ["bifr"], 8.0, True, tmp_path, PlanCache(home / "cache"))
    assert [a.name for a in arms.arms] == ["dpsgd", "dpsgd-poisson", "bifr", "plan"]
    assert (
        arms.skipped[0]["arm"] == "bifr-amplified" and "cyclic-Poisson" in arms.skipped[0]["reason"]
    )


def test_gap_closed_and_bad_arguments(tmp_path):
    assert gap_closed(0.25, 0.1, 0.3) == pytest.approx(0.75)
    assert gap_closed(4.0, 6.0, 3.5) == pytest.approx(0.8)  # loss: lower is better, same formula
    assert gap_closed(0.2, 0.1, 0.1) is None
    assert parse_epsilons("8,1, 2,8") == (1.0, 2.0, 8.0)
    for bad in ("", "1,x", "0,2", "inf", "-1"):
        with pytest.raises(InvalidArgumentError, match="epsilons"):
            parse_epsilons(bad)
    with pytest.raises(InvalidArgumentError, match="kinds"):
        compare(PRESETS["tiny"], ["dpsgd"], tmp_path)
    # every arm is checked before any trains
    with pytest.raises(InvalidArgumentError, match="epochs"):
        compare(replace(PRESETS["tiny"], epochs=3), ["toeplitz"], tmp_path / "z")
    assert not (tmp_path / "z").exists()
    # arXiv lines (multi-attribution): refused before anything trains, not after two arms
    from corrflow.data.arxiv import ArxivSpec, generate_arxiv
    from corrflow.data.vocab import build_vocabulary, count_words

    generate_arxiv(tmp_path / "ax.jsonl", ArxivSpec(users=400, seed=1))
    build_vocabulary(count_words(["the of a"]), 3).save(tmp_path / "v.txt")
    arxiv = replace(
        PRESETS["tiny"], data_path=str(tmp_path / "ax.jsonl"), vocab_path=str(tmp_path / "v.txt")
    )
    with pytest.raises(InvalidArgumentError, match="data: expected a StackOverflow-format"):
        compare(arxiv, ["toeplitz"], tmp_path / "ax")
    assert not (tmp_path / "ax").exists()

    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "corrflow.server.cli", "compare", "--preset", "tiny", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )

    proc = cli("--preset", "huge", "--out", str(tmp_path / "x"))
    assert proc.returncode == 2 and "--preset" in proc.stderr
    proc = cli("--kinds", "toeplitz,foo", "--out", str(tmp_path / "y"))
    assert proc.returncode == 2 and "--kinds" in proc.stderr and "foo" in proc.stderr
    assert not (tmp_path / "y").exists()  # refused before anything was written
    for args, flag in (
        (("--target-epsilon", "-1"), "--target-epsilon"),
        (("--epsilons", "2,-1"), "--epsilons"),
        (("--epsilons", "2,8", "--target-epsilon", "8"), "--target-epsilon"),
        (("--epsilon", "8", "--target-epsilon", "8"), "--epsilon"),  # the deprecated spelling
        (("--jobs", "0"), "--jobs"),
        (("--jobs", "2", "--backend", "flower"), "--jobs"),
    ):
        proc = cli(*args, "--out", str(tmp_path / "w"))
        assert proc.returncode == 2 and flag in proc.stderr and not (tmp_path / "w").exists(), (
            args,
            proc.stderr,
        )


def test_restart_is_announced_only_when_it_happens():
    """An arm restarted by an earlier try and kept since is listed as kept, not "restarted afresh"
    on every later rerun (trial report)."""
    from corrflow.server.compare import _progress

    res = {
        "restarted": 8,
        "stopped": None,
        "accuracy": 0.5,
        "loss": 1.0,
        "epsilon": 7.9,
        "delta": 1e-5,
        "noise_multiplier": 1.0,
        "learned": True,
        "seconds": 1.0,
    }
    lines = []
    _progress(lines.append, 0, 8.0, "dpsgd", res, kept=False)
    assert "restarted afresh" in lines[0] and "released 8 rounds" in lines[0]
    lines.clear()
    _progress(lines.append, 0, 8.0, "dpsgd", res, kept=True)
    assert len(lines) == 1 and lines[0].startswith("kept seed 0 ε = 8 dpsgd")
