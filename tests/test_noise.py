import json
import os
import stat

import numpy as np
import pytest

from corrflow.errors import IntegrityError, InvalidArgumentError
from corrflow.factorization.build import factorize, participation_for
from corrflow.noise import CorrelatedNoise, restore_state, save_state
from corrflow.noise.engine import BLOCK
from corrflow.noise.prng import PhiloxSource, fingerprint, key_from_seed

KEY = bytes(range(16))
SHAPES = [(5000,), (3, 100, 50)]  # d = 20 000


def _rows(gen, rounds):
    return np.stack([np.concatenate([a.ravel() for a in gen.next(t)]) for t in rounds])


@pytest.fixture(scope="module")
def facs():
    part = participation_for(16, 4)
    return {
        "banded": factorize("toeplitz", part),  # banded C (column-normalised Toeplitz)
        "banded-general": factorize("banded", part, bands=3),  # general banded C
        "banded-10": factorize("toeplitz", part, bands=10),  # 9 ring rows: 4 + 4 + 1 per pass
        "banded-inverse": factorize("bifr", part, bands=4),  # banded C⁻¹
        "dense": factorize("dense", part),  # dense C
        "identity": factorize("dpsgd", part),
        # BLT: 2 buffers, one draw per round (single participation: at k = 4 one buffer is optimal)
        "blt": factorize("blt", participation_for(16, 1), buffers=2),
    }


@pytest.mark.parametrize(
    "name, mode",
    [
        ("banded", "banded"),
        ("banded-general", "banded"),
        ("banded-inverse", "banded-inverse"),
        ("dense", "dense"),
        ("identity", "identity"),
        ("blt", "blt"),
    ],
)
def test_empirical_covariance(facs, name, mode):
    fac = facs[name]
    sigma = 1.7
    gen = CorrelatedNoise(fac, SHAPES, stddev=sigma, key=KEY, chunk_size=7000)
    assert gen.mode == mode
    rows = _rows(gen, range(16)).astype(np.float64)
    assert rows.dtype == np.float64 and gen.next_round == 16
    d = rows.shape[1]
    Cinv = np.linalg.inv(fac.encoder.matrix())
    target = sigma**2 * Cinv @ Cinv.T
    emp = rows @ rows.T / d
    # Each entry is a mean of d i.i.d. products with variance Σ_ii Σ_jj + Σ_ij²; allow 5 standard
    # errors, a union bound over 136 entries at ~3e-7 each.
    se = np.sqrt((np.outer(np.diag(target), np.diag(target)) + target**2) / d)
    assert np.all(np.abs(emp - target) <= 5 * se), np.max(np.abs(emp - target) / se)


@pytest.mark.parametrize(
    "name", ["banded", "banded-general", "banded-inverse", "dense", "identity", "blt"]
)
def test_restore_continues_bit_for_bit(facs, name, tmp_path):
    fac = facs[name]
    full = CorrelatedNoise(fac, SHAPES, stddev=0.3, key=KEY)
    expected = _rows(full, range(16))
    first = CorrelatedNoise(fac, SHAPES, stddev=0.3, key=KEY)
    head = _rows(first, range(7))
    save_state(first, tmp_path / "state")
    del first
    resumed = restore_state(tmp_path / "state", fac)
    tail = _rows(resumed, range(7, 16))
    np.testing.assert_array_equal(np.vstack([head, tail]), expected)
    # Replay of an identical release regenerates the same bits; a repeat without replay is refused.
    np.testing.assert_array_equal(
        np.concatenate([a.ravel() for a in resumed.next(3, replay=True)]), expected[3]
    )
    np.testing.assert_array_equal(
        np.concatenate([a.ravel() for a in resumed.next(15, replay=True)]), expected[15]
    )
    with pytest.raises(InvalidArgumentError, match="round_index"):
        resumed.next(15)


