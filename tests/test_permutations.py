"""The cohort engine's compiled data orders against NumPy's generators, draw for draw."""

import logging

import numpy as np
import pytest

from corrflow.clients import permutations as perms


def numpy_draws(keys, sizes, epochs):
    out = []
    for key, n in zip(keys, sizes, strict=True):
        rng = np.random.default_rng(list(key))
        out += [rng.permutation(n) for _ in range(epochs)]
    return np.concatenate(out)


def test_each_generator_draws_numpys_permutations():
    """Keys as the engine builds them (seed, user, round, 400), keys of other lengths, words past
    2^32 (two entropy words), and n = 0, 1 and past 2^16: every permutation equals NumPy's."""
    rng = np.random.default_rng(11)
    keys = [(3, int(u), int(r), 400) for u, r in rng.integers(0, 2**31, size=(40, 2))]
    keys += [(7,), (0, 0), (2**32, 1, 2**40 + 5, 400), (1, 2, 3, 4, 5, 6, 7), (2**63 + 1,)]
    sizes = [int(n) for n in rng.integers(0, 700, size=len(keys))]
    sizes[:3] = [0, 1, 70_000]
    drawn = perms.permutations(keys, sizes, 3)
    np.testing.assert_array_equal(drawn, numpy_draws(keys, sizes, 3))


def test_cohort_keys_of_one_word_each_take_the_table_path():
    keys = [(0, u, 9, 400) for u in range(30)]
    entropy, starts = perms._entropy(keys)
    assert starts.tolist() == list(range(0, 121, 4))
    assert entropy.reshape(30, 4).tolist() == [list(k) for k in keys]
    drawn = perms.permutations(keys, [50] * 30, 2)
    np.testing.assert_array_equal(drawn, numpy_draws(keys, [50] * 30, 2))


def test_a_negative_key_word_is_refused():
    with pytest.raises(ValueError, match="non-negative"):
        perms.permutations([(1, -2)], [5], 1)


def test_a_numpy_whose_draws_differ_is_served_by_numpy_itself(monkeypatch, caplog):
    """Should a NumPy release change its seeding or shuffle, the compiled copy is not used: the
    data order comes from NumPy, and the log says why the engine is slower."""
    real = perms._compiled
    monkeypatch.setattr(perms, "_compiled", lambda k, s, e: real(k, s, e)[::-1].copy())
    perms.compiled_matches_numpy.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="corrflow"):
            drawn = perms.permutations([(5, 6, 7, 400)], [40], 2)
        np.testing.assert_array_equal(drawn, numpy_draws([(5, 6, 7, 400)], [40], 2))
        assert "draws them with NumPy" in caplog.text
    finally:
        perms.compiled_matches_numpy.cache_clear()
