"""The noise key derivations of `corrflow.noise.keys`, versions 1 and 2, pinned to known answers:
every released row, stored MAC and fingerprint was made with these bytes, so a change to a label or
a formula must fail here (and take a new version) instead of silently changing a resumed run's noise
or making its checkpoints unverifiable. Each answer is also recomputed from the module docstring's
formula with the `cryptography` package's HMAC and SHA-256, not the module's own code. A stored
key keeps its version: a version-1 state resumes bit for bit, its new segments are version 2."""

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
    assert keys.block_key(KEY, 3, version=1).hex() == "da25f0b2122ef7a1de9c895a7e6c0469"
    assert keys.block_key(KEY32, 0, version=1).hex() == (
        "6709d7b0bff43c59251574d8ffee41e15a3cf902c2fea897eca3c47ff76fd18d"
    )
    assert keys.fingerprint(KEY, version=1) == "742ec314d83908502b7e96a222aa2ff2"
    assert keys.ring_mac_key(KEY, version=1).hex() == (
        "dcf28358fb9a031834c209b0a4c8c5c0cc8230d59aaebb0efaac5c04316da8ac"
    )
    assert keys.shard_mac_key(KEY, 4, 2, version=1).hex() == (
        "c7c55c6c44bec9025d49e88a8d4955eb01b7fe63a752258cd895789f94b8006a"
    )
    assert keys.seed_key("audit", 16).hex() == "79b94a194e98bb8baed9cf5c0de7d820"
    assert keys.tf_seed(KEY, 5, 7, version=1).hex() == "fbdb34065518a9ccdc6b30854982f8fc"


def test_each_version_1_derivation_is_the_docstrings_formula():
    assert keys.block_key(KEY, 3, version=1) == _hmac(KEY, keys.BLOCK_LABEL + _u64(3))[:16]
    assert keys.block_key(KEY32, 9, version=1) == _hmac(KEY32, keys.BLOCK_LABEL + _u64(9))[:32]
    assert keys.fingerprint(KEY, version=1) == _sha256(keys.FINGERPRINT_LABEL + KEY).hex()[:32]
    assert keys.ring_mac_key(KEY, version=1) == _sha256(keys.RING_LABEL + KEY)
    assert keys.shard_mac_key(KEY, 4, 2, version=1) == _hmac(KEY, keys.SHARD_LABEL + b"4:2")
    assert keys.seed_key("audit", 16) == _sha256(keys.SEED_LABEL + b"audit")[:16]
    assert keys.tf_seed(KEY, 5, 7, version=1) == _sha256(KEY + _u64(5) + _u64(7))[:16]


def test_the_version_1_keys_of_one_segment_are_distinct_and_none_is_the_key():
    derived = [
        keys.block_key(KEY, 0, version=1),
        keys.block_key(KEY, 1, version=1),
        keys.ring_mac_key(KEY, version=1)[:16],
        keys.shard_mac_key(KEY, 0, 1, version=1)[:16],
        keys.tf_seed(KEY, 0, 0, version=1),
        bytes.fromhex(keys.fingerprint(KEY, version=1)),
    ]
    assert len(set(derived)) == len(derived) and KEY not in derived


def _derive(parent: bytes, purpose: bytes, context: bytes, n: int) -> bytes:
    return _hmac(parent, b"corrflow/2/" + purpose + b"\x00" + context)[:n]


def test_version_2_is_one_labelled_hmac_and_keeps_its_bits():
    assert keys.VERSION == 2 and keys.VERSIONS == (1, 2)
    assert keys.block_key(KEY, 3, version=2).hex() == "b6781a2497211d5166aa10cc0475ff6d"
    assert keys.block_key(KEY32, 0, version=2).hex() == (
        "e63d6b91c3e0523b6916e6ae1b50f25d2c9805a58b3e52bf2bbf3178a5f2e193"
    )
    assert keys.fingerprint(KEY, version=2) == "8bf90904eab909836711a48db5b91578"
    assert keys.ring_mac_key(KEY, version=2).hex() == (
        "592cca6954eb4c88148bc921dbf98dfc603fab4ef9828eed6085362a5f15d6f8"
    )
    assert keys.shard_mac_key(KEY, 4, 2, version=2).hex() == (
        "651b85afdb9dda54196ae94aceb3eee37ca70b7edf9119e1f6bb0372a4c9cad5"
    )
    assert keys.tf_seed(KEY, 5, 7, version=2).hex() == "fe376bd2b4d728bc7451c977b967deea"
    # the docstring's formula, recomputed with the cryptography package
    assert keys.block_key(KEY, 3, version=2) == _derive(KEY, b"block", _u64(3), 16)
    assert keys.block_key(KEY32, 9, version=2) == _derive(KEY32, b"block", _u64(9), 32)
    assert keys.fingerprint(KEY, version=2) == _derive(KEY, b"fingerprint", b"", 16).hex()
    assert keys.ring_mac_key(KEY, version=2) == _derive(KEY, b"ring-mac", b"", 32)
    assert keys.shard_mac_key(KEY, 4, 2, version=2) == _derive(KEY, b"shard-mac", b"4:2", 32)
    assert keys.tf_seed(KEY, 5, 7, version=2) == _derive(KEY, b"tf-seed", _u64(5) + _u64(7), 16)
    derived = [
        keys.block_key(KEY, 0, version=2),
        keys.block_key(KEY, 1, version=2),
        keys.ring_mac_key(KEY, version=2)[:16],
        keys.shard_mac_key(KEY, 0, 1, version=2)[:16],
        keys.tf_seed(KEY, 0, 0, version=2),
        bytes.fromhex(keys.fingerprint(KEY, version=2)),
        keys.block_key(KEY, 0, version=1),
    ]
    assert len(set(derived)) == len(derived) and KEY not in derived


