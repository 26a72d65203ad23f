"""The per-user privacy record: a SQLite store written for each round's cohort alone, summarised
in the report (which names it with its row count and digest), equal to a recomputation from the
ledger after every round, kept on resume only where it agrees with the checkpoint's ledger and
rebuilt from it otherwise — also after a real SIGKILL between the checkpoint and the store's
commit, or inside it — and a report whose size does not grow with the population."""

import json
import os
import sqlite3
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from strategy_support import HANDLERS, KEY
from strategy_support import small_config as _cfg

from corrflow.accounting.participation import (
    GAP_QUANTILES,
    entries_digest,
    user_entry,
)
from corrflow.accounting.report import hash_user_id
from corrflow.errors import DataFormatError, IntegrityError
from corrflow.run.checkpoint import load_checkpoint
from corrflow.run.ledger import GENESIS, LEDGER_LOG, LedgerLog, LogPosition, replay
from corrflow.run.reading import participation_users
from corrflow.run.user_store import (
    STORE,
    PerUserRecord,
    UserStore,
    check_entries,
    read_entries,
)
from corrflow.server.app import run_server
from corrflow.server.inprocess import InProcessGrid

TESTS = Path(__file__).parent
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]))


def _hashed(user: str) -> str:
    return hash_user_id(user, b"s" * 16)


def _brute(selected: dict, below: int | None = None) -> dict:
    """Each user's entry from the ledger, from scratch (every user, every round)."""
    out = {}
    for u, rs in selected.items():
        r = sorted(x for x in rs if below is None or x < below)
        if r:
            gaps = [b - a for a, b in zip(r, r[1:], strict=False) if b != a]
            out[_hashed(u)] = (tuple(r), min(gaps) if gaps else None)
    return out


def _quantile(values: list[int], q: float) -> int:
    return sorted(values)[int(q * (len(values) - 1))]


def _rounds(seed: int, users: int, rounds: int, cohort: int):
    """Random cohorts, a few users listed twice in a round (two items of one user)."""
    rng, names = np.random.default_rng(seed), [f"u{i}" for i in range(users)]
    for t in range(rounds):
        c = list(rng.choice(names, size=cohort, replace=False))
        yield t, c + c[:2]


def _position(t: int) -> LogPosition:
    return LogPosition(t, 100 * t, f"{t:064x}")


def test_cohort_updates_equal_a_recomputation_from_the_ledger(tmp_path):
    """Round by round, only the cohort's rows are written, and the store's rows, the summary (user
    count, users by number of rounds, smallest gaps and their quantiles) and the digest equal a
    recomputation over every user from scratch."""
    record = PerUserRecord.start(tmp_path, STORE, "run-a", None, _hashed, _position(0))
    selected: dict[str, list[int]] = {}
    for t, cohort in _rounds(1, 60, 25, 9):
        for u in cohort:
            selected.setdefault(u, []).append(t)
        before = record.store._db.total_changes
        record.commit_round(selected, cohort, _hashed, _position(t + 1))
        # one row per distinct cohort member, the 5 meta rows: O(cohort)
        assert record.store._db.total_changes - before == len(set(cohort)) + 5
        want = _brute(selected)
        got = {e.user: (e.rounds, e.min_gap) for e in read_entries(tmp_path / STORE)}
        assert got == want
        summary = record.summary.to_dict()
        gaps = [g for _, g in want.values() if g is not None]
        assert summary["user_count"] == len(want) == record.section()["rows"]
        assert summary["participations"] == {
            str(k): v for k, v in sorted(Counter(len(r) for r, _ in want.values()).items())
        }
        assert summary["max_participations"] == max(len(r) for r, _ in want.values())
        assert summary["min_gap"] == (min(gaps) if gaps else None)
        if gaps:
            assert summary["min_gap_quantiles"] == {
                f"p{round(100 * q)}": _quantile(gaps, q) for q in GAP_QUANTILES
            }
        digest = entries_digest(user_entry(u, r) for u, (r, _) in want.items())
        assert record.section()["digest"] == digest == record.store.content()[1]
    assert summary["max_participations"] >= 3 and gaps
    # rows numbered as users were first seen, a returning user's row updated in place
    with sqlite3.connect(tmp_path / STORE) as db:
        ids = [i for (i,) in db.execute("SELECT id FROM users ORDER BY id")]
    assert ids == list(range(1, len(want) + 1))


