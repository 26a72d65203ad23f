import numpy as np
import pytest

from corrflow.errors import InvalidArgumentError
from corrflow.factorization.participation import Participation
from corrflow.factorization.workloads import Workload


def test_momentum_matrix_matches_formula():
    # 000 digest §1.2: A[i, j] = Σ_{t=j..i} η_t β^(t−j); constant η gives (1 − β^(i−j+1))/(1 − β).
    n, beta = 7, 0.9
    A = Workload("momentum", beta).matrix(n)
    i, j = np.tril_indices(n)
    np.testing.assert_allclose(A[i, j], (1 - beta ** (i - j + 1)) / (1 - beta), rtol=1e-13)
    assert np.all(np.triu(A, 1) == 0)


def test_cooldown_schedule_matches_reference_code():
    w = Workload.sgd_momentum(0.95, 0.25)
    eta = w.learning_rates(2052)
    assert w.cooldown_rounds(2052) == 513  # n // 4 in the reference code (000 digest §1.2)
    assert np.all(eta[: 2052 - 513] == 1.0)
    assert eta[-513] == 1.0 and eta[-1] == pytest.approx(0.05)
    n = 12
    A = w.matrix(n)
    eta = w.learning_rates(n)
    M = np.tril(0.95 ** np.subtract.outer(np.arange(n), np.arange(n)))
    np.testing.assert_allclose(A, np.tril(np.ones((n, n))) @ np.diag(eta) @ M, rtol=1e-12)


def test_apply_equals_matrix(rng):
    w = Workload.sgd_momentum(0.8, 0.5)
    x = rng.standard_normal((20, 3))
    np.testing.assert_allclose(w.apply(x), w.matrix(20) @ x, rtol=1e-12)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(kind="prefix", momentum=0.5), "momentum"),
        (dict(kind="momentum", momentum=1.0), "momentum"),
        (dict(kind="momentum", momentum=float("nan")), "momentum"),
        (dict(kind="nope"), "workload"),
        (dict(kind="prefix", cooldown_fraction=1.5), "cooldown_fraction"),
    ],
)
def test_bad_workloads(kwargs, field):
    with pytest.raises(InvalidArgumentError) as e:
        Workload(**kwargs)
    assert e.value.field == field


def test_fixed_epoch_patterns():
    p = Participation.fixed_epoch(6, 3)
    # 000 §2: {{1,3,5},{2,4,6}} 1-based
    np.testing.assert_array_equal(p.patterns(), [[0, 2, 4], [1, 3, 5]])
    H = p.contribution_matrix()
    assert H.shape == (6, 2) and H.sum() == 6
    m = p.same_pattern_mask()
    assert m[0, 2] and m[1, 5] and not m[0, 1] and not m[0, 0]


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: Participation.fixed_epoch(10, 3), "epochs"),
        (lambda: Participation.min_separation(10, 0), "min-sep"),
        (lambda: Participation.min_separation(10, 4, epochs=4), "epochs"),  # at most ⌈10/4⌉ = 3 fit
        (lambda: Participation.min_separation(10, 11), "min-sep"),
        (lambda: Participation.fixed_epoch(0, 1), "rounds"),
    ],
)
def test_impossible_participation(make, field):
    with pytest.raises(InvalidArgumentError) as e:
        make()
    assert e.value.field == field


def test_min_sep_defaults():
    p = Participation.min_separation(2048, 256)
    assert p.epochs == 8 and p.max_participations == 8
