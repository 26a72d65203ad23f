"""The release registry: every round a server releases, recorded outside the run directory, so that
a restored or copied run directory cannot release a round's noise a second time.

The release journal inside the run directory catches a rollback of ``state/`` alone; a backup of the
whole run directory restored after more rounds were released (or a copy of a live run resumed
elsewhere) carries a journal that agrees with its checkpoint, and would release rounds again with
identical noise — publishing, up to a tiny difference, the difference of two cohorts' sums. The
registry is a SQLite database (WAL, synchronous FULL: each record is durable before the round's
model leaves the server) under ``$CORRFLOW_HOME`` by default, or at the path the
``release-registry`` setting names (a different volume, a shared mount for several servers of one
host).

Refused, naming the registry entry: a run whose journal is behind the registry (a restored backup),
and a run id that the registry places in another directory (a copy). Limit: restoring the registry
together with the run directory defeats it — back it up separately, and never restore it over a
newer copy.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from pathlib import Path

from corrflow.errors import IntegrityError
from corrflow.paths import corrflow_home

REGISTRY_FILE = "release_registry.sqlite"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (run_id TEXT PRIMARY KEY, run_dir TEXT NOT NULL,
    created_at TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS releases (
    run_id TEXT NOT NULL, round INTEGER NOT NULL, noise_round INTEGER NOT NULL,
    journal_hash TEXT NOT NULL,
    released_at TEXT NOT NULL, PRIMARY KEY (run_id, round));
"""


def default_registry() -> Path:
    return corrflow_home() / REGISTRY_FILE


class ReleaseRegistry:
    """Claims of run ids by run directories, and the rounds each run released (see the module
    docstring)."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path else default_registry()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as db:
            db.executescript(_SCHEMA)

    @contextlib.contextmanager
    def _connect(self):
        db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            yield db
        finally:
            db.close()

    def claim(self, run_id: str, run_dir: Path) -> None:
        """Register a new run in ``run_dir``."""
        with self._connect() as db:
            db.execute(
                "INSERT INTO runs VALUES (?, ?, ?)", (run_id, str(Path(run_dir).resolve()), _now())
            )

    def check(self, run_id: str, run_dir: Path, released: int) -> None:
        """Refuse to resume run ``run_id`` from ``run_dir`` whose journal records ``released``
        rounds when the registry places the run elsewhere or has recorded more releases. A run the
        registry has not seen (made before it existed, or under another ``$CORRFLOW_HOME``) is
        claimed here."""
        here = str(Path(run_dir).resolve())
        with self._connect() as db:
            row = db.execute("SELECT run_dir FROM runs WHERE run_id = ?", (run_id,)).fetchone()
            if row is None:
                db.execute("INSERT INTO runs VALUES (?, ?, ?)", (run_id, here, _now()))
                return
            if row[0] != here:
                raise IntegrityError(
                    f"{self.path}: run {run_id} is registered in {row[0]}, not {here}: this "
                    "directory is a copy of that run, and resuming it would release its noise a "
                    "second time. Resume the original, or start a new run with --fresh"
                )
            last = db.execute(
                "SELECT MAX(round) FROM releases WHERE run_id = ?", (run_id,)
            ).fetchone()[0]
        if last is not None and last + 1 > released:
            raise IntegrityError(
                f"{self.path}: run {run_id} released {last + 1} round(s), but the release journal "
                "in "
                f"{here} records {released}: the directory was restored from an older backup, and "
                "resuming would release rounds again with the same noise. Restore the newest copy, "
                "or start a new run with --fresh"
            )

    def record(self, run_id: str, round_index: int, noise_round: int, journal_hash: str) -> None:
        """Record a release (durable when this returns); recording a round already recorded is a
        no-op only when it is the same journal entry."""
        with self._connect() as db:
            row = db.execute(
                "SELECT journal_hash FROM releases WHERE run_id = ? AND round = ?",
                (run_id, round_index),
            ).fetchone()
            if row is not None:
                if row[0] != journal_hash:
                    raise IntegrityError(
                        f"{self.path}: round {round_index + 1} of run {run_id} was released "
                        "before with another journal entry; refusing to release it again"
                    )
                return
            db.execute(
                "INSERT INTO releases VALUES (?, ?, ?, ?, ?)",
                (run_id, round_index, noise_round, journal_hash, _now()),
            )

    def released(self, run_id: str) -> int:
        """How many rounds the registry records for ``run_id``."""
        with self._connect() as db:
            return db.execute(
                "SELECT COUNT(*) FROM releases WHERE run_id = ?", (run_id,)
            ).fetchone()[0]


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