def _resume(tmp_path, selected, position, run_id="run-a") -> tuple[PerUserRecord, bool]:
    """Start on an existing store; whether it was kept (nothing written) or rebuilt."""
    record = PerUserRecord.start(tmp_path, STORE, run_id, selected, _hashed, position)
    kept = record.store._db.total_changes == 0
    rows = {e.user: (e.rounds, e.min_gap) for e in read_entries(tmp_path / STORE)}
    assert rows == _brute(selected) and record.store.content()[0] == len(rows)
    assert record.store.meta()["ledger_lines"] == str(position.lines)
    return record, kept


def test_a_resumed_store_is_kept_when_it_agrees_with_the_ledger_else_rebuilt(tmp_path):
    """A store at the checkpoint's ledger position with the ledger's rows is kept as is; one
    behind it (killed before its commit), ahead of it, edited, of another run, or not a store at
    all is rebuilt from the ledger."""
    record = PerUserRecord.start(tmp_path, STORE, "run-a", None, _hashed, _position(0))
    selected: dict[str, list[int]] = {}
    rounds = list(_rounds(2, 40, 8, 6))
    for t, cohort in rounds[:7]:
        for u in cohort:
            selected.setdefault(u, []).append(t)
        record.commit_round(selected, cohort, _hashed, _position(t + 1))
    record.store.close()
    assert _resume(tmp_path, selected, _position(7))[1]  # agrees: kept
    ahead = {u: [r for r in rs if r < 6] for u, rs in selected.items()}
    assert not _resume(tmp_path, ahead, _position(6))[1]  # the store was a round ahead
    t, cohort = rounds[7]
    for u in cohort:
        selected.setdefault(u, []).append(t)
    assert not _resume(tmp_path, selected, _position(8))[1]  # the store was a round behind
    with sqlite3.connect(tmp_path / STORE) as db:  # an edited row, the meta left as it was
        db.execute("UPDATE users SET rounds = '0' WHERE user = ?", (_hashed(cohort[0]),))
    assert not _resume(tmp_path, selected, _position(8))[1]
    assert _resume(tmp_path, selected, _position(8))[1]
    assert not _resume(tmp_path, selected, _position(8), run_id="run-b")[1]
    (tmp_path / STORE).write_bytes(b"not a database" * 100)
    assert not _resume(tmp_path, selected, _position(8), run_id="run-b")[1]
    empty = PerUserRecord.start(tmp_path, STORE, "run-c", None, _hashed, LogPosition(0, 0, GENESIS))
    assert list(read_entries(tmp_path / STORE)) == [] and empty.summary.users == 0


def test_a_store_ahead_of_the_report_reads_back_as_the_report(tmp_path):
    """Read below the report's rounds, a store a few rounds ahead gives the report's rows and
    digest; an edited row or a missing store is refused, naming the file."""
    record = PerUserRecord.start(tmp_path, STORE, "run-a", None, _hashed, _position(0))
    selected: dict[str, list[int]] = {}
    for t, cohort in _rounds(3, 30, 9, 5):
        for u in cohort:
            selected.setdefault(u, []).append(t)
        record.commit_round(selected, cohort, _hashed, _position(t + 1))
        if t == 5:
            at_report = record.section()
    entries = list(read_entries(tmp_path / STORE, below=6))
    assert {e.user: (e.rounds, e.min_gap) for e in entries} == _brute(selected, below=6)
    check_entries(entries, at_report, tmp_path / STORE)
    with pytest.raises(IntegrityError, match="does not match the report"):
        check_entries(list(read_entries(tmp_path / STORE)), at_report, tmp_path / STORE)
    with pytest.raises(DataFormatError, match="per-user store"):
        list(read_entries(tmp_path / "missing.sqlite"))


