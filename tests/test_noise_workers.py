"""Noise sharded over Ray actors (``--noise-workers``, corrflow.run.noise_shards), on a real Ray
head started once for the module (its own session and temp directory, stopped by pid): the released
models are bit-identical to the single process's with ε unchanged; a noise worker SIGKILLed mid-run,
one whose call fails with Ray's OutOfMemoryError and then dies again during the retried call, and
one that stops answering are restored from their checkpoints and the run releases the same models,
nothing twice; a worker lost for good, or whose state was edited, stops the run on the record
naming it with nothing of the round released; a resume with another number of workers is refused
with the number to use. The report names the workers (trust.noise_workers)."""

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

from corrflow.clients.tasks import task_for
from corrflow.config import RunConfig
from corrflow.errors import IntegrityError
from corrflow.run import noise_shards
from corrflow.run.checkpoint import current_checkpoint, load_arrays
from corrflow.run.journal import JOURNAL
from corrflow.schemas import validate
from corrflow.server.app import run_server
from corrflow.server.inprocess import InProcessGrid

KEY = bytes(range(16))
BIN = Path(sys.executable).parent
sys.path.insert(0, str(Path(__file__).parent))
from ray_fault_run import faulty_worker  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("processes")]


@pytest.fixture(scope="module")
def ray_address():
    """One Ray head for the module (``ray start --head --block`` in its own session, on loopback,
    in its own temp directory: no other ray.init() on this machine finds it); this process joins
    it; stopped by pid at the end."""
    ray = pytest.importorskip("ray")
    temp = Path(tempfile.mkdtemp(prefix="rn", dir="/tmp"))  # short: Ray's unix sockets live here
    head, address = start_ray_head(temp)
    try:
        start = time.monotonic()
        while True:
            try:
                ray.init(address=address, log_to_driver=False, configure_logging=False)
                break
            except Exception:  # the head answers TCP before it takes drivers
                assert head.poll() is None and time.monotonic() - start < 180
                time.sleep(1)
        yield address
    finally:
        ray.shutdown()
        stop_tree(head)
        shutil.rmtree(temp, ignore_errors=True)


#: The acceptance model: d = 2·10⁵ (4 noise blocks of 2¹⁶); the fault tests use 2 blocks
# (the numpy task's data generation grows with d and dominates these runs).
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
    run_server(
        InProcessGrid(task_for(cfg).handlers, cfg.num_users),
        cfg,
        noise_key=KEY,
        quiet=True,
        on_round_end=on_round_end,
    )


def _final(out: Path) -> tuple[np.ndarray, dict]:
    ckpt = current_checkpoint(out / "state")
    report = json.loads((out / "privacy_report.json").read_text())
    return np.concatenate([p.ravel() for p in load_arrays(ckpt, "model")]), report


def _journal_rounds(out: Path) -> list[int]:
    return [json.loads(line)["round"] for line in (out / JOURNAL).read_text().splitlines()]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    _run(_cfg(out))
    return _final(out)


@pytest.mark.integration
@pytest.mark.xdist_group("processes")
def test_two_noise_workers_release_the_single_process_models_bit_for_bit(ray_address, tmp_path):
    _run(_cfg(tmp_path / "single", dim=FULL_DIM))
    single = _final(tmp_path / "single")
    out = tmp_path / "sharded"
    _run(_cfg(out, 2, ray_address, FULL_DIM))
    model, report = _final(out)
    np.testing.assert_array_equal(model, single[0])
    assert report["realized"]["epsilon"] == single[1]["realized"]["epsilon"]
    assert report["rounds_completed"] == 8 and report["planned"] == single[1]["planned"]
    assert report["noise_multiplier"] == single[1]["noise_multiplier"]
    # each worker's shard state is on its own disk; the server's checkpoint holds none of it
    noise = current_checkpoint(out / "state") / "noise"
    assert sorted(p.name for p in noise.iterdir()) == ["noise_segments.key", "shards.json"]
    shards = sorted(p.name for p in (out / "noise-shards").iterdir())
    assert shards == ["shard-000000-000002", "shard-000002-000002"]


