"""Streaming correlated noise w_t = σ·(C⁻¹Z)_t for model-sized updates (float32), regenerated from a
secret key.

Modes, chosen from the encoder's structure (docs "Conventions" data flow; 001 §1.2, §4.3; 003 §3):

* ``banded``: C has ``p`` bands → the recursion of 001 Alg. 1, y_t = (z_t − Σ_{r=1}^{p−1} C[t,t−r]
  y_{t−r})/C[t,t], with a float32 ring buffer of the last p−1 outputs ((p−1)·d·4 bytes, the only
  large state);
* ``banded-inverse``: C⁻¹ has ``p`` bands → y_t = Σ_{j<p} (C⁻¹)[t,t−j] z_{t−j}: the p fresh draws
  are regenerated from the key, O(d) memory (003 §8 pitfall 1; 001 §4.3);
* ``dense``: any lower-triangular C → y_t = Σ_{j≤t} (C⁻¹)[t,j] z_j, every z_j regenerated: O(t·d)
  work, O(d) memory;
* ``identity``: y_t = z_t / C[0,0] (DP-SGD);
* ``blt``: a buffered linear Toeplitz C = s·T(c) with B buffers (McMahan, Xu, Zhang 2024, arXiv
  2408.08868, Alg. 3): y_t = z_t − Σ_j ω_j S_j, then S_j ← θ_j S_j + y_t, emitting σ·y_t/s — one
  draw per round and B·d float32 of state. The arithmetic runs in float64 (θ near 1 must not be
  rounded to float32: its powers would change C), and only the state is stored in float32.

Every mode draws z one cache-sized block at a time (`BLOCK`
coordinates of a chunk's stream, the same bits as a whole-chunk draw) and combines the block while
it is in cache: the stateful modes with a compiled kernel (`corrflow.noise.kernels`: the ring
or the BLT state read once and written once per round, float64 accumulation), the regenerating modes
by scaling each term's block and adding it to the output, σ folded into the coefficients. Measured
against the whole-chunk code this replaced (docs "Benchmarks"): faster for the stateful modes, as
fast (within the machine's noise) for the regenerating modes, whose cost is their draws; no
model-sized temporaries in any mode. Peak memory beyond the state is the output and a block. Each
z_j chunk's stream comes from `corrflow.noise.prng`, a pure function of (key, j, chunk):
restoring a saved state continues bit for bit, and any released round can be replayed exactly.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import math
import os
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path

import numpy as np
from scipy.linalg import solve_triangular

from corrflow.errors import IntegrityError, InvalidArgumentError, require
from corrflow.factorization.base import Factorization
from corrflow.factorization.encoders import (
    DENSE_LIMIT,
    BandedEncoder,
    BLTEncoder,
    InverseToeplitzEncoder,
    ToeplitzEncoder,
)
from corrflow.factorization.registry import noise_mode_for
from corrflow.fileio import atomic_file, write_bytes
from corrflow.noise.keys import VERSION as KEY_VERSION
from corrflow.noise.keys import fingerprint, new_secret, ring_mac_key
from corrflow.noise.prng import make_source
from corrflow.noise.segments import PublicSegment, PublicSegments, SegmentedSource, SegmentTable

#: Coordinates per block of z (float32): it stays in L2 while the block's state rows stream past.
# The compiled kernels (`corrflow.noise.kernels`) are imported at the first stateful step: numba's
# import would cost every CLI start half a second.
BLOCK = 1 << 16

MODES = ("banded", "banded-inverse", "dense", "identity", "blt")
#: Modes whose model-sized state (``_buffer``) is advanced round by round (and saved with the
# checkpoint).
STATEFUL_MODES = ("banded", "blt")
#: Coordinates per PRNG chunk: the unit of the counter-based stream and of a noise worker's shard
# (`corrflow.noise.shards`): block j of row t is a function of (key, j, t) alone. Small enough
# that a 2·10⁵-parameter model splits over a few workers; one PRNG setup per chunk costs nothing
# measurable next to its 2¹⁶ draws.
DEFAULT_CHUNK = 1 << 16


def default_mode(factorization: Factorization) -> str:
    """The noise engine's mode for a factorization's encoder.

    Args:
        factorization: a normalised factorization.

    Returns:
        One of `MODES`: the registry's mode for the encoder's structure
        (`corrflow.factorization.registry`); a diagonal banded C (one band, not column-rescaled) is
        DP-SGD's ``identity``.
    """

    enc = factorization.encoder
    mode = noise_mode_for(enc.structure)
    if mode == "banded" and enc.bands == 1 and not getattr(enc, "column_normalize", False):
        return "identity"
    return mode


def _normalize_shapes(shapes: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    try:
        out = tuple(tuple(int(s) for s in shape) for shape in shapes)
    except TypeError as exc:
        raise InvalidArgumentError(
            "shapes", "a list of array shapes (tuples of ints)", shapes
        ) from exc
    require(
        len(out) > 0 and all(all(s >= 0 for s in shape) for shape in out),
        "shapes",
        "at least one shape with non-negative sizes",
        shapes,
    )
    return out


class CorrelatedNoise:
    """Generator of σ·(C⁻¹Z)_t, one round at a time: ``next(t) -> list[np.ndarray]`` shaped like
    ``shapes``.

    Z is n × d standard Gaussian noise (d = the model's size), drawn counter-based from (key, round,
    chunk), so any round can be regenerated from the key alone; the mode (module doc; 001 Alg. 1 for
    banded C, 003 for banded C⁻¹, arXiv 2408.08868 Alg. 3 for BLTs) decides what state is kept
    between rounds.

    Args:
        factorization: the mechanism; its encoder C (n × n) fixes the correlation and the number of
            rounds n.
        shapes: the model's array shapes, e.g. ``[(784, 10), (10,)]``; each round's noise comes back
            in them.
        stddev: σ, multiplying the unit-variance noise (the server passes σ·clip).
        key: the secret key (default: a fresh one from the OS, `new_secret`); pass one only for
            audits and restores.
        key_version: the derivation version ``key`` was made under (`corrflow.noise.keys`): a
            stored key's own; a new key's is the current one.
        prng: ``"philox"`` (default) or ``"chacha"`` (ChaCha20, the ``secure`` extra).
        mode: override the mode `default_mode` picks (``dense`` works for any encoder up to a size
            limit).
        chunk_size: coordinates per PRNG chunk (the unit of the counter-based stream; it is saved
            with the state).
        first_chunk: the global index of the first chunk, for a shard of a larger model
            (`corrflow.noise.shards`; shapes then cover the shard's coordinates).
        source: instead of a key, a source that holds only the block keys of the shard's chunks (a
            noise worker's: it never sees the key).
    """

    def __init__(
        self,
        factorization: Factorization,
        shapes: Sequence[Sequence[int]],
        stddev: float = 1.0,
        *,
        key: bytes | None = None,
        key_version: int = KEY_VERSION,
        prng: str = "philox",
        mode: str | None = None,
        chunk_size: int = DEFAULT_CHUNK,
        first_chunk: int = 0,
        source=None,
    ):
        require(isinstance(factorization, Factorization), "factorization", "a Factorization")
        require(
            np.isfinite(stddev) and stddev >= 0, "stddev", "a finite, non-negative number", stddev
        )
        require(
            isinstance(chunk_size, int) and chunk_size >= 1,
            "chunk_size",
            "a positive integer",
            chunk_size,
        )
        self.factorization = factorization
        self.shapes = _normalize_shapes(shapes)
        self.sizes = [math.prod(s) for s in self.shapes]
        self.dim = int(sum(self.sizes))
        self.stddev = float(stddev)
        self.prng = prng
        if source is not None:
            require(key is None, "key", "no key with a shard's source (it holds block keys)")
            self._key, self._source = None, source
        else:
            self._key = new_secret(prng) if key is None else key
            # Row Z_j comes from the key of its segment (corrflow.noise.segments): one key until a
            # restart opens a new segment.
            self._source = SegmentedSource(
                SegmentTable.single(self._key, key_version), partial(make_source, prng)
            )
        self.mode = default_mode(factorization) if mode is None else mode
        require(self.mode in MODES, "mode", f"one of {MODES}", self.mode)
        self.chunk_size = chunk_size
        require(
            isinstance(first_chunk, int) and first_chunk >= 0,
            "first_chunk",
            "a non-negative integer",
            first_chunk,
        )
        self.first_chunk = first_chunk
        self.rounds = factorization.rounds
        self.next_round = 0
        self._buffer: np.ndarray | None = None
        self._prepare_mode(factorization.encoder)

    def _prepare_mode(self, enc) -> None:
        """Check that the mode fits the encoder and allocate its state: the banded or BLT buffer
        (zeros), the banded inverse's coefficients, or the dense mode's C⁻¹."""
        if self.mode == "banded":
            require(
                isinstance(enc, ToeplitzEncoder | BandedEncoder),
                "mode",
                "banded only for a banded encoder (use dense)",
                self.mode,
            )
            self._buffer = np.zeros((max(enc.bands - 1, 0), self.dim), dtype=np.float32)
        elif self.mode == "banded-inverse":
            require(
                isinstance(enc, InverseToeplitzEncoder),
                "mode",
                "banded-inverse only for an encoder with a banded inverse",
                self.mode,
            )
            self._noising = enc.noising
        elif self.mode == "blt":
            require(isinstance(enc, BLTEncoder), "mode", "blt only for a BLT encoder", self.mode)
            self._buffer = np.zeros((enc.buffers, self.dim), dtype=np.float32)
        elif self.mode == "identity":
            require(
                enc.bands == 1 and isinstance(enc, ToeplitzEncoder | BandedEncoder),
                "mode",
                "identity only for a diagonal encoder",
                self.mode,
            )
        else:
            require(enc.n <= DENSE_LIMIT, "mode", f"dense only up to {DENSE_LIMIT} rounds", enc.n)
            self._inverse = solve_triangular(enc.matrix(), np.eye(enc.n), lower=True)

    def __repr__(self) -> str:  # the key stays out of logs
        return (
            f"CorrelatedNoise(mode={self.mode!r}, prng={self.prng!r}, dim={self.dim}, "
            f"rounds={self.rounds}, next_round={self.next_round})"
        )

    # -- public API --------------------------------------------------------------------------------
    @property
    def mac_key(self) -> bytes:
        """The key of the ring rows' MACs (`save_state`), derived from the noise key."""
        return ring_mac_key(self._key, version=self.segments.run_version)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of noise state kept between rounds: (bands − 1)·d·4 (banded), B·d·4 (BLT), else
        0."""
        return 0 if self._buffer is None else self._buffer.nbytes

    def next(
        self,
        round_index: int,
        *,
        replay: bool = False,
        shapes: Sequence[Sequence[int]] | None = None,
    ) -> list[np.ndarray]:
        """The noise of one round.

        Args:
            round_index: t, 0-based; must be the next round (rounds are released in order).
            replay: allow an earlier round, re-created bit for bit (an identical re-release).
            shapes: optionally, the model shapes again, checked against those fixed at construction.

        Returns:
            σ·(C⁻¹Z)_t as float32 arrays, one per shape.

        Raises:
            InvalidArgumentError: a round out of order (without ``replay``) or past the
                factorization's n.
        """
        if shapes is not None and _normalize_shapes(shapes) != self.shapes:
            raise InvalidArgumentError(
                "shapes",
                f"the model shapes fixed at start {list(self.shapes)}",
                [tuple(s) for s in shapes],
            )
        if not (isinstance(round_index, int | np.integer) and 0 <= round_index < self.rounds):
            raise InvalidArgumentError(
                "round_index",
                f"an integer in [0, {self.rounds}): the factorization has only {self.rounds} "
                "rounds",
                round_index,
            )
        if round_index == self.next_round:
            flat = self._advance(round_index)
            self.next_round += 1
        elif replay and round_index < self.next_round:
            flat = self._replay(round_index)
        else:
            what = (
                "an earlier round needs replay=True (an identical re-release)"
                if round_index < self.next_round
                else "rounds are released in order"
            )
            raise InvalidArgumentError(
                "round_index", f"{self.next_round}, the next round ({what})", round_index
            )
        return self._split(flat)

    @property
    def segments(self) -> SegmentTable | PublicSegments:
        """Which key drew each row Z_j (`corrflow.noise.segments`): the keys' table, or, for a
        noise worker's shard (no key), their public forms."""
        return self._source.table

    def begin_segment(self, key: bytes | None = None, version: int = KEY_VERSION) -> None:
        """Draw the rows Z_j, j ≥ the next round, with a new key (default: fresh from the OS);
        earlier rows keep the key that drew them. A server calls this on every start that resumes a
        checkpoint, so that rounds after a restart never repeat the noise of an earlier start.

        Args:
            key: a stored segment's key when its rows are replayed (a noise node's rebuild), or a
                test's; a key the table already holds is refused.
            version: that key's derivation version (a key made now: the current one).
        """
        require(
            self._key is not None,
            "begin_segment",
            "a generator that holds its key (a noise worker's shard takes add_segment)",
        )
        key = new_secret(self.prng) if key is None else key
        require(
            isinstance(key, bytes) and len(key) == len(self._key),
            "noise_key",
            f"{len(self._key)} secret bytes",
        )
        self._source.table = self.segments.extend(self.next_round, key, version)
        # at round 0 the new segment replaces segment 0: it is the run key now (its MAC keys,
        # fingerprint and secret file follow it, with its version)
        self._key = self._source.table.segments[0].key

    def skip_round(self) -> None:
        """Advance past the next round without releasing noise (non-private baselines keep rounds
        aligned)."""
        self.next_round += 1

    def skip_to(self, round_index: int) -> None:
        """Fast-forward a fresh generator so that ``round_index`` is the next round.

        Args:
            round_index: the next round to release, in [0, n]; the banded or BLT buffer is
                recomputed from the key (O(round_index · d) work), the regenerating modes need none.
        """
        require(
            self.next_round == 0,
            "round_index",
            "skip_to only on a fresh generator",
            self.next_round,
        )
        require(
            0 <= round_index <= self.rounds, "start", f"between 0 and {self.rounds}", round_index
        )
        if self.mode in STATEFUL_MODES:
            for t in range(round_index):
                self._advance(t)
        self.next_round = round_index

    # -- modes -------------------------------------------------------------------------------------
    def _chunks(self):
        """(chunk, lo, hi) of the model's coordinates: each chunk's draws z come from the
        counter-based stream of (round, chunk) of the row's key (`self._source.generator`), one
        cache-sized `BLOCK` at a time."""
        for c, lo in enumerate(range(0, self.dim, self.chunk_size), start=self.first_chunk):
            yield c, lo, min(self.dim, lo + self.chunk_size)

    def _advance(self, t: int) -> np.ndarray:
        out = np.empty(self.dim, dtype=np.float32)
        if self.mode == "banded":
            self._banded_step(t, out, self._buffer)
        elif self.mode == "blt":
            self._blt_step(t, out, self._buffer)
        else:
            self._stateless(t, out)
        return out

    def _blt_step(self, t: int, out: np.ndarray, buf: np.ndarray) -> None:
        """One round of MXZ24 Alg. 3 for C⁻¹ (module docstring): y = z_t − Σ_j ω_j S_j; S_j ← θ_j
        S_j + y; out = σ·y/s. Each block of z is drawn into cache and combined there
        (`blt_block`, float64 arithmetic); the state ``buf`` (B × d)
        is float32."""
        enc = self.factorization.encoder
        decay = np.asarray(enc.buf_decay, dtype=np.float64)
        weight = np.asarray(enc.output_scale, dtype=np.float64)
        gain = self.stddev / enc.scale
        from corrflow.noise.kernels import blt_block

        z = np.empty(min(BLOCK, self.dim), dtype=np.float32)
        for c, lo, hi in self._chunks():
            draw = self._source.generator(t, c)
            for a in range(lo, hi, BLOCK):
                b = min(hi, a + BLOCK)
                zb = z[: b - a]
                draw.standard_normal(out=zb, dtype=np.float32)
                blt_block(zb, buf, decay, weight, gain, a, out)

    def _banded_step(self, t: int, out: np.ndarray, buf: np.ndarray) -> None:
        """One round of 001 Alg. 1: y_t = (z_t − Σ_{r≥1} C[t,t−r] y_{t−r})/C[t,t] with y_{t−r} in
        ring slot (t − r) mod (p − 1); y_t replaces the oldest row, out = σ·y_t. Each block of z is
        drawn into cache and combined there with the ring rows it needs
        (`banded_block`): the ring is read once, its new row and the
        output written once."""
        coefs = self.factorization.encoder.row_band(t)
        kept = len(coefs) - 1
        lags = [r for r in range(1, kept + 1) if t - r >= 0 and coefs[r] != 0.0]
        slots = np.array([(t - r) % kept for r in lags], dtype=np.int64)
        weights = np.array([coefs[r] for r in lags], dtype=np.float64)
        slot = t % kept if kept > 0 else -1
        diag, gain = float(coefs[0]), np.float32(self.stddev)
        from corrflow.noise.kernels import banded_block

        z = np.empty(min(BLOCK, self.dim), dtype=np.float32)
        for c, lo, hi in self._chunks():
            draw = self._source.generator(t, c)
            for a in range(lo, hi, BLOCK):
                b = min(hi, a + BLOCK)
                zb = z[: b - a]
                draw.standard_normal(out=zb, dtype=np.float32)
                banded_block(zb, buf, slots, weights, diag, gain, slot, a, out)

    def _terms(self, t: int) -> list[tuple[int, float]]:
        """(j, (C⁻¹)[t, j]) for the fresh draws z_j that round t combines (stateless modes)."""
        if self.mode == "identity":
            return [(t, 1.0 / float(self.factorization.encoder.row_band(t)[0]))]
        if self.mode == "banded-inverse":
            return [
                (t - j, float(self._noising[j])) for j in range(len(self._noising)) if t - j >= 0
            ]
        row = self._inverse[t, : t + 1]
        return [(j, float(row[j])) for j in range(t + 1) if row[j] != 0.0]

    def _stateless(self, t: int, out: np.ndarray) -> None:
        """out = σ·Σ_j coef_j·z_j, block by block: every term's generator for the chunk is open at
        once, and each block of each draw is scaled and added while in cache — the first straight
        into ``out`` — so no draw is ever model-sized and σ costs no pass of its own."""
        terms = self._terms(t)
        scales = [np.float32(coef * self.stddev) for _, coef in terms]
        z = np.empty(min(BLOCK, self.dim), dtype=np.float32)
        for c, lo, hi in self._chunks():
            draws = [self._source.generator(j, c) for j, _ in terms]
            for a in range(lo, hi, BLOCK):
                b = min(hi, a + BLOCK)
                dst, zb = out[a:b], z[: b - a]
                for i, (draw, scale) in enumerate(zip(draws, scales, strict=True)):
                    if i == 0:
                        draw.standard_normal(out=dst, dtype=np.float32)
                        dst *= scale
                    else:
                        draw.standard_normal(out=zb, dtype=np.float32)
                        zb *= scale
                        dst += zb

    def _replay(self, t: int) -> np.ndarray:
        # the state holds sums, not past outputs: recompute from the key, O(t·B·d)
        if self.mode == "blt":
            buf = np.zeros_like(self._buffer)
            out = np.empty(self.dim, dtype=np.float32)
            for s in range(t + 1):
                self._blt_step(s, out, buf)
            return out
        if self.mode != "banded":
            out = np.empty(self.dim, dtype=np.float32)
            self._stateless(t, out)
            return out
        p = self.factorization.encoder.bands
        if p > 1 and t == self.next_round - 1:
            out = self._buffer[t % (p - 1)].copy()
            if self.stddev != 1.0:
                out *= np.float32(self.stddev)
            return out
        buf = np.zeros_like(self._buffer)  # recompute from the key: O(t·p·d) time
        out = np.empty(self.dim, dtype=np.float32)
        for s in range(t + 1):
            self._banded_step(s, out, buf)
        return out

    def _split(self, flat: np.ndarray) -> list[np.ndarray]:
        parts, lo = [], 0
        for shape, size in zip(self.shapes, self.sizes, strict=True):
            parts.append(flat[lo : lo + size].reshape(shape))
            lo += size
        return parts


# -- checkpoints -----------------------------------------------------------------------------------
#: /2: chunks are drawn with block keys (`corrflow.noise.keys.block_key`); a /1 state drew them
# with the key itself, and resuming it would silently change its rows' bits.
STATE_FORMAT = "corrflow.noise-state/2"
PUBLIC_FILE, SECRET_FILE, BUFFER_FILE = "noise_state.json", "noise_secret.key", "noise_buffer.npy"
#: The key segments with their keys (owner-only); the public state lists their fingerprints.
SEGMENTS_FILE = "noise_segments.key"
#: The banded ring buffer's rows on disk, overwritten in place (beside the checkpoints, outside
# them).
RING_FILE = "noise_ring.bin"


class _HashingWriter:
    """A write-only file wrapper that hashes what passes through (np.save writes the buffer once, no
    copy)."""

    def __init__(self, f):
        self.f, self.sha = f, hashlib.sha256()

    def write(self, data) -> int:
        self.sha.update(data)
        return self.f.write(data)


def _row_mac(gen: CorrelatedNoise, fac_sha256: str, round_index: int, row: np.ndarray) -> str:
    """HMAC-SHA256 of one ring row under a key derived from the noise key, bound to the
    factorization, the round whose output it holds and the model size: a row cannot be edited,
    swapped with another round's, or moved."""
    mac = hmac.new(gen.mac_key, f"{fac_sha256}:{round_index}:{gen.dim}:".encode(), hashlib.sha256)
    mac.update(memoryview(np.ascontiguousarray(row)).cast("B"))
    return mac.hexdigest()


def _ring_rows(gen: CorrelatedNoise) -> list[int]:
    """The rounds whose outputs the banded recursion still needs (the last p−1, none before round
    0)."""
    kept = gen._buffer.shape[0]
    return list(range(max(0, gen.next_round - kept), gen.next_round))


def _save_ring(gen: CorrelatedNoise, ring: Path) -> dict:
    """Write the banded buffer's rows into ``ring`` in place: only rows this generator has not yet
    written there (one per round in a running server), each fsync-ed before the caller publishes the
    state that names it.

    The ring has one slot more than the buffer has rows (round s in slot s mod p), so a round's
    write never touches a row the published checkpoint still needs: a kill mid-write leaves that
    checkpoint whole, and a row that does not match its MAC can only be corruption, which
    `restore_state` refuses."""
    kept = gen._buffer.shape[0]
    slots, row_bytes = kept + 1, gen.dim * 4
    known = gen.__dict__.setdefault("_ring_known", {})
    if known.get("path") != str(ring):
        known.clear()
        known["path"] = str(ring)
    rows, fac_sha256 = [], gen.factorization.sha256()
    fd = os.open(ring, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.fchmod(fd, 0o600)
        wrote = False
        for s in _ring_rows(gen):
            slot, row = s % slots, gen._buffer[s % kept]
            if known.get(slot, (None,))[0] != s:
                mac = _row_mac(gen, fac_sha256, s, row)
                view = memoryview(np.ascontiguousarray(row)).cast("B")
                done = 0
                while done < row_bytes:
                    done += os.pwrite(fd, view[done:], slot * row_bytes + done)
                known[slot], wrote = (s, mac), True
            rows.append({"round": s, "slot": slot, "mac": known[slot][1]})
        if wrote:
            os.fsync(fd)
    finally:
        os.close(fd)
    return {"file": ring.name, "slots": slots, "row_bytes": row_bytes, "rows": rows}


def state_parts(
    gen: CorrelatedNoise, *, ring: str | os.PathLike | None = None
) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """The generator's state as named files, without writing any of them (a server's checkpoint
    packs the public ones into its one file and keeps the secret ones apart).

    Args:
        gen: the generator.
        ring: a banded generator in a server's state directory: the buffer's rows go into that file
            in place, one new row per round instead of the whole (p−1)·d buffer, each with its own
            MAC in the public JSON (see `_save_ring`) — the one file this call writes. A BLT's B·d
            state changes in full every round and is returned in full.

    Returns:
        ``(public, secret)``: name → bytes. ``public``: the state's JSON (no key; `PUBLIC_FILE`,
        holding the hashes that tie the parts together) and the model-sized buffer
        (`BUFFER_FILE`, when there is one and no ring); ``secret``: the key (`SECRET_FILE`) and
        the key segments (`SEGMENTS_FILE`), owner-only.
    """
    public = {
        "format": STATE_FORMAT,
        "mode": gen.mode,
        "prng": gen.prng,
        "next_round": gen.next_round,
        "rounds": gen.rounds,
        "shapes": [list(s) for s in gen.shapes],
        "stddev": gen.stddev,
        "chunk_size": gen.chunk_size,
        "dtype": "float32",
        "factorization_sha256": gen.factorization.sha256(),
        "key_fingerprint": fingerprint(gen._key, version=gen.segments.run_version),
        "buffer_sha256": None,
        "key_segments": gen.segments.public(),
    }
    files = {}
    if gen._buffer is not None and ring is not None and gen.mode == "banded":
        public["ring"] = _save_ring(gen, Path(ring))
    elif gen._buffer is not None:
        out = io.BytesIO()
        np.save(out, gen._buffer, allow_pickle=False)
        files[BUFFER_FILE] = out.getvalue()
        public["buffer_sha256"] = hashlib.sha256(files[BUFFER_FILE]).hexdigest()
    # compact: json's C encoder (an indent falls back to its pure-Python one, 10 ms per round for a
    # 342-row ring's MACs at the papers' schedule)
    files[PUBLIC_FILE] = json.dumps(public, sort_keys=True).encode()
    secret = {SECRET_FILE: gen._key.hex().encode(), SEGMENTS_FILE: gen.segments.to_private()}
    return files, secret


def save_state(
    gen: CorrelatedNoise, directory: str | os.PathLike, *, ring: str | os.PathLike | None = None
) -> Path:
    """Write the generator's state (`state_parts`) to ``directory``: public JSON (no key) plus the
    key, the key segments and the model-sized buffer, all three owner-only (0600).

    Args:
        gen: the generator.
        directory: created if missing.
        ring: a banded generator's ring file (see `state_parts`).

    Returns:
        ``directory`` as a `Path`.

    Each file goes through a temp file + rename; the public JSON, written last, holds the hashes
    that tie them together, so a torn write is detected on restore, never used.
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    files, secret = state_parts(gen, ring=ring)
    for name, data in [*secret.items(), *files.items()]:
        if name != PUBLIC_FILE:
            write_bytes(d / name, data, private=True)
    write_bytes(d / PUBLIC_FILE, files[PUBLIC_FILE])
    return d


def save_buffer(gen: CorrelatedNoise, d: Path, ring: str | os.PathLike | None) -> dict:
    """Write the model-sized state of ``gen`` (nothing for the regenerating modes): a banded
    buffer's rows into ``ring`` in place when given, else the buffer into ``d`` (owner-only).

    Returns:
        The public fields that name it: ``ring`` (rows with their MACs) or ``buffer_sha256`` (None
        without a buffer).
    """
    if gen._buffer is not None and ring is not None and gen.mode == "banded":
        return {"ring": _save_ring(gen, Path(ring)), "buffer_sha256": None}
    if gen._buffer is None:
        return {"buffer_sha256": None}
    with atomic_file(d / BUFFER_FILE, "wb", private=True) as f:
        w = _HashingWriter(f)
        np.save(w, gen._buffer, allow_pickle=False)
    return {"buffer_sha256": w.sha.hexdigest()}


def _restore_ring(gen: CorrelatedNoise, info: dict, ring: Path | None, d: Path) -> None:
    """Fill the banded buffer from the ring rows the state names, each checked against its MAC."""
    if ring is None:
        raise IntegrityError(
            f"{d}: the noise buffer's rows are in a ring file ({info.get('file')}), and none was "
            "given to restore from"
        )
    kept = gen._buffer.shape[0]
    slots, row_bytes = kept + 1, gen.dim * 4
    if (
        info.get("slots") != slots
        or info.get("row_bytes") != row_bytes
        or info.get("file") != ring.name
    ):
        raise IntegrityError(
            f"{d}: the ring layout {info.get('file')} × {info.get('slots')} slots of "
            f"{info.get('row_bytes')} bytes does not fit this generator ({ring.name}, {slots} × "
            f"{row_bytes})"
        )
    rows = info.get("rows", [])
    if sorted(int(r["round"]) for r in rows) != _ring_rows(gen):
        raise IntegrityError(
            f"{d}: the ring rows listed ({[r.get('round') for r in rows]}) are not the rounds the "
            f"state at round {gen.next_round} needs"
        )
    known, fac_sha256 = {"path": str(ring)}, gen.factorization.sha256()
    try:
        fd = os.open(ring, os.O_RDONLY)
    except FileNotFoundError as exc:
        raise IntegrityError(f"{ring}: the noise ring is missing") from exc
    try:
        for r in rows:
            s, slot = int(r["round"]), int(r["slot"])
            if slot != s % slots:
                raise IntegrityError(
                    f"{ring}: round {s} listed in slot {slot}, expected {s % slots}"
                )
            data = os.pread(fd, row_bytes, slot * row_bytes)
            if len(data) != row_bytes:
                raise IntegrityError(
                    f"{ring}: slot {slot} (round {s}) is short: {len(data)} of {row_bytes} bytes"
                )
            row = np.frombuffer(data, dtype=np.float32)
            if not hmac.compare_digest(_row_mac(gen, fac_sha256, s, row), str(r["mac"])):
                raise IntegrityError(
                    f"{ring}: slot {slot} (round {s}) does not match its MAC (torn or edited); "
                    "the state refuses to resume from it"
                )
            gen._buffer[s % kept] = row
            known[slot] = (s, str(r["mac"]))
    finally:
        os.close(fd)
    gen._ring_known = known


def _restore_segments(where: str, public: dict, key: bytes, data: bytes | None) -> SegmentTable:
    """The key segments saved with the state, checked against its fingerprints and first key."""
    if data is None:
        raise IntegrityError(f"{where}: incomplete noise state ({SEGMENTS_FILE} missing)")
    table = SegmentTable.from_private(data, public.get("key_segments"), f"{where}/{SEGMENTS_FILE}")
    if table.segments[0].key != key:
        raise IntegrityError(
            f"{where}/{SEGMENTS_FILE}: the first segment's key is not the state's key"
        )
    if table.segments[-1].first_round > int(public["next_round"]):
        raise IntegrityError(
            f"{where}/{SEGMENTS_FILE}: a segment begins after the state's next round"
        )
    return table


def restore_state(
    directory: str | os.PathLike,
    factorization: Factorization,
    cls: type[CorrelatedNoise] = CorrelatedNoise,
    *,
    ring: str | os.PathLike | None = None,
) -> CorrelatedNoise:
    """Rebuild a generator saved by `save_state`; it continues bit for bit.

    Args:
        directory: the state directory.
        factorization: the factorization the state was made for (checked by SHA-256).
        cls: the generator class, e.g. the TensorFlow backend's.
        ring: the ring file the state was saved with, when it was saved with one.

    Returns:
        The generator, positioned at the saved next round.

    Raises:
        IntegrityError: a missing, corrupted, torn or foreign file (a ring row that fails its MAC
            included), or another factorization.
    """
    d = Path(directory)
    names = (PUBLIC_FILE, SECRET_FILE, SEGMENTS_FILE, BUFFER_FILE)
    files = {n: (d / n).read_bytes() for n in names if (d / n).is_file()}
    return restore_parts(files, factorization, cls, ring=ring, where=str(d))


def restore_parts(
    files: Mapping[str, bytes],
    factorization: Factorization,
    cls: type[CorrelatedNoise] = CorrelatedNoise,
    *,
    ring: str | os.PathLike | None = None,
    where: str,
) -> CorrelatedNoise:
    """Rebuild a generator from the files `state_parts` made (public and secret together).

    Args:
        files: name → bytes.
        factorization: the factorization the state was made for (checked by SHA-256).
        cls: the generator class.
        ring: the ring file the state was saved with, when it was saved with one.
        where: where the files were read from (errors name it).

    Returns:
        The generator, positioned at the saved next round.

    Raises:
        IntegrityError: see `restore_state`.
    """
    missing = next((n for n in (PUBLIC_FILE, SECRET_FILE) if n not in files), None)
    if missing is not None:
        raise IntegrityError(f"{where}: incomplete noise state ({missing} missing)")
    try:
        public = json.loads(files[PUBLIC_FILE])
        key_hex = files[SECRET_FILE].decode().strip()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise IntegrityError(f"{where}: noise state is not valid JSON ({exc})") from exc
    if public.get("format") != STATE_FORMAT:
        older = public.get("format") == "corrflow.noise-state/1"
        raise IntegrityError(
            f"{where}: format {public.get('format')!r}, expected {STATE_FORMAT!r}"
            + (
                " (written by an older corrflow, which drew noise without block keys: it cannot "
                "continue bit for bit; start a new run with --fresh)"
                if older
                else ""
            )
        )
    try:
        key = bytes.fromhex(key_hex)
    except ValueError as exc:
        raise IntegrityError(f"{where}: the secret key file is corrupted") from exc
    # the run key's derivation version is segment 0's (absent before versions: 1); the public
    # state is authenticated with the checkpoint, and the segments are checked against it below
    listed = public.get("key_segments")
    try:
        version = PublicSegment.from_public(listed[0]).derivation if listed else 1
    except IntegrityError as exc:
        raise IntegrityError(f"{where}: {exc}") from None
    if fingerprint(key, version=version) != public.get("key_fingerprint"):
        raise IntegrityError(
            f"{where}: the secret key does not belong to this state (foreign or corrupted file)"
        )
    if public.get("factorization_sha256") != factorization.sha256():
        recorded = str(public.get("factorization_sha256"))[:16]
        raise IntegrityError(
            f"{where}: the state was made for factorization {recorded}…, "
            f"not {factorization.sha256()[:16]}…"
        )
    gen = cls(
        factorization,
        public["shapes"],
        public["stddev"],
        key=key,
        key_version=version,
        prng=public["prng"],
        mode=public["mode"],
        chunk_size=int(public["chunk_size"]),
    )
    gen.next_round = int(public["next_round"])
    if SEGMENTS_FILE in files or "key_segments" in public:
        gen._source.table = _restore_segments(where, public, key, files.get(SEGMENTS_FILE))
    restore_buffer(gen, public, Path(where), ring, files.get(BUFFER_FILE))
    return gen


def restore_buffer(
    gen: CorrelatedNoise,
    public: dict,
    d: Path,
    ring: str | os.PathLike | None,
    data: bytes | None = None,
) -> None:
    """Fill ``gen``'s model-sized state from what `save_buffer` wrote (``public``: its fields),
    every row or the whole buffer checked against its MAC or hash; ``data``: the buffer file's
    bytes when they were read elsewhere (a checkpoint's member), else it is read from ``d``.

    Raises:
        IntegrityError: a missing, torn, edited or misshapen buffer or ring row.
    """
    if gen._buffer is not None and "ring" in public:
        if gen.mode != "banded":
            raise IntegrityError(f"{d}: a ring of rows is only for the banded mode, not {gen.mode}")
        _restore_ring(gen, public["ring"], None if ring is None else Path(ring), d)
    elif gen._buffer is not None:
        try:
            data = (d / BUFFER_FILE).read_bytes() if data is None else data
        except FileNotFoundError as exc:
            raise IntegrityError(f"{d}: the noise buffer is missing") from exc
        if hashlib.sha256(data).hexdigest() != public.get("buffer_sha256"):
            raise IntegrityError(
                f"{d}: the noise buffer does not match its recorded hash (torn or edited)"
            )
        buf = np.load(io.BytesIO(data), allow_pickle=False)
        if buf.shape != gen._buffer.shape or buf.dtype != np.float32:
            raise IntegrityError(
                f"{d}: noise buffer has shape {buf.shape} {buf.dtype}, expected "
                f"{gen._buffer.shape} float32"
            )
        gen._buffer[...] = buf
    if gen._buffer is not None and hasattr(gen, "load_buffer"):
        gen.load_buffer()
