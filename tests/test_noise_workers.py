"""Noise sharded over Ray actors (``--noise-workers``, corrflow.run.noise_shards), on a real Ray
head started once for the module (its own session and temp directory, stopped by pid): the released
models are bit-identical to the single process's with ε unchanged; a noise worker SIGKILLed mid-run,
one that stops answering, and one that Ray's own memory monitor kills mid-round (a second head,
started with the monitor's threshold just above the machine's use) and that then dies again during
the retried call are restored from their checkpoints and the run releases the same models, nothing
twice; a worker lost for good, or whose state was edited, stops the run on the record naming it
with nothing of the round released; a resume with another number of workers is refused with the
number to use. The report names the workers (trust.noise_workers).

The runs skip the numpy task's held-out evaluation (`_run`): its test set, 2,000 × d normal
draws, took most of a run's time at these d, and the released models do not depend on it."""

import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from process_support import start_ray_head, stop_tree

from corrflow.clients import numpy_client
from corrflow.config import RunConfig
from corrflow.errors import IntegrityError
from corrflow.run import noise_shards
from corrflow.run.checkpoint import load_checkpoint
from corrflow.run.journal import JOURNAL
from corrflow.schemas import validate
from corrflow.server.inprocess import InProcessGrid
from corrflow.strategies.session import RunSpec, run_strategy

KEY = bytes(range(16))
BIN = Path(sys.executable).parent
sys.path.insert(0, str(Path(__file__).parent))
from ray_fault_run import FILL_BYTES, faulty_worker  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("processes")]


def _join(ray, address: str, head=None) -> None:
    """Join the head at ``address`` from this process (the head answers TCP before it takes
    drivers: retry for up to 180 s while it is alive)."""
    start = time.monotonic()
    while True:
        try:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
            return
        except Exception:
            assert head is None or head.poll() is None, "the Ray head exited"
            assert time.monotonic() - start < 180, f"no Ray head took a driver at {address}"
            time.sleep(1)


@pytest.fixture(scope="module")
def ray_address():
    """One Ray head for the module (``ray start --head --block`` in its own session, on loopback,
    in its own temp directory: no other ray.init() on this machine finds it); this process joins
    it; stopped by pid at the end."""
    ray = pytest.importorskip("ray")
    temp = Path(tempfile.mkdtemp(prefix="rn", dir="/tmp"))  # short: Ray's unix sockets live here
    head, address = start_ray_head(temp)
    try:
        _join(ray, address, head)
        yield address
    finally:
        ray.shutdown()
        stop_tree(head)
        shutil.rmtree(temp, ignore_errors=True)


#: Where the memory monitor's threshold lies above the machine's use when its head starts. Ray's
# processes and the two workers add about 0.3 GiB, so the filling worker crosses it after about
# 1.5 GiB of its at most 3 GiB (measured: 2.2 GB at a margin of 2.5 GiB): other programs on the
# machine may shrink by about 1.5 GiB meanwhile and it still crosses; when they grow by as much,
# the monitor kills a worker before or after, which takes the same path.
MONITOR_MARGIN = 7 << 28


def _memory() -> tuple[int, int]:
    """The machine's total and used memory (MemTotal − MemAvailable, as Ray's monitor counts)."""
    info = {
        line.split(":")[0]: int(line.split()[1]) * 1024
        for line in Path("/proc/meminfo").read_text().splitlines()
    }
    return info["MemTotal"], info["MemTotal"] - info["MemAvailable"]


@pytest.fixture
def monitored_head(ray_address):
    """A second Ray head whose memory monitor checks every 50 ms and kills once the machine's
    use passes `MONITOR_MARGIN` above today's (Ray reads ``RAY_memory_usage_threshold`` and
    ``RAY_memory_monitor_refresh_ms`` from the head's environment when its raylet starts); this
    process joins it for the test, then the module's head again."""
    ray = pytest.importorskip("ray")
    total, used = _memory()
    assert used + MONITOR_MARGIN + FILL_BYTES < total, "not enough free memory for the test"
    threshold = (used + MONITOR_MARGIN) / total
    ray.shutdown()
    temp = Path(tempfile.mkdtemp(prefix="rm", dir="/tmp"))
    env = {"RAY_memory_monitor_refresh_ms": "50", "RAY_memory_usage_threshold": f"{threshold:.4f}"}
    head, address = start_ray_head(temp, env=env)
    try:
        _join(ray, address, head)
        yield address, temp
    finally:
        ray.shutdown()
        stop_tree(head)
        shutil.rmtree(temp, ignore_errors=True)
        _join(ray, ray_address)


#: The acceptance model: d = 2·10⁵ (4 noise blocks of 2¹⁶); the fault tests use 2 blocks, one per
# worker (the smallest model two workers can share).
FULL_DIM, SMALL_DIM = 200_000, 70_000


def _cfg(out: Path, workers: int = 0, address: str = "", dim: int = SMALL_DIM) -> RunConfig:
    """The sharded-noise run: toeplitz, 8 bands."""
    return RunConfig(
        kind="toeplitz",
        bands=8,
        model_dim=dim,
        num_users=16,
        num_rounds=8,
        epochs=2,
        local_steps=1,
        state_dir=str(out),
        noise_workers=workers,
        ray_address=address,
    )


