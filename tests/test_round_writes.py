"""What one round writes: after the first round, a round writes six files besides the logs — the
ledger log, the one checkpoint file, the noise ring, the per-user store, the release journal and
the registry — and never the run's secrets again (written once, by the first round, into
``state/secrets/``); no round recomputes the config's fingerprint or the factorization's hash. The
checkpoint and the secrets it vouches for are refused, naming the file, when edited, truncated,
swapped or missing; and a checkpoint of the previous layout (a directory published through
``CURRENT``, the secrets inside it) — or of the one before, with the momentum in its own file —
still resumes bit for bit, converted by its first round."""

import hashlib
import io
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
from checkpoint_support import (
    checkpoint,
    checkpoint_file,
    read_member,
    replace_member,
    secret_file,
)
from strategy_support import HANDLERS, KEY, forget_last_release
from strategy_support import small_config as _cfg
from test_run import INITIAL, USERS, _rounds

import corrflow.factorization.base as factorization_base
from corrflow.config import RunConfig
from corrflow.errors import IntegrityError
from corrflow.hashing import canonical_hmac
from corrflow.noise.engine import SECRET_FILE, SEGMENTS_FILE
from corrflow.run import Run, RunLock, open_run_directory, prepare
from corrflow.run.checkpoint import CHECKPOINT, POINTER, SAMPLER_KEY, SECRET
from corrflow.run.journal import JOURNAL
from corrflow.run.registry import default_registry
from corrflow.run.resume import check_resume
from corrflow.server.app import run_server
from corrflow.server.inprocess import InProcessGrid

SECRETS = ("report_salt", SECRET, SECRET_FILE, SEGMENTS_FILE)


def _written(roots: list[Path], seen: set) -> tuple[list[str], set]:
    """Files under ``roots`` whose (inode, mtime, size, content) was not seen before: created or
    changed since (the content too: a file rewritten in place within one tick of the file system's
    clock keeps its mtime)."""
    now = {}
    for root in roots:
        for p in [root] if root.is_file() else root.rglob("*"):
            if p.is_file():
                st = p.stat()
                digest = hashlib.sha256(p.read_bytes()).hexdigest()
                now[p] = (st.st_ino, st.st_mtime_ns, st.st_size, digest)
    return sorted(str(p) for p, v in now.items() if v not in seen), set(now.values())


def test_a_round_after_the_first_writes_six_files_and_no_secret(tmp_path, monkeypatch):
    """A 3-round in-process run: after the first round each round writes the same 6 files besides
    the operator's log (the last round adds the report and the metrics); the secrets are the
    files the first round wrote (same inode, same mtime), 0600 in a 0700 directory; rounds 2 and 3
    compute neither the config's fingerprint nor the factorization's hash."""
    run_dir, written, secrets, seen = tmp_path / "run", [], [], set()
    roots = [run_dir, default_registry()]
    calls = {"fingerprint": 0, "factorization": 0}
    fingerprint, arrays_sha256 = RunConfig.fingerprint, factorization_base.arrays_sha256

    def counted(name, f):
        def call(*a, **k):
            calls[name] += 1
            return f(*a, **k)

        return call

    monkeypatch.setattr(RunConfig, "fingerprint", counted("fingerprint", fingerprint))
    monkeypatch.setattr(
        factorization_base, "arrays_sha256", counted("factorization", arrays_sha256)
    )
    counts = []

    def snapshot(strategy, metrics):
        nonlocal seen
        files, seen = _written(roots, seen)
        written.append(sorted(os.path.relpath(f, run_dir) for f in files))
        stats = [secret_file(run_dir, n).stat() for n in SECRETS]
        secrets.append([(st.st_ino, st.st_mtime_ns) for st in stats])
        counts.append(dict(calls))

    run_server(
        InProcessGrid(HANDLERS, 12),
        _cfg(run_dir, num_rounds=3, epochs=1),
        noise_key=KEY,
        quiet=True,
        on_round_end=snapshot,
    )
    registry = os.path.relpath(default_registry(), run_dir)
    per_round = sorted(
        [
            "participation.sqlite",
            "release_journal.jsonl",
            registry,
            "state/ledger.jsonl",
            "state/noise_ring.bin",
            f"state/{CHECKPOINT}",
        ]
    )
    logs = ["operator/rounds.jsonl"]
    assert all(f"state/secrets/{name}" in written[0] for name in SECRETS)
    assert written[1] == sorted(per_round + logs)
    assert written[2] == sorted(per_round + logs + ["metrics.json", "privacy_report.json"])
    assert secrets[0] == secrets[1] == secrets[2]  # written once, by the first round
    assert counts[0] == counts[1] == counts[2]  # nothing hashed again per round
    assert stat.S_IMODE((run_dir / "state" / "secrets").stat().st_mode) == 0o700
    for name in SECRETS:
        assert stat.S_IMODE(secret_file(run_dir, name).stat().st_mode) == 0o600
    assert stat.S_IMODE(checkpoint_file(run_dir).stat().st_mode) == 0o600
    assert sorted(p.name for p in (run_dir / "state").iterdir()) == sorted(
        ["checkpoint.zip", "ledger.jsonl", "noise_ring.bin", "secrets"]
    )


