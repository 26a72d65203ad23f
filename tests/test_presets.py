"""The comparison presets as `simulate --preset` and `compare --preset` use them: the large preset
keeps the papers' cohort-to-population ratio (000 §5.3, 001: 1,000 of 342,477 users per round), its
values reach the run that trains (the run's own privacy report), typed flags override it, and
combinations that cannot hold are refused with exit 2, naming --preset, before --out is touched."""

import json
import subprocess
import sys
from dataclasses import asdict, replace

import pytest

from corrflow.planning.candidates import sampling_of
from corrflow.server.compare import PRESETS, SETTINGS_FILE, plan_request


def corrflow(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "corrflow.server.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_large_preset_has_the_papers_cohort_to_population_ratio():
    """Population ≥ 50,000, cohort ≥ 500, q = cohort/population ≤ 0.01, the nextword client; the
    fixed-epoch groups partition the population (each user in k = 1 round, b = 100 apart); δ below
    1/population; the planner sees the same schedule, and Poisson DP-SGD samples with q = 0.01."""
    large = PRESETS["large"]
    assert (large.users, large.cohort, large.rounds, large.epochs, large.seeds) == (
        50_000,
        500,
        100,
        1,
        2,
    )
    assert large.client == "nextword" and large.data_path == ""
    assert large.cohort / large.users == pytest.approx(0.01)
    assert large.cohort * (large.rounds // large.epochs) == large.users
    assert large.delta == 1e-6 and large.delta < 1 / large.users
    req = plan_request(large, 8.0)
    assert (req.population, req.cohort_size, req.rounds, req.epochs, req.min_sep) == (
        50_000,
        500,
        100,
        1,
        100,
    )
    assert req.delta == 1e-6
    poisson = sampling_of(req, "cyclic-poisson", min_sep=1)
    assert poisson.sampling_probability == pytest.approx(0.01)
    # the amplified arms' separations b < population/cohort = 100: q = b/100 < 1
    assert sampling_of(req, "cyclic-poisson", min_sep=20).sampling_probability == pytest.approx(0.2)


def test_simulate_preset_trains_the_presets_task(tmp_path):
    """`simulate --preset large` with --users and --rounds typed (a 2,000-user, 4-round run of
    the preset's task): the typed flags win, the rest is the preset's — nextword (its held-out
    accuracy), k = 1, δ = 1e-6 and ε = 8, which the run's own accountant verifies."""
    out = tmp_path / "run"
    proc = corrflow(
        "simulate",
        "--preset",
        "large",
        "--users",
        "2000",
        "--rounds",
        "4",
        "--backend",
        "inprocess",
        "--out",
        str(out),
        "--json",
    )
    assert proc.returncode in (0, 3), proc.stderr[-3000:]  # 4 rounds may not learn (exit 3)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["rounds_completed"] == 4
    assert report["mechanism"]["epochs"] == 1 and report["mechanism"]["min_sep"] == 4
    assert report["planned"]["participation"]["expected_cohort"] == 500
    assert report["delta"] == 1e-6 and report["target_epsilon"] == 8.0
    assert report["realized"]["epsilon"] == pytest.approx(8.0, abs=1e-6)
    assert report["realized"]["epsilon"] <= 8.0 + 1e-9
    assert report["held_out"]["initial_test_accuracy"] is not None  # nextword, not numpy
    assert report["clip_norm"] == PRESETS["large"].clip_norm


@pytest.mark.parametrize(
    "args",
    [
        ["--preset", "huge"],
        ["--preset", "large", "--plan", "recipe.json"],
        ["--preset", "large", "--mode", "cross-silo"],
    ],
    ids=["unknown", "with-plan", "cross-silo"],
)
def test_simulate_preset_refusals(tmp_path, args):
    out = tmp_path / "run"
    proc = corrflow("simulate", *args, "--backend", "inprocess", "--out", str(out), timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--preset" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()


def test_simulate_full_large_preset_is_checked_up_front(tmp_path):
    """The whole preset (50,000 users) reaches the up-front budget check: a typed σ whose first
    round alone spends more than the preset's ε = 8 is refused before anything is written."""
    out = tmp_path / "run"
    proc = corrflow(
        "simulate",
        "--preset",
        "large",
        "--noise-multiplier",
        "0.05",
        "--target-epsilon",
        "8",
        "--backend",
        "inprocess",
        "--out",
        str(out),
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--noise-multiplier" in proc.stderr and "target ε = 8" in proc.stderr
    assert not out.exists()


def test_compare_large_preset_resolves_to_the_preset(tmp_path):
    """`compare --preset large` resolves to the preset's settings: against a comparison directory
    whose recorded settings differ only in the population, it is refused (exit 2) naming exactly
    that difference — nothing planned or trained."""
    out = tmp_path / "cmp"
    (out / "runs").mkdir(parents=True)
    large = PRESETS["large"]
    recorded = {
        "preset": asdict(replace(large, users=40_000)),
        "kinds": ["toeplitz"],
        "epsilons": [8.0],
        "amplified": False,
        "backend": "inprocess",
    }
    (out / SETTINGS_FILE).write_text(json.dumps(recorded))
    proc = corrflow("compare", "--preset", "large", "--out", str(out), timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "preset.users: 40000 then, 50000 now" in proc.stderr
    assert proc.stderr.count(" then, ") == 1  # rounds, epochs, δ, client, seeds: the preset's
    assert sorted(p.name for p in out.iterdir()) == [SETTINGS_FILE, "runs"]


def test_compare_large_preset_refuses_a_population_without_cohorts(tmp_path):
    out = tmp_path / "cmp"
    proc = corrflow("compare", "--preset", "large", "--users", "99", "--out", str(out))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--users" in proc.stderr and "100" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()