def _run(cfg: RunConfig, on_round_end=None) -> None:
    """`corrflow.server.app.run_server`'s run of the numpy task (its initial model: zeros), with
    no held-out evaluation."""
    initial = [np.zeros(cfg.model_dim, np.float32), np.zeros(1, np.float32)]
    spec = RunSpec(cfg, initial, on_round_end=on_round_end, noise_key=KEY)
    run_strategy(InProcessGrid({"train": numpy_client.train}, cfg.num_users), spec)


def _final(out: Path) -> tuple[np.ndarray, dict]:
    ckpt = load_checkpoint(out / "state")
    report = json.loads((out / "privacy_report.json").read_text())
    return np.concatenate([p.ravel() for p in ckpt.arrays("model")]), report


def _journal_rounds(out: Path) -> list[int]:
    return [json.loads(line)["round"] for line in (out / JOURNAL).read_text().splitlines()]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    _run(_cfg(out))
    return _final(out)


def _listen(caplog):
    # an earlier command in the same process may have set the "corrflow" logger's level or
    # handlers (compare's --quiet): listen on it directly, at INFO
    logger = logging.getLogger("corrflow")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="corrflow")
    return lambda: logger.removeHandler(caplog.handler)


def _losses(caplog) -> list[str]:
    # the handler may see a record twice (on the logger and through the root): once each
    return list(dict.fromkeys(m for m in caplog.messages if "was lost in round" in m))


def _same_as_single(out: Path, single) -> dict:
    """The run at ``out`` finished with the single process's model, bit for bit, ε and plan, each
    round released once; returns its report."""
    model, report = _final(out)
    assert report["rounds_completed"] == 8 and report["stopped_reason"] is None
    np.testing.assert_array_equal(model, single[0])
    assert report["realized"]["epsilon"] == single[1]["realized"]["epsilon"]
    assert report["planned"] == single[1]["planned"]
    assert report["noise_multiplier"] == single[1]["noise_multiplier"]
    assert _journal_rounds(out) == list(range(8))
    return report


@pytest.mark.slow  # ~2 min on 2 cores; the fault tests compare bit for bit at one block per worker
def test_two_noise_workers_release_the_single_process_models_bit_for_bit(ray_address, tmp_path):
    _run(_cfg(tmp_path / "single", dim=FULL_DIM))
    single = _final(tmp_path / "single")
    out = tmp_path / "sharded"
    _run(_cfg(out, 2, ray_address, FULL_DIM))
    _same_as_single(out, single)
    # each worker's shard state is on its own disk; the server's checkpoint holds none of it
    ckpt = load_checkpoint(out / "state")
    assert sorted(ckpt.noise) == ["shards.json"] and "noise_segments.key" in ckpt.secrets
    shards = sorted(p.name for p in (out / "noise-shards").iterdir())
    assert shards == ["shard-000000-000002", "shard-000002-000002"]


def test_a_sigkilled_worker_and_a_hung_one_are_restored_and_release_the_single_process_models(
    ray_address, single, tmp_path, caplog, monkeypatch
):
    # worker 1 is SIGKILLed after round 3's release (round 4's noise needs a new worker); worker 0
    # stops answering in round 6 (SIGSTOP)
    killed = []

    def kill_worker(strategy, metrics):
        if metrics["round"] == 2:
            pid = strategy.run.noise.worker_info()[1]["pid"]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    plan = {"0:5": ["hang"]}
    monkeypatch.setattr(noise_shards, "NoiseWorker", faulty_worker(plan, str(tmp_path / "f")))
    monkeypatch.setattr(noise_shards, "CALL_TIMEOUT_S", 10.0)
    stop_listening = _listen(caplog)
    try:
        _run(_cfg(tmp_path / "run", 2, ray_address), kill_worker)
    finally:
        stop_listening()
    out = tmp_path / "run"
    report = _same_as_single(out, single)
    lost = _losses(caplog)
    assert killed and len(lost) == 2, lost
    # the numpy task's model: model_dim weights and a bias
    who = f"noise worker 1 (coordinates 65536–70000), pid {killed[0]}"
    assert f"{who} was lost in round 4" in lost[0]
    assert "noise worker 0 (coordinates 0–65535)" in lost[1] and "round 6" in lost[1]
    assert "no answer within 10 s" in lost[1] and "try 1 of 2" in lost[1]
    # each worker's shard state is on its own disk; the server's checkpoint holds none of it
    ckpt = load_checkpoint(out / "state")
    assert sorted(ckpt.noise) == ["shards.json"] and "noise_segments.key" in ckpt.secrets
    shards = sorted(p.name for p in (out / "noise-shards").iterdir())
    assert shards == ["shard-000000-000001", "shard-000001-000001"]
    # the report names the workers as trust parties, each with its state at the checkpoint
    validate("privacy-report", report)
    workers = report["trust"]["noise_workers"]
    assert workers["count"] == 2 and workers["checkpoint_round"] == 8
    assert [s["coordinates"] for s in workers["shards"]] == [[0, 65536], [65536, 70001]]
    recorded = json.loads(ckpt.noise["shards.json"])
    assert [s["state_sha256"] for s in workers["shards"]] == [
        s["state_sha256"] for s in recorded["shards"]
    ]
    assert "Nothing of the run's noise key" in workers["compromised_worker_learns"]


