"""The release journal: the authority on which rounds a server has released.

One JSON line per released round, append-only and hash-chained (each entry holds the SHA-256 of the
one before and an HMAC of its own hash under the server's private secret), written after the round's
checkpoint and before its model leaves the server. It lives in the run's output directory, outside
``state/``, so that restoring an older copy of ``state/`` cannot roll it back: on start, a journal
ahead of the checkpoint means the noise of those rounds was already released and must never be used
again.

An append killed mid-write (a power cut) leaves a last line without its newline. Its model was never
released (release follows the fsync-ed append), so `ReleaseJournal.read` ignores such a tail
and the next append cuts it off; any complete line that does not verify is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import dataclass
from pathlib import Path

from corrflow.errors import IntegrityError
from corrflow.hashing import canonical_sha256

JOURNAL = "release_journal.jsonl"
GENESIS = "0" * 64


@dataclass(frozen=True)
class JournalEntry:
    run_id: str
    round: int  # 0-based round whose model was released
    noise_round: int  # the noise round index it used (each is released at most once, ever)
    cohort_sha256: str  # hash of the round's hashed cohort
    checkpoint: str  # the checkpoint directory that holds the released state
    manifest_sha256: str  # digest of that checkpoint's manifest
    prev: str
    hash: str
    mac: str
    # the key segment that drew its newest row Z_t, {"first_round", "key_fingerprint"}
    # (corrflow.noise.segments): with the checkpoint's segment table, the round replays exactly.
    # None only in journals written before segments existed (one key for the whole run).
    noise_segment: dict | None = None

    def body(self) -> dict:
        d = dict(self.__dict__)
        d.pop("hash")
        d.pop("mac")
        if d["noise_segment"] is None:  # older entries were hashed without the field
            d.pop("noise_segment")
        return d


def _digest(body: dict) -> str:
    return canonical_sha256(body)


class ReleaseJournal:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def read(self, secret: bytes | None = None) -> list[JournalEntry]:
        """Every entry, the chain checked (and each HMAC, given the secret); IntegrityError names
        file:line."""
        if not self.path.exists():
            return []
        entries, prev = [], GENESIS
        with open(self.path, encoding="utf-8", errors="replace") as f:
            for line_no, line in enumerate(f, 1):
                if not line.endswith("\n"):  # a torn append: that round was not released
                    break
                where = f"{self.path}:{line_no}"
                try:
                    entry = JournalEntry(**json.loads(line))
                except (json.JSONDecodeError, TypeError) as exc:
                    raise IntegrityError(f"{where}: not a release-journal entry ({exc})") from None
                if entry.prev != prev or _digest(entry.body()) != entry.hash:
                    raise IntegrityError(
                        f"{where}: the hash chain is broken (edited, truncated or reordered)"
                    )
                if secret is not None and not hmac.compare_digest(
                    entry.mac, _mac(secret, entry.hash)
                ):
                    raise IntegrityError(
                        f"{where}: the entry's HMAC does not match this run's secret"
                    )
                if entries and entry.run_id != entries[0].run_id:
                    raise IntegrityError(f"{where}: an entry of another run ({entry.run_id})")
                if entry.round != len(entries):
                    raise IntegrityError(f"{where}: round {entry.round}, expected {len(entries)}")
                entries.append(entry)
                prev = entry.hash
        return entries

    def append(
        self,
        secret: bytes,
        *,
        run_id: str,
        round_index: int,
        cohort_sha256: str,
        checkpoint: str,
        manifest_sha256: str,
        prev: str,
        noise_segment: dict | None = None,
    ) -> JournalEntry:
        body = {
            "run_id": run_id,
            "round": round_index,
            "noise_round": round_index,
            "cohort_sha256": cohort_sha256,
            "checkpoint": checkpoint,
            "manifest_sha256": manifest_sha256,
            "prev": prev,
            **({"noise_segment": noise_segment} if noise_segment is not None else {}),
        }
        digest = _digest(body)
        entry = JournalEntry(**body, hash=digest, mac=_mac(secret, digest))
        self._cut_torn_tail()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "a", encoding="utf-8") as f:
            f.write(json.dumps({**body, "hash": digest, "mac": entry.mac}, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return entry

    def _cut_torn_tail(self) -> None:
        """Truncate a last line that has no newline (see the module docstring) before appending
        after it."""
        if not self.path.exists():
            return
        with open(self.path, "r+b") as f:
            size = f.seek(0, os.SEEK_END)
            if size == 0 or (f.seek(size - 1) is not None and f.read(1) == b"\n"):
                return  # the usual case: one byte read per round
            f.seek(0)
            f.truncate(f.read().rfind(b"\n") + 1)
            os.fsync(f.fileno())


def _mac(secret: bytes, digest: str) -> str:
    return hmac.new(secret, digest.encode(), hashlib.sha256).hexdigest()


def cohort_digest(hashed_users: list[str]) -> str:
    return hashlib.sha256("\n".join(sorted(hashed_users)).encode()).hexdigest()
