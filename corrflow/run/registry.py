"""The release registry: every round a server releases, recorded outside the run directory, so that
a restored or copied run directory cannot release a round's noise a second time.

The release journal inside the run directory catches a rollback of ``state/`` alone; a backup of the
whole run directory restored after more rounds were released (or a copy of a live run resumed
elsewhere) carries a journal that agrees with its checkpoint. The registry is a SQLite database
(WAL, synchronous FULL: each record is durable before the round's model leaves the server) under
``$CORRFLOW_HOME`` by default, or at the path the ``release-registry`` setting names (a different
volume, a shared mount for several servers of one host).

Refused, naming the registry and the fix: a run whose journal is behind the registry (a restored
backup), a run id that the registry places in another directory (a copy, or a moved run), and a run
whose journal records releases the registry has never seen (a registry deleted or emptied, or a run
resumed under another ``$CORRFLOW_HOME``). `ReleaseRegistry.adopt` (``corrflow runs adopt DIR``)
registers such a run on purpose, and the privacy report lists each adoption.

A damaged, locked or emptied registry is refused (IntegrityError naming the file), never recreated.

What the registry cannot see — the registry restored together with the run directory, or a run
adopted after a rollback — is covered by the noise keys instead: every process start draws the rows
of the rounds after its checkpoint with a fresh key (`corrflow.noise.segments`), so the two
lineages share only the rounds before the rollback. Their later rounds are two independent releases
of the same mechanism: together one Gaussian release of the stacked rows, with sensitivity at most
√2 times the run's (for an amplified run the pair only has that unamplified bound).
Keep the registry on storage that is backed up separately from the run directories.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from pathlib import Path

from corrflow.errors import IntegrityError
from corrflow.paths import corrflow_home

REGISTRY_FILE = "release_registry.sqlite"
#: Seconds to wait for another server's write before refusing (a record takes milliseconds).
LOCK_TIMEOUT = 30.0
_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (run_id TEXT PRIMARY KEY, run_dir TEXT NOT NULL,
    created_at TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS releases (
    run_id TEXT NOT NULL, round INTEGER NOT NULL, noise_round INTEGER NOT NULL,
    journal_hash TEXT NOT NULL,
    released_at TEXT NOT NULL, PRIMARY KEY (run_id, round));
CREATE TABLE IF NOT EXISTS adoptions (
    run_id TEXT NOT NULL, adopted_at TEXT NOT NULL, run_dir TEXT NOT NULL, previous_dir TEXT,
    journal_rounds INTEGER NOT NULL, registry_rounds INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS forked_releases (
    run_id TEXT NOT NULL, round INTEGER NOT NULL, noise_round INTEGER NOT NULL,
    journal_hash TEXT NOT NULL, released_at TEXT NOT NULL, adopted_at TEXT NOT NULL);
"""
_TABLES = {"runs", "releases"}  # present in every registry, also those of older versions


def default_registry() -> Path:
    return corrflow_home() / REGISTRY_FILE


def _adopt_hint(run_dir: str) -> str:
    return (
        f"If this directory is the run's only live copy (moved, or restored on purpose), adopt it "
        f"with `corrflow runs adopt {run_dir}` (rounds after its checkpoint get fresh noise keys); "
        "otherwise resume the original, or start a new run with --fresh"
    )