def _split(cfg, first: int, then_key: bytes | None = None, between=None) -> list:
    """``first`` rounds, ``between(run_dir)``, then a restarted run with ``then_key`` to the end;
    every released model."""
    out = []
    for rounds, key in ((first, KEY), (None, then_key)):
        with RunLock(cfg.state_dir):
            plan = prepare(cfg, USERS, INITIAL, identity="partition-id")
            run = Run.start(plan, INITIAL, open_run_directory(cfg.state_dir), noise_key=key)
            out += _rounds(run, rounds)
        if rounds is not None and between is not None:
            between(Path(cfg.state_dir))
    return out


@pytest.fixture(scope="module")
def two_rounds(tmp_path_factory) -> Path:
    """A run directory after 2 of 6 rounds, with a copy of its state after round 1."""
    run_dir = tmp_path_factory.mktemp("tamper") / "run"
    cfg = _cfg(run_dir)
    for rounds in (1, 1):
        with RunLock(cfg.state_dir):
            plan = prepare(cfg, USERS, INITIAL, identity="partition-id")
            _rounds(Run.start(plan, INITIAL, open_run_directory(run_dir), noise_key=KEY), rounds)
        if not (run_dir.parent / "state-1").exists():
            shutil.copytree(run_dir / "state", run_dir.parent / "state-1")
    return run_dir


