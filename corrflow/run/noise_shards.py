"""The run's noise stream sharded over Ray actors (``--noise-workers N``; McKenna, arXiv 2405.15913,
§3.3 "Distributed Noise Generation").

Each `NoiseWorker` actor owns one shard of the model's coordinates (`corrflow.noise.shards`):
it holds the block keys of its chunks (never the noise key), generates its slice of (C⁻¹Z)_t,
keeps its slice of the noise state (banded ring rows, BLT buffers) and checkpoints it on its own
disk; the server adds each returned slice into the sum and never holds model-sized noise state.
`ShardedNoiseStream` implements the `corrflow.run.noise.NoiseStream` protocol (add, skip,
next_round, segments, save, watch, lost), so the round and the run core have one path for all;
`open_noise` picks one.

Faults: every loss of a worker — Ray's memory monitor killing it (``OutOfMemoryError``), its
process or node dying (``RayActorError``, ``ActorDiedError``, ``ActorUnavailableError``), a second
death while the restarted worker is asked again, a worker that does not answer within
``call_timeout`` (an unreachable node) — takes one path: the worker is restarted from its last
checkpoint (the state the server's published checkpoint recorded by digest), brought to the round
and asked again, at most `RESTARTS` times; the round is completed with the same bits, nothing
released twice. When that fails, `NoiseWorkerLostError` names the worker: the round is not
released and the run stops on the record (``stopped_reason``). A watchdog connects to the
cluster's head every `HEAD_CHECK_S` seconds; once it has not answered `HEAD_MISSES` times in a row
the stream is lost (``lost`` says why), the run is told to stop (`ShardedNoiseStream.watch`) and
no call waits on the cluster again — Ray itself ends a driver 60 s after it loses the head, with no
handler of the run's running. A worker whose saved state is not the one the server's checkpoint
recorded is refused, naming it. A checkpoint resumes with the same number of workers only (a
worker's state lives on its node's disk, shaped by its shard). Each worker checkpoints its state
right after it draws (or skips) a round, so no worker is called between a round's noise and the
server's checkpoint that records it.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from corrflow.config import RunConfig
from corrflow.errors import IntegrityError, InvalidArgumentError, NoiseWorkerLostError
from corrflow.factorization.base import Factorization
from corrflow.noise import new_secret
from corrflow.noise.engine import DEFAULT_CHUNK, PUBLIC_FILE, SEGMENTS_FILE, default_mode
from corrflow.noise.segments import PublicSegment, SegmentTable
from corrflow.noise.shards import (
    Shard,
    ShardNoise,
    ShardSecrets,
    plan_shards,
    restore_shard,
    save_shard,
    segment_blocks,
    shard_secrets,
)
from corrflow.run.checkpoint import Checkpoint, SecretFiles
from corrflow.run.noise import LocalNoiseStream, NoiseStream, _add_scaled
from corrflow.run.noise_node_link import NoiseNodeLink, open_noise_node

log = logging.getLogger("corrflow")

SHARDS_FILE = "shards.json"
SHARDS_FORMAT = "corrflow.noise-shards/1"
#: The workers' state directories, beside the run's checkpoints (``state/`` keeps only its rounds).
SHARD_ROOT = "noise-shards"
#: Memory a worker reserves beyond its noise state and output slice: the Python process with
# NumPy and the compiled kernels (measured: a worker of a small model peaks at ≈ 0.29 GB).
RUNTIME_BYTES = 384 << 20
#: Restarts of one worker within one call before the run stops naming it.
RESTARTS = 2
#: Seconds a worker may take to answer one call (a round's slice, a save) before it counts as
# lost: generous, since a large shard's round takes seconds on a loaded node.
CALL_TIMEOUT_S = 300.0
#: Seconds a worker may take to start, restore its state and catch up: a new process imports
# NumPy and corrflow, and a restored worker may redraw many rounds.
START_TIMEOUT_S = 600.0
#: The head watchdog's period and the misses in a row that make the head lost (≈ 6 s: well
# within Ray's own 60 s, after which it ends the driver's process).
HEAD_CHECK_S, HEAD_MISSES = 2.0, 3


class NoiseWorker:
    """One shard's noise, in a Ray actor (``ray.remote(NoiseWorker)``): see the module docstring.

    Args:
        factorization: the run's.
        shard: its coordinates.
        mode: the server's generator's mode.
        chunk_size: the run's.
        root: its state directory (on the node it runs on).
    """

    def __init__(
        self, factorization: Factorization, shard: Shard, mode: str, chunk_size: int, root: str
    ):
        self._fac, self._shard, self._mode = factorization, shard, mode
        self._chunk, self._root = chunk_size, root
        self._gen: ShardNoise | None = None

    def open(self, secrets: ShardSecrets, next_round: int, digest: str | None) -> dict:
        """Start at round 0 (``digest`` None) or restore the state the server recorded."""
        if digest is None:
            self._gen = ShardNoise(
                self._fac, self._shard, secrets, mode=self._mode, chunk_size=self._chunk
            )
            self._gen.skip_to(next_round)
        else:
            self._gen = restore_shard(
                self._root, self._fac, self._shard, secrets, next_round, digest
            )
        return self.info()

    def info(self) -> dict:
        """The worker's process id, next round, state bytes, CPU seconds and peak resident
        memory."""
        return {
            "pid": os.getpid(),
            "cpu_seconds": time.process_time(),
            "next_round": None if self._gen is None else self._gen.next_round,
            "buffer_bytes": 0 if self._gen is None else self._gen.buffer_bytes,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }

    def draw(self, t: int) -> tuple[np.ndarray, str]:
        """The shard's slice of (C⁻¹Z)_t (unit σ, float32), and the digest of the state it saved
        after it (at round t + 1)."""
        piece = self._gen.next(t)[0]
        return piece, self.save()

    def advance_to(self, t: int) -> int:
        """Draw (and drop) the rounds before ``t``: a worker restored at an earlier round catches
        up with the others."""
        while self._gen.next_round < t:
            self._gen.next(self._gen.next_round)
        return self._gen.next_round

    def skip(self, t: int) -> str:
        """Skip round ``t`` (a non-private baseline draws no noise); returns the saved state's
        digest."""
        self._gen.skip_round()
        return self.save()

    def add_segment(self, blocks: dict[int, bytes], segment: PublicSegment) -> None:
        """Rows from the next round on use a new key segment's block keys (``segment``: its
        public form)."""
        self._gen.add_segment(blocks, segment)

    def save(self) -> str:
        """Checkpoint the shard's state; returns its digest for the server's checkpoint."""
        return save_shard(self._gen, self._root)


def _ray():
    # Ray is imported only by runs that shard their noise: importing it costs seconds and memory.
    import ray

    return ray


class ShardedNoiseStream:
    """The run's (C⁻¹Z)_t generated by N Ray actors, one shard each (module docstring).

    Args:
        factorization: the run's.
        shapes: the trainable arrays' shapes.
        table: the run's key segments (the server keeps the keys; workers get block keys).
        workers: N.
        address: the Ray cluster to join ("": the running one, or a new local instance).
        root: the workers' state directory (a path on every worker's node).
        prng: the run's PRNG.
        chunk_size: coordinates per PRNG chunk (a shard is whole chunks).
        next_round: the round a resumed run's workers restore at (0: a new run).
        digests: the SHA-256 of each worker's state at ``next_round``, from the server's
            checkpoint (None: a new run).
    """

    #: Why the stream can draw no more (the cluster's head lost); None while it can.
    lost: str | None = None

    def __init__(
        self,
        factorization: Factorization,
        shapes: Sequence[tuple[int, ...]],
        table: SegmentTable,
        workers: int,
        address: str,
        root: Path,
        *,
        prng: str = "philox",
        chunk_size: int = DEFAULT_CHUNK,
        next_round: int = 0,
        digests: Sequence[str] | None = None,
        call_timeout: float | None = None,
    ):
        self._fac, self._table, self._prng, self._chunk = factorization, table, prng, chunk_size
        self._sizes = [int(np.prod(s)) for s in shapes]
        self.dim = sum(self._sizes)
        self.shards = plan_shards(self.dim, workers, chunk_size)
        self.mode = default_mode(factorization)
        self.call_timeout = CALL_TIMEOUT_S if call_timeout is None else call_timeout
        self._root = str(Path(root).resolve())
        self._next = self._saved_round = next_round
        self._digests: list[str | None] = list(digests) if digests else [None] * workers
        self._drawn: tuple[int, list[str]] | None = None  # (next round, the workers' digests)
        self.lost: str | None = None
        self._on_lost: list[Callable[[], None]] = []
        self._closed = threading.Event()
        self._own_ray = _join(address, _object_store_bytes(self.dim))
        ray = _ray()
        self._remote = ray.remote(NoiseWorker)
        self._actors = [None] * workers
        self._pids = [0] * workers
        gcs = ray.get_runtime_context().gcs_address  # the head's own idea of its host
        shown = address if address and address != "auto" else gcs
        threading.Thread(
            target=self._watch_head, args=(gcs, shown), name="corrflow-ray-head", daemon=True
        ).start()
        # all workers start at once: each is a new process importing NumPy and corrflow
        launched = [self._launch(s.index) for s in self.shards]
        for s, (actor, ref) in zip(self.shards, launched, strict=True):
            try:
                self._opened(s.index, actor, ref)
            except ray.exceptions.RayError as exc:  # e.g. a cluster without the memory it asks
                raise NoiseWorkerLostError(
                    f"{s.describe()} did not start ({self._loss(exc)[0]}; it reserves "
                    f"{self.share_bytes(s) / 2**30:.2f} GiB of the cluster's memory)"
                ) from None
            finally:
                if self._actors[s.index] is None:  # it failed: stop every worker started here
                    self._closed.set()
                    for other, _ in launched:
                        _kill(other)

    # -- workers -----------------------------------------------------------------------------------
    def share_bytes(self, shard: Shard) -> int:
        """The memory a worker reserves: its noise state, its output slice and the slice's copy in
        Ray's object store (shared memory mapped into the worker), the runtime.

        Args:
            shard: the worker's.

        Returns:
            Bytes.
        """
        rows = {"banded": max(self._fac.encoder.bands - 1, 0)}.get(self.mode, 0)
        if self.mode == "blt":
            rows = self._fac.encoder.buffers
        return (rows + 2) * shard.size * 4 + RUNTIME_BYTES

    def _who(self, i: int) -> str:
        return f"{self.shards[i].describe()}, pid {self._pids[i]}"

    def _start(self, i: int) -> None:
        """Start (or restart) worker ``i`` and bring it to the stream's last checkpoint.

        Raises:
            IntegrityError: the worker refused its saved state (named).
            InvalidArgumentError: the worker refused its settings.
            ray.exceptions.RayError: it was lost or did not answer within ``call_timeout``.
        """
        self._opened(i, *self._launch(i))

    def _launch(self, i: int):
        """Create worker ``i``'s actor (the one it replaces killed) and ask it to open its state;
        returns the actor and the pending call, for `_opened`."""
        s = self.shards[i]
        if self._actors[i] is not None:  # a hung worker must not come back beside its successor
            _kill(self._actors[i])
            self._actors[i] = None
        actor = self._remote.options(
            num_cpus=0, memory=self.share_bytes(s), max_restarts=0, max_concurrency=1
        ).remote(self._fac, s, self.mode, self._chunk, self._root)
        secrets = shard_secrets(self._table, s, self._prng)
        return actor, actor.open.remote(secrets, self._saved_round, self._digests[i])

    def _opened(self, i: int, actor, ref) -> None:
        """Wait for worker ``i``'s `_launch` (at most `START_TIMEOUT_S`) and take it as the
        shard's worker; the errors of `_start`."""
        ray = _ray()
        try:
            info = self._get(ref, START_TIMEOUT_S)
        except ray.exceptions.RayError as exc:
            _kill(actor)
            cause = _refusal(exc)
            if cause is not None:  # the worker's refusal, without Ray's traceback
                raise cause from None
            raise
        self._actors[i], self._pids[i] = actor, int(info["pid"])

    def _retry(self, i: int, call: str, args: tuple, why: str):
        """Worker ``i`` was lost (``why``): restart it from its checkpoint, bring it to the
        stream's round and ask it ``call`` again, at most `RESTARTS` times.

        Raises:
            NoiseWorkerLostError: it could not be restored (named; nothing of the round released).
        """
        ray, t, tries = _ray(), self._next, 0
        heals = True
        while heals and tries < RESTARTS:
            self._check_head()
            tries += 1
            log.warning(
                "%s was lost in round %d (%s); restarting it from its checkpoint at round %d "
                "(try %d of %d)",
                *(self._who(i), t + 1, why, self._saved_round + 1, tries, RESTARTS),
            )
            try:
                self._start(i)
                self._get(self._actors[i].advance_to.remote(t), START_TIMEOUT_S)
                return self._get(getattr(self._actors[i], call).remote(*args))
            except ray.exceptions.RayError as exc:
                why, heals = self._loss(exc)
            except (IntegrityError, InvalidArgumentError) as refused:  # a state that never heals
                why, heals = str(refused), False
        raise self._lost_error(i, why, tries)

    def _get(self, ref, timeout: float | None = None):
        """``ray.get(ref)`` within ``timeout`` seconds (default ``call_timeout``), given up at once
        when the head is lost (Ray would wait for it until it ends the process).

        Raises:
            ray.exceptions.GetTimeoutError: no answer in time.
            NoiseWorkerLostError: the head is lost.
        """
        ray = _ray()
        timeout = self.call_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while not ray.wait([ref], timeout=min(1.0, timeout))[0]:
            self._check_head()
            if time.monotonic() >= deadline:
                raise ray.exceptions.GetTimeoutError(f"no answer within {timeout:g} s")
        return ray.get(ref)

    def _lost_error(self, i: int, why: str, tries: int) -> NoiseWorkerLostError:
        t = self._next
        return NoiseWorkerLostError(
            f"{self._who(i)} was lost in round {t + 1} and could not be restored from its "
            f"checkpoint at round {self._saved_round + 1} ({tries} restart(s); {why}); round "
            f"{t + 1} was not released"
        )

    def _loss(self, exc: BaseException) -> tuple[str, bool]:
        """Why a worker's call failed (one line), and whether a restart can heal it (a lost
        worker: yes; its refusal of its state: no); a fault in the worker's own code is raised,
        with its traceback."""
        ray = _ray()
        cause = _refusal(exc)
        if cause is not None:
            return str(cause), False
        if isinstance(exc, ray.exceptions.RayTaskError):
            if not isinstance(exc.cause, ray.exceptions.RayError):
                raise exc
            exc = exc.cause  # e.g. an OutOfMemoryError raised inside the worker's call
        if isinstance(exc, ray.exceptions.GetTimeoutError):
            return str(exc), True
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return (f"{type(exc).__name__}: {first[:160]}" if first else type(exc).__name__), True

    def _each(self, call: str, *args) -> list:
        """Call every worker; a lost one is restored (`_retry`); results in shard order.

        Raises:
            NoiseWorkerLostError: a worker could not be restored, or the head is lost.
        """
        ray = _ray()
        self._check_head()
        out: list = [None] * len(self._actors)
        refs = {getattr(a, call).remote(*args): i for i, a in enumerate(self._actors)}
        pending, deadline = list(refs), time.monotonic() + self.call_timeout
        while pending:
            left = deadline - time.monotonic()
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, min(1.0, left)))
            self._check_head()
            if not done and left <= 0:  # unreachable workers: each is restored in turn
                for ref in pending:
                    i = refs[ref]
                    out[i] = self._retry(i, call, args, f"no answer within {self.call_timeout:g} s")
                break
            for ref in done:
                i = refs[ref]
                try:
                    out[i] = ray.get(ref)
                except ray.exceptions.RayError as exc:
                    why, heals = self._loss(exc)
                    if not heals:
                        raise self._lost_error(i, why, 0) from None
                    out[i] = self._retry(i, call, args, why)
        return out

    # -- the cluster's head ------------------------------------------------------------------------
    def watch(self, on_lost: Callable[[], None]) -> None:
        """Call ``on_lost`` (from the watchdog's thread) once the cluster's head is lost.

        Args:
            on_lost: e.g. the run's stop event's ``set``; the run then stops with ``lost``.
        """
        self._on_lost.append(on_lost)
        if self.lost is not None:
            on_lost()

    def _watch_head(self, gcs: str, shown: str) -> None:
        """Connect to the head's GCS port every `HEAD_CHECK_S` s; after `HEAD_MISSES` misses in a
        row set ``lost`` (naming the head as ``shown``) and call the ``watch`` callbacks."""
        misses = 0
        while not self._closed.wait(HEAD_CHECK_S):
            misses = 0 if _answers(gcs) else misses + 1
            if misses >= HEAD_MISSES:
                self.lost = (
                    f"the Ray cluster's head at {shown} stopped answering (no connection for "
                    f"{HEAD_MISSES * HEAD_CHECK_S:g} s): the noise workers are out of reach"
                )
                log.error("corrflow: %s; the run stops", self.lost)
                for on_lost in self._on_lost:
                    on_lost()
                return

    def _check_head(self) -> None:
        if self.lost is not None:
            raise NoiseWorkerLostError(f"{self.lost}; round {self._next + 1} was not released")

    def worker_info(self) -> list[dict]:
        """Each worker's pid, next round, state bytes and peak RSS (benchmarks, tests)."""
        return [self._get(a.info.remote()) for a in self._actors]

    def trust(self) -> dict:
        """The workers as the privacy report names them: shards, pids and state digests at the
        last checkpoint (no call to the workers: a report is written after they are lost too)."""
        return {
            "count": len(self.shards),
            "mode": self.mode,
            "shards": [
                {
                    "worker": s.index,
                    "coordinates": [s.lo, s.hi],
                    "first_chunk": s.first_chunk,
                    "chunks": s.chunks,
                    "pid": self._pids[s.index],
                    "state_sha256": self._digests[s.index],
                }
                for s in self.shards
            ],
            "checkpoint_round": self._saved_round,
        }

    def close(self) -> None:
        """Stop the workers (and the local Ray instance this stream started)."""
        self._closed.set()
        if self.lost is None:  # a lost head cannot be asked
            for a in self._actors:
                if a is not None:
                    _ray().kill(a)
        self._actors = [None] * len(self._actors)
        if self._own_ray:
            _ray().shutdown()

    # -- NoiseStream's interface -------------------------------------------------------------------
    @property
    def next_round(self) -> int:
        return self._next

    @property
    def segments(self) -> SegmentTable:
        return self._table

    def add(self, total: Sequence[np.ndarray], t: int, scale: np.float32) -> None:
        """total += scale·(C⁻¹Z)_t: every worker's slice added where its coordinates lie, in the
        order they arrive (the slices are disjoint: the sum's bits do not depend on it)."""
        if t != self._next:
            raise InvalidArgumentError("round_index", f"{self._next}, the next round", t)
        flats = [g.reshape(-1) for g in total]
        drawn = self._each("draw", t)
        for s, (piece, _) in zip(self.shards, drawn, strict=True):
            self._add_range(flats, s.lo, piece, scale)
        self._next = t + 1
        self._drawn = (self._next, [h for _, h in drawn])

    def _add_range(self, flats: list[np.ndarray], lo: int, piece: np.ndarray, scale) -> None:
        start = 0
        for g in flats:
            a, b = max(lo, start), min(lo + piece.size, start + g.size)
            if a < b:
                _add_scaled(g[a - start : b - start], piece[a - lo : b - lo], scale)
            start += g.size

    def skip(self, t: int) -> None:
        digests = self._each("skip", t)
        self._next = t + 1
        self._drawn = (self._next, digests)

    def save(self, state_dir: Path, secrets: SecretFiles) -> dict[str, bytes]:
        """Each worker checkpoints its shard on its disk; the server's checkpoint records their
        digests (``shards.json``, returned) and the key segments (a secret, to ``secrets``), never
        noise.

        Args:
            state_dir: the run's ``state/`` directory.
            secrets: the run's secret files.

        Returns:
            The public files, name → bytes.
        """
        drawn = self._drawn
        digests = drawn[1] if drawn is not None and drawn[0] == self._next else self._each("save")
        secrets.put(SEGMENTS_FILE, self._table.to_private())
        info = {
            "format": SHARDS_FORMAT,
            "workers": len(self.shards),
            "dim": self.dim,
            "chunk_size": self._chunk,
            "mode": self.mode,
            "prng": self._prng,
            "next_round": self._next,
            "factorization_sha256": self._fac.sha256(),
            "key_segments": self._table.public(),
            "shards": [
                {"first_chunk": s.first_chunk, "chunks": s.chunks, "state_sha256": h}
                for s, h in zip(self.shards, digests, strict=True)
            ],
        }
        # From here the checkpoint about to be published is where a worker restarts.
        self._digests, self._saved_round = list(digests), self._next
        return {SHARDS_FILE: json.dumps(info, sort_keys=True).encode()}

    def begin_segment(self, key: bytes | None) -> None:
        """A resumed run's rows from its next round on use a fresh key (`corrflow.noise.segments`),
        sent to each worker as its chunks' block keys."""
        used = {s.key for s in self._table.segments}
        key = key if key is not None and key not in used else new_secret(self._prng)
        self._table = self._table.extend(self._next, key)
        for s, a in zip(self.shards, self._actors, strict=True):
            segment = self._table.segments[-1]
            self._get(a.add_segment.remote(segment_blocks(segment, s), segment.info()))


