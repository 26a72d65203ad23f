"""The printed ε stays true under faults: one server per directory, refusals on tampered or
rolled-back state, declared identities, stop reasons, bad inputs. Real processes and real files; the
in-process grid (no Ray)."""

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from checkpoint_support import checkpoint, checkpoint_file, replace_member, secret_file
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from strategy_support import HANDLERS, KEY, forget_last_release
from strategy_support import small_config as _cfg

from corrflow.accounting import epsilon_of, realized_sensitivity, unamplified_event
from corrflow.config import RunConfig, from_run_config
from corrflow.errors import IntegrityError, InvalidArgumentError
from corrflow.factorization import Factorization
from corrflow.run.journal import JOURNAL, ReleaseJournal
from corrflow.run.reading import participation_users
from corrflow.server.app import run_server
from corrflow.server.inprocess import InProcessGrid
from corrflow.strategies.identity import IdentityError

TESTS = Path(__file__).parent
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]))


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def _finished_run(tmp_path, copy_at: int | None = None) -> tuple[RunConfig, Path | None]:
    cfg = _cfg(tmp_path, num_rounds=8, epochs=2)
    snapshot = tmp_path / "state-at-round"

    def copy_state(strategy, metrics):
        if metrics["round"] + 1 == copy_at:
            shutil.copytree(tmp_path / "state", snapshot)

    run_server(InProcessGrid(HANDLERS, 12), cfg, noise_key=KEY, quiet=True, on_round_end=copy_state)
    return cfg, snapshot if copy_at else None