def _flip(path: Path, at: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 1
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    "fault, names",
    [
        ("edit-secret", "secrets/server_secret"),
        ("edit-noise-key", f"secrets/{SECRET_FILE}"),
        ("missing-secret", f"secrets/{SEGMENTS_FILE}"),
        ("edit-model", "member model/0.npy changed"),
        ("edit-state", "member state.json changed"),
        ("truncate", CHECKPOINT),
        ("older-copy", "older than what was released"),
        ("foreign", f"{CHECKPOINT}:MANIFEST.json: the HMAC"),
        ("compressed", "a compressed member"),
        ("duplicate-member", "a member name appears twice"),
        ("non-hex-hmac", "MANIFEST.json: unreadable manifest"),
        ("no-secret-entry", "MANIFEST.json: unreadable manifest"),
    ],
)
def test_an_edited_truncated_or_swapped_checkpoint_or_secret_is_refused(
    two_rounds, tmp_path, fault, names
):
    run_dir = tmp_path / "run"
    shutil.copytree(two_rounds, run_dir)
    ckpt = checkpoint_file(run_dir)
    if fault == "edit-secret":
        _flip(secret_file(run_dir, SECRET), 3)
    elif fault == "edit-noise-key":
        key = secret_file(run_dir, SECRET_FILE)
        key.write_bytes(key.read_bytes()[::-1])
    elif fault == "missing-secret":
        secret_file(run_dir, SEGMENTS_FILE).unlink()
    elif fault == "edit-model":
        with np.load(ckpt) as d:  # the checkpoint is a zip of .npy members
            model = d["model/0"]
        model[0] += 1
        buf = io.BytesIO()
        np.save(buf, model)
        replace_member(run_dir, "model/0.npy", buf.getvalue())
    elif fault == "edit-state":
        public = checkpoint(run_dir).public
        public["ledger_log"]["lines"] -= 1  # vouch for one round less of the ledger log
        replace_member(run_dir, "state.json", json.dumps(public, sort_keys=True).encode())
    elif fault == "truncate":
        ckpt.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])
    elif fault == "older-copy":
        shutil.rmtree(run_dir / "state")
        shutil.copytree(two_rounds.parent / "state-1", run_dir / "state")
    elif fault == "foreign":  # another run's checkpoint (another server secret)
        other = tmp_path / "other"
        with RunLock(other):
            plan = prepare(_cfg(other), USERS, INITIAL, identity="partition-id")
            _rounds(Run.start(plan, INITIAL, open_run_directory(other), noise_key=KEY), 2)
        shutil.copyfile(checkpoint_file(other), ckpt)
    elif fault in ("compressed", "duplicate-member"):  # the same bytes, repacked
        with zipfile.ZipFile(ckpt) as z:
            parts = [(i.filename, z.read(i.filename)) for i in z.infolist()]
        if fault == "duplicate-member":
            parts.insert(0, ("state.json", b"{}"))
        method = zipfile.ZIP_DEFLATED if fault == "compressed" else zipfile.ZIP_STORED
        with warnings.catch_warnings(), zipfile.ZipFile(ckpt, "w", method) as z:
            warnings.simplefilter("ignore")  # zipfile warns of the duplicate name
            for name, data in parts:
                z.writestr(name, data)
    elif fault in ("non-hex-hmac", "no-secret-entry"):
        manifest = json.loads(read_member(run_dir, "MANIFEST.json"))
        if fault == "non-hex-hmac":
            manifest["hmac"] = "é" * 64  # hmac.compare_digest would raise TypeError on it
        else:
            del manifest["secrets"][SECRET]
        replace_member(run_dir, "MANIFEST.json", json.dumps(manifest).encode())
    with pytest.raises(IntegrityError, match=names):
        check_resume(run_dir)


def _to_legacy_layout(state: Path, momentum_file: bool) -> None:
    """Rewrite the published checkpoint as the previous layout wrote it — a directory
    ``round-NNNNNN/`` named by ``CURRENT``, every file (secrets included) listed in its
    HMAC-authenticated ``MANIFEST.json`` — with the momentum in model.npz, or (``momentum_file``)
    in optimizer.npz as before that; as if it had been killed before the round's journal entry."""
    ckpt = checkpoint(state.parent)
    d = state / ckpt.name
    (d / "noise").mkdir(parents=True)
    model, momentum = ckpt.arrays("model"), ckpt.arrays("momentum")
    if momentum_file:
        np.savez(d / "model.npz", **{f"arr_{i}": a for i, a in enumerate(model)})
        np.savez(d / "optimizer.npz", **{f"arr_{i}": a for i, a in enumerate(momentum)})
    else:
        named = {f"arr_{i}": a for i, a in enumerate(model)}
        named.update({f"momentum_{i}": a for i, a in enumerate(momentum)})
        np.savez(d / "model.npz", **named)
    (d / "state.json").write_text(json.dumps(ckpt.public, sort_keys=True))
    for name in ("report_salt", SECRET):
        (d / name).write_bytes(ckpt.secrets[name])
    for name, data in [*ckpt.noise.items(), *[(n, ckpt.secrets[n]) for n in SECRETS[2:]]]:
        (d / "noise" / name).write_bytes(data)
    files = {
        p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file()
    }
    body = {"checkpoint": ckpt.name, "files": files}
    mac = canonical_hmac(ckpt.secrets[SECRET], body)
    (d / "MANIFEST.json").write_text(json.dumps({**body, "hmac": mac}, sort_keys=True))
    (state / POINTER).write_text(ckpt.name)
    checkpoint_file(state.parent).unlink()
    shutil.rmtree(state / "secrets")
    run_dir = state.parent
    lines = (run_dir / JOURNAL).read_text().splitlines(keepends=True)
    (run_dir / JOURNAL).write_text("".join(lines[:-1]))
    forget_last_release(run_dir)