def _join(address: str, store_bytes: int) -> bool:
    """Join the Ray cluster at ``address`` ("": a new local instance owned by this process, never
    a cluster some other program left running on this machine, which ray.init's default would
    join; "auto": the one `ray start` left here), keeping the signal handlers the run installed
    (ray.init replaces SIGTERM's with one that exits 15). Returns whether this process owns it."""
    ray = _ray()
    if ray.is_initialized():
        return False
    if address and address != "auto":
        check_ray_address(address)
    kept = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        ray.init(
            address=address or "local",
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
            **({} if address else {"object_store_memory": store_bytes}),
        )
    except (ConnectionError, ValueError, RuntimeError) as exc:
        raise InvalidArgumentError(
            "ray-address",
            f"the host:port of a running Ray cluster's head ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else 'no answer'})",
            address,
        ) from None
    if threading.current_thread() is threading.main_thread():
        for s, handler in kept.items():
            if handler is not None:
                signal.signal(s, handler)
    return not address


def _refusal(exc: BaseException) -> BaseException | None:
    """The worker's own refusal (IntegrityError, InvalidArgumentError) inside a Ray error."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, IntegrityError | InvalidArgumentError) else None


def _kill(actor) -> None:
    """Kill a worker, whatever state it (or its node) is in, without waiting: ray.kill asks the
    head, and a lost head would hold the caller until Ray ends the process."""

    def kill() -> None:
        try:
            _ray().kill(actor)
        except Exception as exc:  # already gone, or its node unreachable: nothing left to stop
            log.debug("killing a noise worker: %s", exc)

    threading.Thread(target=kill, name="corrflow-kill-worker", daemon=True).start()


def _answers(address: str, timeout: float = 2.0) -> bool:
    """Whether ``address`` (host:port) accepts a TCP connection within ``timeout`` seconds."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


