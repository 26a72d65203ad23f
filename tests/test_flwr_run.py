"""`flwr run .` on this repository completes the default app (the docs' command), with its own
Flower home, ports and corrflow home; the local SuperLink that `flwr` spawns is stopped by pid
afterwards (every process whose environment carries this test's Flower home), and none survives."""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from independent import independent_epsilon

from corrflow.factorization import Factorization
from corrflow.run.reading import participation_users

ROOT = Path(__file__).parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_processes_with_home(home: Path) -> list[int]:
    """SIGKILL every process started with this test's Flower home in its environment (the detached
    local SuperLink, its SuperExec and their children inherit it), found by pid in /proc; returns
    their pids."""
    mark = f"FLWR_HOME={home}".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            with contextlib.suppress(OSError):
                if mark in (proc / "environ").read_bytes().split(b"\0"):
                    pids.append(int(proc.name))
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def _wait_for_completion(report: Path, rounds: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            if json.loads(report.read_text())["rounds_completed"] >= rounds:
                return
        time.sleep(1)


def test_loading_the_server_app_imports_every_client_app_the_pyprojects_name():
    """Flower's simulation loads the ServerApp and the ClientApp in two threads (one lock around
    each load) and takes a module already in sys.modules as it is: the ServerApp must finish
    importing corrflow's ClientApp modules when it is loaded, not lazily in its main, or the
    ClientApp loader can get a half-initialised module (`flwr run .` then failed at random with
    "partially initialized module … has no attribute 'app'")."""
    import tomllib

    refs = {
        tomllib.loads(p.read_text())["tool"]["flwr"]["app"]["components"]["clientapp"]
        for p in (ROOT / "pyproject.toml", ROOT / "deploy" / "app" / "pyproject.toml")
    }
    code = "import sys, corrflow.server.app; print(' '.join(sorted(sys.modules)))"
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    loaded = set(r.stdout.split())
    assert refs and all(ref.split(":")[0] in loaded for ref in refs), refs
    assert {"corrflow.clients.nextword_client", "corrflow.clients.keras_client"} <= loaded
    assert "tensorflow" not in loaded  # the Keras client imports TensorFlow only when it trains


@pytest.mark.integration
@pytest.mark.xdist_group("processes")
def test_flwr_run_completes_the_default_app(tmp_path):
    flwr = shutil.which("flwr", path=os.path.dirname(sys.executable))
    assert flwr, "flwr is installed with corrflow (flwr[simulation])"
    home, corrflow_home = tmp_path / "flwr-home", tmp_path / "corrflow-home"
    home.mkdir()
    env = dict(
        os.environ,
        FLWR_HOME=str(home),
        CORRFLOW_HOME=str(corrflow_home),
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(_free_port()),
        FLWR_LOCAL_CONTROL_API_PORT=str(_free_port()),
        PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
    )
    run_dir = corrflow_home / "flwr-run"
    try:
        r = subprocess.run(
            [flwr, "run", ".", "--stream", "--federation-config", "num-supernodes=10"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        # `--stream` can end early
        _wait_for_completion(run_dir / "privacy_report.json", rounds=10, timeout=300)
    finally:
        _stop_processes_with_home(home)
        deadline = time.monotonic() + 30
        # until none is alive
        while _stop_processes_with_home(home) and time.monotonic() < deadline:
            time.sleep(0.5)
    assert not _stop_processes_with_home(home), "a Flower process of this test survived"
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    assert f"run directory {run_dir}" in log, log[-3000:]  # the absolute state path is logged
    assert (run_dir / "privacy_report.json").exists(), log[-3000:]
    report = json.loads((run_dir / "privacy_report.json").read_text())
    assert report["rounds_completed"] == 10 and report["stopped_reason"] is None
    users = participation_users(report, run_dir)
    assert len(users) == 10
    independent = independent_epsilon(
        Factorization.load(run_dir / "factorization.npz"),
        users,
        report["noise_multiplier"],
        report["delta"],
    )
    assert (
        report["realized"]["epsilon"] == pytest.approx(independent, rel=1e-6)
        and independent <= 8.0 + 1e-6
    )
