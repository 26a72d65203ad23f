"""Shards of the noise (corrflow.noise.shards): N shards drawn from block keys only equal the single
process's noise bit for bit, in every mode, through save/restore and a new key segment; a shard's
state that is not the one the server recorded is refused naming the worker."""

import numpy as np
import pytest

from corrflow.errors import IntegrityError, InvalidArgumentError
from corrflow.factorization.build import factorize, participation_for
from corrflow.noise import CorrelatedNoise, restore_state, save_state
from corrflow.noise.prng import PhiloxSource, block_key
from corrflow.noise.segments import SegmentTable
from corrflow.noise.shards import (
    ShardNoise,
    plan_shards,
    restore_shard,
    save_shard,
    segment_blocks,
    shard_secrets,
)

KEY = bytes(range(16))
CHUNK = 1000
DIM = 5500  # 6 chunks, the last one partial


@pytest.fixture(scope="module")
def facs():
    part = participation_for(12, 3)
    return {
        "banded": factorize("toeplitz", part, bands=4),
        "banded-inverse": factorize("bifr", part, bands=3),
        "dense": factorize("dense", part),
        "blt": factorize("blt", participation_for(12, 1), buffers=2),
    }


def _single(fac, key=KEY):
    return CorrelatedNoise(fac, [(DIM,)], key=key, chunk_size=CHUNK)


def _sharded(fac, workers, table, mode):
    shards = plan_shards(DIM, workers, CHUNK)
    return [
        ShardNoise(fac, s, shard_secrets(table, s, "philox"), mode=mode, chunk_size=CHUNK)
        for s in shards
    ]


def test_plan_shards_covers_the_model_in_whole_chunks():
    shards = plan_shards(DIM, 4, CHUNK)
    assert [(s.first_chunk, s.chunks, s.lo, s.hi) for s in shards] == [
        (0, 2, 0, 2000),
        (2, 2, 2000, 4000),
        (4, 1, 4000, 5000),
        (5, 1, 5000, 5500),
    ]
    with pytest.raises(
        InvalidArgumentError,
        match="noise-workers: expected 0 .* or an integer from 1 to 6.*6 noise block",
    ):
        plan_shards(DIM, 7, CHUNK)


def test_block_keys_are_not_the_key_and_a_worker_draws_only_its_chunks(facs):
    table = SegmentTable.single(KEY)
    shard = plan_shards(DIM, 3, CHUNK)[1]
    secrets = shard_secrets(table, shard, "philox")
    held = {k for _, blocks in secrets.segments for k in blocks.values()} | {secrets.mac_key}
    assert KEY not in held and len(held) == shard.chunks + 1
    assert secrets.segments[0][1][2] == block_key(KEY, 2, version=2) != block_key(KEY, 3, version=2)
    worker = PhiloxSource(blocks=secrets.segments[0][1])
    np.testing.assert_array_equal(
        worker.generator(5, 2).standard_normal(10, dtype=np.float32),
        PhiloxSource(KEY).normal(5, 2, 10),
    )
    with pytest.raises(IntegrityError, match="chunk 0 is not one of this worker's blocks"):
        worker.generator(5, 0)
    assert "KEY" not in repr(secrets) and KEY.hex() not in repr(secrets)


@pytest.mark.parametrize("name", ["banded", "banded-inverse", "dense", "blt"])
@pytest.mark.parametrize("workers", [1, 2, 4])
def test_shards_equal_the_single_process_bit_for_bit(facs, name, workers):
    fac = facs[name]
    single = _single(fac)
    parts = _sharded(fac, workers, single.segments, single.mode)
    for t in range(fac.rounds):
        whole = single.next(t)[0]
        np.testing.assert_array_equal(np.concatenate([p.next(t)[0] for p in parts]), whole)
    # replaying an earlier round (the stateful modes recompute it from the block keys)
    np.testing.assert_array_equal(
        np.concatenate([p.next(3, replay=True)[0] for p in parts]), single.next(3, replay=True)[0]
    )


