"""No noise is ever released twice (real processes, deterministic clients): the four ways a run
directory can be rolled back that its release journal cannot see. Refused by the release registry
until adopted (`corrflow runs adopt`), or — where nothing on one machine can tell (the registry
rolled back with the run) — released with fresh noise: each process start draws the rounds after
its checkpoint with a new key. Each case compares the two lineages' released models round by round.
Also: a damaged, locked or emptied registry exits 1 naming the file, without a traceback, and
releases nothing."""

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from checkpoint_support import checkpoint
from lineage_support import KEY, released, segments

from corrflow.run import registry as registry_module
from corrflow.run.journal import JOURNAL
from corrflow.run.registry import REGISTRY_FILE, UNKNOWN_TWICE

TESTS = Path(__file__).parent
BACKUP_AT = 3  # the backup holds rounds 1–3; the first lineage released 8
SIMULATE = [
    *("simulate", "--backend", "inprocess", "--users", "12", "--rounds", "8", "--epochs", "2"),
    *("--noise-multiplier", "0.7", "--model-dim", "6"),
]


def _env(home: Path, **extra) -> dict:
    return dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]),
        CORRFLOW_HOME=str(home),
        **extra,
    )


def _run(out: Path, home: Path, **extra) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(TESTS / "rollback_run.py"), str(out)],
        env=_env(home, **extra),
        capture_output=True,
        text=True,
        timeout=300,
    )


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "corrflow.server.cli", *args],
        env=_env(home),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    """Lineage A: 8 rounds under home H1, with the run directory and the registry backed up after
    round 3."""
    root = tmp_path_factory.mktemp("rollback")
    home, run = root / "h1", root / "h1" / "run"
    r = _run(
        run,
        home,
        BACKUP_AT=str(BACKUP_AT),
        BACKUP_DIR=str(root / "backup"),
        BACKUP_REGISTRY=str(root / "registry-backup.sqlite"),
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert len(released(run)) == 8
    return root


def _refused_then_adopted(run: Path, home: Path, why: str) -> dict:
    """The CLI refuses the run (exit 1, the registry named, no traceback, nothing released);
    `corrflow runs adopt` takes it; the run then finishes."""
    journal = (run / JOURNAL).read_bytes()
    r = _cli(home, *SIMULATE, "--out", str(run))
    assert r.returncode == 1, r.stderr[-2000:]
    assert str(home / REGISTRY_FILE) in r.stderr and why in r.stderr, r.stderr
    assert f"corrflow runs adopt {run.resolve()}" in r.stderr and "Traceback" not in r.stderr
    assert (run / JOURNAL).read_bytes() == journal and len(released(run)) == BACKUP_AT
    r = _cli(home, "runs", "adopt", str(run), "--json")
    assert r.returncode == 0, r.stderr
    adoption = json.loads(r.stdout.splitlines()[-1])
    r = _run(run, home, NOISE_KEY="os")
    assert r.returncode == 0, r.stderr[-2000:]
    return adoption


def _assert_no_repeat(first_run: Path, second_run: Path) -> None:
    """Rounds 1–3 are the shared history; every later round of the second lineage carries noise
    that is not the first lineage's: the two releases of a round differ by the size of the noise
    (a repeat would differ only through the cohorts' sums, by orders of magnitude less)."""
    a, b = released(first_run), released(second_run)
    assert len(a) == len(b) == 8
    for t in range(BACKUP_AT):
        np.testing.assert_array_equal(a[t], b[t])
    step = min(np.linalg.norm(a[t] - a[t - 1]) for t in range(BACKUP_AT, 8))
    for t in range(BACKUP_AT, 8):
        assert np.linalg.norm(a[t] - b[t]) > 0.2 * step, t
    table = segments(second_run)
    assert [r for r, _ in table] == [0, BACKUP_AT] and table[0][1] == KEY != table[1][1]
    report = json.loads((second_run / "privacy_report.json").read_text())
    assert report["lineage"]["key_segments"] == [0, BACKUP_AT]


def _assert_twice_unknown(run: Path) -> None:
    """The original lineage went on to round 8 under a registry this one is not: which rounds were
    released twice is unknown here, and the report says so instead of []."""
    lineage = json.loads((run / "privacy_report.json").read_text())["lineage"]
    assert lineage["rounds_released_twice"] == UNKNOWN_TWICE, lineage


def test_restored_backup_under_another_home_is_refused_then_adopted_with_fresh_noise(
    first, tmp_path
):
    run = tmp_path / "restored"
    shutil.copytree(first / "backup", run)
    adoption = _refused_then_adopted(run, tmp_path / "h2", "does not know run")
    assert adoption["previous_dir"] is None and adoption["journal_rounds"] == BACKUP_AT
    _assert_no_repeat(first / "h1" / "run", run)
    _assert_twice_unknown(run)


def test_live_copy_under_another_home_is_refused_then_adopted_with_fresh_noise(first, tmp_path):
    """A copy of the live run taken after round 3 (the original went on to round 8)."""
    run = tmp_path / "copy"
    shutil.copytree(first / "backup", run)
    home = tmp_path / "h3"
    _refused_then_adopted(run, home, "does not know run")
    _assert_no_repeat(first / "h1" / "run", run)
    _assert_twice_unknown(run)
    report = json.loads((run / "privacy_report.json").read_text())
    assert len(report["lineage"]["adoptions"]) == 1 and str(tmp_path) not in json.dumps(report)


def test_registry_deleted_is_refused_then_adopted_with_fresh_noise(first, tmp_path):
    """The run restored in place under its own home, whose registry was deleted."""
    home = tmp_path / "h1"
    shutil.copytree(first / "h1", home)
    run = home / "run"
    shutil.rmtree(run)
    shutil.copytree(first / "backup", run)
    for f in home.glob(REGISTRY_FILE + "*"):
        f.unlink()
    _refused_then_adopted(run, home, "does not know run")
    _assert_no_repeat(first / "h1" / "run", run)
    _assert_twice_unknown(run)


def test_restored_backup_in_place_is_refused_and_adoption_releases_again_with_fresh_noise(
    first, tmp_path
):
    """The same home, the registry intact: it knows rounds 4–8 were released. Adoption moves those
    records aside, and the report lists the rounds released twice."""
    home = tmp_path / "h1"
    shutil.copytree(first / "h1", home)
    run = home / "run"
    # the registry records the original path: put the restored copy where the original was
    with sqlite3.connect(home / REGISTRY_FILE) as db:
        db.execute("UPDATE runs SET run_dir = ?", (str(run.resolve()),))
    shutil.rmtree(run)
    shutil.copytree(first / "backup", run)
    adoption = _refused_then_adopted(run, home, "released 8 round(s)")
    assert adoption["rounds_released_again"] == list(range(BACKUP_AT, 8))
    _assert_no_repeat(first / "h1" / "run", run)
    lineage = json.loads((run / "privacy_report.json").read_text())["lineage"]
    assert lineage["rounds_released_twice"] == list(range(BACKUP_AT, 8))


def test_registry_restored_with_the_run_releases_fresh_noise(first, tmp_path):
    """Undetectable on one machine: the run directory and its registry both restored to round 3.
    The run resumes without a word — and every round after 3 carries fresh noise."""
    home = tmp_path / "h1"
    home.mkdir()
    shutil.copy(first / "registry-backup.sqlite", home / REGISTRY_FILE)
    run = home / "run"
    shutil.copytree(first / "backup", run)
    with sqlite3.connect(home / REGISTRY_FILE) as db:
        db.execute("UPDATE runs SET run_dir = ?", (str(run.resolve()),))
    r = _run(run, home, NOISE_KEY="os")
    assert r.returncode == 0, r.stderr[-2000:]
    _assert_no_repeat(first / "h1" / "run", run)


@pytest.mark.parametrize("fault", ["damaged", "emptied", "not-a-registry"])
def test_a_broken_registry_exits_1_naming_it_and_releases_nothing(first, tmp_path, fault):
    home = tmp_path / "h"
    home.mkdir()
    reg = home / REGISTRY_FILE
    if fault == "damaged":
        shutil.copy(first / "registry-backup.sqlite", reg)
        data = bytearray(reg.read_bytes())
        data[:100] = b"\xff" * 100  # the SQLite header
        reg.write_bytes(bytes(data))
    elif fault == "emptied":
        reg.write_bytes(b"")
    else:
        with sqlite3.connect(reg) as db:
            db.execute("CREATE TABLE notes (x)")
    run = tmp_path / "run"
    shutil.copytree(first / "backup", run)
    journal = (run / JOURNAL).read_bytes()
    for args in (SIMULATE + ["--out", str(run)], ["runs", "adopt", str(run)]):
        r = _cli(home, *args)
        assert r.returncode == 1, (args, r.stderr[-2000:])
        assert f"{reg}:" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert (run / JOURNAL).read_bytes() == journal and len(released(run)) == BACKUP_AT
    if fault == "emptied":
        assert reg.stat().st_size == 0  # never silently recreated


@pytest.mark.integration
def test_a_locked_registry_refuses_naming_it(first, tmp_path, monkeypatch):
    """Another process holds the registry's write lock past the timeout: the run refuses, naming
    the file, before releasing anything."""
    from corrflow.errors import IntegrityError
    from corrflow.run.registry import ReleaseRegistry

    reg = tmp_path / REGISTRY_FILE
    ReleaseRegistry(reg)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sqlite3, sys, time; db = sqlite3.connect(sys.argv[1], isolation_level=None); "
            "db.execute('BEGIN EXCLUSIVE'); print('locked', flush=True); time.sleep(60)",
            str(reg),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        monkeypatch.setattr(registry_module, "LOCK_TIMEOUT", 0.3)
        with pytest.raises(IntegrityError, match=rf"{reg}: the release registry is locked"):
            ReleaseRegistry(reg).record("run", 0, 0, "h")
    finally:
        holder.kill()
        holder.wait()
    ReleaseRegistry(reg).record("run", 0, 0, "h")  # usable again once the holder is gone


def test_adopt_refuses_what_is_not_a_run_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    for target in (tmp_path / "missing", tmp_path / "empty"):
        r = _cli(tmp_path / "h", "runs", "adopt", str(target))
        assert r.returncode == 2 and "DIR: expected a corrflow run directory" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
    assert not (tmp_path / "missing").exists() and not any((tmp_path / "empty").iterdir())


@pytest.mark.integration
def test_adopting_a_copy_of_a_live_run_is_refused(first, tmp_path):
    """The registry places the run in a directory a server is running on: adopting a copy now would
    let both release the same rounds."""
    from corrflow.run.registry import ReleaseRegistry

    live, copy, home = tmp_path / "live", tmp_path / "copy", tmp_path / "h"
    shutil.copytree(first / "backup", live)
    shutil.copytree(first / "backup", copy)
    run_id = checkpoint(live).public["run_id"]
    ReleaseRegistry(home / REGISTRY_FILE).claim(run_id, live)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from corrflow.run.resume import RunLock\n"
            "with RunLock(sys.argv[1]):\n    print('locked', flush=True); time.sleep(60)",
            str(live),
        ],
        env=_env(home),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        r = _cli(home, "runs", "adopt", str(copy))
        assert r.returncode == 1 and f"the run is live in {live.resolve()}" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
    finally:
        holder.kill()
        holder.wait()
    assert ReleaseRegistry(home / REGISTRY_FILE).run_dir(run_id) == str(live.resolve())


