import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from corrflow.errors import InvalidArgumentError
from corrflow.participation import (
    BallsInBinsSampler,
    BMinSepSampler,
    CyclicPoissonSampler,
    MultiAttributionSampler,
)


def _history(sampler, rounds, available=None):
    return [sampler.sample(None if available is None else available(t)) for t in range(rounds)]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), b=st.integers(1, 9), p=st.floats(0.05, 1.0), warm=st.booleans())
def test_bminsep_never_within_b_minus_1_rounds(seed, b, p, warm):
    s = BMinSepSampler(200, b, p, seed, warm=warm)
    last = {}
    for t, chosen in enumerate(_history(s, 60)):
        for i in chosen.tolist():
            assert t - last.get(i, -(10**9)) >= b
            last[i] = t


def test_bminsep_rate_matches_004():
    # 004 §1.5: 1/p0 = 1/p + (b − 1) at stationarity (warm start).
    n, b, p = 20_000, 8, 0.05
    s = BMinSepSampler(n, b, p, seed=1, warm=True)
    sizes = [len(x) for x in _history(s, 200)]
    p0 = 1 / (1 / p + (b - 1))
    assert np.mean(sizes) / n == pytest.approx(p0, rel=0.01)
    assert abs(np.mean(sizes[:10]) / n - p0) < 0.05 * p0  # warm start: no large early batches
    assert BMinSepSampler.probability_for_rate(p0, b) == pytest.approx(p)


def test_replay_and_state_restore_are_exact():
    a = BMinSepSampler(500, 5, 0.1, seed=3)
    full = _history(a, 30)
    b = BMinSepSampler(500, 5, 0.1, seed=3)
    _history(b, 12)
    st_ = b.state()
    c = BMinSepSampler(500, 5, 0.1, seed=3)
    c.load_state(st_)
    for t in range(12, 30):
        np.testing.assert_array_equal(c.sample(), full[t])


def test_unavailable_items_are_skipped_not_substituted():
    s = BMinSepSampler(100, 3, 0.5, seed=0, warm=False)
    mask = np.zeros(100, dtype=bool)
    mask[:50] = True
    for chosen in _history(s, 20, lambda t: mask):
        assert np.all(chosen < 50)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), b=st.integers(1, 6))
def test_multi_attribution_blocks_every_shared_user(seed, b):
    rng = np.random.default_rng(seed)
    users = 40
    item_users = [
        sorted(set(rng.integers(0, users, size=rng.integers(1, 4)).tolist())) for _ in range(150)
    ]
    s = MultiAttributionSampler(item_users, users, b, 0.1, seed)
    user_last: dict[int, int] = {}
    for t in range(40):
        chosen = s.sample()
        for i in chosen.tolist():
            for u in item_users[i]:
                assert t - user_last.get(u, -(10**9)) >= b
        # a user may contribute several items in one round, never in two within b
        for i in chosen.tolist():
            for u in item_users[i]:
                user_last[u] = t


def test_balls_in_bins_and_cyclic_poisson():
    bb = BallsInBinsSampler(1000, 10, seed=0)
    rounds = _history(bb, 30)
    for t in range(10, 30):
        np.testing.assert_array_equal(rounds[t], rounds[t - 10])  # the same bin every epoch
    assert sum(len(r) for r in rounds[:10]) == 1000
    cp = CyclicPoissonSampler(1000, 4, 0.5, seed=0)
    parts = [set(x.tolist()) for x in _history(cp, 8)]
    assert parts[0].isdisjoint(parts[1]) and all(cp.part[i] == 0 for i in parts[4])


@pytest.mark.parametrize(
    "make",
    [
        lambda: BMinSepSampler(10, 0, 0.5, 0),
        lambda: BMinSepSampler(10, 2, 0.0, 0),
        lambda: MultiAttributionSampler([[0], []], 2, 2, 0.5, 0),
        lambda: MultiAttributionSampler([[0], [5]], 2, 2, 0.5, 0),
        lambda: BMinSepSampler.probability_for_rate(0.5, 4),
    ],
)
def test_bad_sampler_input(make):
    with pytest.raises(InvalidArgumentError):
        make()
