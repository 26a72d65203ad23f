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
exactly from the checkpoint.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from corrflow.errors import IntegrityError, InvalidArgumentError, require
from corrflow.noise.keys import fingerprint
from corrflow.noise.prng import GaussianSource


@dataclass(frozen=True)
class KeySegment:
    """Rows Z_j for j ≥ ``first_round`` (up to the next segment's first round) drawn with
    ``key``."""

    first_round: int
    key: bytes

    def public(self) -> dict:
        """The segment without its key: first round and the key's fingerprint."""
        return {"first_round": self.first_round, "key_fingerprint": fingerprint(self.key)}


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
    def single(cls, key: bytes) -> SegmentTable:
        """One key for every row (a run that has not restarted)."""
        return cls((KeySegment(0, key),))

    def index_of(self, round_index: int) -> int:
        """The index of the segment that holds row ``round_index``."""
        return bisect_right([s.first_round for s in self.segments], round_index) - 1

    def segment_for(self, round_index: int) -> KeySegment:
        """The segment whose key drew row Z_``round_index``."""
        return self.segments[self.index_of(round_index)]

    def key_for(self, round_index: int) -> bytes:
        """The key that draws row Z_``round_index`` (the one hook the noise engine uses)."""
        return self.segment_for(round_index).key

    def extend(self, first_round: int, key: bytes) -> SegmentTable:
        """The table with a new segment for the rows j ≥ ``first_round``.

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
            return SegmentTable.single(key)
        return SegmentTable((*kept, KeySegment(first_round, key)))

    def public(self) -> list[dict]:
        """First round and key fingerprint of each segment (no key)."""
        return [s.public() for s in self.segments]

    def to_private(self) -> bytes:
        """The table with its keys, for the owner-only file of a checkpoint."""
        return json.dumps(
            [[s.first_round, s.key.hex()] for s in self.segments], separators=(",", ":")
        ).encode()

    @classmethod
    def from_private(cls, data: bytes, public: list[dict] | None, where: str) -> SegmentTable:
        """Parse `to_private`'s bytes and check them against the public fingerprints.

        Raises:
            IntegrityError: (naming ``where``) unreadable, or keys that do not match the
                fingerprints recorded beside them.
        """
        try:
            rows = json.loads(data)
            table = cls(tuple(KeySegment(int(r), bytes.fromhex(k)) for r, k in rows))
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
        factory: builds the source of one key (NumPy's Philox or ChaCha, TensorFlow's Philox).
    """

    def __init__(self, table: SegmentTable, factory: Callable[[bytes], GaussianSource]):
        self._factory = factory
        self._sources: dict[bytes, GaussianSource] = {}
        self.table = table

    @property
    def name(self) -> str:
        return self._source(self.table.segments[0].key).name

    def _source(self, key: bytes) -> GaussianSource:
        if key not in self._sources:
            self._sources[key] = self._factory(key)
        return self._sources[key]

    def normal(self, round_index: int, chunk: int, size: int) -> np.ndarray:
        """Row ``round_index``'s chunk, drawn with the key of its segment."""
        return self._source(self.table.key_for(round_index)).normal(round_index, chunk, size)

    def generator(self, round_index: int, chunk: int):
        """The (round, chunk) stream's generator, from the key of the row's segment (for sources
        that draw block by block)."""
        return self._source(self.table.key_for(round_index)).generator(round_index, chunk)