@pytest.mark.parametrize("name", ["banded", "banded-general"])
def test_ring_writes_one_row_per_round_and_every_saved_state_resumes(facs, name, tmp_path):
    """A banded buffer saved with a ring: each save writes only the new round's row in place (the
    ring has p slots for p − 1 rows), and every state saved so far that the ring still serves — the
    published one and the one before it, which a kill mid-write falls back to — resumes bit for
    bit."""
    fac = facs[name]
    full = CorrelatedNoise(fac, SHAPES, stddev=0.3, key=KEY)
    expected = _rows(full, range(16))
    gen = CorrelatedNoise(fac, SHAPES, stddev=0.3, key=KEY)
    ring, kept = tmp_path / "noise_ring.bin", fac.bands - 1
    for t in range(12):
        gen.next(t)
        before = ring.read_bytes() if ring.exists() else b""
        save_state(gen, tmp_path / f"s{t}", ring=ring)
        after = ring.read_bytes()
        assert (
            len(after) <= fac.bands * gen.dim * 4
            and not (tmp_path / f"s{t}" / "noise_buffer.npy").exists()
        )
        changed = {
            i // (gen.dim * 4)
            for i in range(len(after))
            if i >= len(before) or after[i] != before[i]
        }
        assert changed <= {t % fac.bands}  # one row rewritten: this round's slot
    for t in (10, 11):  # the last state, and the one a torn write of round 12 would leave
        back = restore_state(tmp_path / f"s{t}", fac, ring=ring)
        np.testing.assert_array_equal(_rows(back, range(t + 1, 16)), expected[t + 1 :])
    # its oldest row has been overwritten since: refused, never used
    old = tmp_path / f"s{11 - kept}"
    with pytest.raises(IntegrityError, match="MAC"):
        restore_state(old, fac, ring=ring)
    with pytest.raises(IntegrityError, match="ring file"):
        restore_state(tmp_path / "s11", fac)
    raw = bytearray(ring.read_bytes())
    raw[(11 % fac.bands) * gen.dim * 4 + 7] ^= 1  # a torn or edited row
    ring.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match="slot .* does not match its MAC"):
        restore_state(tmp_path / "s11", fac, ring=ring)


@pytest.mark.parametrize("name", ["banded", "dense", "banded-inverse", "blt"])
def test_chunked_equals_unchunked_and_start(facs, name):
    fac = facs[name]
    a = _rows(CorrelatedNoise(fac, [(20000,)], key=KEY, chunk_size=1 << 20), range(16))
    b = _rows(CorrelatedNoise(fac, [(20000,)], key=KEY, chunk_size=20000), range(16))
    np.testing.assert_array_equal(a, b)  # same chunk grid → same bits
    # A different chunk grid draws different z but must keep the same law: compare with the exact
    # recursion.
    c = CorrelatedNoise(fac, [(20000,)], key=KEY, chunk_size=999)
    rows_c = _rows(c, range(16))
    src = PhiloxSource(KEY)
    Z = np.stack(
        [
            np.concatenate(
                [
                    src.normal(t, i, min(999, 20000 - lo))
                    for i, lo in enumerate(range(0, 20000, 999))
                ]
            )
            for t in range(16)
        ]
    ).astype(np.float64)
    exact = np.linalg.solve(fac.encoder.matrix(), Z)
    np.testing.assert_allclose(rows_c, exact, rtol=2e-4, atol=2e-4)
    late = CorrelatedNoise(fac, [(20000,)], key=KEY)
    late.skip_to(9)
    np.testing.assert_array_equal(_rows(late, range(9, 16)), a[9:])


