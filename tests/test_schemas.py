"""The JSON Schemas corrflow ships (corrflow/schemas) describe the files it really writes: the
privacy report and metrics of an unamplified and of an amplified (secret-cohort) simulation, and the
recipe of `corrflow plan`, all validate; documents that break the conventions (no δ, ε as text, a
raw user id, a recipe missing its hash) do not; `corrflow schema NAME` prints exactly the shipped
schema and refuses an unknown name with exit 2."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from corrflow.run.reading import participation_users
from corrflow.schemas import SCHEMAS, load_schema, validate

ROOT = Path(__file__).resolve().parents[1]


def corrflow(*args: str, cwd: Path, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CORRFLOW_HOME": str(home)}
    return subprocess.run(
        [sys.executable, "-m", "corrflow.server.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory, finished_run):
    root = tmp_path_factory.mktemp("schemas")
    home = root / "home"
    # the plain run: the suite's shared finished run (4 rounds, 10 users, in-process engine)
    shutil.copytree(finished_run, root / "plain", ignore=shutil.ignore_patterns(".corrflow.lock*"))
    amplified = corrflow(
        "simulate",
        "--users",
        "20",
        "--rounds",
        "4",
        "--epochs",
        "2",
        "--min-sep",
        "2",
        "--participation",
        "cyclic-poisson",
        "--accountant",
        "cyclic-poisson",
        "--backend",
        "inprocess",
        "--out",
        "amplified",
        "--json",
        cwd=root,
        home=home,
    )
    assert amplified.returncode in (0, 3), amplified.stderr[-2000:]
    plan = corrflow(
        "plan",
        "--rounds",
        "8",
        "--users",
        "40",
        "--cohort",
        "10",
        "--target-epsilon",
        "8",
        "--delta",
        "1e-5",
        "--kinds",
        "dpsgd,toeplitz",
        "--accountants",
        "unamplified,cyclic-poisson",
        "--model-dim",
        "1000",
        "--no-plots",
        "--quiet",
        "--out",
        "plan",
        "--json",
        cwd=root,
        home=home,
    )
    assert plan.returncode == 0, plan.stderr[-2000:]
    return root


def _load(path: Path):
    return json.loads(path.read_text())


@pytest.mark.parametrize("run", ["plain", "amplified"])
def test_reports_and_metrics_a_run_writes_validate(runs, run):
    report = _load(runs / run / "privacy_report.json")
    validate("privacy-report", report)
    validate("metrics", _load(runs / run / "metrics.json"))
    assert report["rounds_completed"] == 4 and report["delta"] == 1e-5
    if run == "amplified":  # the secret-cohort shape: participation points to the operator's file
        assert "users" not in report["realized"]["participation"]
        assert "operator_only" in report["realized"]["participation"]
    else:
        assert len(participation_users(report, runs / run)) == 10


def test_the_plan_recipe_validates(runs):
    validate("recipe", _load(runs / "plan" / "recipe.json"))
    validate("recipe", _load(runs / "plan" / "plan.json")["recommended"])


def test_documents_that_break_the_conventions_are_refused(runs):
    report = _load(runs / "plain" / "privacy_report.json")
    broken = []
    no_delta = copy.deepcopy(report)
    del no_delta["delta"]
    broken.append(no_delta)
    text_eps = copy.deepcopy(report)
    text_eps["realized"]["epsilon"] = "7.99"
    broken.append(text_eps)
    raw_id = copy.deepcopy(report)
    raw_id["realized"]["participation"]["users"] = {"partition-3": {"rounds": [0, 2], "min_gap": 2}}
    broken.append(raw_id)
    no_sens = copy.deepcopy(report)
    del no_sens["realized"][
        "sensitivity"
    ]  # a public ledger must say which sensitivity it was accounted at
    broken.append(no_sens)
    for doc in broken:
        with pytest.raises(jsonschema.ValidationError):
            validate("privacy-report", doc)
    recipe = _load(runs / "plan" / "recipe.json")
    del recipe["factorization_sha256"]
    with pytest.raises(jsonschema.ValidationError):
        validate("recipe", recipe)
    metrics = _load(runs / "plain" / "metrics.json")
    metrics[0]["round"] = 0  # the first entry is the initial model, round −1
    with pytest.raises(jsonschema.ValidationError):
        validate("metrics", metrics)


def test_schema_command_prints_each_schema_and_refuses_unknown_names(tmp_path):
    for name in SCHEMAS:
        res = corrflow("schema", name, "--json", cwd=tmp_path, home=tmp_path)
        assert res.returncode == 0, res.stderr
        printed = json.loads(res.stdout.strip().splitlines()[-1])
        assert printed == load_schema(name)
        jsonschema.Draft202012Validator.check_schema(printed)
    bad = corrflow("schema", "report", cwd=tmp_path, home=tmp_path)
    assert bad.returncode == 2 and "NAME" in bad.stderr and "privacy-report" in bad.stderr


@pytest.mark.integration
@pytest.mark.xdist_group("processes")
@pytest.mark.slow
def test_the_readme_demo_report_validates_against_the_printed_schema(tmp_path):
    """The README's first command (its `corrflow simulate …` part, on Flower's simulation engine:
    Ray start-up and 100 users make it a few minutes) writes a report that `corrflow schema
    privacy-report` validates."""
    first = (ROOT / "README.md").read_text().splitlines()[3]
    simulate = first[first.index("corrflow simulate") :].split()[1:]
    assert simulate[0] == "simulate" and "--out" in simulate
    run = corrflow(*simulate, cwd=tmp_path, home=tmp_path / "home")
    assert run.returncode == 0, run.stderr[-3000:]
    out = tmp_path / simulate[simulate.index("--out") + 1]
    printed = json.loads(corrflow("schema", "privacy-report", cwd=tmp_path, home=tmp_path).stdout)
    jsonschema.validate(
        _load(out / "privacy_report.json"), printed, cls=jsonschema.Draft202012Validator
    )
    validate("metrics", _load(out / "metrics.json"))
