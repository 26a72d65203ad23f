"""Faults on Flower's simulation engine (Ray), with real processes: Ctrl-C (SIGINT to the process
group, as a terminal sends it) and the resume (the suite's case: one start on Ray); Ctrl-C, then
SIGKILL of the whole group, then a clean finish, all on Ray (slow: three starts). Each run starts
in its own session (setsid) and every pid of it is killed at the end (Ray's agents ignore SIGTERM;
never `ray stop`, which would stop other Ray processes by name)."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from corrflow.accounting import epsilon_of, realized_sensitivity, unamplified_event
from corrflow.factorization import Factorization
from corrflow.run.checkpoint import load_checkpoint
from corrflow.run.journal import JOURNAL, ReleaseJournal
from corrflow.run.reading import participation_users

TESTS = Path(__file__).parent
ENV = dict(
    os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]), RAY_DEDUP_LOGS="0"
)
sys.path.insert(0, str(TESTS))
import ray_fault_run  # noqa: E402
from lineage_support import segments  # noqa: E402
from ray_fault_run import KEY, config  # noqa: E402


def _model(out: Path) -> np.ndarray:
    """The run's model at its published checkpoint, flattened."""
    params = load_checkpoint(out / "state").arrays("model")
    return np.concatenate([p.ravel() for p in params])


def _released(out: Path) -> int:
    try:
        return len((out / JOURNAL).read_text().splitlines())
    except FileNotFoundError:
        return 0


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL every process of the run's session (the driver and the Ray processes it started)."""
    out = subprocess.run(["ps", "-eo", "pid=,sid="], capture_output=True, text=True).stdout
    for line in out.splitlines():
        pid, sid = map(int, line.split())
        if sid == proc.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    proc.wait()


def _start(out: Path, log) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(TESTS / "ray_fault_run.py"), str(out)],
        env=ENV,
        stdout=log,
        stderr=log,
        start_new_session=True,
    )