def _numpy_reference(fac, mode, key, dim, chunk, sigma, rounds):
    """The engine's arithmetic written as whole-chunk numpy operations in the same order (float64
    accumulation, float32 state and output): the compiled, block-wise kernels must match it bit for
    bit, across block and chunk boundaries."""
    src, enc = PhiloxSource(key), fac.encoder
    grid = list(enumerate(range(0, dim, chunk)))
    out = []
    if mode == "banded":
        kept = enc.bands - 1
        ring = np.zeros((kept, dim), dtype=np.float32)
        for t in range(rounds):
            coefs = enc.row_band(t)
            acc = np.concatenate([src.normal(t, c, min(chunk, dim - lo)) for c, lo in grid])
            acc = acc.astype(np.float64)
            for r in range(1, kept + 1):
                if t - r >= 0 and coefs[r] != 0.0:
                    acc -= coefs[r] * ring[(t - r) % kept].astype(np.float64)
            y = (acc / coefs[0]).astype(np.float32)
            ring[t % kept] = y
            out.append(y * np.float32(sigma))
    else:  # blt
        state = np.zeros((enc.buffers, dim), dtype=np.float32)
        for t in range(rounds):
            y = np.concatenate([src.normal(t, c, min(chunk, dim - lo)) for c, lo in grid])
            y = y.astype(np.float64)
            for j in range(enc.buffers):
                y -= state[j].astype(np.float64) * float(enc.output_scale[j])
            for j in range(enc.buffers):
                state[j] = state[j].astype(np.float64) * float(enc.buf_decay[j]) + y
            out.append((y * (sigma / enc.scale)).astype(np.float32))
    return np.stack(out)


@pytest.mark.parametrize("name", ["banded", "banded-general", "banded-10", "blt"])
def test_blockwise_kernels_match_numpy_definition_and_float64(facs, name):
    """Blocks (``engine.BLOCK``) cut across chunks of another size, the last ones partial: the
    stream, the replay of any round and a restart at a later round equal the whole-chunk numpy
    reference bit for bit, and the float32 outputs stay within float32 rounding of the float64
    recursion C⁻¹z (relative RMS error ≤ 1e-7, about one unit roundoff)."""
    fac, sigma, rounds = facs[name], 0.7, 12
    dim, chunk = 2 * BLOCK + 777, BLOCK + 1000
    gen = CorrelatedNoise(fac, [(dim,)], stddev=sigma, key=KEY, chunk_size=chunk)
    rows = _rows(gen, range(rounds))
    ref = _numpy_reference(fac, gen.mode, KEY, dim, chunk, sigma, rounds)
    np.testing.assert_array_equal(rows, ref)
    np.testing.assert_array_equal(gen.next(4, replay=True)[0], ref[4])
    np.testing.assert_array_equal(gen.next(rounds - 1, replay=True)[0], ref[-1])
    late = CorrelatedNoise(fac, [(dim,)], stddev=sigma, key=KEY, chunk_size=chunk)
    late.skip_to(7)
    np.testing.assert_array_equal(_rows(late, range(7, rounds)), ref[7:])
    src = PhiloxSource(KEY)
    z = np.stack(
        [
            np.concatenate(
                [
                    src.normal(t, c, min(chunk, dim - lo))
                    for c, lo in enumerate(range(0, dim, chunk))
                ]
            )
            for t in range(rounds)
        ]
    ).astype(np.float64)
    exact = sigma * np.linalg.solve(fac.encoder.matrix()[:rounds, :rounds], z)
    rel = np.sqrt(np.mean((rows - exact) ** 2) / np.mean(exact**2))
    assert rel <= 1e-7, rel


@pytest.mark.parametrize("name", ["banded-inverse", "dense", "identity"])
def test_blockwise_sums_match_whole_draws(facs, name):
    """The regenerating modes' block-by-block sum equals σ·Σ_j coef_j·z_j of whole-chunk draws in
    float32, in the same order, bit for bit (draws split into blocks continue the same stream)."""
    fac, sigma = facs[name], 0.7
    dim, chunk = 2 * BLOCK + 777, BLOCK + 1000
    gen = CorrelatedNoise(fac, [(dim,)], stddev=sigma, key=KEY, chunk_size=chunk)
    rows = _rows(gen, range(12))
    src = PhiloxSource(KEY)
    for t in (0, 5, 11):
        expected = np.empty(dim, dtype=np.float32)
        for c, lo in enumerate(range(0, dim, chunk)):
            hi = min(dim, lo + chunk)
            for i, (j, coef) in enumerate(gen._terms(t)):
                z = src.normal(j, c, hi - lo) * np.float32(coef * sigma)
                expected[lo:hi] = z if i == 0 else expected[lo:hi] + z
        np.testing.assert_array_equal(rows[t], expected)


