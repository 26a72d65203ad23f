"""Every recipe `corrflow plan` recommends runs with `simulate --plan` — a small
grid of settings with population/cohort = b exactly (the b-min-sep probability p = p0/(1 − p0(b −
1)) is exactly 1 there), b = 1 and cohort = population, each recommended recipe run in-process to
its end."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from corrflow.participation.samplers import BMinSepSampler, clamp_probability
from corrflow.planning.cache import PlanCache
from corrflow.planning.candidates import PlanRequest, make_plan, write_plan
from corrflow.server.cli import app

GRID = [
    dict(rounds=4, population=40, cohort_size=10),  # P/B = b = 4 exactly (fixed-epoch or p = 1)
    dict(rounds=3, population=30, cohort_size=10),  # P/B = b = 3 with b·k = n
    dict(rounds=2, population=10, cohort_size=10),  # b = 1: cohort = population
    dict(rounds=3, population=25, cohort_size=10),  # b = 2, b·k ≠ n: min-sep participation
]


def test_probability_at_p0_equal_one_over_b_is_exactly_one():
    for b in range(1, 40):
        for cohort in (1, 3, 7, 10, 33):
            p0 = cohort / (cohort * b)
            assert BMinSepSampler.probability_for_rate(p0, b) == 1.0
    assert clamp_probability(1.0000000000000002) == 1.0 and clamp_probability(0.3) == 0.3
    assert clamp_probability(1.1) == 1.1  # a real excess is left for the caller's check to refuse


@pytest.mark.parametrize(
    "setting", GRID, ids=lambda s: "P{population}-B{cohort_size}-n{rounds}".format(**s)
)
def test_recommended_recipe_runs(setting, tmp_path):
    req = PlanRequest(
        **setting, target_epsilon=4.0, delta=1e-5, model_params=10, kinds=("dpsgd", "toeplitz")
    )
    res = make_plan(req, PlanCache(tmp_path / "cache"), quiet=True)
    assert res.recommended is not None
    write_plan(res, tmp_path / "plan", plots=False)
    out = CliRunner().invoke(
        app,
        [
            "simulate",
            "--plan",
            str(tmp_path / "plan" / "recipe.json"),
            "--backend",
            "inprocess",
            "--out",
            str(tmp_path / "run"),
            "--json",
        ],
    )
    # 3: ran to the end but did not learn (tiny runs may not)
    assert out.exit_code in (0, 3), out.output
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["rounds_completed"] == setting["rounds"] and report["stopped_reason"] is None
    assert report["noise_multiplier"] == pytest.approx(res.recommended.noise_multiplier)
