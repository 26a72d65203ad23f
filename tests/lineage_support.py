"""Shared by the kill tests (test_strategy, test_blt, test_ray_faults): what a run released, round
by round, and the noise key segments it recorded. A restart draws the rounds after its checkpoint
with a fresh key, so an interrupted run equals an uninterrupted one only before the restart; with
the recorded keys injected again, the whole run replays exactly."""

import json
import os
from pathlib import Path

import numpy as np
from checkpoint_support import checkpoint

from corrflow.noise.engine import SEGMENTS_FILE
from corrflow.noise.segments import KeySegment
from corrflow.run.journal import JOURNAL, ReleaseJournal

KEY = bytes(range(16))


def noise_key_from_env() -> bytes | None:
    """NOISE_KEY: hex of the key this start injects; "os" for a fresh key from the OS (what a
    server does); unset: the fixed test key."""
    value = os.environ.get("NOISE_KEY")
    if value is None:
        return KEY
    return None if value == "os" else bytes.fromhex(value)


def save_released(out, strategy, metrics) -> None:
    """on_round_end: keep the model this round released in OUT/released/ROUND.npy."""
    d = Path(out) / "released"
    d.mkdir(exist_ok=True)
    np.save(d / f"{metrics['round']}.npy", np.concatenate([p.ravel() for p in strategy.params]))


def released(run_dir) -> list[np.ndarray]:
    d = Path(run_dir) / "released"
    return [np.load(d / f"{t}.npy") for t in range(len(list(d.glob("*.npy"))))]


def segments(run_dir) -> list[tuple[int, bytes]]:
    """The (first round, key) table in the run's published checkpoint."""
    table = checkpoint(run_dir).secrets[SEGMENTS_FILE]
    rows = json.loads(table)
    assert all(len(row) == 3 and row[2] == 2 for row in rows)  # new keys: version 2, recorded
    return [(int(row[0]), bytes.fromhex(row[1])) for row in rows]


def assert_fresh_after_restart(full, crash, restart: int) -> list[tuple[int, bytes]]:
    """Rounds before ``restart`` released as the uninterrupted run did; every later round different
    (fresh noise); the journal names each round's segment as the checkpoint's table does. Returns
    the table."""
    a, b = released(full), released(crash)
    assert len(a) == len(b)
    for t in range(restart):
        np.testing.assert_array_equal(b[t], a[t])
    for t in range(restart, len(a)):
        assert not np.array_equal(b[t], a[t]), f"round {t} repeats the uninterrupted run's noise"
    table = segments(crash)
    assert [r for r, _ in table] == [0, restart] and table[0][1] == KEY and table[1][1] != KEY
    for e in ReleaseJournal(Path(crash) / JOURNAL).read():
        first, key = table[0] if e.round < restart else table[1]
        assert e.noise_segment == KeySegment(first, key).public()  # a new run: version 2
    return table


def assert_same_releases(run_a, run_b) -> None:
    a, b = released(run_a), released(run_b)
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