def test_a_worker_rays_memory_monitor_kills_mid_round_is_restored_though_it_dies_again(
    monitored_head, single, tmp_path, caplog, monkeypatch
):
    # worker 1 fills its memory in round 3 until Ray's monitor kills it; its restart dies in the
    # retried call; the second restart answers
    address, temp = monitored_head
    plan = {"1:2": ["memory", "die"]}
    monkeypatch.setattr(noise_shards, "NoiseWorker", faulty_worker(plan, str(tmp_path / "f")))
    stop_listening = _listen(caplog)
    try:
        _run(_cfg(tmp_path / "run", 2, address))
    finally:
        stop_listening()
    lost = _losses(caplog)
    # Ray's monitor killed it (its message, and the raylet's log), not an injected error
    by_monitor = "(OutOfMemoryError: 1 worker(s) were killed due to the node running low on memory"
    filled = [
        m
        for m in lost
        if m.startswith("noise worker 1 (coordinates 65536–70000), pid ")
        and f"was lost in round 3 {by_monitor}" in m
    ]
    assert filled, lost
    raylet = "".join(p.read_text() for p in temp.glob("session_*/logs/raylet.out"))
    assert "exceeds the memory usage threshold" in raylet
    out = tmp_path / "run"
    _, report = _final(out)
    validate("privacy-report", report)
    if report["stopped_reason"] is None:  # restored: the same bits, each round released once
        _same_as_single(out, single)
        died = [m for m in lost if "ActorDiedError" in m]
        assert len(died) == 1 and died[0].startswith("noise worker 1 "), lost
        assert "lost in round 3" in died[0] and "try 2 of 2" in died[0]
        assert len(filled) == 1 and "try 1 of 2" in filled[0]
        # any other loss: the monitor again, as another program's memory grew; restored alike
        assert all(by_monitor in m for m in lost if m not in died), lost
    else:  # another program's memory grew too: the monitor killed a restart as well
        reason = report["stopped_reason"]
        assert re.match(r"noise worker \d \(coordinates [0-9–]+\), pid \d+ was lost", reason)
        assert "could not be restored" in reason and reason.endswith("was not released")
        assert _journal_rounds(out) == list(range(report["rounds_completed"]))


def test_a_worker_lost_for_good_stops_the_run_naming_it_with_nothing_of_the_round_released(
    ray_address, tmp_path, monkeypatch
):
    plan = {"1:2": ["oom", "die", "die"]}  # RESTARTS = 2: the second restart dies too
    monkeypatch.setattr(noise_shards, "NoiseWorker", faulty_worker(plan, str(tmp_path / "f")))
    _run(_cfg(tmp_path / "run", 2, ray_address))
    _, report = _final(tmp_path / "run")
    reason = report["stopped_reason"]
    assert reason.startswith("noise worker 1 (coordinates 65536–70000), pid "), reason
    assert "was lost in round 3" in reason and "2 restart(s); ActorDiedError" in reason
    assert reason.endswith("round 3 was not released")
    assert report["rounds_completed"] == 2 and _journal_rounds(tmp_path / "run") == [0, 1]
    validate("privacy-report", report)


@pytest.mark.integration
@pytest.mark.xdist_group("processes")
@pytest.mark.slow  # ~35 s on 2 cores; the suite keeps the SIGKILL case
def test_an_edited_worker_state_stops_the_run_naming_it_and_resume_needs_the_same_workers(
    ray_address, tmp_path
):
    def edit_and_kill(strategy, metrics):
        if metrics["round"] == 1:
            state = next((tmp_path / "noise-shards" / "shard-000001-000001").glob("round-000002"))
            path = state / "shard_state.json"
            path.write_text(path.read_text().replace('"rounds"', '"rounds" ', 1))
            os.kill(strategy.run.noise.worker_info()[1]["pid"], signal.SIGKILL)

    _run(_cfg(tmp_path, 2, ray_address), edit_and_kill)
    _, report = _final(tmp_path)
    assert re.search(r"noise worker 1 .* lost in round 3.*disagrees", report["stopped_reason"])
    # round 3 was not released; the checkpoint is round 2's
    assert _journal_rounds(tmp_path) == [0, 1] and report["rounds_completed"] == 2
    with pytest.raises(IntegrityError, match="sharded over 2 noise workers.*--noise-workers 2"):
        _run(_cfg(tmp_path, 3, ray_address))
    with pytest.raises(IntegrityError, match="sharded over 2 noise workers.*not 0"):
        _run(_cfg(tmp_path, 0))
    with pytest.raises(IntegrityError, match="noise worker 1 .*disagrees with the server's"):
        _run(_cfg(tmp_path, 2, ray_address))
    assert _journal_rounds(tmp_path) == [0, 1]