def test_banded_buffer_memory(facs):
    fac = facs["banded"]
    gen = CorrelatedNoise(fac, [(100_000,)], key=KEY)
    assert gen.buffer_bytes == (fac.bands - 1) * 100_000 * 4
    assert CorrelatedNoise(facs["banded-inverse"], [(100_000,)], key=KEY).buffer_bytes == 0


def test_secret_stays_private(facs, tmp_path, caplog):
    fac = facs["banded"]
    gen = CorrelatedNoise(fac, SHAPES, key=KEY)
    gen.next(0)
    d = save_state(gen, tmp_path / "s")
    public = (d / "noise_state.json").read_text()
    assert KEY.hex() not in public and "secret" not in json.loads(public)
    assert json.loads(public)["key_fingerprint"] == fingerprint(KEY, version=2)
    for name in ("noise_secret.key", "noise_buffer.npy"):
        assert stat.S_IMODE(os.stat(d / name).st_mode) == 0o600
    assert KEY.hex() not in repr(gen) and str(KEY) not in repr(gen)


def test_bad_state_and_input(facs, tmp_path):
    fac, other = facs["banded"], facs["banded-general"]
    gen = CorrelatedNoise(fac, SHAPES, key=KEY)
    gen.next(0)
    d = save_state(gen, tmp_path / "s")
    with pytest.raises(IntegrityError, match="factorization"):
        restore_state(d, other)
    (d / "noise_secret.key").write_text(bytes(16).hex())  # a foreign key
    with pytest.raises(IntegrityError, match="does not belong"):
        restore_state(d, fac)
    d2 = save_state(gen, tmp_path / "s2")
    raw = bytearray((d2 / "noise_buffer.npy").read_bytes())
    raw[-1] ^= 1
    (d2 / "noise_buffer.npy").write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match="hash"):
        restore_state(d2, fac)
    with pytest.raises(IntegrityError):
        restore_state(tmp_path / "nothing", fac)
    with pytest.raises(InvalidArgumentError, match="shapes"):
        gen.next(1, shapes=[(5000,), (3, 100, 51)])
    with pytest.raises(InvalidArgumentError, match="round_index"):
        gen.next(2)  # not the next round
    g2 = CorrelatedNoise(fac, [(10,)], key=KEY)
    g2.skip_to(16)
    with pytest.raises(InvalidArgumentError, match="only 16 rounds"):
        g2.next(16)
    with pytest.raises(InvalidArgumentError, match="mode"):
        CorrelatedNoise(facs["dense"], [(10,)], mode="banded")


def test_seed_parsing():
    assert key_from_seed("000102030405060708090a0b0c0d0e0f") == KEY
    assert key_from_seed(42) == key_from_seed("42") != key_from_seed(43)
    assert len(key_from_seed(7, "chacha")) == 32


def test_chacha_source_deterministic():
    pytest.importorskip("randomgen")
    from corrflow.noise.prng import ChaChaSource

    src = ChaChaSource(bytes(32))
    a, b = src.normal(3, 1, 1000), src.normal(3, 1, 1000)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, src.normal(3, 2, 1000)) and abs(a.std() - 1) < 0.1


