"""Shards of the noise: the model's coordinates split into contiguous runs of PRNG chunks, each
generated, kept and checkpointed by one noise worker (McKenna, "Scaling up the Banded Matrix
Factorization Mechanism for Differentially Private ML", arXiv 2405.15913, §3.3: every coordinate
follows the same recursion, so the noise and its state split by coordinate with no communication
until the noise is added).

Chunk c of row Z_t is drawn from (the block key of c, t) alone (`corrflow.noise.keys.block_key`),
whatever the number of workers, so the slices of N workers put together are bit for bit the single
process's noise. A worker is given its chunks' block keys for each key segment and a ring-MAC key
derived for its shard (`ShardSecrets`): never the noise key. What a compromised worker learns is
its shard's noise (every round's, past and future, of its coordinates), which lets whoever also
sees the released updates remove that shard's noise; nothing of the other shards.

A worker's state — the banded ring rows or the BLT buffers of its coordinates — is saved by
`save_shard` into its own directory (the ring rows with per-row MACs, as the single process's
`corrflow.noise.engine.save_state` writes them) and named by the SHA-256 of its public JSON,
which the server records in its authenticated checkpoint; `restore_shard` refuses any state whose
digest is not the one the server recorded.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from bisect import bisect_right
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from corrflow.errors import IntegrityError, require
from corrflow.factorization.base import Factorization
from corrflow.fileio import write_bytes
from corrflow.noise.engine import (
    DEFAULT_CHUNK,
    RING_FILE,
    CorrelatedNoise,
    restore_buffer,
    save_buffer,
)
from corrflow.noise.keys import block_key, shard_mac_key
from corrflow.noise.prng import make_block_source
from corrflow.noise.segments import KeySegment, PublicSegment, PublicSegments, SegmentTable

SHARD_FORMAT = "corrflow.noise-shard/1"
SHARD_STATE = "shard_state.json"


@dataclass(frozen=True)
class Shard:
    """Worker ``index``'s coordinates [lo, hi): chunks first_chunk … first_chunk + chunks − 1."""

    index: int
    first_chunk: int
    chunks: int
    lo: int
    hi: int

    @property
    def size(self) -> int:
        return self.hi - self.lo

    @property
    def name(self) -> str:
        """The shard's directory name: its chunks, so that a directory never holds another
        layout's state."""
        return f"shard-{self.first_chunk:06d}-{self.chunks:06d}"

    def describe(self) -> str:
        return f"noise worker {self.index} (coordinates {self.lo}–{self.hi - 1})"


def plan_shards(dim: int, workers: int, chunk_size: int = DEFAULT_CHUNK) -> tuple[Shard, ...]:
    """Split d coordinates into ``workers`` contiguous shards of whole chunks, as even as chunks
    allow (the first ``chunks mod workers`` shards take one chunk more).

    Args:
        dim: d, the model's size.
        workers: N ≥ 1.
        chunk_size: coordinates per PRNG chunk.

    Returns:
        N shards covering [0, d) in order.

    Raises:
        InvalidArgumentError: (``noise-workers``) more workers than the model has chunks.
    """
    chunks = max(1, math.ceil(dim / chunk_size))
    require(
        isinstance(workers, int) and 1 <= workers <= chunks,
        "noise-workers",
        f"0 (the noise in the server's process) or an integer from 1 to {chunks}: the model's "
        f"{dim} coordinates make {chunks} noise block(s) of {chunk_size}, the smallest share a "
        "worker can take",
        workers,
    )
    base, extra = divmod(chunks, workers)
    out, c = [], 0
    for i in range(workers):
        k = base + (i < extra)
        out.append(Shard(i, c, k, c * chunk_size, min(dim, (c + k) * chunk_size)))
        c += k
    return tuple(out)


@dataclass(frozen=True)
class ShardSecrets:
    """What one worker is given: per key segment its first round and the block keys of the shard's
    chunks, the key of its ring rows' MACs, and the segments' public forms — never the noise
    key."""

    prng: str
    segments: tuple[tuple[int, Mapping[int, bytes]], ...]
    mac_key: bytes
    public: tuple[PublicSegment, ...]

    def __repr__(self) -> str:  # keys stay out of logs
        return f"ShardSecrets(prng={self.prng!r}, segments={[s for s, _ in self.segments]})"


