"""The privacy ledger: who was selected in which round (selected-but-silent counts as
participating), what was rejected and why, overrides, and the ε history — in memory (`Ledger`)
and on disk as an append-only, hash-chained log of each round's additions (`LedgerLog`). ε itself
is computed by ``corrflow.accounting.tracking``."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from corrflow.errors import IntegrityError


@dataclass
class Ledger:
    selected: dict[str, list[int]] = field(default_factory=dict)  # user -> rounds selected
    # user -> rounds with an accepted update
    replied: dict[str, list[int]] = field(default_factory=dict)
    rejections: list[dict] = field(default_factory=list)  # {"round", "user", "reason"}
    overrides: list[dict] = field(default_factory=list)
    rounds_completed: int = 0
    epsilon_history: list[float] = field(default_factory=list)

    def record_round(
        self,
        round_index: int,
        users: Iterable[str],
        accepted: Iterable[str],
        rejections: Iterable[Sequence],
        overrides: Iterable[dict],
        epsilon: float | None,
    ) -> None:
        """Add round ``round_index``, which completes it.

        Args:
            round_index: the round, after every recorded one.
            users: who was selected (a user listed m times contributes m items in it).
            accepted: the ids whose update was accepted.
            rejections: (who, reason) of each rejection.
            overrides: the round's override records.
            epsilon: the realised ε after the round (None: a non-private run).
        """
        self.overrides.extend(overrides)
        for u in users:
            self.selected.setdefault(u, []).append(round_index)
        self.rejections.extend(
            {"round": round_index, "user": who, "reason": why} for who, why in rejections
        )
        for key in accepted:
            self.replied.setdefault(key, []).append(round_index)
        self.epsilon_history.append(epsilon)
        self.rounds_completed = round_index + 1

    def to_dict(self) -> dict:
        return {
            "selected": self.selected,
            "replied": self.replied,
            "rejections": self.rejections,
            "overrides": self.overrides,
            "rounds_completed": self.rounds_completed,
            "epsilon_history": self.epsilon_history,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Ledger:
        return cls(**d)


LEDGER_LOG = "ledger.jsonl"
GENESIS = "0" * 64


@dataclass(frozen=True)
class LogPosition:
    """How much of the ledger log a checkpoint vouches for: its first ``lines`` lines, ``size``
    bytes, whose chained SHA-256 is ``sha256`` (d_i = SHA-256(d_{i−1} ‖ line_i), d_0 = 64 zeros).
    Stored in the checkpoint's HMAC-covered ``state.json``, it authenticates the log's prefix."""

    lines: int = 0
    size: int = 0
    sha256: str = GENESIS

    def to_dict(self) -> dict:
        return {"lines": self.lines, "size": self.size, "sha256": self.sha256}

    @classmethod
    def from_dict(cls, d: dict) -> LogPosition:
        return cls(int(d["lines"]), int(d["size"]), str(d["sha256"]))


class LedgerLog:
    """The ledger as an append-only file (``state/ledger.jsonl``, 0600: it names raw user ids): one
    JSON line per released round with what the round added — its cohort, accepted keys,
    rejections, override records, ε and metrics — so a round writes O(cohort) bytes however many
    users the run has seen (the checkpoint of schema version 1 held the whole ledger).

    Crash consistency: a round's line is appended (fsync-ed) before its checkpoint, which records
    the `LogPosition` after it; on resume the log is read up to that position, its chain checked,
    and anything after it (a round killed before its checkpoint: never released) cut off. An edited,
    truncated or swapped log is refused, naming the file.
    """

    def __init__(self, path: str | os.PathLike, position: LogPosition | None = None):
        self.path = Path(path)
        self.position = position or LogPosition()

    def append(self, entry: dict) -> LogPosition:
        """Append one line at the vouched-for position (cutting any tail a killed append left).

        Args:
            entry: a round's delta (`round_entry`), JSON-serialisable.

        Returns:
            The position after it (for the next checkpoint).
        """
        data = (json.dumps(entry, sort_keys=True, separators=(",", ":")) + "\n").encode()
        pos = self.position
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, pos.size)
            os.lseek(fd, pos.size, os.SEEK_SET)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        self.position = LogPosition(pos.lines + 1, pos.size + len(data), _chain(pos.sha256, data))
        return self.position

    def read(self) -> list[dict]:
        """The entries up to the position, verified; the tail after it is cut off.

        Returns:
            One dict per line.

        Raises:
            IntegrityError: the file is shorter than the position, or its chain does not match.
        """
        pos = self.position
        size = self.path.stat().st_size if self.path.exists() else 0
        if size < pos.size:
            raise IntegrityError(
                f"{self.path}: {size} bytes, but the checkpoint vouches for {pos.size} "
                "(truncated or replaced): the run's participation record is incomplete; restore "
                "the state directory, or start a new run with --fresh"
            )
        with open(self.path, "rb") as f:
            raw = f.read(pos.size)
        lines = raw.splitlines(keepends=True)
        digest = GENESIS
        for line in lines:
            digest = _chain(digest, line)
        if len(lines) != pos.lines or digest != pos.sha256:
            raise IntegrityError(
                f"{self.path}: does not match the checkpoint's record of it (edited, reordered or "
                "swapped); restore the state directory, or start a new run with --fresh"
            )
        if size > pos.size:  # a round appended, then killed before its checkpoint: not released
            with open(self.path, "r+b") as f:
                f.truncate(pos.size)
                os.fsync(f.fileno())
        try:
            return [json.loads(line) for line in lines]
        except json.JSONDecodeError as exc:  # only with a forged chain (the MAC covers it)
            raise IntegrityError(f"{self.path}: not a ledger log ({exc})") from None


def _chain(prev: str, line: bytes) -> str:
    return hashlib.sha256(prev.encode() + line).hexdigest()


def round_entry(
    round_index: int,
    users: Sequence[str],
    accepted: Sequence[str],
    rejections: Sequence[tuple[str | None, str]],
    overrides: Sequence[dict],
    epsilon: float | None,
    metrics: dict,
) -> dict:
    """One released round's line of the ledger log (what the round adds to the `Ledger`)."""
    return {
        "round": round_index,
        "selected": list(users),
        "accepted": list(accepted),
        "rejections": [[who, why] for who, why in rejections],
        "overrides": list(overrides),
        "epsilon": epsilon,
        "metrics": metrics,
    }


def replay(entries: Iterable[dict]) -> tuple[Ledger, list[dict]]:
    """The ledger and metric history the log's entries add up to (a ``snapshot`` line — a run
    resumed from a checkpoint that still held the whole ledger — sets both).

    Args:
        entries: the log's lines, in order.

    Returns:
        (ledger, metrics history).
    """
    ledger, metrics, completed = Ledger(), [], 0
    for e in entries:
        if "snapshot" in e:
            ledger = Ledger.from_dict(e["snapshot"]["ledger"])
            metrics = list(e["snapshot"]["metrics_history"])
            completed = ledger.rounds_completed
            continue
        t = int(e["round"])
        ledger.record_round(
            t, e["selected"], e["accepted"], e["rejections"], e["overrides"], e["epsilon"]
        )
        completed = t + 1
        metrics.append(e["metrics"])
    return replace(ledger, rounds_completed=completed), metrics