def test_previous_layout_directories_left_without_their_pointer_are_removed(tmp_path):
    """A kill while the previous layout was being removed can leave its directories (copies of the
    secrets) without ``CURRENT``: the next start's first round removes them."""
    cfg, left = _cfg(tmp_path / "run"), tmp_path / "run" / "state" / "round-000001"

    def leave_a_directory(run_dir: Path) -> None:
        left.mkdir()
        (left / SECRET).write_bytes(secret_file(run_dir, SECRET).read_bytes())

    _split(cfg, 1, bytes(range(16, 32)), between=leave_a_directory)
    assert not left.exists() and not (left.parent / POINTER).exists()
    assert checkpoint(cfg.state_dir).public["next_round"] == cfg.num_rounds


def test_checkpoints_of_the_earlier_layouts_resume_bit_for_bit(tmp_path):
    """Three rounds, the checkpoint rewritten in the previous layout (or the one before it, the
    momentum in its own file), a restart with a fixed key, three more rounds: every released model
    is the bits of the same split run in the current layout (momentum 0.5, so the restored
    momentum enters rounds 4–6), and the first round after the restart leaves this layout alone."""
    later = bytes(range(16, 32))
    released = {}
    for name in ("current", "legacy", "older"):
        cfg = _cfg(tmp_path / name)

        def convert(state_dir, name=name):
            if name != "current":
                _to_legacy_layout(state_dir / "state", momentum_file=name == "older")

        released[name] = [
            b"".join(a.tobytes() for a in m) for m in _split(cfg, 3, later, between=convert)
        ]
        state = tmp_path / name / "state"
        assert sorted(p.name for p in state.iterdir()) == sorted(
            [CHECKPOINT, "ledger.jsonl", "noise_ring.bin", "secrets"]
        )
        assert checkpoint(tmp_path / name).public["next_round"] == 6 and cfg.momentum == 0.5
    assert len(released["current"]) == 6
    assert released["legacy"] == released["current"] == released["older"]


def test_a_resumed_start_writes_its_key_segments_once_beside_the_published_ones(tmp_path):
    """A restart draws a new key segment: its table goes to a file the published checkpoint does
    not name (which keeps verifying until the new checkpoint replaces it), written once by the
    start's first round; the file no checkpoint names any more is removed after it."""
    cfg, run_dir = _cfg(tmp_path / "run"), tmp_path / "run"
    with RunLock(run_dir):
        plan = prepare(cfg, USERS, INITIAL, identity="partition-id")
        _rounds(Run.start(plan, INITIAL, open_run_directory(run_dir), noise_key=KEY), 2)
    assert checkpoint(run_dir).secret_files[SEGMENTS_FILE]["file"] == SEGMENTS_FILE
    stats = []
    with RunLock(run_dir):
        plan = prepare(cfg, USERS, INITIAL, identity="partition-id")
        run = Run.start(plan, INITIAL, open_run_directory(run_dir))
        assert check_resume(run_dir).checkpoint.name == "round-000002"  # nothing written yet
        while _rounds(run, 1):
            st = secret_file(run_dir, SEGMENTS_FILE).stat()
            stats.append((st.st_ino, st.st_mtime_ns))
    ckpt = checkpoint(run_dir)
    files = ckpt.secret_files
    assert files[SEGMENTS_FILE]["file"] == f"{SEGMENTS_FILE}.1"
    # a checkpoint named in a message shows its path, never its secrets
    # no bytes literal (a secret) in its repr; a hex digest may end in "b'" itself
    assert str(ckpt) == str(ckpt.path) and not re.search(r"""(?<![0-9a-f])b['"]""", repr(ckpt))
    assert len(stats) == 4 and len(set(stats)) == 1  # written once, by the start's first round
    assert sorted(p.name for p in (run_dir / "state" / "secrets").iterdir()) == sorted(
        e["file"] for e in files.values()
    )
    assert SAMPLER_KEY not in files  # an unamplified run has no sampler key