#: A cheap call each kind of Ray head answers: the GCS (host:port) and the Ray Client server
# (ray://host:port).
_HEAD_METHODS = {
    False: "/ray.rpc.NodeInfoGcsService/GetClusterId",
    True: "/ray.rpc.RayletDriver/ClusterInfo",
}


def _ask_ray_head(address: str, deadline: float) -> None:
    """One gRPC call a Ray head answers, before ``deadline``: a firewall or proxy that accepts
    every connection (and answers HTTP/2 with a 404) is not a Ray head."""
    import grpc

    client = address.startswith("ray://")
    with grpc.insecure_channel(address.removeprefix("ray://")) as channel:
        call = channel.unary_unary(_HEAD_METHODS[client])
        try:
            call(b"", timeout=max(deadline - time.monotonic(), 0.001))
        except grpc.RpcError as exc:
            code = exc.code()
            if code in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.UNIMPLEMENTED,
                grpc.StatusCode.UNKNOWN,
                grpc.StatusCode.INTERNAL,
            ):
                raise ConnectionError(
                    f"no Ray head answered ({code.name}: {(exc.details() or '')[:120]})"
                ) from None
            # any other status (an argument or permission error) came from a Ray head


#: How long `check_ray_address` waits for the head's TCP port.
RAY_CONNECT_TIMEOUT = 10.0