def test_an_unknown_version_is_refused_by_name():
    import pytest

    from corrflow.errors import CorrflowError
    from corrflow.noise.segments import KeySegment

    with pytest.raises(CorrflowError, match="key derivation version"):
        keys.block_key(KEY, 0, version=3)
    with pytest.raises(CorrflowError, match="key derivation version"):
        KeySegment(0, KEY, 0)
    with pytest.raises(ValueError, match="key derivation version"):
        KeySegment.from_row([0, KEY.hex(), 7])


def test_a_version_1_state_resumes_bit_for_bit_and_its_new_segments_are_version_2(tmp_path):
    """A state saved before version 2 (segment 0 of version 1: its public form has no
    ``derivation``, its private row no version) restores with the same rows, fingerprint and ring
    MACs; the segment a restart opens is version 2, and both are replayed from the saved table."""
    import json

    import numpy as np

    from corrflow.factorization import factorize, participation_for
    from corrflow.noise.engine import CorrelatedNoise, restore_state, save_state
    from corrflow.noise.prng import PhiloxSource

    fac = factorize("toeplitz", participation_for(8, 1, 1, kind="min-sep"), bands=3)
    old = CorrelatedNoise(fac, [(40,)], key=KEY, key_version=1, chunk_size=16)
    v2 = CorrelatedNoise(fac, [(40,)], key=KEY, chunk_size=16)
    rows = [old.next(t)[0] for t in range(3)]
    assert not np.array_equal(rows[0], v2.next(0)[0])  # the version changes the bits
    # row 0 of C⁻¹Z is Z_0 / C_00, Z_0 drawn with version 1's block keys
    z0 = np.concatenate(
        [PhiloxSource(KEY, version=1).normal(0, c, n) for c, n in ((0, 16), (1, 16), (2, 8))]
    )
    np.testing.assert_allclose(rows[0] * fac.encoder.matrix()[0, 0], z0, rtol=1e-5)
    d = save_state(old, tmp_path / "s")
    public = json.loads((d / "noise_state.json").read_text())
    assert public["key_segments"] == [
        {"first_round": 0, "key_fingerprint": keys.fingerprint(KEY, version=1)}
    ]
    assert public["key_fingerprint"] == keys.fingerprint(KEY, version=1)
    assert json.loads((d / "noise_segments.key").read_text()) == [[0, KEY.hex()]]

    back = restore_state(d, fac)
    assert back.segments.run_version == 1 and back.mac_key == keys.ring_mac_key(KEY, version=1)
    fresh = bytes(range(50, 66))
    back.begin_segment(fresh)
    assert [s.version for s in back.segments.segments] == [1, 2]
    assert back.segments.public()[1]["derivation"] == 2
    # the continued run: rows 3.. from the fresh version-2 key, replayed identically after a save
    cont = CorrelatedNoise(fac, [(40,)], key=KEY, key_version=1, chunk_size=16)
    for t in range(3):
        cont.next(t)
    cont.begin_segment(fresh)
    np.testing.assert_array_equal(back.next(3)[0], cont.next(3)[0])
    d2 = save_state(back, tmp_path / "s2")
    assert json.loads((d2 / "noise_segments.key").read_text()) == [
        [0, KEY.hex()],
        [3, fresh.hex(), 2],
    ]
    again = restore_state(d2, fac)
    np.testing.assert_array_equal(again.next(4)[0], cont.next(4)[0])


def test_rows_drawn_by_numpy_integer_rounds_across_segments_are_the_int_rounds():
    """The engine remembers the segment of the last row it drew: after `begin_segment` a row comes
    from the new key (identity mode: row t is z_t / C_tt, the row of a generator keyed with the new
    key alone), a NumPy integer round draws the rows a Python int does, and a replay of an earlier
    segment's row looks it up again (a lookup by ``in range(…)`` once made a NumPy integer round
    scan toward sys.maxsize: a hang, in C, that no alarm interrupts)."""
    import numpy as np

    from corrflow.factorization import factorize, participation_for
    from corrflow.noise.engine import CorrelatedNoise

    other = bytes(range(16, 32))
    participation = participation_for(16, 4)
    for kind, kw in (("dpsgd", {}), ("bifr", {"bands": 4}), ("toeplitz", {"bands": 3})):
        fac = factorize(kind, participation, **kw)
        drawn = {}
        for as_round in (int, np.int64):
            gen = CorrelatedNoise(fac, [(50,)], key=KEY, chunk_size=16)
            rows = [gen.next(as_round(t))[0].copy() for t in range(3)]
            gen.begin_segment(other)
            rows += [gen.next(as_round(t))[0].copy() for t in range(3, 6)]
            rows.append(gen.next(as_round(1), replay=True)[0].copy())
            drawn[as_round] = rows
        for a, b in zip(drawn[int], drawn[np.int64], strict=True):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(drawn[int][6], drawn[int][1])  # replayed, same key
        if kind == "dpsgd":
            alone = CorrelatedNoise(fac, [(50,)], key=other, chunk_size=16)
            alone.skip_to(3)
            np.testing.assert_array_equal(drawn[int][3], alone.next(3)[0])
            first = CorrelatedNoise(fac, [(50,)], key=KEY, chunk_size=16)
            first.skip_to(3)
            assert not np.array_equal(drawn[int][3], first.next(3)[0])  # not the old key's row