def test_cli_sample_matches_engine(facs, tmp_path):
    import subprocess
    import sys

    fac = facs["banded"]
    path = fac.save(tmp_path / "f.npz")
    out = tmp_path / "rows.npy"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "corrflow.server.cli",
            "noise",
            "sample",
            "--factorization",
            str(path),
            "--dim",
            "3000",
            "--seed",
            "7",
            "--start",
            "5",
            "--rounds",
            "4",
            "--out",
            str(out),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["mode"] == "banded"
    gen = CorrelatedNoise(fac, [(3000,)], key=key_from_seed(7))
    expected = _rows(gen, range(9))[5:]
    np.testing.assert_array_equal(np.load(out), expected)
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "corrflow.server.cli",
            "noise",
            "sample",
            "--factorization",
            str(path),
            "--dim",
            "10",
            "--seed",
            "7",
            "--rounds",
            "17",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "--rounds" in bad.stderr

    # a key made before version 2 is regenerated with --key-version 1; another version is refused
    from typer.testing import CliRunner

    from corrflow.server.cli import app

    key = "000102030405060708090a0b0c0d0e0f"
    args = ["noise", "sample", "--factorization", str(path), "--dim", "40", "--seed", key]
    drawn = []
    for version in (1, 2):
        r = CliRunner().invoke(app, [*args, "--out", str(out), "--key-version", str(version)])
        assert r.exit_code == 0, r.output
        gen = CorrelatedNoise(fac, [(40,)], key=bytes.fromhex(key), key_version=version)
        drawn.append(np.load(out))
        np.testing.assert_array_equal(drawn[-1], _rows(gen, range(fac.rounds)))
    assert not np.array_equal(*drawn)
    r = CliRunner().invoke(app, [*args, "--out", str(out), "--key-version", "3"])
    assert r.exit_code == 2 and "--key-version" in r.output


def test_tensorflow_backend(facs, tmp_path):
    pytest.importorskip("tensorflow")
    from corrflow.noise.tf_backend import TFCorrelatedNoise

    for name in ("banded", "banded-inverse", "dense", "blt"):
        fac = facs[name]
        gen = TFCorrelatedNoise(fac, [(20000,)], key=KEY, chunk_size=6000)
        rows = _rows(gen, range(16)).astype(np.float64)
        again = _rows(TFCorrelatedNoise(fac, [(20000,)], key=KEY, chunk_size=6000), range(16))
        np.testing.assert_array_equal(rows, again)  # deterministic for its key
        Cinv = np.linalg.inv(fac.encoder.matrix())
        target = Cinv @ Cinv.T
        se = np.sqrt((np.outer(np.diag(target), np.diag(target)) + target**2) / 20000)
        assert np.all(np.abs(rows @ rows.T / 20000 - target) <= 5 * se)
        np.testing.assert_array_equal(
            np.concatenate(gen.next(4, replay=True)), rows[4].astype(np.float32)
        )


def test_tensorflow_backend_restore(facs, tmp_path):
    pytest.importorskip("tensorflow")
    from corrflow.noise.tf_backend import TFCorrelatedNoise

    for name in ("banded", "blt"):
        fac = facs[name]
        full = _rows(TFCorrelatedNoise(fac, [(5000,)], key=KEY), range(10))
        gen = TFCorrelatedNoise(fac, [(5000,)], key=KEY)
        _rows(gen, range(4))
        save_state(gen, tmp_path / name)
        back = restore_state(tmp_path / name, fac, cls=TFCorrelatedNoise)
        np.testing.assert_array_equal(_rows(back, range(4, 10)), full[4:])
        # a new key segment from round 4: the TF draws follow it too, and replay uses both keys
        fresh = restore_state(tmp_path / name, fac, cls=TFCorrelatedNoise)
        fresh.begin_segment(bytes(range(100, 116)))
        tail = _rows(fresh, range(4, 10))
        assert np.all(np.abs(tail - full[4:]).max(axis=1) > 0.1)
        save_state(fresh, tmp_path / f"{name}-2")
        again = restore_state(tmp_path / f"{name}-2", fac, cls=TFCorrelatedNoise)
        np.testing.assert_array_equal(np.concatenate(again.next(2, replay=True)), full[2])
        np.testing.assert_array_equal(np.concatenate(again.next(7, replay=True)), tail[3])


# -- key segments: every process start draws the rows after its checkpoint with a fresh key --------
KEY2 = bytes(range(100, 116))