def check_ray_address(address: str, timeout: float = RAY_CONNECT_TIMEOUT) -> None:
    """Refuse a Ray address that is malformed, or whose head does not accept a TCP connection and
    answer one gRPC call within ``timeout`` seconds (Ray itself retries for minutes before it
    gives up). Runs first, before any data, factorization or registry work, so a refusal writes
    nothing. "" (no cluster) and "auto" (the cluster `ray start` left on this machine) are not
    checked.

    Args:
        address: ``host:port`` (the GCS) or ``ray://host:port`` (the Ray Client server).
        timeout: seconds for the whole check (resolution, connection and the call together).

    Raises:
        InvalidArgumentError: naming ``ray-address``.
    """
    if not address or address == "auto":
        return
    expected = "the host:port of a running Ray cluster's head"
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgumentError("ray-address", f"{expected} (host:port)", address)
    deadline = time.monotonic() + timeout
    try:
        left = deadline - time.monotonic()
        with socket.create_connection((host.strip("[]"), int(port)), timeout=left):
            pass
        _ask_ray_head(address, deadline)
    except OSError as exc:  # TimeoutError, ConnectionError and socket.gaierror are OSErrors
        raise InvalidArgumentError(
            "ray-address", f"{expected} (connecting failed: {exc or 'timed out'})", address
        ) from None


