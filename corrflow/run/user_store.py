"""The run's per-user privacy record (``participation.sqlite``; in an amplified run, whose cohorts
are secret, ``operator/participation.sqlite``, owner-only): one row per user — the salted hash of
its id, the rounds it was selected in, its smallest gap — written for the round's cohort alone, so
a round's write is O(cohort) however many users the run has seen. The privacy report summarises it
and names it with its row count and digest (`corrflow.accounting.participation`).

SQLite (the standard library's ``sqlite3``): one transaction per round, in rollback-journal mode
with ``synchronous=FULL``, so the file alone holds every committed round — a copy of the run
directory needs no ``-wal`` beside it, and a reader opens it read-only without writing anything.

Crash consistency: a round commits the store after its checkpoint and before its release journal
entry (ledger log → checkpoint → per-user store → journal → registry). The store records the
ledger log position it reflects; on every start of a resumed run it is checked against the
checkpoint's ledger — same run, same position, and rows whose digest equals the one recomputed from
the ledger — and rebuilt from the ledger in one transaction when anything differs (killed between
the checkpoint and the store's commit, a commit torn by a kill, an edited or missing file). The
store is never ahead of the privacy report's reader: a report covers rounds ``< rounds_completed``
and `read_entries` keeps those rounds of each row, so a store a few rounds ahead of the report
(which is complete every few rounds) reads back as the report's.
"""

from __future__ import annotations

import logging
import os
import sqlite3
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import closing
from pathlib import Path

from corrflow.accounting.participation import (
    ParticipationSummary,
    UserEntry,
    entries_digest,
    user_entry,
)
from corrflow.errors import DataFormatError, IntegrityError
from corrflow.run.disclosure import OPERATOR_DIR
from corrflow.run.ledger import LogPosition

log = logging.getLogger("corrflow")

STORE = "participation.sqlite"
TABLE = "users"
# Rows keyed by the order users were first seen (the run keeps hashed id → row id), with no index
# on the hashed id: a round's new users are appended together, a returning cohort's rows sit
# together (fixed-epoch: the same users every b rounds), so a round rewrites a few pages — not one
# page per user at a random place, as a table keyed by the (random) hashed id would.
_SCHEMA = (
    f"CREATE TABLE IF NOT EXISTS {TABLE} (id INTEGER PRIMARY KEY, user TEXT NOT NULL, "
    "rounds TEXT NOT NULL, participations INTEGER NOT NULL, min_gap INTEGER)",
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
)


def _row(row: tuple[int, UserEntry]) -> tuple:
    i, e = row
    return i, e.user, ",".join(map(str, e.rounds)), len(e.rounds), e.min_gap


def _entry(user: str, rounds: str, below: int | None = None) -> UserEntry | None:
    r = [int(x) for x in rounds.split(",")] if rounds else []
    if below is not None:
        r = [x for x in r if x < below]
    return user_entry(user, r) if r else None


class UserStore:
    """The per-user store of one run, open for writing (see the module docstring).

    Args:
        path: the SQLite file (created, owner-only when ``private``, where missing).
        private: create it 0600 (an amplified run's record is the operator's alone).
    """

    def __init__(self, path: str | os.PathLike, private: bool = False):
        self.path = Path(path)
        if private and not self.path.exists():
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600))
        # check_same_thread=False: a server's rounds may run on another thread than the one that
        # opened it (they never run at once: a run's state changes in one place).
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=DELETE")
        self._db.execute("PRAGMA synchronous=FULL")
        for statement in _SCHEMA:
            self._db.execute(statement)

    def meta(self) -> dict[str, str]:
        """The store's record of what it reflects (run id, ledger position, rows, digest)."""
        return dict(self._db.execute("SELECT key, value FROM meta"))

    def commit(
        self, rows: Iterable[tuple[int, UserEntry]], meta: dict, replace: bool = False
    ) -> None:
        """Write the entries (each replaces the row of its id) and the meta in one transaction.

        Args:
            rows: (row id, entry) of the round's cohort (or, with ``replace``, of every user).
            meta: what the store reflects after it (`str` values).
            replace: drop every row first (a rebuild from the ledger).
        """
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            if replace:
                db.execute(f"DELETE FROM {TABLE}")
                db.execute("DELETE FROM meta")
            db.executemany(
                f"INSERT OR REPLACE INTO {TABLE} VALUES (?, ?, ?, ?, ?)", map(_row, rows)
            )
            db.executemany(
                "INSERT OR REPLACE INTO meta VALUES (?, ?)", [(k, str(v)) for k, v in meta.items()]
            )
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def ids(self) -> dict[str, int]:
        """Hashed id → row id, of every row."""
        return dict(self._db.execute(f"SELECT user, id FROM {TABLE}"))

    def content(self) -> tuple[int, str]:
        """The rows' count and digest, recomputed from the file (a pass over every row).

        Returns:
            ``(rows, digest)``.
        """
        rows = self._db.execute(f"SELECT user, rounds FROM {TABLE}").fetchall()
        return len(rows), entries_digest(_entry(u, r) for u, r in rows)

    def close(self) -> None:
        self._db.close()


