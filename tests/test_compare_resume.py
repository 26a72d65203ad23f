"""compare as the longest command must be: Ctrl-C exits 130 without a traceback, rerunning the same
command continues (finished arms kept, the interrupted one restarted afresh), other settings are
refused naming the difference; `corrflow report` re-prints a finished arm's summary. Real
processes and a real SIGINT."""

import json
import signal
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from corrflow.cli import app

CLI = [sys.executable, "-m", "corrflow.server.cli"]
ARGS = ["compare", "--preset", "tiny", "--rounds", "16", "--users", "80"]


@pytest.mark.integration
def test_compare_interrupted_then_resumed(tmp_path):
    out = tmp_path / "cmp"
    err_path = tmp_path / "first.err"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(
            [*CLI, *ARGS, "--out", str(out)], stdout=subprocess.PIPE, stderr=err, text=True
        )
        deadline = time.monotonic() + 240
        while "arm 3 of 5" not in err_path.read_text():  # two arms finished, the third training
            assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()
            time.sleep(0.1)
        time.sleep(0.2)  # inside the third arm's 16 rounds (about 1 s on an idle 2-core machine)
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=120)
    first = err_path.read_text()
    assert proc.returncode == 130, first
    assert "Traceback" not in first and "rerun the same command" in first

    # in this process (the refusal comes before any training): a CLI start saved
    changed = CliRunner().invoke(app, [*ARGS[:-1], "96", "--out", str(out)])
    assert changed.exit_code == 2, changed.output
    assert "--out" in changed.output and "users: 80 then, 96 now" in changed.output

    again = subprocess.run(
        [*CLI, *ARGS, "--out", str(out)], capture_output=True, text=True, timeout=600
    )
    assert again.returncode == 0, again.stderr
    assert "kept seed 0 nonprivate" in again.stderr
    assert "kept seed 0 ε = 8 dpsgd " in again.stderr
    assert "arm 1 of 5" not in again.stderr and "arm 2 of 5" not in again.stderr
    # the arm the signal interrupted trains again from round 0 (its earlier run, if it had
    # checkpointed a round, moved aside: "restarted afresh")
    assert "arm 3 of 5" in again.stderr
    result = json.loads((out / "comparison.json").read_text())
    arms = result["epsilons"]["8"]["arms"]
    assert set(arms) == {"nonprivate", "dpsgd", "dpsgd-poisson", "toeplitz", "plan"}
    assert all(a["epsilon"] is None or a["epsilon"] <= 8 * (1 + 1e-9) for a in arms.values())
    assert not result["stopped"]

    run = out / "eps8" / "runs" / "toeplitz-seed0"
    rep = CliRunner().invoke(app, ["report", str(run)])
    assert rep.exit_code == 0, rep.output
    assert "privacy     ε = " in rep.stdout and "16 completed" in rep.stdout
    assert (run / "run.png").stat().st_size > 0

    # a kept result that ran another recipe (say, an older planner's pick) is not kept: the arm
    # retrains and the old result is set aside, never mixed into the comparison
    plan_result = out / "eps8" / "runs" / "plan-seed0" / "arm_result.json"
    old = json.loads(plan_result.read_text())
    plan_result.write_text(json.dumps({**old, "noise_multiplier": old["noise_multiplier"] * 2}))
    third = subprocess.run(
        [*CLI, *ARGS, "--out", str(out)], capture_output=True, text=True, timeout=600
    )
    assert third.returncode == 0, third.stderr
    assert "plan, seed 0, ε = 8: its kept result ran another configuration (noise_multiplier" in (
        third.stderr
    )
    assert "kept seed 0 ε = 8 toeplitz " in third.stderr and "arm 5 of 5" in third.stderr
    assert "kept seed 0 ε = 8 dpsgd-poisson " in third.stderr  # a recipe arm planned the same
    assert third.stderr.count("ran another configuration") == 1
    assert json.loads(plan_result.read_text())["noise_multiplier"] == old["noise_multiplier"]
    assert len(list(plan_result.parent.glob("arm_result.json.stale-*"))) == 1