def segment_blocks(segment: KeySegment, shard: Shard) -> dict[int, bytes]:
    """The block keys of a shard's chunks under one segment's key (its derivation version)."""
    key, version = segment.key, segment.version
    chunks = range(shard.first_chunk, shard.first_chunk + shard.chunks)
    return {c: block_key(key, c, version=version) for c in chunks}


def shard_secrets(table: SegmentTable, shard: Shard, prng: str) -> ShardSecrets:
    """The secrets of ``shard``'s worker for the key segments of ``table`` (module docstring).

    Args:
        table: the run's key segments (the server's).
        shard: the worker's shard.
        prng: the run's PRNG.

    Returns:
        The worker's `ShardSecrets`.
    """
    segs = tuple((s.first_round, segment_blocks(s, shard)) for s in table.segments)
    run = table.segments[0]
    mac = shard_mac_key(run.key, shard.first_chunk, shard.chunks, version=run.version)
    return ShardSecrets(prng, segs, mac, tuple(s.info() for s in table.segments))


class ShardSource:
    """A worker's Gaussian source: row t's chunk c from the block key of t's segment; ``table``:
    the segments' public forms (the worker holds no key)."""

    def __init__(self, secrets: ShardSecrets):
        require(
            [p.first_round for p in secrets.public] == [f for f, _ in secrets.segments],
            "secrets",
            "the public form of each key segment",
        )
        self._prng = secrets.prng
        self._firsts: list[int] = []
        self._sources: list = []
        self.table = PublicSegments(())
        for (_, blocks), segment in zip(secrets.segments, secrets.public, strict=True):
            self.extend(blocks, segment)

    def extend(self, blocks: Mapping[int, bytes], segment: PublicSegment) -> None:
        """Draw rows ≥ ``segment.first_round`` with a new segment's block keys (later segments
        dropped, as `SegmentTable.extend` drops them)."""
        first_round = segment.first_round
        keep = bisect_right(self._firsts, first_round - 1)
        self._firsts, self._sources = self._firsts[:keep], self._sources[:keep]
        self._firsts.append(int(first_round))
        self._sources.append(make_block_source(self._prng, dict(blocks)))
        self.table = self.table.extend(segment)

    def generator(self, round_index: int, chunk: int):
        i = bisect_right(self._firsts, round_index) - 1
        if i < 0:
            raise IntegrityError(f"no noise key segment holds round {round_index}")
        return self._sources[i].generator(round_index, chunk)


class ShardNoise(CorrelatedNoise):
    """`CorrelatedNoise` of one shard's coordinates, drawn from block keys only: its rounds are
    the single process's σ·(C⁻¹Z)_t restricted to [shard.lo, shard.hi), bit for bit.

    Args:
        factorization: the run's.
        shard: the worker's coordinates.
        secrets: its block keys and MAC key (`shard_secrets`).
        mode: as the server's generator's.
        chunk_size: the run's.
    """

    def __init__(
        self,
        factorization: Factorization,
        shard: Shard,
        secrets: ShardSecrets,
        *,
        mode: str | None = None,
        chunk_size: int = DEFAULT_CHUNK,
    ):
        super().__init__(
            factorization,
            [(shard.size,)],
            1.0,
            prng=secrets.prng,
            mode=mode,
            chunk_size=chunk_size,
            first_chunk=shard.first_chunk,
            source=ShardSource(secrets),
        )
        self.shard, self._mac_key = shard, secrets.mac_key

    def __repr__(self) -> str:
        return f"ShardNoise({self.shard.describe()}, mode={self.mode!r}, next={self.next_round})"

    @property
    def mac_key(self) -> bytes:
        return self._mac_key

    def add_segment(self, blocks: Mapping[int, bytes], segment: PublicSegment) -> None:
        """Draw the rows from the next round on with a new segment's block keys (a resumed run's
        fresh key, `CorrelatedNoise.begin_segment`); ``segment``: its public form."""
        require(
            segment.first_round == self.next_round,
            "segment",
            f"a segment from round {self.next_round}, the worker's next round",
            segment.first_round,
        )
        self._source.extend(blocks, segment)