def read_entries(path: str | os.PathLike, below: int | None = None) -> Iterator[UserEntry]:
    """The store's rows, read-only (nothing written beside the file).

    Args:
        path: the store.
        below: keep only rounds before this one (the report's ``rounds_completed``), dropping
            users left with none; None keeps every round.

    Yields:
        Each user's `UserEntry`, in hashed-id order.

    Raises:
        DataFormatError: not a per-user store, or unreadable (a commit a kill left unfinished is
            rolled back when the run resumes).
    """
    path = Path(path)
    if not path.is_file():
        raise DataFormatError(path, None, "the run's per-user store (missing)")
    try:
        with closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)) as db:
            rows = db.execute(f"SELECT user, rounds FROM {TABLE} ORDER BY user").fetchall()
    except sqlite3.Error as exc:
        raise DataFormatError(
            path,
            None,
            f"the run's per-user store, readable ({exc}); if the server was killed, rerun the "
            "run's command to resume it",
        ) from None
    for user, rounds in rows:
        e = _entry(user, rounds, below)
        if e is not None:
            yield e


def check_entries(entries: list[UserEntry], per_user: dict, path: Path) -> None:
    """Check a store's rows (as of the report) against the report's reference to them.

    Args:
        entries: the rows, as `read_entries` gives them below the report's rounds.
        per_user: the report's ``per_user`` section (``rows``, ``digest``).
        path: the store (named in the error).

    Raises:
        IntegrityError: another number of rows or another digest than the report's.
    """
    rows, digest = len(entries), entries_digest(entries)
    if rows != per_user.get("rows") or digest != per_user.get("digest"):
        raise IntegrityError(
            f"{path}: {rows} users with digest {digest[:16]}…, the privacy report names "
            f"{per_user.get('rows')} with {str(per_user.get('digest'))[:16]}… (edited, or of "
            "another run): the per-user record does not match the report"
        )


class PerUserRecord:
    """The run's per-user store with its summary, both updated from each round's cohort.

    Args:
        store: the open store.
        summary: the summary of its rows.
        run_id: the run's id (recorded in the store).
        name: the store's path relative to the run directory (the report's reference).
    """

    def __init__(self, store: UserStore, summary: ParticipationSummary, run_id: str, name: str):
        self.store, self.summary, self.run_id, self.name = store, summary, run_id, name
        self._ids: dict[str, int] = {}  # hashed id → row id (first seen, first numbered)
        self._next = 1

    @classmethod
    def start(
        cls,
        run_dir: Path,
        name: str,
        run_id: str,
        selected: Mapping[str, Sequence[int]] | None,
        hashed: Callable[[str], str],
        position: LogPosition,
    ) -> PerUserRecord:
        """Open the store of a new run (``selected`` None: emptied) or of a resumed one: kept when
        it agrees with the checkpoint's ledger, else rebuilt from it (see the module docstring).

        Args:
            run_dir: the run directory.
            name: the store's path in it.
            run_id: the run's id.
            selected: the resumed ledger's user → rounds, or None for a new run.
            hashed: user id → its salted hash.
            position: the ledger log position the checkpoint vouches for.

        Returns:
            The record.
        """
        path = run_dir / name
        private = path.parent.name == OPERATOR_DIR
        entries = [user_entry(hashed(u), rs) for u, rs in (selected or {}).items() if rs]
        summary = ParticipationSummary.of(entries)
        out = cls(None, summary, run_id, name)  # type: ignore[arg-type]
        want = out._meta(position)
        if selected is None:
            _remove(path)
        try:
            out.store = UserStore(path, private)
            agrees = out.store.meta() == want and out.store.content() == (
                summary.users,
                summary.hex_digest(),
            )
        except sqlite3.DatabaseError:  # not a store (overwritten): rebuilt
            if out.store is not None:
                out.store.close()
            _remove(path)
            out.store, agrees = UserStore(path, private), False
        if agrees:
            out._ids = out.store.ids()
        else:
            if selected is not None:
                log.info("%s: rebuilt from the ledger log (behind or unlike the checkpoint)", path)
            out._ids = {e.user: i for i, e in enumerate(entries, 1)}
            out.store.commit(enumerate(entries, 1), want, replace=True)
        out._next = max(out._ids.values(), default=0) + 1
        return out

    def commit_round(
        self,
        selected: Mapping[str, Sequence[int]],
        cohort: Iterable[str],
        hashed: Callable[[str], str],
        position: LogPosition,
    ) -> None:
        """Write the round's cohort's entries (O(cohort)), in one transaction with the ledger
        position they bring the store to.

        Args:
            selected: the ledger's user → rounds, the round included (its last rounds).
            cohort: the round's users (a user listed m times was selected m times in it).
            hashed: user id → its salted hash.
            position: the ledger log position after the round.
        """
        rows = []
        for user, m in Counter(cohort).items():
            rounds, h = selected[user], hashed(user)
            old = user_entry(h, rounds[:-m]) if len(rounds) > m else None
            new = user_entry(h, rounds)
            self.summary.move(old, new)
            i = self._ids.get(h)
            if i is None:
                i = self._ids[h] = self._next
                self._next += 1
            rows.append((i, new))
        self.store.commit(rows, self._meta(position))

    def section(self) -> dict:
        """The report's reference to the store: ``{"store", "table", "rows", "digest"}``."""
        return {
            "store": self.name,
            "table": TABLE,
            "rows": self.summary.users,
            "digest": self.summary.hex_digest(),
        }

    def _meta(self, position: LogPosition) -> dict:
        return {
            "run_id": self.run_id,
            "ledger_lines": str(position.lines),
            "ledger_sha256": position.sha256,
            "rows": str(self.summary.users),
            "digest": self.summary.hex_digest(),
        }


def _remove(path: Path) -> None:
    for p in (path, path.with_name(path.name + "-journal")):
        p.unlink(missing_ok=True)