class ReleaseRegistry:
    """Claims of run ids by run directories, and the rounds each run released (see the module
    docstring).

    Raises:
        IntegrityError: (naming the file) a registry that is damaged, locked by another process for
            `LOCK_TIMEOUT` seconds, emptied (a zero-byte file), or not a release registry.
    """

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path else default_registry()
        existed = self.path.exists()
        if existed and self.path.is_file() and self.path.stat().st_size == 0:
            raise IntegrityError(
                f"{self.path}: the release registry is empty (truncated or emptied): the record "
                "of which rounds were released is lost, and a new one would let restored runs "
                "release again unseen. Restore it from its backup, or delete the file to start a "
                "new registry (the runs it knew are then refused until adopted: `corrflow runs "
                "adopt DIR`)"
            )
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise IntegrityError(
                f"{self.path}: cannot create the release registry ({exc})"
            ) from None
        with self._connect() as db:
            if existed:
                tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master")}
                if not _TABLES <= tables:
                    raise IntegrityError(
                        f"{self.path}: not a release registry (tables {sorted(tables)}); point "
                        "--release-registry at the registry file"
                    )
            db.executescript(_SCHEMA)

    @contextlib.contextmanager
    def _connect(self):
        """A connection; SQLite's errors become IntegrityError naming the file (a damaged or
        locked registry refuses the run, never with a traceback and never by releasing)."""
        try:
            db = sqlite3.connect(self.path, timeout=LOCK_TIMEOUT, isolation_level=None)
        except sqlite3.Error as exc:
            raise IntegrityError(f"{self.path}: cannot open the release registry ({exc})") from None
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            yield db
        except sqlite3.OperationalError as exc:
            what = (
                f"locked by another process for {LOCK_TIMEOUT:g} s"
                if "locked" in str(exc) or "busy" in str(exc)
                else f"unusable ({exc})"
            )
            raise IntegrityError(
                f"{self.path}: the release registry is {what}; nothing was released. Retry when "
                "the other server has finished, or check the file"
            ) from None
        except sqlite3.DatabaseError as exc:
            raise IntegrityError(
                f"{self.path}: the release registry is damaged ({exc}); nothing was released. "
                "Restore it from its backup"
            ) from None
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
        rounds when the registry places the run elsewhere, has recorded more releases, or has
        never seen a run that released rounds. A run that released nothing is claimed here."""
        here = str(Path(run_dir).resolve())
        with self._connect() as db:
            row = db.execute("SELECT run_dir FROM runs WHERE run_id = ?", (run_id,)).fetchone()
            if row is None and released == 0:
                db.execute("INSERT INTO runs VALUES (?, ?, ?)", (run_id, here, _now()))
                return
            if row is None:
                raise IntegrityError(
                    f"{self.path}: does not know run {run_id}, whose release journal in {here} "
                    f"records {released} released round(s): the registry was deleted, emptied or "
                    "replaced, or the run comes from another $CORRFLOW_HOME. " + _adopt_hint(here)
                )
            if row[0] != here:
                raise IntegrityError(
                    f"{self.path}: run {run_id} is registered in {row[0]}, not {here}: this "
                    "directory is a copy or a move of that run, and resuming both would release "
                    "their rounds twice. " + _adopt_hint(here)
                )
            last = db.execute(
                "SELECT MAX(round) FROM releases WHERE run_id = ?", (run_id,)
            ).fetchone()[0]
        if last is not None and last + 1 > released:
            raise IntegrityError(
                f"{self.path}: run {run_id} released {last + 1} round(s), but the release journal "
                f"in {here} records {released}: the directory was restored from an older backup. "
                "Restore the newest copy. " + _adopt_hint(here)
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

    def run_dir(self, run_id: str) -> str | None:
        """The directory the registry places run ``run_id`` in (None: unknown)."""
        with self._connect() as db:
            row = db.execute("SELECT run_dir FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        return None if row is None else row[0]

    def released(self, run_id: str) -> int:
        """How many rounds the registry records for ``run_id``."""
        with self._connect() as db:
            return db.execute(
                "SELECT COUNT(*) FROM releases WHERE run_id = ?", (run_id,)
            ).fetchone()[0]

    def adopt(self, run_id: str, run_dir: Path, journal: list[tuple[int, int, str]]) -> dict:
        """Register run ``run_id`` in ``run_dir`` on purpose, with the releases its journal records
        (``(round, noise_round, journal hash)`` each); see `corrflow.server.runs.adopt_run`.

        Releases the registry holds beyond the journal, or with another journal entry (the other
        lineage of a restored backup), are moved to ``forked_releases``: the adopted run releases
        those rounds again, with noise drawn from fresh keys.

        Returns:
            the adoption record (what the privacy report lists).
        """
        here, now = str(Path(run_dir).resolve()), _now(precise=True)
        hashes = {r: h for r, _, h in journal}
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            row = db.execute("SELECT run_dir FROM runs WHERE run_id = ?", (run_id,)).fetchone()
            previous = None if row is None else row[0]
            known = db.execute(
                "SELECT round, noise_round, journal_hash, released_at FROM releases "
                "WHERE run_id = ? ORDER BY round",
                (run_id,),
            ).fetchall()
            forked = [k for k in known if hashes.get(k[0]) != k[2]]
            for r, nr, h, at in forked:
                db.execute(
                    "INSERT INTO forked_releases VALUES (?, ?, ?, ?, ?, ?)",
                    (run_id, r, nr, h, at, now),
                )
                db.execute("DELETE FROM releases WHERE run_id = ? AND round = ?", (run_id, r))
            if row is None:
                db.execute("INSERT INTO runs VALUES (?, ?, ?)", (run_id, here, now))
            else:
                db.execute("UPDATE runs SET run_dir = ? WHERE run_id = ?", (here, run_id))
            present = {k[0] for k in known} - {f[0] for f in forked}
            for r, nr, h in journal:
                if r not in present:
                    db.execute(
                        "INSERT INTO releases VALUES (?, ?, ?, ?, ?)", (run_id, r, nr, h, now)
                    )
            db.execute(
                "INSERT INTO adoptions VALUES (?, ?, ?, ?, ?, ?)",
                (run_id, now, here, previous, len(journal), len(known)),
            )
            db.execute("COMMIT")
        return {
            "adopted_at": now,
            "run_dir": here,
            "previous_dir": previous,
            "journal_rounds": len(journal),
            "registry_rounds": len(known),
            "rounds_released_again": sorted(f[0] for f in forked),
        }

    def adoptions(self, run_id: str) -> list[dict]:
        """Every adoption of ``run_id`` (oldest first), with the rounds it released again."""
        with self._connect() as db:
            rows = db.execute(
                "SELECT adopted_at, run_dir, previous_dir, journal_rounds, registry_rounds "
                "FROM adoptions WHERE run_id = ? ORDER BY rowid",
                (run_id,),
            ).fetchall()
            out = []
            for at, d, prev, jr, rr in rows:
                again = db.execute(
                    "SELECT round FROM forked_releases WHERE run_id = ? AND adopted_at = ? "
                    "ORDER BY round",
                    (run_id, at),
                ).fetchall()
                out.append(
                    {
                        "adopted_at": at,
                        "run_dir": d,
                        "previous_dir": prev,
                        "journal_rounds": jr,
                        "registry_rounds": rr,
                        "rounds_released_again": [r[0] for r in again],
                    }
                )
        return out


def _now(precise: bool = False) -> str:
    """UTC time; ``precise`` adds microseconds (an adoption's time is also its key)."""
    t = time.time()
    text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t))
    return f"{text}.{int(t % 1 * 1e6):06d}Z" if precise else text + "Z"


