"""Counter-based Gaussian sources: z for (round j, coordinate chunk c) is a pure function of (secret
key, j, c).

docs "Conventions", Randomness: no global RNG; noise is keyed by (secret seed, round, chunk), so any
row can be regenerated in any order, exactly. Two sources:

* ``philox`` (default): NumPy's Philox-4×64 with the 128-bit secret as its key and (0, 0, c, j) as
  the starting counter. Each (j, c) stream owns 2¹²⁸ counter values, so streams never overlap. Fast;
  statistically strong, not cryptographically secure.
* ``chacha``: ChaCha20 from the maintained ``randomgen`` package (``pip install corrflow[secure]``),
  256-bit key, (j, c) placed in the counter's high words — a cryptographically secure counter-based
  generator.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Protocol

import numpy as np

from corrflow.errors import InvalidArgumentError, require

PRNGS = ("philox", "chacha")
KEY_BYTES = {"philox": 16, "chacha": 32}


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
        key: the secret key.
    """

    name = "philox"

    def __init__(self, key: bytes):
        require(isinstance(key, bytes) and len(key) == 16, "seed", "16 secret bytes for philox")
        self._key = np.frombuffer(key, dtype="<u8").astype(np.uint64)

    def generator(self, round_index: int, chunk: int) -> np.random.Generator:
        counter = np.array([0, 0, chunk, round_index], dtype=np.uint64)
        return np.random.Generator(np.random.Philox(key=self._key, counter=counter))

    def normal(self, round_index: int, chunk: int, size: int) -> np.ndarray:
        return self.generator(round_index, chunk).standard_normal(size, dtype=np.float32)


class ChaChaSource:
    """ChaCha20 (``randomgen``, the ``secure`` extra), a cryptographically secure counter-based
    source.

    Args:
        key: the 32-byte secret key.
    """

    name = "chacha"

    def __init__(self, key: bytes):
        require(isinstance(key, bytes) and len(key) == 32, "seed", "32 secret bytes for chacha")
        try:
            from randomgen import ChaCha
        except ImportError as exc:  # pragma: no cover - depends on the optional extra
            raise InvalidArgumentError(
                "prng", "the randomgen package for chacha (pip install corrflow[secure])"
            ) from exc
        self._chacha = ChaCha
        self._key = int.from_bytes(key, "little")

    def generator(self, round_index: int, chunk: int) -> np.random.Generator:
        # 128-bit block counter: high 64 bits = round, next 32 = chunk; a chunk uses far fewer than
        # 2³² blocks.
        counter = (round_index << 64) | (chunk << 32)
        return np.random.Generator(self._chacha(key=self._key, counter=counter, rounds=20))

    def normal(self, round_index: int, chunk: int, size: int) -> np.ndarray:
        return self.generator(round_index, chunk).standard_normal(size, dtype=np.float32)


def new_secret(prng: str = "philox") -> bytes:
    """A fresh secret key from the operating system's entropy.

    Args:
        prng: ``"philox"`` or ``"chacha"``; fixes the key length.

    Returns: The key bytes (never logged; stored owner-only by
    `save_state`).
    """
    require(prng in PRNGS, "prng", f"one of {PRNGS}", prng)
    return secrets.token_bytes(KEY_BYTES[prng])


def make_source(prng: str, key: bytes) -> GaussianSource:
    """The Gaussian source for a PRNG name.

    Args:
        prng: ``"philox"`` or ``"chacha"``.
        key: the secret key.

    Returns:
        A source whose ``normal(round, chunk, size)`` is a pure function of (key, round, chunk).
    """
    require(prng in PRNGS, "prng", f"one of {PRNGS}", prng)
    return PhiloxSource(key) if prng == "philox" else ChaChaSource(key)


def key_from_seed(seed: int | str | bytes, prng: str = "philox") -> bytes:
    """An audit key from a user-given seed (``corrflow noise sample --seed``).

    Args: seed: bytes of the key's length, hex of the key's length (taken as the key), or any other
    text or integer (hashed with SHA-256). prng: ``"philox"`` or ``"chacha"``.

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
    return hashlib.sha256(b"corrflow-seed:" + text.encode()).digest()[:n]


def fingerprint(key: bytes) -> str:
    """A one-way fingerprint of a secret key (safe to store in public state; identifies a foreign
    secret).

    Args:
        key: the secret key.

    Returns:
        32 hex digits of a domain-separated SHA-256.
    """
    return hashlib.sha256(b"corrflow-noise-key:" + key).hexdigest()[:32]
