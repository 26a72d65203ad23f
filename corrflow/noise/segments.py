"""Key segments: which secret key drew each row Z_j of the noise matrix.

A run's noise is σ·C⁻¹Z with Z an n × d matrix of i.i.d. standard Gaussians. Every process start
of a server draws a fresh key from the operating system for the rows j ≥ the checkpoint's next
round; the rows before it keep the key that drew them. Z stays i.i.d. Gaussian, so the mechanism
and its accounting are unchanged, but a run directory rolled back together with its release
registry (undetectable on one machine) can no longer release a round with the noise of an earlier
release: the rows it draws after the restart are new.

The table of segments (first round, key) is private key material; it is saved in the
authenticated checkpoint, and the public state and the release journal name each segment by its
first round and a one-way fingerprint of its key, so that any released round can be replayed
exactly from the checkpoint. Each segment keeps the derivation version its key was made under
(`corrflow.noise.keys`): a new key is made under the current version, a stored one keeps its own.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_right
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from corrflow.errors import IntegrityError, InvalidArgumentError, require
from corrflow.noise.keys import VERSION, VERSIONS, fingerprint
from corrflow.noise.prng import GaussianSource


@dataclass(frozen=True)
class PublicSegment:
    """A key segment without its key, as a holder of no key knows it (the server of a noise-node
    run, a noise worker): first round, the key's fingerprint and its derivation version (1 where
    none was named)."""

    first_round: int
    key_fingerprint: str
    derivation: int = 1

    def public(self) -> dict:
        """The public form: from version 2 on with ``derivation`` (a version-1 segment's is as it
        was before versions)."""
        out = {"first_round": self.first_round, "key_fingerprint": self.key_fingerprint}
        if self.derivation != 1:
            out["derivation"] = self.derivation
        return out

    @classmethod
    def from_public(cls, segment: Mapping) -> PublicSegment:
        """Parse `public`'s form (a receipt's or a checkpoint's); IntegrityError when malformed or
        of an unknown derivation version."""
        try:
            out = cls(
                int(segment["first_round"]),
                str(segment["key_fingerprint"]),
                int(segment.get("derivation", 1)),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise IntegrityError(f"a malformed key segment {segment!r} ({exc})") from None
        if out.derivation not in VERSIONS:
            raise IntegrityError(f"key segment of unknown derivation version {out.derivation}")
        return out


@dataclass(frozen=True)
class PublicSegments:
    """Key segments without their keys, by increasing first round (the noise node's receipts of
    the released rows; a noise worker's segments)."""

    segments: tuple[PublicSegment, ...]
    #: what names a segment here, for the error of a round none covers
    source: str = "key segment"

    def segment_for(self, round_index: int) -> PublicSegment:
        """The segment that drew row ``round_index`` (IntegrityError when none)."""
        found = [s for s in self.segments if s.first_round <= round_index]
        if not found:
            raise IntegrityError(f"no {self.source} covers round {round_index + 1}")
        return found[-1]

    def extend(self, segment: PublicSegment) -> PublicSegments:
        """With ``segment`` for the rows from its first round on (later segments dropped, as
        `SegmentTable.extend` drops them)."""
        kept = tuple(s for s in self.segments if s.first_round < segment.first_round)
        return PublicSegments((*kept, segment), self.source)


@dataclass(frozen=True)
class KeySegment:
    """Rows Z_j for j ≥ ``first_round`` (up to the next segment's first round) drawn with
    ``key``, whose derived keys follow derivation ``version`` (`corrflow.noise.keys`)."""

    first_round: int
    key: bytes
    version: int = VERSION

    def __post_init__(self):
        require(
            self.version in VERSIONS, "key derivation version", f"one of {VERSIONS}", self.version
        )

    def info(self) -> PublicSegment:
        """The segment without its key."""
        fp = fingerprint(self.key, version=self.version)
        return PublicSegment(self.first_round, fp, self.version)

    def public(self) -> dict:
        """The segment's public form (`PublicSegment.public`)."""
        return self.info().public()

    def private(self) -> list:
        """[first round, key hex] (version 1, as stored before versions) or [..., version]."""
        row = [self.first_round, self.key.hex()]
        return row if self.version == 1 else [*row, self.version]

    @classmethod
    def from_row(cls, row) -> KeySegment:
        """Parse `private`'s row (raises ValueError or TypeError when malformed, an unknown
        version included)."""
        if not isinstance(row, list) or len(row) not in (2, 3):
            raise ValueError(f"a segment is [first round, key hex(, version)], not {row!r}")
        version = int(row[2]) if len(row) == 3 else 1
        return cls(int(row[0]), bytes.fromhex(row[1]), version)


@dataclass(frozen=True)
class SegmentTable:
    """The segments of one lineage of a run, by increasing first round (the first starts at 0)."""

    segments: tuple[KeySegment, ...]

    def __post_init__(self):
        firsts = [s.first_round for s in self.segments]
        if not firsts or firsts[0] != 0 or firsts != sorted(set(firsts)):
            raise IntegrityError(
                f"noise key segments start at rounds {firsts}: expected 0 then increasing rounds"
            )

    @classmethod
    def single(cls, key: bytes, version: int = VERSION) -> SegmentTable:
        """One key for every row (a run that has not restarted); ``version``: its derivation (a
        new key's is the current one)."""
        return cls((KeySegment(0, key, version),))

    @property
    def run_version(self) -> int:
        """The run key's (segment 0's) derivation version: its ring- and shard-MAC keys and
        fingerprint follow it."""
        return self.segments[0].version

    def index_of(self, round_index: int) -> int:
        """The index of the segment that holds row ``round_index``."""
        return bisect_right([s.first_round for s in self.segments], round_index) - 1

    def segment_for(self, round_index: int) -> KeySegment:
        """The segment whose key drew row Z_``round_index``."""
        return self.segments[self.index_of(round_index)]

    def extend(self, first_round: int, key: bytes, version: int = VERSION) -> SegmentTable:
        """The table with a new segment for the rows j ≥ ``first_round``; ``version``: its key's
        derivation (a key made now: the current one; a stored segment replayed: its own).

        Segments that began at or after ``first_round`` drew rows that were never released (the
        process stopped before it checkpointed them) and are dropped; a key the table already
        holds is refused, since reusing it would repeat rows of an earlier start."""
        require(
            isinstance(first_round, int) and first_round >= 0,
            "first_round",
            "a non-negative integer",
            first_round,
        )
        if any(s.key == key for s in self.segments):
            raise InvalidArgumentError(
                "noise_key", "a key this run has not used before (it would repeat noise rows)"
            )
        kept = tuple(s for s in self.segments if s.first_round < first_round)
        if not kept:
            return SegmentTable.single(key, version)
        return SegmentTable((*kept, KeySegment(first_round, key, version)))

    def public(self) -> list[dict]:
        """First round and key fingerprint of each segment (no key)."""
        return [s.public() for s in self.segments]

    def to_private(self) -> bytes:
        """The table with its keys, for the owner-only file of a checkpoint."""
        return json.dumps([s.private() for s in self.segments], separators=(",", ":")).encode()

    @classmethod
    def from_private(cls, data: bytes, public: list[dict] | None, where: str) -> SegmentTable:
        """Parse `to_private`'s bytes and check them against the public fingerprints.

        Raises:
            IntegrityError: (naming ``where``) unreadable, or keys that do not match the
                fingerprints recorded beside them.
        """
        try:
            rows = json.loads(data)
            table = cls(tuple(KeySegment.from_row(row) for row in rows))
        except (ValueError, TypeError) as exc:
            raise IntegrityError(f"{where}: unreadable noise key segments ({exc})") from None
        if public is not None and table.public() != public:
            raise IntegrityError(
                f"{where}: the noise key segments do not match the fingerprints in the state "
                "(foreign or edited file)"
            )
        return table


class SegmentedSource:
    """A Gaussian source whose row j comes from the source of the key that drew it.

    Args:
        table: the key segments.
        factory: builds the source of one key under its derivation version, ``factory(key,
            version)`` (NumPy's Philox or ChaCha, TensorFlow's Philox).
    """

    def __init__(self, table: SegmentTable, factory: Callable[[bytes, int], GaussianSource]):
        self._factory = factory
        self._sources: dict[bytes, GaussianSource] = {}
        self.table = table
        # (table, first and end row of the last row's segment, its source): valid while ``table`` is
        # the table
        self._last: tuple = (None, 0, 0, None)

    @property
    def name(self) -> str:
        return self._source(self.table.segments[0]).name

    def _source(self, segment: KeySegment) -> GaussianSource:
        if segment.key not in self._sources:
            self._sources[segment.key] = self._factory(segment.key, segment.version)
        return self._sources[segment.key]

    def normal(self, round_index: int, chunk: int, size: int) -> np.ndarray:
        """Row ``round_index``'s chunk, drawn with the key of its segment."""
        return self._source(self.table.segment_for(round_index)).normal(round_index, chunk, size)

    def generator(self, round_index: int, chunk: int):
        """The (round, chunk) stream's generator, from the key of the row's segment (for sources
        that draw block by block). The segment of the last row drawn is kept: a round's chunks,
        and the rounds after it until the next segment, look nothing up."""
        table, first, end, source = self._last
        # comparisons, not ``in range(…)``: a NumPy integer round would make that a linear scan
        if table is not self.table or not first <= round_index < end:
            table = self.table
            i = table.index_of(round_index)
            segments = table.segments
            first = segments[i].first_round
            end = segments[i + 1].first_round if i + 1 < len(segments) else math.inf
            source = self._source(segments[i])
            self._last = (table, first, end, source)
        return source.generator(round_index, chunk)