def test_an_unwritable_registry_path_is_refused_before_anything_is_written(tmp_path):
    """A --release-registry no file can be written at: exit 2 naming the flag, and --out is not
    created (a run that could not record its releases must not start)."""
    out = tmp_path / "run"
    r = _cli(
        tmp_path / "h", *SIMULATE, "--release-registry", "/proc/x/reg.sqlite", "--out", str(out)
    )
    assert r.returncode == 2 and "--release-registry" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not out.exists()


def test_lineage_cannot_list_rounds_released_twice_after_adoption_into_a_foreign_registry():
    """Adopted into a registry that never recorded the run (previous directory None) with rounds
    already in its journal: the rounds released twice are unknown, not []. Adopted into the registry
    that knew it: the forked rounds it kept aside."""
    from types import SimpleNamespace

    from corrflow.run.registry import lineage_section

    segs = SimpleNamespace(segments=[SimpleNamespace(first_round=0)])

    def adoption(previous, journal_rounds, again):
        return {
            "adopted_at": "2026-01-01T00:00:00.000000Z",
            "run_dir": "/runs/b",
            "previous_dir": previous,
            "journal_rounds": journal_rounds,
            "registry_rounds": 0 if previous is None else 8,
            "rounds_released_again": again,
        }

    foreign = lineage_section(segs, [adoption(None, 3, [])])
    assert foreign["rounds_released_twice"] == UNKNOWN_TWICE
    assert "unknown here" in foreign["note"]
    assert lineage_section(segs, [adoption(None, 0, [])])["rounds_released_twice"] == []
    known = lineage_section(segs, [adoption("/runs/a", 3, [3, 4, 5])])
    assert known["rounds_released_twice"] == [3, 4, 5]
    schema = json.loads(
        (Path(__file__).parent.parent / "corrflow/schemas/privacy-report.json").read_text()
    )
    prop = schema["properties"]["lineage"]["properties"]["rounds_released_twice"]
    assert {"const": UNKNOWN_TWICE} in prop["oneOf"]
