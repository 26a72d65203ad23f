"""What a server may do with an output directory before it runs: hold it alone, and resume only from
a state that agrees with everything already released.

* `RunLock`: an OS-level exclusive lock (``filelock``, ``flock`` on POSIX) on the output
  directory for the whole run; it dies with the process, so SIGKILL leaves no stale lock. A second
  server exits at once, naming the holder's pid.
* `check_resume`: compares the published checkpoint with the release journal by round numbers
  (never file times) and refuses — naming the file, deleting nothing — when they disagree: a journal
  ahead of the checkpoint (``state/`` restored from an older copy: its noise was already released),
  a checkpoint more than one round ahead of the journal, a missing checkpoint after releases, a
  checkpoint that fails its manifest or HMAC (or a secret it vouches for), a short salt. The one
  allowed gap is a round checkpointed but not yet released (killed between the two writes): it is
  released on resume.
* `archive_run`: ``--fresh`` moves the old run aside (never deletes it).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from corrflow.errors import CorrflowError, IntegrityError
from corrflow.fileio import write_json
from corrflow.run.checkpoint import (
    CHECKPOINT,
    SALT,
    SECRET,
    SECRETS_DIR,
    Checkpoint,
    load_checkpoint,
    remove_stale_temporaries,
)
from corrflow.run.journal import JOURNAL, JournalEntry, ReleaseJournal
from corrflow.run.ledger import LEDGER_LOG, LedgerLog, LogPosition
from corrflow.run.noise_shards import SHARD_ROOT

log = logging.getLogger("corrflow")

LOCK = ".corrflow.lock"
STATE = "state"  # the checkpoints, inside the run directory
MIN_SALT_BYTES = 16
#: Written when a round's unmasked secure sum failed the plausibility check: its presence refuses
# every rerun of the run (summing that round again, same cohort and noise, could tell members
# apart) until ``--fresh`` moves it aside with the run.
SECURE_SUM_REFUSED = "secure_sum_refused.json"
#: Under secure aggregation: the count of every reply the server received, over every process
# start of the run (`corrflow.strategies.wire`); the report's ``server_saw`` is derived from it.
SERVER_RECEIVED = "server_received.json"
#: With the noise workers' states (`SHARD_ROOT`), which go with the run.
RUN_FILES = (
    JOURNAL,
    "privacy_report.json",
    "participation.sqlite",  # the per-user store (corrflow.run.user_store.STORE)
    "participation.sqlite-journal",
    "metrics.json",
    SHARD_ROOT,
    SECURE_SUM_REFUSED,
    SERVER_RECEIVED,
)


class RunLockedError(CorrflowError):
    """Another server holds the output directory."""


class RunLock:
    """Exclusive lock on ``out_dir`` for the lifetime of a server (context manager)."""

    def __init__(self, out_dir: str | os.PathLike):
        self.out = Path(out_dir)
        self.path = self.out / LOCK
        self.holder = self.out / (LOCK + ".holder")
        # thread_local=False: a server's rounds may run on another thread than the one that locked.
        self._lock = FileLock(self.path, timeout=0, thread_local=False, is_singleton=False)

    def __enter__(self) -> RunLock:
        self.out.mkdir(parents=True, exist_ok=True)
        try:
            self._lock.acquire()
        except Timeout:
            who = "unknown pid"
            try:
                info = json.loads(self.holder.read_text())
                who = f"pid {info['pid']} on {info['host']}, since {info['since']}"
            except (OSError, ValueError, KeyError):
                pass
            raise RunLockedError(
                f"{self.out.resolve()} is in use by another corrflow server ({who}); two servers "
                "on one run would release rounds twice. Stop the other one, or use another "
                "--out."
            ) from None
        write_json(
            self.holder,
            {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            },
        )
        return self

    def __exit__(self, *exc) -> None:
        self.holder.unlink(missing_ok=True)
        self._lock.release()


@dataclass(frozen=True)
class ResumePoint:
    checkpoint: Checkpoint | None  # None: a new run
    journal: list[JournalEntry]
    unreleased_round: int | None  # a round checkpointed but not journaled (released on resume)


def check_resume(run_dir: str | os.PathLike) -> ResumePoint:
    """Decide, from the files alone, whether this run directory starts a run, resumes one, or must
    be refused (IntegrityError naming the file). Removes stale temporary checkpoint files."""
    out = Path(run_dir)
    if (refused := out / SECURE_SUM_REFUSED).exists():
        raise IntegrityError(
            f"{refused}: {_refusal(refused)}. Summing that round again would give the server a "
            "second sum of the same cohort with the same noise; start a new run with --fresh (the "
            "old one is moved aside)."
        )
    state = out / STATE
    stale = remove_stale_temporaries(state)
    if stale:
        log.info("removed %d stale temporary checkpoint file(s) in %s", len(stale), state)
    journal = ReleaseJournal(out / JOURNAL)
    ckpt = load_checkpoint(state)
    if ckpt is None:
        entries = journal.read()
        rounds = sorted(p.name for p in state.glob("round-*")) if state.is_dir() else []
        if entries:
            raise IntegrityError(
                f"{state / CHECKPOINT}: missing, but {journal.path} records {len(entries)} "
                "released round(s): starting over would reuse released noise. Restore the state "
                "directory, or start a new run with --fresh (the old one is moved aside)."
            )
        if rounds:
            raise IntegrityError(
                f"{state / CHECKPOINT}: missing, but {state} holds checkpoint(s) {rounds[-1]} of "
                "an earlier layout without its CURRENT pointer: refusing to guess. Restore "
                "CURRENT, or start a new run with --fresh."
            )
        return ResumePoint(None, [], None)
    entries = journal.read(ckpt.secrets[SECRET])
    if len(ckpt.secrets.get(SALT, b"")) < MIN_SALT_BYTES:
        where = ckpt.secret_files.get(SALT, {}).get("file", SALT)
        raise IntegrityError(
            f"{_secret_path(ckpt, where)}: the report salt is shorter than {MIN_SALT_BYTES} bytes "
            "(hashed user ids would be reversible)"
        )
    public = ckpt.public
    completed = int(public["next_round"])
    released = len(entries)
    if entries and entries[0].run_id != public.get("run_id"):
        raise IntegrityError(
            f"{journal.path}: belongs to run {entries[0].run_id}, the checkpoint to "
            f"{public.get('run_id')}"
        )
    if released > completed:
        raise IntegrityError(
            f"{ckpt.path}: the checkpoint is at round {completed} but {journal.path} "
            f"records {released} released rounds: this state is older than what was released "
            "(a restored copy?) and resuming would release noise twice. Restore the newest state, "
            "or start a new run with --fresh."
        )
    if released < completed - 1:
        raise IntegrityError(
            f"{journal.path}: records {released} released rounds but the checkpoint is at round "
            f"{completed}: the journal was truncated or replaced."
        )
    if (
        entries
        and released == completed
        and entries[-1].checkpoint == ckpt.name
        and entries[-1].manifest_sha256 != ckpt.digest
    ):
        raise IntegrityError(
            f"{ckpt.path}: differs from the checkpoint recorded in {journal.path} for round "
            f"{released - 1}"
        )
    return ResumePoint(ckpt, entries, completed - 1 if released == completed - 1 else None)


def _secret_path(ckpt: Checkpoint, fname: str) -> Path:
    """Where a checkpoint's secret file lies (inside a checkpoint directory of the earlier
    layout)."""
    return ckpt.path / fname if ckpt.legacy else ckpt.state_dir / SECRETS_DIR / fname


def _refusal(path: Path) -> str:
    """What a `SECURE_SUM_REFUSED` file says (its own reason; any content refuses)."""
    try:
        return str(json.loads(path.read_text())["reason"])
    except (OSError, ValueError, KeyError, TypeError):
        return "a round's secure sum was refused after unmasking"


def preflight(run_dir: str | os.PathLike) -> ResumePoint:
    """What a CLI checks before it starts an engine (Ray takes ~20 s): the directory is not in use
    and agrees with its release journal. Holds the lock only while checking; the run takes it
    again."""
    with RunLock(run_dir):
        return check_resume(run_dir)


def verify_finished_ledger(run_dir: str | os.PathLike) -> None:
    """Check a run's ledger log against its published checkpoint, as a resume does: a rerun of a
    finished run prints its report without starting the run, and must not vouch for a ledger that
    was edited since (the participation its ε is accounted on).

    Args:
        run_dir: the run directory (its ``state/``).

    Raises:
        IntegrityError: the ledger log does not match the checkpoint's record of it.
    """
    with RunLock(run_dir):
        ckpt = load_checkpoint(Path(run_dir) / STATE)
        if ckpt is not None and "ledger_log" in ckpt.public:
            position = LogPosition.from_dict(ckpt.public["ledger_log"])
            LedgerLog(Path(run_dir) / STATE / LEDGER_LOG, position).read()


def settings_conflict(state_dir: str | os.PathLike, settings: dict) -> str | None:
    """The settings that differ between ``settings`` and the run checkpointed in ``state_dir``
    ("name: old → new", …), or None when they match or there is no checkpoint — so a CLI can refuse
    before starting an engine."""
    try:
        ckpt = load_checkpoint(state_dir)
    except IntegrityError:
        return None  # the run itself refuses, naming the file
    if ckpt is None:
        return None
    theirs = ckpt.public.get("settings", {})
    diff = [
        f"{k}: {theirs.get(k)!r} → {settings.get(k)!r}"
        for k in sorted(set(theirs) | set(settings))
        if theirs.get(k) != settings.get(k)
    ]
    return ", ".join(diff) or None


def archive_run(run_dir: str | os.PathLike, reason: str = "--fresh") -> Path | None:
    """Move the run's checkpoints and its run files (journal, report, metrics) into
    ``run_dir/previous-runs/<UTC time>/`` — for ``--fresh``, and before a new run starts where an
    old one left its report: nothing is overwritten, and journal and checkpoint always leave
    together."""
    out = Path(run_dir)
    state = out / STATE
    present = [name for name in RUN_FILES if (out / name).exists()]
    if state.exists():
        present.append(STATE)
    if not present:
        return None
    dest = out / "previous-runs" / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    while dest.exists():
        dest = dest.with_name(dest.name + "-1")
    dest.mkdir(parents=True)
    for name in present:
        shutil.move(str(out / name), str(dest / name))
    log.warning("%s: moved the previous run (%s) to %s", reason, ", ".join(present), dest)
    return dest
