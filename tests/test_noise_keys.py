"""The noise key derivations of `corrflow.noise.keys`, version 1, pinned to known answers: every
released row, stored MAC and fingerprint was made with these bytes, so a change to a label or a
formula must fail here (and take a new version) instead of silently changing a resumed run's noise
or making its checkpoints unverifiable. Each answer is also recomputed from the module docstring's
formula with the `cryptography` package's HMAC and SHA-256, not the module's own code."""

from __future__ import annotations

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.hmac import HMAC

from corrflow.noise import keys

KEY = bytes(range(16))  # a philox key
KEY32 = bytes(range(32))  # a chacha key


def _hmac(key: bytes, data: bytes) -> bytes:
    h = HMAC(key, hashes.SHA256())
    h.update(data)
    return h.finalize()


def _sha256(data: bytes) -> bytes:
    h = hashes.Hash(hashes.SHA256())
    h.update(data)
    return h.finalize()


def _u64(n: int) -> bytes:
    return n.to_bytes(8, "little")


def test_version_1_derivations_keep_their_bits():
    assert keys.VERSION == 1
    assert keys.block_key(KEY, 3).hex() == "da25f0b2122ef7a1de9c895a7e6c0469"
    assert keys.block_key(KEY32, 0).hex() == (
        "6709d7b0bff43c59251574d8ffee41e15a3cf902c2fea897eca3c47ff76fd18d"
    )
    assert keys.fingerprint(KEY) == "742ec314d83908502b7e96a222aa2ff2"
    assert keys.ring_mac_key(KEY).hex() == (
        "dcf28358fb9a031834c209b0a4c8c5c0cc8230d59aaebb0efaac5c04316da8ac"
    )
    assert keys.shard_mac_key(KEY, 4, 2).hex() == (
        "c7c55c6c44bec9025d49e88a8d4955eb01b7fe63a752258cd895789f94b8006a"
    )
    assert keys.seed_key("audit", 16).hex() == "79b94a194e98bb8baed9cf5c0de7d820"
    assert keys.tf_seed(KEY, 5, 7).hex() == "fbdb34065518a9ccdc6b30854982f8fc"


def test_each_derivation_is_the_docstrings_formula():
    assert keys.block_key(KEY, 3) == _hmac(KEY, keys.BLOCK_LABEL + _u64(3))[:16]
    assert keys.block_key(KEY32, 9) == _hmac(KEY32, keys.BLOCK_LABEL + _u64(9))[:32]
    assert keys.fingerprint(KEY) == _sha256(keys.FINGERPRINT_LABEL + KEY).hex()[:32]
    assert keys.ring_mac_key(KEY) == _sha256(keys.RING_LABEL + KEY)
    assert keys.shard_mac_key(KEY, 4, 2) == _hmac(KEY, keys.SHARD_LABEL + b"4:2")
    assert keys.seed_key("audit", 16) == _sha256(keys.SEED_LABEL + b"audit")[:16]
    assert keys.tf_seed(KEY, 5, 7) == _sha256(KEY + _u64(5) + _u64(7))[:16]


def test_the_keys_of_one_segment_are_distinct_and_none_is_the_key():
    derived = [
        keys.block_key(KEY, 0),
        keys.block_key(KEY, 1),
        keys.ring_mac_key(KEY)[:16],
        keys.shard_mac_key(KEY, 0, 1)[:16],
        keys.tf_seed(KEY, 0, 0),
        bytes.fromhex(keys.fingerprint(KEY)),
    ]
    assert len(set(derived)) == len(derived) and KEY not in derived