def _object_store_bytes(dim: int) -> int:
    """A local instance's object store: a few rounds of slices in flight (Ray's default, 30% of
    the machine's memory, would claim what the workers' state needs)."""
    return int(min(4 << 30, max(128 << 20, 4 * dim * 4)))


def open_noise(
    cfg: RunConfig,
    factorization: Factorization,
    shapes: Sequence[tuple[int, ...]],
    key: bytes | NoiseNodeLink | None,
    checkpoint: Checkpoint | None = None,
) -> NoiseStream:
    """The run's noise stream: in the server's process, or over ``cfg.noise_workers`` Ray actors;
    new, or restored from ``checkpoint`` with a new key segment from its next round on; or, with
    ``cfg.noise_node``, the receipts of the noise node that adds it inside the secure sum (``key``
    is then its `NoiseNodeLink`: the server holds no noise key).

    Args:
        cfg: the run's settings (noise_workers, ray_address, state_dir).
        factorization: the run's.
        shapes: the trainable arrays'.
        key: this start's noise key (tests and audits; default fresh from the OS).
        checkpoint: the verified checkpoint a resumed run continues.

    Raises:
        IntegrityError: a checkpoint whose noise was generated with another number of workers (the
            reason and the number to resume with), or whose files do not verify.
    """
    if isinstance(key, NoiseNodeLink) or cfg.noise_node:  # the noise node holds the key
        return open_noise_node(cfg, key, checkpoint)
    workers = cfg.noise_workers
    root = Path(cfg.state_dir) / SHARD_ROOT
    if checkpoint is None:
        if not workers:
            return LocalNoiseStream.new(factorization, shapes, key)
        table = SegmentTable.single(key or new_secret())
        return ShardedNoiseStream(
            factorization, shapes, table, workers, cfg.ray_address, root, next_round=0
        )
    where = f"{checkpoint.path}:noise/{SHARDS_FILE}"
    if SHARDS_FILE not in checkpoint.noise:
        if workers and PUBLIC_FILE in checkpoint.noise:
            raise IntegrityError(
                f"{checkpoint.path}: this run generated its noise in the server's process; resume "
                "it without --noise-workers (corrflow.noise-workers 0): its noise state cannot "
                "move to workers mid-run"
            )
        return LocalNoiseStream.restore(checkpoint, factorization, key)
    info = json.loads(checkpoint.noise[SHARDS_FILE])
    n = int(info["workers"])
    if workers != n:
        raise IntegrityError(
            f"{checkpoint.path}: this run's noise state is sharded over {n} noise workers, each "
            f"holding its shard on its own disk; resume it with --noise-workers {n} "
            f"(corrflow.noise-workers {n}), not {workers}"
        )
    if info.get("format") != SHARDS_FORMAT or info.get("factorization_sha256") != (
        factorization.sha256()
    ):
        raise IntegrityError(f"{where}: another format or factorization")
    if SEGMENTS_FILE not in checkpoint.secrets:
        raise IntegrityError(f"{where}: the key segments ({SEGMENTS_FILE}) are missing")
    table = SegmentTable.from_private(
        checkpoint.secrets[SEGMENTS_FILE], info.get("key_segments"), SEGMENTS_FILE
    )
    stream = ShardedNoiseStream(
        factorization,
        shapes,
        table,
        n,
        cfg.ray_address,
        root,
        prng=info["prng"],
        chunk_size=int(info["chunk_size"]),
        next_round=int(info["next_round"]),
        digests=[s["state_sha256"] for s in info["shards"]],
    )
    if [(s.first_chunk, s.chunks) for s in stream.shards] != [
        (s["first_chunk"], s["chunks"]) for s in info["shards"]
    ]:
        stream.close()
        raise IntegrityError(f"{where}: its shards are not this model's")
    if stream.next_round < factorization.rounds:
        stream.begin_segment(key)
    return stream