def _round_dir(root: Path, shard: Shard, next_round: int) -> Path:
    return root / shard.name / f"round-{next_round:06d}"


def save_shard(gen: ShardNoise, root: str | os.PathLike) -> str:
    """Write the worker's state at its next round under ``root/<shard>/round-<t>/`` (the ring rows
    in ``root/<shard>/noise_ring.bin``, overwritten in place one row per round), keep the previous
    round's for a server that dies before publishing its checkpoint, remove older ones.

    Args:
        gen: the worker's generator.
        root: the worker's state directory (on its own node's disk).

    Returns:
        The SHA-256 of the saved public JSON: the digest the server's checkpoint records.
    """
    base = Path(root) / gen.shard.name
    d = _round_dir(Path(root), gen.shard, gen.next_round)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    base.chmod(0o700)  # the ring rows are noise: owner-only, as the server's state/
    public = {
        "format": SHARD_FORMAT,
        "shard": {"first_chunk": gen.shard.first_chunk, "chunks": gen.shard.chunks},
        "lo": gen.shard.lo,
        "hi": gen.shard.hi,
        "mode": gen.mode,
        "prng": gen.prng,
        "next_round": gen.next_round,
        "rounds": gen.rounds,
        "chunk_size": gen.chunk_size,
        "factorization_sha256": gen.factorization.sha256(),
        **save_buffer(gen, d, base / RING_FILE),
    }
    data = json.dumps(public, sort_keys=True).encode()  # compact: the C encoder
    write_bytes(d / SHARD_STATE, data, private=True)
    for old in base.glob("round-*"):
        if old.is_dir() and int(old.name[6:]) < gen.next_round - 1:
            shutil.rmtree(old, ignore_errors=True)
    return hashlib.sha256(data).hexdigest()


def restore_shard(
    root: str | os.PathLike,
    factorization: Factorization,
    shard: Shard,
    secrets: ShardSecrets,
    next_round: int,
    digest: str,
) -> ShardNoise:
    """The worker's generator at ``next_round``, from the state `save_shard` wrote there.

    Args:
        root: the worker's state directory.
        factorization: the run's.
        shard: the worker's.
        secrets: its secrets (`shard_secrets`).
        next_round: the server's checkpoint's.
        digest: the SHA-256 the server's checkpoint recorded for this shard.

    Raises:
        IntegrityError: (naming the worker) a missing state, one that is not the one the server
            recorded (another round, an edited file), or a ring row that fails its MAC.
    """
    who = shard.describe()
    d = _round_dir(Path(root), shard, next_round)
    try:
        data = (d / SHARD_STATE).read_bytes()
    except FileNotFoundError:
        raise IntegrityError(
            f"{who}: no saved state for round {next_round + 1} in {d} (the worker runs on "
            "another node's disk, or its files were removed)"
        ) from None
    if hashlib.sha256(data).hexdigest() != digest:
        raise IntegrityError(
            f"{who}: its state in {d} disagrees with the server's checkpoint at round "
            f"{next_round + 1} (edited, or another run's); refused"
        )
    public = json.loads(data)
    require(public.get("format") == SHARD_FORMAT, "format", SHARD_FORMAT, public.get("format"))
    gen = ShardNoise(
        factorization,
        shard,
        secrets,
        mode=public["mode"],
        chunk_size=int(public["chunk_size"]),
    )
    if int(public["next_round"]) != next_round or public["factorization_sha256"] != (
        factorization.sha256()
    ):
        raise IntegrityError(
            f"{who}: its state is at round {public['next_round']} of another mechanism or round "
            f"than the server's ({next_round})"
        )
    gen.next_round = next_round
    try:
        restore_buffer(gen, public, d, Path(root) / shard.name / RING_FILE)
    except IntegrityError as exc:
        raise IntegrityError(f"{who}: {exc}") from None
    return gen


__all__ = [
    "Shard",
    "ShardNoise",
    "ShardSecrets",
    "plan_shards",
    "restore_shard",
    "save_shard",
    "segment_blocks",
    "shard_secrets",
]
