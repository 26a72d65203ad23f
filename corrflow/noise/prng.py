"""Counter-based Gaussian sources: z for (round j, coordinate chunk c) is a pure function of (secret
key, j, c).

docs "Conventions", Randomness: no global RNG; noise is keyed by (secret seed, round, chunk), so any
row can be regenerated in any order, exactly. Two sources:

* ``philox`` (default): NumPy's Philox-4×64 with chunk c's block key (below) as its key and
  (0, 0, c, j) as the starting counter. Each (j, c) stream owns 2¹²⁸ counter values, so streams
  never overlap. Fast; statistically strong, not cryptographically secure.
* ``chacha``: ChaCha20 from the maintained ``randomgen`` package (``pip install corrflow[secure]``),
  256-bit block key, (j, c) placed in the counter's high words — a cryptographically secure
  counter-based generator.

Block keys: chunk c of every row is drawn with ``block_key(key, c)``, an HMAC-SHA256 of the key
(`corrflow.noise.keys`, where every noise key is derived under the key's derivation version),
never with the secret key itself. A noise worker that generates a shard of the coordinates (McKenna,
"Scaling up the Banded Matrix Factorization Mechanism for Differentially Private ML", arXiv
2405.15913, §3.3) is given the block keys of its chunks only: it draws exactly the bits the single
process draws for them, and learns nothing of the other chunks' noise (HMAC is a PRF).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np

from corrflow.errors import IntegrityError, InvalidArgumentError, require

# block_key, fingerprint and new_secret are re-exported: their home is corrflow.noise.keys
from corrflow.noise.keys import (  # noqa: F401
    KEY_BYTES,
    VERSION,
    block_key,
    fingerprint,
    new_secret,
    seed_key,
)

PRNGS = ("philox", "chacha")


class _BlockKeys:
    """Block keys by chunk: derived from the secret key (and cached), or only the given ones (a
    noise worker's)."""

    def __init__(
        self,
        key: bytes | None,
        blocks: Mapping[int, bytes] | None,
        size: int,
        prng: str,
        version: int,
    ):
        require(
            (key is None) != (blocks is None), "seed", "either the secret key or its block keys"
        )
        given = [key] if key is not None else list(blocks.values())
        require(
            all(isinstance(k, bytes) and len(k) == size for k in given),
            "seed",
            f"{size} secret bytes for {prng}",
        )
        self._key, self._version = key, version
        self._cache: dict[int, bytes] = {} if blocks is None else dict(blocks)

    def get(self, chunk: int) -> bytes:
        k = self._cache.get(chunk)
        if k is None:
            if self._key is None:
                raise IntegrityError(f"noise chunk {chunk} is not one of this worker's blocks")
            k = self._cache[chunk] = block_key(self._key, chunk, version=self._version)
        return k


class GaussianSource(Protocol):
    name: str

    def normal(self, round_index: int, chunk: int, size: int) -> np.ndarray:
        """Standard normal float32 vector of ``size`` for (round, chunk); identical on every
        call."""

    def generator(self, round_index: int, chunk: int) -> np.random.Generator:
        """A fresh generator positioned at the start of the (round, chunk) stream: successive
        ``standard_normal(out=block, dtype=np.float32)`` calls continue `normal`'s sequence,
        so a chunk can be drawn block by block into cache-sized buffers."""


class PhiloxSource:
    """NumPy's Philox counter-based generator keyed by the secret key; (round, chunk) select the
    counter.

    Args:
        key: the secret key (each chunk is drawn with its block key, `block_key`).
        version: the key's derivation version (`corrflow.noise.keys`; a new key's is the current
            one); with ``key`` only.
        blocks: instead of the key, the block keys of some chunks (a noise worker's shard).
    """

    name = "philox"

    def __init__(
        self,
        key: bytes | None = None,
        *,
        version: int = VERSION,
        blocks: Mapping[int, bytes] | None = None,
    ):
        self._block_keys = _BlockKeys(key, blocks, KEY_BYTES["philox"], "philox", version)

    def generator(self, round_index: int, chunk: int) -> np.random.Generator:
        key = np.frombuffer(self._block_keys.get(chunk), dtype="<u8")
        counter = np.array([0, 0, chunk, round_index], dtype=np.uint64)
        return np.random.Generator(np.random.Philox(key=key, counter=counter))

    def normal(self, round_index: int, chunk: int, size: int) -> np.ndarray:
        return self.generator(round_index, chunk).standard_normal(size, dtype=np.float32)


class ChaChaSource:
    """ChaCha20 (``randomgen``, the ``secure`` extra), a cryptographically secure counter-based
    source.

    Args:
        key: the 32-byte secret key (each chunk is drawn with its block key, `block_key`).
        version: the key's derivation version (`corrflow.noise.keys`; a new key's is the current
            one); with ``key`` only.
        blocks: instead of the key, the block keys of some chunks (a noise worker's shard).
    """

    name = "chacha"

    def __init__(
        self,
        key: bytes | None = None,
        *,
        version: int = VERSION,
        blocks: Mapping[int, bytes] | None = None,
    ):
        self._block_keys = _BlockKeys(key, blocks, KEY_BYTES["chacha"], "chacha", version)
        try:
            from randomgen import ChaCha
        except ImportError as exc:  # pragma: no cover - depends on the optional extra
            raise InvalidArgumentError(
                "prng", "the randomgen package for chacha (pip install corrflow[secure])"
            ) from exc
        self._chacha = ChaCha

    def generator(self, round_index: int, chunk: int) -> np.random.Generator:
        # 128-bit block counter: high 64 bits = round, next 32 = chunk; a chunk uses far fewer than
        # 2³² blocks.
        counter = (round_index << 64) | (chunk << 32)
        key = int.from_bytes(self._block_keys.get(chunk), "little")
        return np.random.Generator(self._chacha(key=key, counter=counter, rounds=20))

    def normal(self, round_index: int, chunk: int, size: int) -> np.ndarray:
        return self.generator(round_index, chunk).standard_normal(size, dtype=np.float32)


def make_source(prng: str, key: bytes, version: int) -> GaussianSource:
    """The Gaussian source for a PRNG name.

    Args:
        prng: ``"philox"`` or ``"chacha"``.
        key: the secret key.
        version: its derivation version (`corrflow.noise.keys`).

    Returns:
        A source whose ``normal(round, chunk, size)`` is a pure function of (key, round, chunk).
    """
    require(prng in PRNGS, "prng", f"one of {PRNGS}", prng)
    source = PhiloxSource if prng == "philox" else ChaChaSource
    return source(key, version=version)


def make_block_source(prng: str, blocks: Mapping[int, bytes]) -> GaussianSource:
    """The Gaussian source of a noise worker: only the chunks whose block keys it holds.

    Args:
        prng: ``"philox"`` or ``"chacha"``.
        blocks: chunk c → `block_key` (key, c).

    Returns:
        A source drawing those chunks with the same bits as `make_source` (key); any other chunk
        raises IntegrityError.
    """
    require(prng in PRNGS, "prng", f"one of {PRNGS}", prng)
    return PhiloxSource(blocks=blocks) if prng == "philox" else ChaChaSource(blocks=blocks)


def key_from_seed(seed: int | str | bytes, prng: str = "philox") -> bytes:
    """An audit key from a user-given seed (``corrflow noise sample --seed``).

    Args:
        seed: bytes of the key's length, hex of the key's length (taken as the key), or any other
            text or integer (hashed with SHA-256).
        prng: ``"philox"`` or ``"chacha"``.

    Returns:
        The key bytes.
    """
    n = KEY_BYTES[prng]
    if isinstance(seed, bytes):
        require(len(seed) == n, "seed", f"{n} bytes for {prng}", len(seed))
        return seed
    text = str(seed)
    if len(text) == 2 * n:
        try:
            return bytes.fromhex(text)
        except ValueError:
            pass
    return seed_key(text, n)