def test_a_finished_runs_rerun_checks_its_ledger_before_vouching_for_it(tmp_path):
    """Rerunning a finished run prints its report without starting the run; its ledger log (the
    participation the report's ε is accounted on) is still checked against the checkpoint, as a
    resume checks it: an edited ledger is refused (exit 1, naming the file)."""
    command = [sys.executable, "-m", "corrflow.server.cli", "simulate", "--users", "12"]
    command += ["--rounds", "4", "--epochs", "2", "--noise-multiplier", "0.5"]
    command += ["--backend", "inprocess", "--out", str(tmp_path / "run")]

    def simulate():
        return subprocess.run(command, capture_output=True, text=True, timeout=300)

    assert (first := simulate()).returncode == 0, first.stderr[-2000:]
    assert (again := simulate()).returncode == 0 and "already complete" in again.stderr
    _flip(tmp_path / "run" / "state" / "ledger.jsonl", 5)
    edited = simulate()
    assert edited.returncode == 1 and "Traceback" not in edited.stderr
    assert "ledger.jsonl: does not match the checkpoint's record" in edited.stderr


def test_a_rounds_compute_side_calls_at_most_60_functions_in_15_files(tmp_path):
    """Round 3 of the plain loop, traced: `Run.step` outside `RunStore.commit` — check, clip and
    sum the replies, draw the noise, step the optimizer, account ε, apply the record in memory —
    calls at most 60 of corrflow's functions, in at most 15 files (36 in 14 when this was
    written); the commit is the one place that writes. Comprehensions are left out of the count
    (Python 3.12 inlines them)."""
    from test_run import NODE, _client

    from corrflow.run.store import RunStore

    root = str(Path(__import__("corrflow").__file__).parent) + os.sep
    called: set[tuple[str, str, int]] = set()
    depth = {"step": 0, "commit": 0}

    def profile(frame, event, arg):
        code = frame.f_code
        if event not in ("call", "return") or not code.co_filename.startswith(root):
            return
        where = (code.co_filename[len(root) :], code.co_name, code.co_firstlineno)
        edge = 1 if event == "call" else -1
        if where[:2] == ("run/core.py", "step"):
            depth["step"] += edge
        elif code is RunStore.commit.__code__:
            depth["commit"] += edge
        elif event == "call" and depth["step"] and not depth["commit"] and where[1][0] != "<":
            called.add(where)

    cfg = _cfg(tmp_path / "run", num_rounds=6, epochs=2)
    with RunLock(cfg.state_dir):
        plan = prepare(cfg, USERS, INITIAL, identity="partition-id")
        run = Run.start(plan, INITIAL, open_run_directory(cfg.state_dir), noise_key=KEY)
        for t in range(3):
            routed = run.plan_next().route(NODE, set(NODE.values()))
            replies = [_client(run, n) for n in routed.expected]
            if t == 2:
                sys.setprofile(profile)
            try:
                assert run.step(routed, replies) is not None
            finally:
                sys.setprofile(None)
    files = sorted({f for f, _, _ in called})
    shown = sorted(f"{f}:{name}" for f, name, _ in called)
    assert 20 <= len(called) <= 60, shown
    assert len(files) <= 15, files
    assert "run/store.py" not in files and "run/disclosure.py" not in files, files
    assert {"run/round.py", "run/clipping.py", "noise/engine.py", "run/optimizer.py"} <= set(files)
