"""The run's noise stream: σ·clip·(C⁻¹Z)_t added to round t's sum, each round once and in order,
saved with every checkpoint and restored bit for bit.

`NoiseStream` is the one interface the round uses, a `typing.Protocol` (``lost``, ``next_round``,
``segments``, `NoiseStream.watch`, `NoiseStream.add`, `NoiseStream.skip`, `NoiseStream.save`), so
a different source of the same noise plugs in without a second path through the round. Three
implementations, none inheriting from another and none with a member that only refuses:

- `LocalNoiseStream` (here): one `CorrelatedNoise` in the server's process;
- `corrflow.run.noise_shards.ShardedNoiseStream`: noise workers generate it shard by shard (``add``
  then adds each returned slice into the sum, never materialising the whole model-sized noise);
- `corrflow.run.noise_node_link.NoiseNodeStream`: a noise node adds it inside the secure sum (the
  server holds no noise key; ``add`` checks the noise node's receipt for the round).

`corrflow.run.noise_shards.open_noise` picks one.

Every process start that resumes a checkpoint draws the rows Z_j, j ≥ the checkpoint's next round,
with a fresh key from the operating system (`LocalNoiseStream.restore`; `corrflow.noise.segments`);
earlier rows keep the key that drew them. A run directory rolled back together with its release
registry therefore never releases a round with the noise of an earlier release, and the segment
table (a secret file the authenticated checkpoint vouches for, written once per start; each segment
named in the release journal) replays any released round exactly.

`NoiseStream.save` writes nothing into the checkpoint itself: it returns the stream's public files,
which the checkpoint packs into its one file, and hands its secrets to the run's
`corrflow.run.checkpoint.SecretFiles`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from corrflow.errors import InvalidArgumentError
from corrflow.factorization.base import Factorization
from corrflow.noise import CorrelatedNoise, new_secret
from corrflow.noise.engine import RING_FILE, SECRET_FILE, SEGMENTS_FILE, restore_parts, state_parts
from corrflow.noise.segments import SegmentTable
from corrflow.run.checkpoint import Checkpoint, SecretFiles

#: Coordinates per block when adding the noise into the sum (256 KiB of float32).
_BLOCK = 1 << 16
#: The noise stream's secrets among the run's (`corrflow.run.checkpoint.SecretFiles`).
NOISE_SECRETS = (SECRET_FILE, SEGMENTS_FILE)


class KeySegmentInfo(Protocol):
    """One key segment as a stream reports it: its first round and a public form."""

    @property
    def first_round(self) -> int:
        """The first row Z_j its key drew."""
        ...

    def public(self) -> dict:
        """What a report or journal may show of it (never the key)."""
        ...


class KeySegments(Protocol):
    """Which key segment drew each row Z_j (`corrflow.noise.segments.SegmentTable`, or the noise
    node's receipts of them)."""

    @property
    def segments(self) -> tuple[KeySegmentInfo, ...]:
        """The segments by increasing first round."""
        ...

    def segment_for(self, round_index: int) -> KeySegmentInfo:
        """The segment that drew row Z_``round_index``."""
        ...


@runtime_checkable
class NoiseStream(Protocol):
    """The run's (C⁻¹Z)_t, one round at a time, as the round, the recorder and the strategies use
    it (module docstring)."""

    #: Why the stream can draw no more (a lost Ray head); None while it can.
    lost: str | None

    @property
    def next_round(self) -> int:
        """The next round whose noise has not been added."""
        ...

    @property
    def segments(self) -> KeySegments:
        """Which key drew each row Z_j."""
        ...

    def watch(self, on_lost: Callable[[], None]) -> None:
        """Call ``on_lost`` once the stream is lost (never, for a stream that cannot be)."""
        ...

    def add(self, total: Sequence[np.ndarray], t: int, scale: np.float32) -> None:
        """total += scale·(C⁻¹Z)_t, in place; round ``t`` must be the next round."""
        ...

    def skip(self, t: int) -> None:
        """Advance past round ``t`` without noise of the server's (a non-private baseline)."""
        ...

    def save(self, state_dir: Path, secrets: SecretFiles) -> dict[str, bytes]:
        """The stream's state for the checkpoint being written: its public files (returned,
        packed into the checkpoint) and its secrets (to ``secrets``)."""
        ...


class LocalNoiseStream:
    """`NoiseStream` in the server's process: one `CorrelatedNoise` (module docstring)."""

    #: One in the server's process is never lost.
    lost: str | None = None

    def __init__(self, generator: CorrelatedNoise):
        self._gen = generator

    def watch(self, on_lost: Callable[[], None]) -> None:
        """Call ``on_lost`` once the stream is lost; one in the server's process never is."""

    @classmethod
    def new(
        cls, factorization: Factorization, shapes: Sequence[tuple[int, ...]], key: bytes | None
    ) -> LocalNoiseStream:
        """A stream for a new run, from ``key`` (default: a fresh secret; tests and audits fix
        one)."""
        return cls(CorrelatedNoise(factorization, shapes, 1.0, key=key or new_secret()))

    @classmethod
    def restore(
        cls, checkpoint: Checkpoint, factorization: Factorization, key: bytes | None = None
    ) -> LocalNoiseStream:
        """The stream a checkpoint saved, positioned at its next round, with a new key segment from
        that round on (IntegrityError when its files do not verify).

        Args:
            checkpoint: the verified checkpoint.
            factorization: the run's.
            key: this start's key (tests only; default, and for a key the run already used: fresh
                from the OS — never from anything stored, which would roll back with the run
                directory).
        """
        files = dict(checkpoint.noise)
        files.update({n: checkpoint.secrets[n] for n in NOISE_SECRETS if n in checkpoint.secrets})
        gen = restore_parts(
            files,
            factorization,
            ring=checkpoint.state_dir / RING_FILE,
            where=f"{checkpoint.path}:noise",
        )
        if gen.next_round < gen.rounds:  # a finished run draws no more rows: no segment to open
            used = {s.key for s in gen.segments.segments}
            gen.begin_segment(key if key not in used else None)
        return cls(gen)

    @property
    def next_round(self) -> int:
        """The next round whose noise has not been drawn."""
        return self._gen.next_round

    @property
    def segments(self) -> SegmentTable:
        """Which key drew each row Z_j: (first round, key) per process start."""
        return self._gen.segments

    @property
    def generator(self) -> CorrelatedNoise:
        """The underlying generator (benchmarks measure it alone)."""
        return self._gen

    @property
    def mode(self) -> str:
        """The generator's recursion (``banded``, ``blt``, …)."""
        return self._gen.mode

    @property
    def dim(self) -> int:
        """The model's trainable coordinates."""
        return self._gen.dim

    def add(self, total: Sequence[np.ndarray], t: int, scale: np.float32) -> None:
        """total += scale·(C⁻¹Z)_t, in place, block by block in cache; draws round ``t`` (which must
        be the next round)."""
        for g, w in zip(total, self._gen.next(t), strict=True):
            _add_scaled(g, w, scale)

    def skip(self, t: int) -> None:
        """Advance past round ``t`` without drawing (a non-private baseline keeps rounds
        aligned)."""
        self._gen.skip_round()

    def save(self, state_dir: Path, secrets: SecretFiles) -> dict[str, bytes]:
        """The stream's state for the checkpoint being written in ``state_dir``: its public files
        (returned, packed into the checkpoint) and its secrets (the key and the key segments, to
        ``secrets``, which writes them only when they changed: once per process start). A banded
        buffer's rows go into one ring file in ``state_dir``, one row per round.

        Args:
            state_dir: the run's ``state/`` directory.
            secrets: the run's secret files.

        Returns:
            The public files, name → bytes.
        """
        public, secret = state_parts(self._gen, ring=state_dir / RING_FILE)
        for name, data in secret.items():
            secrets.put(name, data)
        return public


class NoiseView:
    """The run's noise stream as seen from outside the run: facts about it, nothing that draws,
    skips or saves a row (that would put it out of step with the run's state)."""

    __slots__ = ("_stream",)

    def __init__(self, stream: NoiseStream):
        self._stream = stream

    @property
    def next_round(self) -> int:
        """The next round whose noise has not been drawn."""
        return self._stream.next_round

    @property
    def segments(self) -> KeySegments:
        """Which key drew each row Z_j (immutable)."""
        return self._stream.segments

    @property
    def lost(self) -> str | None:
        """Why the stream can draw no more (a lost Ray head); None while it can."""
        return self._stream.lost

    @property
    def mode(self) -> str:
        """The generator's recursion (``banded``, ``blt``, …), in a stream of the server's
        process or of noise workers."""
        return self._drawn_here("mode").mode

    @property
    def dim(self) -> int:
        """The model's trainable coordinates, in a stream of the server's process or of noise
        workers."""
        return self._drawn_here("dim").dim

    @property
    def buffer_bytes(self) -> int:
        """The generator's model-sized state, in bytes, in a stream of the server's process."""
        return self._drawn_here("buffer_bytes", workers=False).generator.buffer_bytes

    def _drawn_here(self, what: str, workers: bool = True):
        """The stream, when the server (or, with ``workers``, its noise workers) draws the noise.

        Raises:
            InvalidArgumentError: a stream that does not (the noise node's; the workers' for the
                generator's own state).
        """
        from corrflow.run.noise_shards import ShardedNoiseStream

        kinds = (LocalNoiseStream, ShardedNoiseStream) if workers else (LocalNoiseStream,)
        if not isinstance(self._stream, kinds):
            raise InvalidArgumentError(
                "noise",
                f"noise drawn by the server{' or its noise workers' * workers} to read {what}",
                type(self._stream).__name__,
            )
        return self._stream

    def watch(self, on_lost) -> None:
        """Call ``on_lost`` once the stream is lost (noise workers); a stream of the server's
        process never is.

        Args:
            on_lost: a callable without arguments.
        """
        self._stream.watch(on_lost)

    def worker_info(self) -> list[dict]:
        """Each noise worker's host and pid (a stream of noise workers only).

        Returns:
            One dict per worker.
        """
        return self._stream.worker_info()


def _add_scaled(g: np.ndarray, w: np.ndarray, scale: np.float32) -> None:
    """g += scale·w, block by block in cache (w, the noise, is left as it was)."""
    gf, wf = g.reshape(-1), w.reshape(-1)
    tmp = np.empty(min(gf.size, _BLOCK), dtype=np.float32)
    for lo in range(0, gf.size, _BLOCK):
        wb = wf[lo : lo + _BLOCK]
        tb = np.multiply(wb, scale, out=tmp[: wb.size])
        gf[lo : lo + _BLOCK] += tb
