"""``corrflow compare --preset tiny``: the arms share data, initialisation, cohort and ε; one seed reproduces its
numbers except the noise (the key is always fresh); the plots are valid PNGs; the gap arithmetic is right."""

import json
import struct
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from corrflow.errors import InvalidArgumentError
from corrflow.server.compare import PRESETS, compare, gap_closed


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    proc = subprocess.run([sys.executable, "-m", "corrflow.server.cli", "compare", "--preset", "tiny", "--out",
                           str(out), "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), out, proc.stderr


def test_json_contract_and_shared_setup(tiny):
    result, out, _ = tiny
    p = PRESETS["tiny"]
    assert {"preset", "epsilon", "delta", "rounds", "cohort", "seeds", "arms", "gap_closed", "plots"} <= set(result)
    assert (result["preset"], result["rounds"], result["cohort"], result["seeds"]) == ("tiny", p.rounds, p.cohort,
                                                                                       p.seeds)
    assert set(result["arms"]) == {"nonprivate", "dpsgd", "toeplitz"} and set(result["gap_closed"]) == {"toeplitz"}
    for seed in range(p.seeds):
        runs = {name: arm["per_seed"][seed] for name, arm in result["arms"].items()}
        # same data, same initial model (so the same initial held-out metrics), same cohort in every arm
        assert len({r["data_sha256"] for r in runs.values()}) == 1
        assert len({r["init_sha256"] for r in runs.values()}) == 1
        assert len({(r["initial_loss"], r["initial_accuracy"]) for r in runs.values()}) == 1
        assert {r["cohort"] for r in runs.values()} == {float(p.cohort)}
        # both private arms spend the same ε (calibrated to the target, within the σ grid), the baseline none
        for name in ("dpsgd", "toeplitz"):
            assert p.epsilon * 0.98 <= runs[name]["epsilon"] <= p.epsilon * (1 + 1e-9)
            assert runs[name]["noise_multiplier"] > 0
        assert runs["nonprivate"]["epsilon"] is None and runs["nonprivate"]["noise_multiplier"] == 0
    for arm in result["arms"].values():
        for r in arm["per_seed"]:    # each run's verdict is its own held-out loss against its initial model's
            assert r["learned"] is (r["loss"] < r["initial_loss"])
        assert arm["learned_seeds"] == sum(r["learned"] for r in arm["per_seed"])
        assert arm["accuracy"] == pytest.approx(np.mean([r["accuracy"] for r in arm["per_seed"]]))
        assert arm["loss"] == pytest.approx(np.mean([r["loss"] for r in arm["per_seed"]]))
    a = result["arms"]
    # ρ: none without noise; at one σ, independent noise carries more than correlated noise
    assert a["nonprivate"]["noise_to_signal"] == 0 < a["toeplitz"]["noise_to_signal"] < a["dpsgd"]["noise_to_signal"]
    assert result["gap_closed"]["toeplitz"]["accuracy"] == pytest.approx(
        (a["toeplitz"]["accuracy"] - a["dpsgd"]["accuracy"]) / (a["nonprivate"]["accuracy"] - a["dpsgd"]["accuracy"]))
    saved = json.loads((out / "comparison.json").read_text())
    assert saved["arms"]["dpsgd"]["per_seed"][0]["curve"][0]["round"] == -1   # curves start at the initial model
    assert len(saved["arms"]["dpsgd"]["per_seed"][0]["curve"]) == p.rounds + 1


def test_the_non_private_model_learns(tiny):
    result, _, stderr = tiny
    free = result["arms"]["nonprivate"]
    assert free["accuracy"] > free["per_seed"][0]["initial_accuracy"] + 0.05
    assert free["loss"] < free["per_seed"][0]["initial_loss"]
    assert "nonprivate" in stderr and "gap closed" in stderr and "learned" in stderr   # the table, on stderr


def test_plots_are_valid_pngs(tiny):
    result, out, _ = tiny
    assert sorted(result["plots"]) == sorted(str(out / f) for f in ("accuracy.png", "loss.png"))
    for path in result["plots"]:
        with open(path, "rb") as f:
            data = f.read()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
        width, height = struct.unpack(">II", data[16:24])
        assert width >= 300 and height >= 200 and data.endswith(b"IEND\xaeB`\x82")


def test_one_seed_reproduces_its_numbers_but_not_its_noise(tiny, tmp_path):
    first, _, _ = tiny
    again = compare(PRESETS["tiny"], ["toeplitz"], tmp_path)
    a, b = first["arms"], again["arms"]
    # no noise: bit for bit
    assert a["nonprivate"]["accuracy"] == b["nonprivate"]["accuracy"] and a["nonprivate"]["loss"] == b[
        "nonprivate"]["loss"]
    for name in ("dpsgd", "toeplitz"):
        x, y = a[name]["per_seed"][0], b[name]["per_seed"][0]
        assert (x["data_sha256"], x["init_sha256"], x["initial_loss"], x["noise_multiplier"]) == \
            (y["data_sha256"], y["init_sha256"], y["initial_loss"], y["noise_multiplier"])
        assert x["loss"] != y["loss"]          # a fresh secret noise key per run, whatever the seed


def test_gap_closed_and_bad_arguments(tmp_path):
    assert gap_closed(0.25, 0.1, 0.3) == pytest.approx(0.75)
    assert gap_closed(4.0, 6.0, 3.5) == pytest.approx(0.8)          # loss: lower is better, same formula
    assert gap_closed(0.2, 0.1, 0.1) is None
    with pytest.raises(InvalidArgumentError, match="kinds"):
        compare(PRESETS["tiny"], ["dpsgd"], tmp_path)
    proc = subprocess.run([sys.executable, "-m", "corrflow.server.cli", "compare", "--preset", "huge", "--out",
                           str(tmp_path / "x")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--preset" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "corrflow.server.cli", "compare", "--preset", "tiny", "--kinds",
                           "toeplitz,foo", "--out", str(tmp_path / "y")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--kinds" in proc.stderr and "foo" in proc.stderr
    assert not (tmp_path / "y").exists()                              # refused before anything was written
    with pytest.raises(InvalidArgumentError, match="epochs"):           # every arm is checked before any trains
        compare(replace(PRESETS["tiny"], epochs=3), ["toeplitz"], tmp_path / "z")
    assert not (tmp_path / "z").exists()
    proc = subprocess.run([sys.executable, "-m", "corrflow.server.cli", "compare", "--preset", "tiny", "--epsilon",
                           "-1", "--out", str(tmp_path / "w")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--epsilon" in proc.stderr and not (tmp_path / "w").exists()
