"""The per-user part of the privacy report, kept per round in O(cohort): each user's entry (hashed
id, rounds, smallest gap), and a summary of all entries — user count, users by number of
participations, quantiles of the smallest gaps, and an order-independent digest of the entries —
that the report publishes instead of listing every user. The entries themselves go to the run's
per-user store (`corrflow.run.user_store`), which an auditor checks against the digest.

Digest: the sum, modulo 2²⁵⁶, of SHA-256(``id:r₁,r₂,…``) over every user (``id`` the salted hash,
``rᵢ`` the user's rounds ascending with multiplicity), as 64 hex digits. A sum (a multiset hash)
rather than a hash of the sorted list, so a round updates it from its cohort alone: the entry a
user leaves is subtracted, the one it enters added.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

#: The digest's modulus (a sum of SHA-256 values).
MODULUS = 1 << 256
#: The quantiles of the users' smallest gaps the summary gives.
GAP_QUANTILES = (0.0, 0.1, 0.5, 0.9, 1.0)


class UserEntry(NamedTuple):
    """One user's line of the per-user record.

    Attributes:
        user: the salted hash of the user's id (`corrflow.accounting.report.hash_user_id`).
        rounds: the rounds the user was selected in, ascending, with multiplicity.
        min_gap: the smallest gap between two distinct rounds (None: fewer than two).
    """

    user: str
    rounds: tuple[int, ...]
    min_gap: int | None


def user_entry(user: str, rounds: Sequence[int]) -> UserEntry:
    """A user's entry (``min_gap`` as `corrflow.accounting.posthoc.min_gap`), in plain Python: a
    round computes one per cohort member, and numpy's per-call overhead would dominate.

    Args:
        user: the salted hash of the user's id.
        rounds: the rounds the user was selected in (any order, with multiplicity).

    Returns:
        The `UserEntry`.
    """
    r = tuple(sorted(int(x) for x in rounds))
    gaps = [b - a for a, b in zip(r, r[1:], strict=False) if b != a]
    return UserEntry(user, r, min(gaps) if gaps else None)


def entry_hash(entry: UserEntry) -> int:
    """The entry's term of the digest: SHA-256(``id:r₁,r₂,…``) as an integer.

    Args:
        entry: a user's entry.

    Returns:
        The integer.
    """
    text = f"{entry.user}:{','.join(map(str, entry.rounds))}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest(), "big")


def entries_digest(entries: Iterable[UserEntry]) -> str:
    """The digest of a whole per-user record (see the module docstring), recomputed from scratch.

    Args:
        entries: every user's entry, in any order.

    Returns:
        64 hex digits.
    """
    return f"{sum(entry_hash(e) for e in entries) % MODULUS:064x}"


@dataclass
class ParticipationSummary:
    """The per-user record summarised, updated from each round's cohort (`move`).

    Attributes:
        participations: number of rounds → users with that many (with multiplicity).
        gaps: smallest gap → users with it (users with fewer than two distinct rounds absent).
        digest: the sum of the entries' hashes modulo 2²⁵⁶ (`entries_digest`).
    """

    participations: Counter = field(default_factory=Counter)
    gaps: Counter = field(default_factory=Counter)
    digest: int = 0

    @classmethod
    def of(cls, entries: Iterable[UserEntry]) -> ParticipationSummary:
        """The summary of a whole record (a resumed run's: one pass over the population).

        Args:
            entries: every user's entry.

        Returns:
            The summary.
        """
        out = cls()
        for e in entries:
            out._enter(e)
        return out

    @property
    def users(self) -> int:
        """How many users have an entry."""
        return sum(self.participations.values())

    def move(self, old: UserEntry | None, new: UserEntry) -> None:
        """Replace a user's entry ``old`` (None: the user had none) with ``new``.

        Args:
            old: the entry before the round, or None.
            new: the entry after it.
        """
        if old is not None:
            self._leave(old)
        self._enter(new)

    def _enter(self, e: UserEntry) -> None:
        self.participations[len(e.rounds)] += 1
        if e.min_gap is not None:
            self.gaps[e.min_gap] += 1
        self.digest = (self.digest + entry_hash(e)) % MODULUS

    def _leave(self, e: UserEntry) -> None:
        for counter, key in ((self.participations, len(e.rounds)), (self.gaps, e.min_gap)):
            if key is None:
                continue
            counter[key] -= 1
            if not counter[key]:
                del counter[key]
        self.digest = (self.digest - entry_hash(e)) % MODULUS

    def to_dict(self) -> dict:
        """The report's summary of the per-user record.

        Returns:
            ``{"user_count", "min_gap", "max_participations", "participations": {"k": users},
            "min_gap_quantiles": {"p0", "p10", "p50", "p90", "p100"} or None}``.
        """
        return {
            "user_count": self.users,
            "min_gap": min(self.gaps) if self.gaps else None,
            "max_participations": max(self.participations, default=0),
            "participations": {str(k): v for k, v in sorted(self.participations.items())},
            "min_gap_quantiles": counter_quantiles(self.gaps, GAP_QUANTILES),
        }

    def hex_digest(self) -> str:
        """The digest as 64 hex digits (`entries_digest` of the record)."""
        return f"{self.digest:064x}"


def counter_quantiles(counts: Mapping[int, int], qs: Sequence[float]) -> dict | None:
    """Quantiles (lower, nearest rank) of the values a histogram counts, in O(distinct values).

    Args:
        counts: value → how many times it occurs.
        qs: the quantiles, each in [0, 1].

    Returns:
        ``{"p<100q>": value}``, or None for an empty histogram.
    """
    total = sum(counts.values())
    if not total:
        return None
    out, items = {}, sorted(counts.items())
    for q in qs:
        rank, seen = min(total - 1, int(q * (total - 1))), 0
        for value, n in items:
            seen += n
            if seen > rank:
                out[f"p{round(100 * q)}"] = value
                break
    return out