def test_the_report_does_not_grow_with_the_population(tmp_path):
    """The same schedule (2 rounds, every user once) at 50 and at 5,000 users: the published
    reports differ by a few bytes (the counts' digits), the per-user store holds every user, and
    `corrflow report --json` lists each user back from it."""
    sizes = {}
    for users in (50, 5000):
        d = tmp_path / str(users)
        cfg = _cfg(d, num_users=users, num_rounds=2, epochs=1, model_dim=2)
        run_server(InProcessGrid(HANDLERS, users), cfg, noise_key=KEY, quiet=True)
        report = json.loads((d / "privacy_report.json").read_text())
        part = report["realized"]["participation"]
        assert part["user_count"] == part["per_user"]["rows"] == users
        assert part["participations"] == {"1": users} and part["min_gap"] is None
        assert len(participation_users(report, d)) == users
        sizes[users] = (d / "privacy_report.json").stat().st_size
    assert abs(sizes[5000] - sizes[50]) <= 24, sizes


def _ledger_entries(out: Path) -> dict:
    """Each user's entry recomputed from the ledger log at the checkpoint's position and salt."""
    ckpt = load_checkpoint(out / "state")
    log = LedgerLog(out / "state" / LEDGER_LOG, LogPosition.from_dict(ckpt.public["ledger_log"]))
    ledger, _ = replay(log.read())
    salt = ckpt.secrets["report_salt"]
    return {
        hash_user_id(u, salt): {"rounds": sorted(rs), "min_gap": user_entry("", rs).min_gap}
        for u, rs in ledger.selected.items()
    }


@pytest.mark.integration
def test_sigkill_around_the_stores_commit_then_resume(tmp_path):
    """A server SIGKILLed after round 2's checkpoint, before its per-user store commits (the
    store a round behind the checkpoint), resumed and SIGKILLed inside round 3's commit, its rows
    written (a torn transaction, its hot journal left), then resumed to the end: each resume
    rebuilds the store from the ledger, and at the end its rows are the ledger's, with the
    report's row count and digest."""
    out = tmp_path / "run"
    helper = [sys.executable, str(TESTS / "user_store_kill_run.py"), str(out)]
    for kill_round, where in ((1, "before"), (2, "inside")):
        env = dict(ENV, KILL_ROUND=str(kill_round), KILL_WHERE=where)
        killed = subprocess.run(helper, env=env, capture_output=True, timeout=240)
        assert killed.returncode == -9, killed.stderr[-2000:]
        ckpt = load_checkpoint(out / "state").public
        assert ckpt["next_round"] == kill_round + 1
        if where == "before":
            with sqlite3.connect(f"{(out / STORE).as_uri()}?mode=ro", uri=True) as db:
                meta = dict(db.execute("SELECT key, value FROM meta"))
            assert meta["ledger_lines"] == str(kill_round)  # one round behind the checkpoint
        else:
            assert (out / (STORE + "-journal")).stat().st_size > 0  # a torn commit
    r = subprocess.run(helper, env=ENV, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads((out / "privacy_report.json").read_text())
    assert report["rounds_completed"] == 4
    users = participation_users(report, out)
    assert users == _ledger_entries(out) and len(users) == 12
    meta = UserStore(out / STORE).meta()
    per_user = report["realized"]["participation"]["per_user"]
    assert meta["ledger_lines"] == "4" and meta["digest"] == per_user["digest"]


def test_a_report_of_schema_2_is_read_with_its_users_inline(tmp_path):
    """A report of schema version 2 lists every user: `participation_users` and the summary's
    users line read them from the report, no store needed."""
    from corrflow.cli.summary import _users_line

    users = {
        _hashed("a"): {"rounds": [0, 3], "min_gap": 3},
        _hashed("b"): {"rounds": [1], "min_gap": None},
    }
    realized = {
        "rejections": 0,
        "participation": {
            "min_gap": 3,
            "max_participations": 2,
            "policy": "reject",
            "overrides": [],
            "users": users,
        },
    }
    report = {"schema_version": 2, "rounds_completed": 4, "realized": realized}
    assert participation_users(report, tmp_path) == users
    assert _users_line(realized, tmp_path).startswith("users       2, at most 2 rounds each")