@pytest.mark.parametrize("name", ["banded", "blt"])
def test_shard_state_saves_restores_and_takes_a_new_segment(facs, name, tmp_path):
    fac = facs[name]
    single = _single(fac)
    shards = plan_shards(DIM, 2, CHUNK)
    parts = _sharded(fac, 2, single.segments, single.mode)
    for t in range(5):
        single.next(t)
        for p in parts:
            p.next(t)
    digests = [save_shard(p, tmp_path / "w") for p in parts]
    # the server restarts: a new key segment from round 5 on, sent as block keys
    new_key = bytes(range(100, 116))
    single.begin_segment(new_key)
    table = single.segments
    restored = [
        restore_shard(
            tmp_path / "w", fac, s, shard_secrets(table, s, "philox"), 5, digests[s.index]
        )
        for s in shards
    ]
    for t in range(5, fac.rounds):
        np.testing.assert_array_equal(
            np.concatenate([p.next(t)[0] for p in restored]), single.next(t)[0]
        )
    # a worker given the new segment after its restore draws the same as one restored with it
    late = restore_shard(
        tmp_path / "w",
        fac,
        shards[0],
        shard_secrets(SegmentTable.single(KEY), shards[0], "philox"),
        5,
        digests[0],
    )
    late.add_segment(segment_blocks(table.segments[-1], shards[0]), table.segments[-1].info())
    # a worker knows its segments' public forms only (no key): the server's, segment for segment
    assert [s.public() for s in late.segments.segments] == table.public()
    assert table.public()[1]["derivation"] == 2
    again = restore_shard(
        tmp_path / "w", fac, shards[0], shard_secrets(table, shards[0], "philox"), 5, digests[0]
    )
    np.testing.assert_array_equal(late.next(5)[0], again.next(5)[0])


def test_shard_state_that_is_not_the_servers_is_refused_naming_the_worker(facs, tmp_path):
    fac = facs["banded"]
    table = SegmentTable.single(KEY)
    parts = _sharded(fac, 2, table, "banded")
    for t in range(3):
        for p in parts:
            p.next(t)
    d3 = [save_shard(p, tmp_path) for p in parts]
    for p in parts:
        p.next(3)
    d4 = [save_shard(p, tmp_path) for p in parts]
    s1 = parts[1].shard
    secrets = shard_secrets(table, s1, "philox")
    # the server's checkpoint is at round 4 (the previous round's state is still kept)
    assert restore_shard(tmp_path, fac, s1, secrets, 3, d3[1]).next_round == 3
    with pytest.raises(
        IntegrityError, match=r"noise worker 1 \(coordinates 3000–5499\).*disagrees"
    ):
        restore_shard(tmp_path, fac, s1, secrets, 4, d3[1])
    with pytest.raises(IntegrityError, match="noise worker 1.*no saved state for round 7"):
        restore_shard(tmp_path, fac, s1, secrets, 6, d4[1])
    # a ring row edited on the worker's disk fails its MAC
    ring = tmp_path / s1.name / "noise_ring.bin"
    data = bytearray(ring.read_bytes())
    data[s1.size * 4 + 8] ^= 1  # slot 1: round 1, which round 4 still needs
    ring.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="noise worker 1.*does not match its MAC"):
        restore_shard(tmp_path, fac, s1, secrets, 4, d4[1])


def test_chacha_shards_equal_the_single_process(facs):
    pytest.importorskip("randomgen")
    fac, key = facs["banded"], bytes(range(32))
    single = CorrelatedNoise(fac, [(DIM,)], key=key, prng="chacha", chunk_size=CHUNK)
    table = single.segments
    parts = [
        ShardNoise(fac, s, shard_secrets(table, s, "chacha"), mode="banded", chunk_size=CHUNK)
        for s in plan_shards(DIM, 3, CHUNK)
    ]
    for t in range(4):
        np.testing.assert_array_equal(
            np.concatenate([p.next(t)[0] for p in parts]), single.next(t)[0]
        )


def test_a_state_from_before_block_keys_is_refused_with_the_reason(facs, tmp_path):
    gen = _single(facs["banded"])
    gen.next(0)
    save_state(gen, tmp_path)
    path = tmp_path / "noise_state.json"
    path.write_text(path.read_text().replace("noise-state/2", "noise-state/1"))
    with pytest.raises(IntegrityError, match="older corrflow.*without block keys.*--fresh"):
        restore_state(tmp_path, facs["banded"])


def test_the_summary_names_each_noise_worker_and_what_a_compromised_one_learns(facs):
    from corrflow.run.noise import LocalNoiseStream
    from corrflow.run.noise_trust import noise_worker_lines, noise_workers_trust

    assert noise_workers_trust(LocalNoiseStream(_single(facs["banded"]))) == {}
    assert noise_worker_lines({"trust": {}}) == [] and noise_worker_lines({}) == []
    shards = plan_shards(DIM, 2, CHUNK)  # 6 chunks: 3 each
    report = {
        "trust": {
            "noise_workers": {
                "count": 2,
                "checkpoint_round": 5,
                "shards": [
                    {"worker": s.index, "coordinates": [s.lo, s.hi], "chunks": s.chunks}
                    | {"state_sha256": h}
                    for s, h in zip(shards, ["ab" * 32, None], strict=True)
                ],
            }
        }
    }
    lines = noise_worker_lines(report)
    assert lines[0].startswith("trust       2 noise workers (Ray)") and "round 5" in lines[0]
    assert lines[1].endswith("worker 0: coordinates 0–2999 (3 chunks), state " + "ab" * 8)
    assert lines[2].endswith("worker 1: coordinates 3000–5499 (3 chunks), state none saved yet")
    assert "nothing of the run key or the other shards" in lines[3]