@pytest.mark.integration
@pytest.mark.xdist_group("processes")
def test_a_worker_sigkilled_mid_run_is_restored_and_nothing_is_released_twice(
    ray_address, single, tmp_path, caplog
):
    killed = []

    def kill_worker(strategy, metrics):
        if metrics["round"] == 2:  # after round 3's release: round 4's noise needs a new worker
            pid = strategy.run.noise.worker_info()[1]["pid"]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    # an earlier command in the same process may have set the "corrflow" logger's level or
    # handlers (compare's --quiet): listen on it directly, at INFO
    logger = logging.getLogger("corrflow")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="corrflow"):
            _run(_cfg(tmp_path, 2, ray_address), kill_worker)
    finally:
        logger.removeHandler(caplog.handler)
    model, report = _final(tmp_path)
    assert killed and report["rounds_completed"] == 8 and report["stopped_reason"] is None
    np.testing.assert_array_equal(model, single[0])
    assert _journal_rounds(tmp_path) == list(range(8))
    assert any(
        # the numpy task's model: model_dim weights and a bias
        f"noise worker 1 (coordinates 65536–70000), pid {killed[0]} was lost in round 4"
        in r.getMessage()
        for r in caplog.records
    ), [r.getMessage() for r in caplog.records]


def _listen(caplog):
    # an earlier command in the same process may have set the "corrflow" logger's level or
    # handlers (compare's --quiet): listen on it directly, at INFO
    logger = logging.getLogger("corrflow")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="corrflow")
    return lambda: logger.removeHandler(caplog.handler)


@pytest.mark.integration
@pytest.mark.xdist_group("processes")
def test_an_oom_a_death_during_the_retry_and_a_hung_worker_are_recovered(
    ray_address, single, tmp_path, caplog, monkeypatch
):
    # worker 1's round-3 call fails with OutOfMemoryError, its restart dies in the retried call,
    # the second restart answers; worker 0 stops answering in round 6 (SIGSTOP)
    plan = {"1:2": ["oom", "die"], "0:5": ["hang"]}
    monkeypatch.setattr(noise_shards, "NoiseWorker", faulty_worker(plan, str(tmp_path / "f")))
    monkeypatch.setattr(noise_shards, "CALL_TIMEOUT_S", 20.0)
    stop_listening = _listen(caplog)
    try:
        _run(_cfg(tmp_path / "run", 2, ray_address))
    finally:
        stop_listening()
    model, report = _final(tmp_path / "run")
    assert report["rounds_completed"] == 8 and report["stopped_reason"] is None
    np.testing.assert_array_equal(model, single[0])
    assert _journal_rounds(tmp_path / "run") == list(range(8))
    # the handler may see a record twice (on the logger and through the root): once each
    lost = list(dict.fromkeys(m for m in caplog.messages if "was lost in round" in m))
    assert len(lost) == 3, lost
    assert "noise worker 1 (coordinates 65536–70000)" in lost[0] and "round 3" in lost[0]
    assert "OutOfMemoryError" in lost[0] and "try 1 of 2" in lost[0]
    assert "ActorDiedError" in lost[1] and "try 2 of 2" in lost[1]
    assert "noise worker 0 (coordinates 0–65535)" in lost[2] and "round 6" in lost[2]
    assert "no answer within 20 s" in lost[2]
    # the report names the workers as trust parties, each with its state at the checkpoint
    validate("privacy-report", report)
    workers = report["trust"]["noise_workers"]
    assert workers["count"] == 2 and workers["checkpoint_round"] == 8
    assert [s["coordinates"] for s in workers["shards"]] == [[0, 65536], [65536, 70001]]
    shards = json.loads(
        (current_checkpoint(tmp_path / "run" / "state") / "noise" / "shards.json").read_text()
    )
    assert [s["state_sha256"] for s in workers["shards"]] == [
        s["state_sha256"] for s in shards["shards"]
    ]
    assert "Nothing of the run's noise key" in workers["compromised_worker_learns"]


@pytest.mark.integration
@pytest.mark.xdist_group("processes")
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