@pytest.mark.integration
def test_second_server_on_the_same_directory_exits_at_once(tmp_path):
    # the first server's replies wait while it exists
    hold = tmp_path.parent / f"{tmp_path.name}.hold"
    hold.touch()
    first = subprocess.Popen(
        [sys.executable, str(TESTS / "fault_run.py"), str(tmp_path)],
        env=dict(ENV, HOLD=str(hold)),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not (
            tmp_path / ".corrflow.lock.holder"
        ).exists():  # the first server holds the directory
            assert first.poll() is None and time.monotonic() < deadline, (
                first.stderr.read() if first.stderr else ""
            )
            time.sleep(0.05)
        second = subprocess.run(
            [sys.executable, str(TESTS / "fault_run.py"), str(tmp_path)],
            env=ENV,
            capture_output=True,
            text=True,
            timeout=600,
        )
        # refused while the first server still runs, not queued behind it
        assert first.poll() is None
        assert second.returncode != 0
        assert (
            "in use by another corrflow server" in second.stderr
            and f"pid {first.pid}" in second.stderr
        )
        hold.unlink()
        assert first.wait(timeout=240) == 0, first.stderr.read()
    finally:
        first.kill()
    report = json.loads((tmp_path / "privacy_report.json").read_text())
    assert report["rounds_completed"] == 8 and report["stopped_reason"] is None
    assert len(ReleaseJournal(tmp_path / JOURNAL).read()) == 8


@pytest.mark.integration
def test_lock_dies_with_a_killed_server(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, str(TESTS / "fault_run.py"), str(tmp_path)],
        env=dict(ENV, ROUND_DELAY="0.2"),
    )
    deadline = time.monotonic() + 120
    while not (tmp_path / JOURNAL).exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    r = subprocess.run(
        [sys.executable, str(TESTS / "fault_run.py"), str(tmp_path)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    entries = ReleaseJournal(tmp_path / JOURNAL).read()
    assert [e.round for e in entries] == list(range(8))  # every noise round released exactly once
    assert not list((tmp_path / "state").glob(".tmp-*"))


@pytest.mark.parametrize(
    "fault, names",
    [
        ("delete-checkpoint", "checkpoint.zip: missing"),
        ("edit-state", "state.json"),
        ("edit-ledger", "ledger.jsonl"),
        ("truncate-ledger", "ledger.jsonl"),
        ("old-state", "older than what was released"),
        ("empty-salt", "report_salt"),
        ("journal-truncated", JOURNAL),
        ("journal-edited", JOURNAL),
        ("edit-ring-row", "noise_ring.bin"),
        ("swap-ring-rows", "noise_ring.bin"),
    ],
)
def test_tampered_or_rolled_back_state_is_refused(tmp_path, fault, names):
    cfg, snapshot = _finished_run(tmp_path, copy_at=3)
    ckpt = checkpoint(tmp_path)
    if fault == "delete-checkpoint":
        checkpoint_file(tmp_path).unlink()
    elif fault == "edit-state":
        public = dict(ckpt.public)
        public["ledger_log"]["lines"] -= 1  # vouch for one round less of the ledger log
        replace_member(tmp_path, "state.json", json.dumps(public, sort_keys=True).encode())
    elif fault in ("edit-ledger", "truncate-ledger"):  # the append-only ledger log
        log_path = tmp_path / "state" / "ledger.jsonl"
        lines = log_path.read_text().splitlines(keepends=True)
        if fault == "edit-ledger":
            entry = json.loads(lines[1])
            entry["selected"] = entry["selected"][1:]  # hide a participation
            lines[1] = json.dumps(entry, sort_keys=True, separators=(",", ":")) + "\n"
        else:
            lines = lines[:-1]
        log_path.write_text("".join(lines))
    elif fault == "old-state":
        shutil.rmtree(tmp_path / "state")
        shutil.copytree(snapshot, tmp_path / "state")
    elif fault == "empty-salt":
        secret_file(tmp_path, "report_salt").write_bytes(b"")
    elif fault in (
        "edit-ring-row",
        "swap-ring-rows",
    ):  # the banded buffer's rows, outside the checkpoint file
        ring = tmp_path / "state" / "noise_ring.bin"
        raw = bytearray(ring.read_bytes())
        rows = json.loads(ckpt.noise["noise_state.json"])["ring"]
        size, slot = rows["row_bytes"], rows["rows"][-1]["slot"]
        if fault == "edit-ring-row":
            raw[slot * size + 5] ^= 1
        else:
            other = rows["rows"][0]["slot"]
            raw[slot * size : (slot + 1) * size], raw[other * size : (other + 1) * size] = (
                raw[other * size : (other + 1) * size],
                raw[slot * size : (slot + 1) * size],
            )
        ring.write_bytes(bytes(raw))
    elif fault == "journal-truncated":
        lines = (tmp_path / JOURNAL).read_text().splitlines(keepends=True)
        (tmp_path / JOURNAL).write_text("".join(lines[:-2]))
    elif fault == "journal-edited":
        lines = (tmp_path / JOURNAL).read_text().splitlines(keepends=True)
        lines[2] = lines[2].replace('"round": 2', '"round": 5')
        (tmp_path / JOURNAL).write_text("".join(lines))
    before = _files(tmp_path)
    with pytest.raises(IntegrityError, match=names):
        run_server(InProcessGrid(HANDLERS, 12), cfg, quiet=True)
    assert _files(tmp_path) == before  # nothing deleted, nothing rewritten


def test_unreleased_checkpoint_is_released_on_resume_and_fresh_moves_the_run_aside(tmp_path):
    cfg, _ = _finished_run(tmp_path)
    lines = (tmp_path / JOURNAL).read_text().splitlines(keepends=True)
    # killed between round 7's checkpoint and its entry
    (tmp_path / JOURNAL).write_text("".join(lines[:-1]))
    forget_last_release(tmp_path)  # (so the registry never recorded it either)
    s = run_server(InProcessGrid(HANDLERS, 12), cfg, quiet=True)
    assert s.next_round == 8 and len(ReleaseJournal(tmp_path / JOURNAL).read()) == 8
    old_report = (tmp_path / "privacy_report.json").read_bytes()
    s = run_server(InProcessGrid(HANDLERS, 12), cfg, quiet=True, fresh=True)
    moved = list((tmp_path / "previous-runs").iterdir())
    assert len(moved) == 1 and (moved[0] / "privacy_report.json").read_bytes() == old_report
    assert len(ReleaseJournal(moved[0] / JOURNAL).read()) == 8
    assert s.next_round == 8 and len(ReleaseJournal(tmp_path / JOURNAL).read()) == 8
    assert (
        json.loads((tmp_path / "privacy_report.json").read_text())["run_id"]
        != json.loads(old_report)["run_id"]
    )


def test_fresh_moves_the_checkpoints_with_their_journal_whatever_the_run_directory_is_called(
    tmp_path,
):
    """--fresh (the wrapper's fresh=True) moves state/ with the journal, report and metrics: the
    next start would otherwise meet a checkpoint without its journal (or resume the old run)."""
    cfg = _cfg(tmp_path / "server-state", num_rounds=4, epochs=2)
    first = run_server(InProcessGrid(HANDLERS, 12), cfg, quiet=True)
    second = run_server(InProcessGrid(HANDLERS, 12), cfg, quiet=True, fresh=True)
    (moved,) = (tmp_path / "server-state" / "previous-runs").iterdir()
    assert (moved / "state" / "checkpoint.zip").exists() and len(
        ReleaseJournal(moved / JOURNAL).read()
    ) == 4
    assert (moved / "privacy_report.json").exists() and (moved / "metrics.json").exists()
    assert second.run.run_id != first.run.run_id
    assert len(ReleaseJournal(tmp_path / "server-state" / JOURNAL).read()) == 4
    assert second.ledger.selected != {} and second.next_round == 4


def test_other_settings_are_named_on_resume(tmp_path):
    cfg, _ = _finished_run(tmp_path)
    other = RunConfig(**{**cfg.to_dict(), "clip_norm": 2.0, "server_lr": cfg.server_lr / 2})
    diff = rf"clip_norm: 1\.0 → 2\.0.*server_lr: {cfg.server_lr} → {cfg.server_lr / 2}.*--fresh"
    with pytest.raises(IntegrityError, match=diff):
        run_server(InProcessGrid(HANDLERS, 12), other, quiet=True)


def test_the_cli_names_every_setting_that_differs(tmp_path):
    """Rerunning `simulate` on a finished run with other flags is refused, and the message lists
    each difference (an 80-character cut once hid all but the first)."""
    base = [
        sys.executable,
        "-m",
        "corrflow.server.cli",
        "simulate",
        "--backend",
        "inprocess",
        "--users",
        "12",
        "--rounds",
        "4",
        "--epochs",
        "2",
        "--out",
        str(tmp_path / "run"),
    ]
    assert (
        subprocess.run(base, env=ENV, capture_output=True, text=True, timeout=300).returncode == 0
    )
    r = subprocess.run(
        [*base, "--clip-norm", "2", "--server-lr", "0.25", "--momentum", "0.3", "--seed", "4"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2
    for setting in ("clip_norm", "server_lr", "momentum", "seed"):
        assert setting in r.stderr, r.stderr
    assert (tmp_path / "run" / ".gitignore").read_text().splitlines()[
        -1
    ] == "*"  # the run's secrets stay out of git


def test_node_without_the_identity_mod_is_refused_naming_the_fix(tmp_path):
    cfg = _cfg(tmp_path)
    with pytest.raises(
        IdentityError,
        match=r"cannot report identity = partition-id.*no corrflow identity "
        r"handler.*register_identity",
    ):
        run_server(InProcessGrid(HANDLERS, 12, identity=False), cfg, quiet=True)
    user_cfg = _cfg(tmp_path, identity="user-id")
    with pytest.raises(IdentityError, match="user-id"):
        run_server(InProcessGrid(HANDLERS, 12), user_cfg, quiet=True)
    assert not (tmp_path / "state").exists() and not (tmp_path / JOURNAL).exists()


def test_user_id_identity_and_a_restarted_node_keep_their_ledger(tmp_path):
    cfg = _cfg(tmp_path, identity="user-id")
    grid = InProcessGrid(HANDLERS, 12, node_config=lambda p: {"user-id": f"device-{p:02d}"})
    restarted = {}

    def restart(strategy, metrics):
        # partition 0 trains in rounds r and r + 3: give it a new node id in between
        if metrics["round"] == 1:
            restarted["node"] = grid.restart_node(0)

    s = run_server(grid, cfg, noise_key=KEY, quiet=True, on_round_end=restart)
    assert s.next_round == 6 and not s.ledger.rejections
    assert sorted(s.ledger.selected) == sorted(f"user-device-{p:02d}" for p in range(12))
    assert all(len(r) == 2 for r in s.ledger.selected.values())
    assert s.directory.node_to_user[restarted["node"]] == "user-device-00"


def test_the_node_directory_maps_a_new_listing_once_and_retries_a_failed_mapping():
    """`NodeDirectory.refresh` reuses its set while the in-process grid lists the same tuple (no
    population-sized work per round), maps a restarted node when the listing changes, and asks
    again after a mapping that raised."""
    from corrflow.strategies.messaging import NodeDirectory

    grid = InProcessGrid(HANDLERS, 5)
    calls, fail = [], [True]

    def resolve(nodes):
        calls.append(nodes)
        if fail[0]:
            raise IdentityError("probe failed")
        return {n: "user-2" for n in nodes}

    directory = NodeDirectory({n: f"user-{p}" for n, p in grid.nodes.items()}, resolve, b"salt")
    first = directory.refresh(grid)
    assert first == set(grid.nodes) and directory.refresh(grid) is first and calls == []
    new = grid.restart_node(2)
    with pytest.raises(IdentityError):
        directory.refresh(grid)
    fail[0] = False
    online = directory.refresh(grid)
    assert calls == [[new], [new]] and new in online
    assert directory.node_to_user[new] == "user-2" and directory.user_to_node["user-2"] == new
    assert directory.refresh(grid) is online and len(calls) == 2


def test_per_launch_identity_is_marked_and_never_resumes(tmp_path):
    cfg = _cfg(tmp_path, identity="per-launch", num_rounds=2, epochs=1, num_users=4)
    run_server(InProcessGrid(HANDLERS, 4), cfg, quiet=True)
    report = json.loads((tmp_path / "privacy_report.json").read_text())
    assert report["identity"] == {"source": "per-launch", "stable_across_restarts": False}
    with pytest.raises(IntegrityError, match="per-launch runs cannot resume"):
        run_server(InProcessGrid(HANDLERS, 4), cfg, quiet=True)


def _nan_train(msg, ctx):
    arrays = [np.full_like(a, np.nan) for a in msg.content["arrays"].to_numpy_ndarrays()]
    return Message(
        content=RecordDict(
            {"arrays": ArrayRecord(arrays), "metrics": MetricRecord({"num-examples": 1})}
        ),
        reply_to=msg,
    )


def test_all_nan_replies_stop_the_run_on_the_record(tmp_path, caplog):
    from corrflow.server.simulation import RunStoppedEarlyError, simulate

    cfg = _cfg(tmp_path, max_empty_rounds=2)
    with caplog.at_level(logging.WARNING, logger="corrflow"):
        s = run_server(InProcessGrid({**HANDLERS, "train": _nan_train}, 12), cfg, quiet=True)
    report = json.loads((tmp_path / "privacy_report.json").read_text())
    assert s.next_round == 2 and report["rounds_completed"] == 2
    assert "no valid replies in 2 consecutive rounds" in report["stopped_reason"]
    assert "NaN or Inf values ×8" in report["stopped_reason"]  # 2 rounds × 4 users
    metrics = json.loads((tmp_path / "metrics.json").read_text())[
        1:
    ]  # after the initial model's entry
    assert [m["rejected"] for m in metrics] == [4, 4] and metrics[0][
        "top_rejection"
    ] == "NaN or Inf values"
    # The ε of the two rounds that did run (noise only) is still accounted.
    fac = Factorization.load(tmp_path / "factorization.npz")
    sens, _ = realized_sensitivity(fac.encoder, {u: r for u, r in s.ledger.selected.items()})
    assert report["realized"]["epsilon"] == pytest.approx(
        epsilon_of(unamplified_event(0.7, sens.value), 1e-5)
    )
    # `corrflow simulate` exits 1 on it
    with pytest.raises(RunStoppedEarlyError, match="budget guard"):
        simulate(
            _cfg(tmp_path / "b", target_epsilon=0.1, noise_multiplier=0.5),
            backend="inprocess",
            quiet=True,
        )


def test_budget_guard_stop_at_round_zero_writes_the_report(tmp_path):
    # σ fixed, target far below one round's ε
    cfg = _cfg(tmp_path, noise_multiplier=0.5, target_epsilon=0.1)
    s = run_server(InProcessGrid(HANDLERS, 12), cfg, quiet=True)
    report = json.loads((tmp_path / "privacy_report.json").read_text())
    assert s.next_round == 0 and report["rounds_completed"] == 0
    assert report["stopped_reason"].startswith("budget guard: round 1 of 6 would spend")
    assert participation_users(report, tmp_path) == {} and not (tmp_path / JOURNAL).exists()


def test_inputs_that_cannot_be_private_are_refused():
    for kw, field in [
        ({"clip_norm": float("inf")}, "clip-norm"),
        ({"noise_multiplier": float("nan")}, "noise-multiplier"),
        ({"target_epsilon": float("inf")}, "target-epsilon"),
    ]:
        with pytest.raises(InvalidArgumentError, match=field):
            RunConfig(**{"noise_multiplier": 1.0, **kw})
    with pytest.raises(InvalidArgumentError, match="clip-norm.*not a boolean"):
        from_run_config({"corrflow.noise-multiplier": 1.0, "corrflow.clip-norm": True})


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--clip-norm", "inf"),
        ("--noise-multiplier", "nan"),
        ("--noise-multiplier", "1e-6"),
        ("--seed", "-1"),
        ("--participation-rate", "0.5"),
    ],
)
def test_cli_refuses_unusable_privacy_inputs_with_exit_2(tmp_path, flag, value):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "corrflow.server.cli",
            "simulate",
            "--backend",
            "inprocess",
            "--out",
            str(tmp_path / "run"),
            flag,
            value,
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr[-1500:]
    assert flag in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "run" / "state").exists()


def test_a_torn_last_journal_line_is_an_unreleased_round(tmp_path):
    """A power cut during round 7's journal append leaves half a line without its newline. Its model
    never left (release follows the append), so the resume treats round 7 as
    checkpointed-but-unreleased: it journals it again from the checkpoint, cutting the torn tail; a
    complete line that does not verify is still refused (above)."""
    cfg, _ = _finished_run(tmp_path)
    lines = (tmp_path / JOURNAL).read_text().splitlines(keepends=True)
    (tmp_path / JOURNAL).write_text("".join(lines[:-1]) + lines[-1][:40])
    forget_last_release(tmp_path)  # the registry records a round after its journal entry
    assert len(ReleaseJournal(tmp_path / JOURNAL).read()) == 7
    s = run_server(InProcessGrid(HANDLERS, 12), cfg, quiet=True)
    assert s.next_round == 8
    assert (tmp_path / JOURNAL).read_text().splitlines(
        keepends=True
    ) == lines  # the same entry, chain intact


def test_a_restored_or_copied_run_directory_is_refused_by_the_release_registry(tmp_path):
    """Backing up the whole run directory at round 3 and restoring it after the run finished carries
    a journal that agrees with its checkpoint: only the registry outside the directory knows rounds
    4–8 were released. A copy of the run directory resumed elsewhere is refused too; in both cases
    nothing is released."""
    from corrflow.errors import IntegrityError

    run = tmp_path / "run"
    backup = tmp_path / "backup"

    def back_up(strategy, metrics):
        if metrics["round"] + 1 == 3:
            shutil.copytree(run, backup, ignore=shutil.ignore_patterns(".corrflow.lock*"))

    cfg = _cfg(run, num_rounds=8, epochs=2)
    run_server(InProcessGrid(HANDLERS, 12), cfg, noise_key=KEY, quiet=True, on_round_end=back_up)
    copy = tmp_path / "copy"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns(".corrflow.lock*"))
    shutil.rmtree(run)
    shutil.copytree(backup, run)
    journal = (run / JOURNAL).read_bytes()
    with pytest.raises(
        IntegrityError, match=r"release_registry\.sqlite: run \w+ released 8 round\(s\).*records 3"
    ):
        run_server(InProcessGrid(HANDLERS, 12), cfg, noise_key=KEY, quiet=True)
    assert (run / JOURNAL).read_bytes() == journal
    with pytest.raises(IntegrityError, match=r"is registered in .*/run, not .*/copy"):
        run_server(
            InProcessGrid(HANDLERS, 12), cfg.replace(state_dir=str(copy)), noise_key=KEY, quiet=True
        )
    from typer.testing import CliRunner

    from corrflow.server.cli import app

    r = CliRunner().invoke(
        app,
        [
            "simulate",
            "--backend",
            "inprocess",
            "--out",
            str(run),
            "--users",
            "12",
            "--rounds",
            "8",
            "--epochs",
            "2",
            "--noise-multiplier",
            "0.7",
            "--model-dim",
            "6",
        ],
    )
    assert r.exit_code == 1 and "release_registry.sqlite" in r.output, r.output


def test_flower_engine_at_scale_is_warned_of_its_cost(tmp_path, caplog, monkeypatch):
    """From FLOWER_ENGINE_WARN_USERS users on, a run on Flower's simulation engine says on screen
    that the engine's cost grows with population × cohort and names the in-process backend
    (measured in docs/reference/benchmarks.md); a smaller one is not warned."""
    import flwr.simulation

    from corrflow.server import simulation

    class EngineStartedError(Exception):
        pass

    def engine(**kwargs):
        raise EngineStartedError(kwargs["num_supernodes"])

    monkeypatch.setattr(flwr.simulation, "run_simulation", engine)
    for users, warned in ((simulation.FLOWER_ENGINE_WARN_USERS, True), (12, False)):
        caplog.clear()
        cfg = _cfg(tmp_path / str(users), num_users=users, num_rounds=10, epochs=1)
        with caplog.at_level(logging.WARNING, logger="corrflow"), pytest.raises(EngineStartedError):
            simulation.simulate(cfg, backend="flower", quiet=True, verbose=False)
        text = caplog.text
        assert ("population × cohort" in text and "--backend inprocess" in text) == warned
