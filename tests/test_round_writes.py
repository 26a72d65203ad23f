"""What one round writes: after the first round, a round writes the ledger log, its checkpoint
(pointer, manifest, state, model with momentum, noise state), the noise ring, the per-user store,
the release journal and the registry — never the run's secrets again (hard-linked into each
checkpoint from the one that first held them) — and a checkpoint written before the momentum moved
into the model's file still resumes bit for bit."""

import json
import os
import shutil
import stat
from pathlib import Path

import numpy as np
from strategy_support import HANDLERS, KEY, forget_last_release
from strategy_support import small_config as _cfg
from test_run import INITIAL, USERS, _rounds

from corrflow.fileio import write_bytes
from corrflow.run import Run, RunLock, open_run_directory, prepare
from corrflow.run.checkpoint import (
    SECRET,
    current_checkpoint,
    load_arrays,
    write_checkpoint,
)
from corrflow.run.journal import JOURNAL
from corrflow.run.registry import default_registry
from corrflow.server.app import run_server
from corrflow.server.inprocess import InProcessGrid

SECRETS = ("report_salt", SECRET, "noise/noise_secret.key", "noise/noise_segments.key")


def _written(roots: list[Path], seen: set) -> tuple[list[str], set]:
    """Files under ``roots`` whose (inode, mtime, size) was not seen before: created or changed
    since (a hard link to a file seen before is neither)."""
    now = {}
    for root in roots:
        for p in [root] if root.is_file() else root.rglob("*"):
            if p.is_file():
                st = p.stat()
                now[p] = (st.st_ino, st.st_mtime_ns, st.st_size)
    return sorted(str(p) for p, v in now.items() if v not in seen), set(now.values())


def test_write_bytes_links_only_a_file_with_the_same_bytes_and_mode(tmp_path):
    old = write_bytes(tmp_path / "old", b"k" * 32, private=True)
    same = write_bytes(tmp_path / "same", b"k" * 32, private=True, same_as=old)
    assert os.stat(same).st_ino == os.stat(old).st_ino  # linked: nothing written
    other = write_bytes(tmp_path / "other", b"j" * 32, private=True, same_as=old)
    shared = write_bytes(tmp_path / "shared", b"k" * 32, same_as=old)  # not 0600: another mode
    missing = write_bytes(tmp_path / "new", b"k" * 32, private=True, same_as=tmp_path / "none")
    for p, data in ((other, b"j" * 32), (shared, b"k" * 32), (missing, b"k" * 32)):
        assert os.stat(p).st_ino != os.stat(old).st_ino and p.read_bytes() == data
    assert stat.S_IMODE(os.stat(shared).st_mode) != 0o600
    assert stat.S_IMODE(os.stat(missing).st_mode) == 0o600
    assert old.read_bytes() == b"k" * 32 and not list(tmp_path.glob(".tmp-*"))


def test_a_round_after_the_first_writes_no_secret(tmp_path):
    """A 3-round in-process run: after the first round each round writes the same 10 files besides
    the operator's log (the last round adds the report and the metrics), and the checkpoint's
    secrets are the files the first round wrote."""
    run_dir, written, inodes, seen = tmp_path / "run", [], [], set()
    roots = [run_dir, default_registry()]

    def snapshot(strategy, metrics):
        nonlocal seen
        files, seen = _written(roots, seen)
        ckpt = current_checkpoint(run_dir / "state")
        written.append(
            sorted(os.path.relpath(f, run_dir).replace(ckpt.name, "CKPT") for f in files)
        )
        inodes.append([(ckpt / name).stat().st_ino for name in SECRETS])

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
            "state/CURRENT",
            "state/ledger.jsonl",
            "state/noise_ring.bin",
            "state/CKPT/MANIFEST.json",
            "state/CKPT/model.npz",
            "state/CKPT/state.json",
            "state/CKPT/noise/noise_state.json",
        ]
    )
    logs = ["operator/rounds.jsonl"]
    assert all(f"state/CKPT/{name}" in written[0] for name in SECRETS)
    assert written[1] == sorted(per_round + logs)
    assert written[2] == sorted(per_round + logs + ["metrics.json", "privacy_report.json"])
    assert inodes[0] == inodes[1] == inodes[2]  # each checkpoint holds the files round 1 wrote
    ckpt = current_checkpoint(run_dir / "state")
    assert all(stat.S_IMODE((ckpt / name).stat().st_mode) == 0o600 for name in SECRETS)


def _to_legacy_layout(run_dir: Path) -> None:
    """Rewrite the published checkpoint as a corrflow before this layout wrote it (model.npz with
    the model alone, optimizer.npz with the momentum, every secret a file of its own), signed
    again, as if it had been killed before the round's journal entry."""
    state = run_dir / "state"
    ckpt = current_checkpoint(state)
    public = json.loads((ckpt / "state.json").read_text())
    model, momentum = load_arrays(ckpt, "model"), load_arrays(ckpt, "model", "momentum")
    private = {name: (ckpt / name).read_bytes() for name in ("report_salt", SECRET)}
    noise = {p.name: p.read_bytes() for p in (ckpt / "noise").iterdir()}

    def old_noise(d: Path) -> None:
        (d / "noise").mkdir()
        for name, data in noise.items():
            (d / "noise" / name).write_bytes(data)

    shutil.rmtree(ckpt)  # not linked from: every file is written anew
    write_checkpoint(
        state,
        ckpt.name,
        {"model": {"arr": model}, "optimizer": {"arr": momentum}},
        public,
        private,
        save_extra=old_noise,
    )
    with np.load(ckpt / "model.npz") as d:
        assert sorted(d.files) == [f"arr_{i}" for i in range(len(model))]
    lines = (run_dir / JOURNAL).read_text().splitlines(keepends=True)
    (run_dir / JOURNAL).write_text("".join(lines[:-1]))
    forget_last_release(run_dir)


def test_a_checkpoint_of_the_earlier_layout_resumes_bit_for_bit(tmp_path):
    """Three rounds, the checkpoint rewritten in the layout before the momentum moved into
    model.npz (or left as written), a restart with a fixed key, three more rounds: every released
    model is the bits of the same split run in the current layout (momentum 0.5, so the restored
    momentum enters rounds 4–6)."""
    later = bytes(range(16, 32))
    released = {}
    for name in ("current", "legacy"):
        cfg, out = _cfg(tmp_path / name), []
        for rounds, key in ((3, KEY), (None, later)):
            with RunLock(cfg.state_dir):
                plan = prepare(cfg, USERS, INITIAL, identity="partition-id")
                run = Run.start(plan, INITIAL, open_run_directory(cfg.state_dir), noise_key=key)
                out += _rounds(run, rounds)
            if name == "legacy" and rounds == 3:
                _to_legacy_layout(Path(cfg.state_dir))
        assert run.state.next_round == 6 and cfg.momentum == 0.5
        released[name] = [b"".join(a.tobytes() for a in model) for model in out]
    assert len(released["current"]) == 6 and released["legacy"] == released["current"]