#: ``rounds_released_twice`` after an adoption into a registry that had not recorded the run.
UNKNOWN_TWICE = "unknown: the registry that recorded them is not this one"


def lineage_section(segments, adoptions: list[dict]) -> dict:
    """The privacy report's ``lineage``: the rounds from which each process start drew fresh noise
    keys, and the run's adoptions (module docstring).

    Args:
        segments: the noise generator's `corrflow.noise.segments.SegmentTable`.
        adoptions: `ReleaseRegistry.adoptions`.
    """
    again = sorted({r for a in adoptions for r in a["rounds_released_again"]})
    # An adoption into a registry that never knew the run (lost, emptied, or another home's) found
    # a journal of releases this registry did not record: which of them another lineage released
    # too, only the registry that recorded them could say.
    foreign = any(a["previous_dir"] is None and a["journal_rounds"] > 0 for a in adoptions)
    public = [  # no paths: the report may be published
        {
            "adopted_at": a["adopted_at"],
            "was_registered": a["previous_dir"] is not None,
            "moved": a["previous_dir"] not in (None, a["run_dir"]),
            "journal_rounds": a["journal_rounds"],
            "registry_rounds": a["registry_rounds"],
            "rounds_released_again": a["rounds_released_again"],
        }
        for a in adoptions
    ]
    return {
        "key_segments": [s.first_round for s in segments.segments],
        "adoptions": public,
        "rounds_released_twice": UNKNOWN_TWICE if foreign else again,
        "note": (
            "each process start draws the noise of the rounds after its checkpoint with a fresh "
            "key; rounds released again after an adoption carry new noise, and the two releases "
            "together have at most √2 times the planned sensitivity (unamplified)"
            if again or foreign
            else "each process start draws the noise of the rounds after its checkpoint with a "
            "fresh key"
        )
        + (
            "; the run was adopted into a registry that had not recorded its releases, so "
            "whether another copy released some rounds too is unknown here"
            if foreign
            else ""
        ),
    }
