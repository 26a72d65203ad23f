"""The noise keys: every key corrflow derives for its correlated noise, in one place, under one
versioned set of labels — the noise node, the server's in-process stream and the noise workers all
derive through these functions.

The tree (version 1; ``‖`` is concatenation, HMAC is HMAC-SHA256, n the PRNG's key length: 16
bytes for philox, 32 for chacha; c a coordinate chunk)::

    run key = segment 0's key      new_secret(): OS entropy, written once (0600)
    ├── segment keys               one per key segment (a restart, a redo at the noise node):
    │   │                          fresh new_secret()s, saved before a row is drawn with them
    │   ├── block keys             HMAC(seg, BLOCK_LABEL ‖ c as u64 LE)[:n]: chunk c of its rows
    │   ├── TensorFlow seeds       SHA-256(seg ‖ t as u64 LE ‖ c as u64 LE)[:16]: chunk c of row t
    │   │                          in the TensorFlow backend (`corrflow.noise.tf_backend`; no label
    │   │                          in version 1: the only hash of a key with no label first)
    │   └── fingerprint            SHA-256(FINGERPRINT_LABEL ‖ seg), 32 hex digits: public, names
    │                              the segment in checkpoints, journals and reports
    ├── ring-MAC key               SHA-256(RING_LABEL ‖ run key): a checkpoint's ring-row MACs
    └── shard-MAC keys             HMAC(run key, SHARD_LABEL ‖ "first:count"): a noise worker's
                                   ring-row MACs, one key per shard of chunks
    audit keys                     SHA-256(SEED_LABEL ‖ text)[:n] (corrflow noise sample --seed;
                                   never a run's key)

HMAC and SHA-256 with distinct labels are independent pseudo-random functions of the key, so a
noise worker given its block keys and its shard-MAC key learns nothing of other chunks' noise, and a
fingerprint reveals nothing of the key.

The labels are those every released row and every stored MAC and fingerprint were made with:
changing one would change released bits or make stored checkpoints unverifiable, so they are kept
byte for byte (tests/test_noise_keys.py pins each derivation to known answers); a new scheme would
take a new `VERSION` with new labels (the noise node's report names the version its rows were
drawn under).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from corrflow.errors import require

#: The derivation scheme's version (the labels below).
VERSION = 1
#: Key lengths by PRNG.
KEY_BYTES = {"philox": 16, "chacha": 32}
#: The labels of version 1 (unchanged since the first release: the released bits depend on them).
BLOCK_LABEL = b"corrflow.noise-block/1:"
RING_LABEL = b"corrflow.noise-ring/1"
SHARD_LABEL = b"corrflow.noise-shard-ring/1:"
FINGERPRINT_LABEL = b"corrflow-noise-key:"
SEED_LABEL = b"corrflow-seed:"


def new_secret(prng: str = "philox") -> bytes:
    """A fresh run or segment key from the operating system's entropy.

    Args:
        prng: ``"philox"`` or ``"chacha"``; fixes the key length.

    Returns:
        The key bytes (never logged; stored owner-only).
    """
    require(prng in KEY_BYTES, "prng", f"one of {tuple(KEY_BYTES)}", prng)
    return secrets.token_bytes(KEY_BYTES[prng])


def block_key(key: bytes, chunk: int) -> bytes:
    """The key that draws coordinate chunk ``chunk`` of every row of a segment (module docstring).

    Args:
        key: the segment's key (16 bytes for philox, 32 for chacha).
        chunk: c ≥ 0.

    Returns:
        ``len(key)`` bytes.
    """
    mac = hmac.new(key, BLOCK_LABEL + int(chunk).to_bytes(8, "little"), hashlib.sha256)
    return mac.digest()[: len(key)]


def tf_seed(key: bytes, round_index: int, chunk: int) -> bytes:
    """The seed of the TensorFlow backend's stateless Philox draw of chunk ``chunk`` of row
    ``round_index`` (module docstring).

    Args:
        key: the segment's key.
        round_index: t ≥ 0.
        chunk: c ≥ 0.

    Returns:
        16 bytes (two little-endian int64 words, TensorFlow's seed shape).
    """
    data = key + int(round_index).to_bytes(8, "little") + int(chunk).to_bytes(8, "little")
    return hashlib.sha256(data).digest()[:16]


def fingerprint(key: bytes) -> str:
    """A one-way fingerprint of a secret key (public: identifies a segment, reveals nothing).

    Args:
        key: the secret key.

    Returns:
        32 hex digits of a labelled SHA-256.
    """
    return hashlib.sha256(FINGERPRINT_LABEL + key).hexdigest()[:32]


def ring_mac_key(key: bytes) -> bytes:
    """The key of a checkpoint's ring-row MACs, derived from the noise key.

    Args:
        key: the run key.

    Returns:
        32 bytes.
    """
    return hashlib.sha256(RING_LABEL + key).digest()


def shard_mac_key(run_key: bytes, first_chunk: int, chunks: int) -> bytes:
    """The ring-MAC key of the noise worker that holds chunks [first, first + count).

    Args:
        run_key: segment 0's key.
        first_chunk: the shard's first chunk.
        chunks: its number of chunks.

    Returns:
        32 bytes.
    """
    label = SHARD_LABEL + f"{first_chunk}:{chunks}".encode()
    return hmac.new(run_key, label, hashlib.sha256).digest()


def seed_key(text: str, n: int) -> bytes:
    """An audit key hashed from a user's seed text (never a run's key).

    Args:
        text: the seed.
        n: the key length.

    Returns:
        ``n`` bytes.
    """
    return hashlib.sha256(SEED_LABEL + text.encode()).digest()[:n]
