"""The noise keys: every key corrflow derives for its correlated noise, in one place, under one
versioned derivation — the noise node, the server's in-process stream and the noise workers all
derive through these functions.

Version 2 (every key made since it was introduced) is one labelled derivation, HMAC-SHA256 with
the parent key as the HMAC key::

    derive(parent, purpose, context, n) = HMAC(parent, "corrflow/2/" ‖ purpose ‖ 0x00 ‖ context)[:n]

(``‖`` is concatenation, n the PRNG's key length: 16 bytes for philox, 32 for chacha; c a
coordinate chunk, t a round, both as u64 little-endian). The tree::

    run key = segment 0's key      new_secret(): OS entropy, written once (0600)
    ├── segment keys               one per key segment (a restart, a redo at the noise node):
    │   │                          fresh new_secret()s, saved before a row is drawn with them
    │   ├── block keys             derive(seg, "block", c, n): chunk c of the segment's rows
    │   ├── TensorFlow seeds       derive(seg, "tf-seed", t ‖ c, 16): chunk c of row t in the
    │   │                          TensorFlow backend (`corrflow.noise.tf_backend`)
    │   └── fingerprint            derive(seg, "fingerprint", "", 16) in hex (32 digits): public,
    │                              names the segment in checkpoints, journals and reports
    ├── ring-MAC key               derive(run key, "ring-mac", "", 32): a checkpoint's ring-row MACs
    └── shard-MAC keys             derive(run key, "shard-mac", "first:count", 32): a noise
                                   worker's ring-row MACs, one key per shard of chunks

HMAC-SHA256 is a pseudo-random function of its key (Bellare, "New Proofs for NMAC and HMAC:
Security without Collision-Resistance", CRYPTO 2006), and the purposes are distinct and end at the
0x00 before the context, so no two derivations share an input: a noise worker given its block keys
and its shard-MAC key learns nothing of other chunks' noise, and a fingerprint reveals nothing of
the key.

**Version 1** (keys made before version 2) mixed four styles — block and shard-MAC keys
HMAC(key, label ‖ context), the ring-MAC key and the fingerprint SHA-256(label ‖ key), the
TensorFlow seeds SHA-256(key ‖ t ‖ c) with no label — with the labels below. Released rows, stored
MACs and fingerprints depend on those bytes, so a key keeps the version it was made under: each
key segment records its version (``derivation`` in its public form; absent means 1), a run key's
MACs and fingerprint follow segment 0's, and a checkpoint or noise-node store written before
version 2 resumes bit for bit while its new segments are version 2. tests/test_noise_keys.py pins
both versions to known answers.

Audit keys (``corrflow noise sample --seed TEXT``) are not in the tree: they are a public hash of
a user's text, SHA-256("corrflow-seed:" ‖ text)[:n], unchanged so that a recorded audit seed gives
the same key; no run's key is ever made this way. The rows drawn from that key follow the sample's
``--key-version`` (default: the current one; 1 reproduces a sample recorded before version 2).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from corrflow.errors import require

#: The derivation version of every key made now (module docstring); a stored key keeps its own.
VERSION = 2
#: The versions a stored key may have been made under.
VERSIONS = (1, 2)
#: Key lengths by PRNG.
KEY_BYTES = {"philox": 16, "chacha": 32}
#: Version 2's prefix: "corrflow/2/" ‖ purpose ‖ 0x00 ‖ context.
PREFIX = b"corrflow/2/"
#: The labels of version 1 (its released bits depend on them: never changed).
BLOCK_LABEL = b"corrflow.noise-block/1:"
RING_LABEL = b"corrflow.noise-ring/1"
SHARD_LABEL = b"corrflow.noise-shard-ring/1:"
FINGERPRINT_LABEL = b"corrflow-noise-key:"
SEED_LABEL = b"corrflow-seed:"


def derive(parent: bytes, purpose: str, context: bytes, n: int) -> bytes:
    """Version 2's one derivation: HMAC-SHA256(parent, "corrflow/2/" ‖ purpose ‖ 0x00 ‖
    context), its first ``n`` bytes (module docstring).

    Args:
        parent: the key derived from.
        purpose: what the key is for (ASCII, no 0x00).
        context: what distinguishes keys of one purpose (a chunk, a round, a shard).
        n: 1 to 32 bytes.

    Returns:
        ``n`` bytes.
    """
    mac = hmac.new(parent, PREFIX + purpose.encode("ascii") + b"\0" + context, hashlib.sha256)
    return mac.digest()[:n]


def _check(version: int) -> int:
    require(version in VERSIONS, "key derivation version", f"one of {VERSIONS}", version)
    return version


def _u64(*values: int) -> bytes:
    return b"".join(int(v).to_bytes(8, "little") for v in values)


def new_secret(prng: str = "philox") -> bytes:
    """A fresh run or segment key from the operating system's entropy.

    Args:
        prng: ``"philox"`` or ``"chacha"``; fixes the key length.

    Returns:
        The key bytes (never logged; stored owner-only).
    """
    require(prng in KEY_BYTES, "prng", f"one of {tuple(KEY_BYTES)}", prng)
    return secrets.token_bytes(KEY_BYTES[prng])


def block_key(key: bytes, chunk: int, *, version: int) -> bytes:
    """The key that draws coordinate chunk ``chunk`` of every row of a segment (module docstring).

    Args:
        key: the segment's key (16 bytes for philox, 32 for chacha).
        chunk: c ≥ 0.
        version: the segment's derivation version.

    Returns:
        ``len(key)`` bytes.
    """
    if _check(version) == 1:
        mac = hmac.new(key, BLOCK_LABEL + _u64(chunk), hashlib.sha256)
        return mac.digest()[: len(key)]
    return derive(key, "block", _u64(chunk), len(key))


def tf_seed(key: bytes, round_index: int, chunk: int, *, version: int) -> bytes:
    """The seed of the TensorFlow backend's stateless Philox draw of chunk ``chunk`` of row
    ``round_index`` (module docstring).

    Args:
        key: the segment's key.
        round_index: t ≥ 0.
        chunk: c ≥ 0.
        version: the segment's derivation version.

    Returns:
        16 bytes (two little-endian int64 words, TensorFlow's seed shape).
    """
    if _check(version) == 1:
        return hashlib.sha256(key + _u64(round_index, chunk)).digest()[:16]
    return derive(key, "tf-seed", _u64(round_index, chunk), 16)


def fingerprint(key: bytes, *, version: int) -> str:
    """A one-way fingerprint of a secret key (public: identifies a segment, reveals nothing).

    Args:
        key: the secret key.
        version: the key's derivation version.

    Returns:
        32 hex digits.
    """
    if _check(version) == 1:
        return hashlib.sha256(FINGERPRINT_LABEL + key).hexdigest()[:32]
    return derive(key, "fingerprint", b"", 16).hex()


def ring_mac_key(key: bytes, *, version: int) -> bytes:
    """The key of a checkpoint's ring-row MACs, derived from the run key.

    Args:
        key: the run key.
        version: the run key's (segment 0's) derivation version.

    Returns:
        32 bytes.
    """
    if _check(version) == 1:
        return hashlib.sha256(RING_LABEL + key).digest()
    return derive(key, "ring-mac", b"", 32)


def shard_mac_key(run_key: bytes, first_chunk: int, chunks: int, *, version: int) -> bytes:
    """The ring-MAC key of the noise worker that holds chunks [first, first + count).

    Args:
        run_key: segment 0's key.
        first_chunk: the shard's first chunk.
        chunks: its number of chunks.
        version: segment 0's derivation version.

    Returns:
        32 bytes.
    """
    context = f"{first_chunk}:{chunks}".encode()
    if _check(version) == 1:
        return hmac.new(run_key, SHARD_LABEL + context, hashlib.sha256).digest()
    return derive(run_key, "shard-mac", context, 32)


def seed_key(text: str, n: int) -> bytes:
    """An audit key hashed from a user's seed text (never a run's key).

    Args:
        text: the seed.
        n: the key length.

    Returns:
        ``n`` bytes.
    """
    return hashlib.sha256(SEED_LABEL + text.encode()).digest()[:n]
