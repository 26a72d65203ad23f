import numpy as np
import pytest

from corrflow.factorization.participation import Participation
from corrflow.factorization.sensitivity import (
    brute_force_sensitivity,
    sensitivity_from_gram,
    toeplitz_min_sep_sensitivity,
    vec_sens,
)


def _random_lower(rng, n, nonneg):
    C = np.tril(rng.uniform(0 if nonneg else -1, 1, (n, n)))
    C[np.diag_indices(n)] = rng.uniform(0.5, 1.5, n)
    return C


@pytest.mark.parametrize("seed", range(6))
def test_eq3_equals_brute_force_for_nonnegative_gram(seed):
    rng = np.random.default_rng(seed)
    for part in (Participation.fixed_epoch(12, 3), Participation.min_separation(9, 3, 3)):
        C = _random_lower(rng, part.rounds, nonneg=True)
        s = sensitivity_from_gram(C.T @ C, part)
        brute = brute_force_sensitivity(C, part)
        if part.kind == "fixed-epoch":
            assert s.exact and s.method == "eq3-nonnegative-gram"
            assert s.value == pytest.approx(brute, rel=1e-12)
        else:  # general X under min-sep: a bound, never below the truth
            assert s.value >= brute * (1 - 1e-12)


@pytest.mark.parametrize("seed", range(10))
def test_bounds_never_below_brute_force(seed):
    rng = np.random.default_rng(100 + seed)
    for part in (
        Participation.fixed_epoch(12, 4),
        Participation.fixed_epoch(10, 2),
        Participation.min_separation(10, 2, 3),
        Participation.min_separation(11, 3),
    ):
        C = _random_lower(rng, part.rounds, nonneg=False)
        s = sensitivity_from_gram(C.T @ C, part)
        assert not s.exact
        assert s.value >= brute_force_sensitivity(C, part) * (1 - 1e-12)


def test_counterexample_h2():
    # 000 App. H.2: scalar sensitivity 1 but ‖CG‖_F = √1.1 for unit-norm rows G: vectors need the
    # bound.
    C = np.array([[2, 1, 1], [1, 2, -1], [1, -1, 2]]) / np.sqrt(24)
    G = np.array([[2, 1], [2, -1], [1, 2]]) / np.sqrt(5)
    part = Participation.fixed_epoch(3, 3)
    assert brute_force_sensitivity(C, part) == pytest.approx(1.0, rel=1e-12)
    assert np.linalg.norm(C @ G) == pytest.approx(np.sqrt(1.1), rel=1e-12)
    s = sensitivity_from_gram(C.T @ C, part)
    assert not s.exact and s.value >= np.sqrt(1.1)


@pytest.mark.parametrize(
    "s, k, expected", [(6, 2, 3.405), (4, 2, 3.925), (3, 3, 6.9675), (2, 3, 8.6275), (6, 3, 4.765)]
)
def test_toeplitz_min_sep_formula(s, k, expected):
    # 001 digest §9.6 (verified there by brute force; re-checked here).
    theta = np.array([1, 0.6, 0.45, 0.3, 0.2, 0.1])
    n = 14
    assert toeplitz_min_sep_sensitivity(theta, n, s, k) ** 2 == pytest.approx(expected, rel=1e-12)
    idx = np.arange(n)
    C = np.where(
        idx[:, None] >= idx[None, :],
        np.concatenate([theta, np.zeros(n)])[np.clip(idx[:, None] - idx[None, :], 0, None)],
        0.0,
    )
    assert brute_force_sensitivity(C, Participation.min_separation(n, s, k)) ** 2 == pytest.approx(
        expected
    )


def test_vec_sens_matches_enumeration(rng):
    x = rng.uniform(-0.2, 1, (5, 13))
    for b, k in [(1, 3), (3, 2), (4, 4)]:
        got = vec_sens(x, b, k)
        for row, val in zip(x, got, strict=True):
            best = 0.0
            for mask in range(1 << 13):
                sel = [i for i in range(13) if mask >> i & 1]
                if len(sel) <= k and all(j - i >= b for i, j in zip(sel, sel[1:], strict=False)):
                    best = max(best, row[sel].sum() if sel else 0.0)
            assert val == pytest.approx(best, abs=1e-12)