def _wait_for_releases(proc, out: Path, count: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while _released(out) < count:
        assert proc.poll() is None, (
            f"the run ended (code {proc.returncode}) before {count} releases"
        )
        assert time.monotonic() < deadline, f"no {count} releases within {timeout} s"
        time.sleep(0.02)


def _ctrl_c(out: Path, log, log_path: Path) -> int:
    """Start the run on Ray and send SIGINT to its whole process group (as a terminal's Ctrl-C)
    once rounds are being released: it exits 130 with the report saying so, no traceback, each
    round it released on the record; returns the rounds it completed."""
    proc = _start(out, log)
    try:
        _wait_for_releases(proc, out, 2)
        os.killpg(proc.pid, signal.SIGINT)
        # Ray's shutdown takes seconds on an idle machine and much longer on a loaded one: a
        # generous bound that only catches a hang (timings are benchmarks' business, not the
        # suite's).
        assert proc.wait(timeout=180) == 130
    finally:
        _kill_session(proc)
    report = json.loads((out / "privacy_report.json").read_text())
    interrupted_at = report["rounds_completed"]
    assert 2 <= interrupted_at < 24 and "interrupted" in report["stopped_reason"]
    assert _released(out) == interrupted_at
    assert "Traceback" not in log_path.read_text()
    return interrupted_at


def _check_lineage_and_privacy(tmp_path: Path, out: Path, starts: int) -> list[int]:
    """The finished run at ``out``: each of its ``starts`` drew the rounds after its checkpoint with
    a fresh key, so it differs from an uninterrupted run with the first key, and the in-process
    engine (in this process), given the recorded keys at the recorded rounds, replays it bit for
    bit (same clients, same order); exactly --users identities, each in k = 2 rounds b = 12
    apart; every round released once; ε recomputed from the realized participation. Returns each
    start's first round."""
    table = segments(out)
    firsts = [r for r, _ in table]
    assert table[0][1] == KEY and len({k for _, k in table}) == starts == len(table)
    for e in ReleaseJournal(out / JOURNAL).read():  # each release names the segment that drew it
        assert e.noise_segment["first_round"] == max(r for r in firsts if r <= e.round)
    ref, replayed = tmp_path / "ref", tmp_path / "replayed"
    ray_fault_run.run(str(ref), "inprocess")
    ray_fault_run.replay(str(replayed), str(out))
    assert not np.array_equal(_model(out), _model(ref))
    np.testing.assert_array_equal(_model(out), _model(replayed))

    cfg = config(str(out))
    report = json.loads((out / "privacy_report.json").read_text())
    users = participation_users(report, out)
    assert report["rounds_completed"] == 24 and report["stopped_reason"] is None
    assert len(users) == cfg.num_users
    assert all(
        len(u["rounds"]) == 2 and u["rounds"][1] - u["rounds"][0] == 12 for u in users.values()
    )
    assert [e.round for e in ReleaseJournal(out / JOURNAL).read()] == list(range(24))
    fac = Factorization.load(out / "factorization.npz")
    sens, _ = realized_sensitivity(fac.encoder, {u: v["rounds"] for u, v in users.items()})
    assert sens.value == pytest.approx(1.0)
    assert report["realized"]["epsilon"] == pytest.approx(
        epsilon_of(unamplified_event(0.7, sens.value), 1e-5), rel=1e-12
    )
    assert KEY.hex() not in json.dumps(report)
    return firsts


@pytest.mark.integration
@pytest.mark.xdist_group("processes")
def test_ctrl_c_on_ray_exits_130_and_the_run_resumes_with_a_fresh_key(tmp_path):
    """One start on Flower's engine (Ray), Ctrl-C, then the resume finished on the in-process
    engine, in this process (a start on Ray costs about half a minute; the slow test below resumes
    on Ray, after a SIGKILL of every process too)."""
    out, log_path = tmp_path / "run", tmp_path / "log.txt"
    with open(log_path, "w") as log:
        interrupted_at = _ctrl_c(out, log, log_path)
    ray_fault_run.run(str(out), "inprocess")
    assert _check_lineage_and_privacy(tmp_path, out, starts=2) == [0, interrupted_at]


@pytest.mark.integration
@pytest.mark.xdist_group("processes")
@pytest.mark.slow  # three starts on Ray: ~2 min on 2 cores; the suite keeps the Ctrl-C case
def test_ctrl_c_then_sigkill_then_finish_on_ray(tmp_path):
    out, log_path = tmp_path / "run", tmp_path / "log.txt"
    log = open(log_path, "w")  # noqa: SIM115 - shared by three runs, closed below
    # 1. Ctrl-C: SIGINT to the run's whole process group once rounds are being released.
    interrupted_at = _ctrl_c(out, log, log_path)
    # 2. Restart, then SIGKILL everything mid-run (no chance to write anything more).
    proc = _start(out, log)
    try:
        _wait_for_releases(proc, out, interrupted_at + 2)
        _kill_session(proc)
    finally:
        _kill_session(proc)
    killed_at = _released(out)
    assert killed_at < 24, "the run finished before it could be killed"
    # 3. Restart and finish.
    proc = _start(out, log)
    try:
        assert proc.wait(timeout=240) == 0, log_path.read_text()[-3000:]
    finally:
        _kill_session(proc)
    log.close()
    firsts = _check_lineage_and_privacy(tmp_path, out, starts=3)
    assert firsts[:2] == [0, interrupted_at] and firsts[2] in (killed_at, killed_at + 1)


# -- noise workers on a lost Ray head; signals with and without workers ---------------------------
def _cli(out: Path, log, *extra: str) -> subprocess.Popen:
    args = ["--users", "40", "--rounds", "40", "--epochs", "2", "--local-steps", "1"]
    return subprocess.Popen(
        [sys.executable, "-m", "corrflow.server.cli", "simulate", "--backend", "inprocess"]
        + args
        + ["--out", str(out), *extra],
        env=ENV,
        stdout=log,
        stderr=log,
        start_new_session=True,
    )


def _interrupt(out: Path, log_path: Path, signum: int, *extra: str) -> str:
    """Start a run (or resume it), send ``signum`` to its process once it released a round, and
    return its output; it must exit 130 with corrflow's message."""
    before = _released(out)
    with open(log_path, "w") as log:
        proc = _cli(out, log, *extra)
        try:
            _wait_for_releases(proc, out, before + 1)
            os.kill(proc.pid, signum)
            assert proc.wait(timeout=120) == 130, log_path.read_text()[-3000:]
        finally:
            _kill_session(proc)
    text = log_path.read_text()
    assert "interrupted: interrupted by the operator (SIGINT/SIGTERM)" in text, text[-3000:]
    assert "Traceback" not in text
    report = json.loads((out / "privacy_report.json").read_text())
    assert report["stopped_reason"].startswith("interrupted by the operator")
    assert report["rounds_completed"] == _released(out) < 40
    return text


@pytest.mark.integration
@pytest.mark.xdist_group("processes")
def test_sigterm_and_sigint_exit_130_without_noise_workers(tmp_path):
    for signum in (signal.SIGTERM, signal.SIGINT):
        _interrupt(tmp_path / "run", tmp_path / "log.txt", signum, "--model-dim", "6")


@pytest.mark.integration
@pytest.mark.xdist_group("processes")
@pytest.mark.slow  # two Ray heads and five starts of the CLI: ~2–3 min on 2 busy cores
def test_a_lost_head_stops_the_run_within_30_s_and_a_new_head_resumes_it(tmp_path):
    from process_support import kill_tree, start_ray_head, stop_tree

    out, log_path = tmp_path / "run", tmp_path / "log.txt"
    workers = ["--model-dim", "70000", "--noise-workers", "2", "--ray-address"]
    head, address = start_ray_head(Path(tempfile.mkdtemp(prefix="rh", dir="/tmp")))
    try:
        with open(log_path, "w") as log:
            proc = _cli(out, log, *workers, address)
            try:
                _wait_for_releases(proc, out, 2, timeout=240)
                kill_tree(head)  # the head's GCS, raylet and the workers on its node
                killed = time.monotonic()
                rc = proc.wait(timeout=90)
                took = time.monotonic() - killed
            finally:
                _kill_session(proc)
    finally:
        kill_tree(head)
    text = log_path.read_text()
    report = json.loads((out / "privacy_report.json").read_text())
    assert rc == 1 and took < 30, (rc, took, text[-3000:])
    print(f"lost head: the run exited {took:.1f} s after the head was killed")
    assert "Traceback" not in text and "Failed to connect to GCS" not in text, text[-3000:]
    reason = report["stopped_reason"]
    assert f"the Ray cluster's head at {address} stopped answering" in reason, reason
    assert reason.endswith("was not released") and reason in text
    assert 2 <= report["rounds_completed"] == _released(out) < 40
    assert report["trust"]["noise_workers"]["count"] == 2
    # A new head: the run resumes with its workers' states on disk; SIGTERM and SIGINT exit 130
    # with the workers too (Ray's own SIGTERM handler would exit 15); then it finishes.
    head, address = start_ray_head(Path(tempfile.mkdtemp(prefix="rh", dir="/tmp")))
    try:
        for signum in (signal.SIGTERM, signal.SIGINT):
            _interrupt(out, log_path, signum, *workers, address)
        with open(log_path, "w") as log:
            proc = _cli(out, log, *workers, address)
            try:
                assert proc.wait(timeout=300) in (0, 3), log_path.read_text()[-3000:]
            finally:
                _kill_session(proc)
    finally:
        stop_tree(head)
    report = json.loads((out / "privacy_report.json").read_text())
    assert report["rounds_completed"] == 40 and report["stopped_reason"] is None
    assert [e.round for e in ReleaseJournal(out / JOURNAL).read()] == list(range(40))
    table = segments(out)  # every start drew its rows with a fresh key
    assert len(table) == 4 and len({k for _, k in table}) == 4
    assert report["lineage"]["rounds_released_twice"] == []


def test_noise_workers_on_flowers_engine_are_refused_naming_both_flags(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "corrflow.server.cli", "simulate", "--backend", "flower"]
        + ["--noise-workers", "2", "--model-dim", "70000", "--users", "8", "--rounds", "4"]
        + ["--epochs", "2", "--out", str(tmp_path / "run")],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert "--noise-workers: expected 0 with --backend flower" in r.stderr
    assert "--backend inprocess" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()  # a refusal writes nothing


@pytest.mark.integration
def test_a_failed_engine_ends_the_run_at_once_naming_its_cause(tmp_path):
    """Ray refusing to start (here: a RAY_RUNTIME_ENV_HOOK that does not import) would leave the
    ServerApp's thread probing nodes that can never answer, for node-timeout (600 s): the command
    ends within seconds instead, exit 1, one line naming the cause, no traceback, nothing
    trained."""
    out = tmp_path / "run"
    started = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "corrflow.server.cli", "simulate", "--users", "4", "--rounds", "2"]
        + ["--epochs", "1", "--noise-multiplier", "0.5", "--out", str(out)],
        env={**ENV, "RAY_RUNTIME_ENV_HOOK": "no_such_module_anywhere.hook"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 1, r.stderr[-3000:]
    assert time.monotonic() - started < 120
    assert "Traceback" not in r.stderr
    assert "error: Flower's simulation engine failed: ModuleNotFoundError" in r.stderr
    assert "no_such_module_anywhere" in r.stderr and "engine.log" in r.stderr
    assert (
        not (out / "state").exists()
        and "no_such_module_anywhere" in (out / "engine.log").read_text()
    )