def _z_matrix(fac, dim, table, chunk_size):
    """Z (n × d) drawn independently of the engine: row j from the Philox source of its segment's
    key, chunk by chunk."""
    z = np.empty((fac.rounds, dim))
    for j in range(fac.rounds):
        seg = table.segment_for(j)
        src = PhiloxSource(seg.key, version=seg.version)
        for c, lo in enumerate(range(0, dim, chunk_size)):
            hi = min(dim, lo + chunk_size)
            z[j, lo:hi] = src.normal(j, c, hi - lo)
    return z


@pytest.mark.parametrize(
    "name", ["banded", "banded-general", "banded-inverse", "dense", "identity", "blt"]
)
def test_new_segment_draws_later_rows_with_its_key(facs, name, tmp_path):
    """A state restored at round 6 and given a new key: rounds 0–5 as before; rounds 6–15 are
    σ·(C⁻¹Z)_t with rows Z_j, j ≥ 6, drawn with the new key (an independent float64 solve); the
    segment table survives a save and restore, and replaying any earlier round, old or new segment,
    is exact."""
    fac, sigma, dim = facs[name], 0.3, 2000
    first = CorrelatedNoise(fac, [(dim,)], stddev=sigma, key=KEY, chunk_size=700)
    head = _rows(first, range(6))
    save_state(first, tmp_path / "a")
    resumed = restore_state(tmp_path / "a", fac)
    resumed.begin_segment(KEY2)
    assert [(s.first_round, s.key) for s in resumed.segments.segments] == [(0, KEY), (6, KEY2)]
    tail = _rows(resumed, range(6, 16))
    z = _z_matrix(fac, dim, resumed.segments, 700)
    want = sigma * np.linalg.solve(fac.encoder.matrix(), z)
    got = np.vstack([head, tail])
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5 * np.abs(want).max())
    one_key = _rows(
        CorrelatedNoise(fac, [(dim,)], stddev=sigma, key=KEY, chunk_size=700), range(16)
    )
    np.testing.assert_array_equal(head, one_key[:6])
    assert np.all(np.abs(tail - one_key[6:]).max(axis=1) > 0.1 * sigma)  # every later row fresh
    save_state(resumed, tmp_path / "b")
    again = restore_state(tmp_path / "b", fac)
    assert again.segments == resumed.segments
    for t in (2, 6, 15):
        np.testing.assert_array_equal(again.next(t, replay=True)[0], got[t])


def test_segments_refuse_reuse_and_tampering(facs, tmp_path):
    fac = facs["dense"]
    gen = CorrelatedNoise(fac, [(50,)], key=KEY)
    _rows(gen, range(3))
    with pytest.raises(InvalidArgumentError, match="noise_key"):
        gen.begin_segment(KEY)  # the key of rows 0–2: rows from 3 on would not be fresh
    with pytest.raises(InvalidArgumentError, match="noise_key"):
        gen.begin_segment(b"short")
    gen.begin_segment(KEY2)
    gen.begin_segment()  # a restart before round 3 was released: its segment replaces KEY2's
    assert [s.first_round for s in gen.segments.segments] == [0, 3]
    assert gen.segments.segments[1].key not in (KEY, KEY2)
    save_state(gen, tmp_path / "s")
    seg = tmp_path / "s" / "noise_segments.key"
    assert stat.S_IMODE(os.stat(seg).st_mode) == 0o600
    assert KEY2.hex() not in (tmp_path / "s" / "noise_state.json").read_text()
    rows = json.loads(seg.read_bytes())
    rows[1][1] = KEY2.hex()  # another key for rows 3+: the fingerprints no longer match
    seg.write_text(json.dumps(rows))
    with pytest.raises(IntegrityError, match="noise_segments.key"):
        restore_state(tmp_path / "s", fac)
    seg.unlink()
    with pytest.raises(IntegrityError, match="noise_segments.key missing"):
        restore_state(tmp_path / "s", fac)
