import numpy as np
import pytest

from corrflow.factorization.dense import (
    optimal_decoder_loss,
    optimize_dense,
    reversed_cholesky,
    solve_constrained,
)
from corrflow.factorization.participation import Participation
from corrflow.factorization.sensitivity import brute_force_sensitivity, sensitivity_from_gram
from corrflow.factorization.workloads import Workload

P632 = Participation.fixed_epoch(6, 3)
MOMENTUM = Workload("momentum", 0.95)

# 000 Table 6 (printed precision), constraint sets Eq. 34 / 36 / 35, and the printed min X.
TABLE6 = [
    (Workload.prefix(), "sign", 6.461, 0.000),
    (Workload.prefix(), "pattern-nonneg", 6.461, 0.000),
    (Workload.prefix(), "nonneg", 6.461, 0.000),
    (MOMENTUM, "sign", 16.114, -0.031),
    (MOMENTUM, "pattern-nonneg", 16.131, -0.015),
    (MOMENTUM, "nonneg", 16.134, 0.000),
]


@pytest.mark.parametrize("workload, constraints, error, min_x", TABLE6)
def test_table6(workload, constraints, error, min_x):
    res = solve_constrained(workload, P632, constraints)
    assert round(np.sqrt(res.loss), 3) == error
    assert round(res.X.min(), 3) == min_x
    # Feasibility: every constraint vector's quadratic form ≤ 1 (sign vectors for Eq. 34).
    C = reversed_cholesky(res.X)
    assert brute_force_sensitivity(C, P632) <= 1 + 1e-6


def test_default_solver_reaches_eq36_optimum_with_exact_vector_sensitivity():
    for workload, expected in ((Workload.prefix(), 6.4609), (MOMENTUM, 16.1313)):
        res = optimize_dense(workload, P632, tol=1e-9)
        assert np.sqrt(res.loss) == pytest.approx(expected, abs=1e-4)
        assert res.lower_bound <= res.loss * (1 + 1e-9)
        assert res.relative_gap <= 1e-6
        s = sensitivity_from_gram(res.X, P632)
        assert s.exact and s.value == pytest.approx(1.0, abs=1e-9)


def test_optimal_prefix_x_matches_digest_14b():
    res = optimize_dense(Workload.prefix(), P632, tol=1e-10)
    expected = np.array(
        [
            [0.42553, 0.19567, 0.0, 0.03439, 0.0, 0.00827],
            [0.19567, 0.39659, 0.13342, 0.0, 0.01699, 0.0],
            [0.0, 0.13342, 0.3354, 0.12095, 0.0, 0.01226],
            [0.03439, 0.0, 0.12095, 0.35029, 0.09779, 0.0],
            [0.0, 0.01699, 0.0, 0.09779, 0.23907, 0.07662],
            [0.00827, 0.0, 0.01226, 0.0, 0.07662, 0.25312],
        ]
    )
    np.testing.assert_allclose(res.X, expected, atol=2e-4)
    assert res.loss == pytest.approx(41.7430, abs=2e-4)
    C = reversed_cholesky(res.X)
    assert np.allclose(np.triu(C, 1), 0) and C[0, 0] == pytest.approx(0.54251, abs=1e-4)
    B = Workload.prefix().matrix(6) @ np.linalg.inv(C)
    np.testing.assert_allclose(
        np.sum(B**2, axis=1), [3.3977, 3.5293, 6.1318, 6.8921, 10.1904, 11.6017], atol=2e-3
    )


def test_gap_and_peer_value_n64():
    # jax_privacy dense.optimize(64, epochs=4): RMSE 4.408 (notes, measured on the peer).
    res = optimize_dense(Workload.prefix(), Participation.fixed_epoch(64, 4))
    assert res.converged and res.relative_gap <= 1e-3
    assert np.sqrt(res.loss / 64) == pytest.approx(4.408, abs=1e-3)


def test_single_epoch_denisov_values():
    # 000 digest check 13: single-epoch optimum, n = 100 → 499.78, n = 200 → 1198.96 (rel. gap ≤
    # 2e−4).
    for n, expected in ((100, 499.78), (200, 1198.96)):
        res = optimize_dense(Workload.prefix(), Participation.single(n), tol=1e-5)
        assert res.loss == pytest.approx(expected, rel=3e-4)


def test_optimal_decoder_loss_identity(rng):
    C = np.tril(rng.uniform(0.1, 1, (8, 8))) + np.eye(8)
    A = MOMENTUM.matrix(8)
    assert optimal_decoder_loss(A, C.T @ C) == pytest.approx(
        np.sum((A @ np.linalg.inv(C)) ** 2), rel=1e-10
    )


def test_stopped_optimizer_reports_a_finite_valid_gap():
    # An early stop used to report an infinite gap when the primal's dual point was
    # not positive definite (here n = 64, k = 4, momentum: at 1 iteration). The bound must be finite
    # and below the optimum.
    wl = Workload.sgd_momentum(0.9, 0.25)
    small = Participation.fixed_epoch(12, 3)
    opt = solve_constrained(
        wl, small, "pattern-nonneg"
    ).loss  # Eq. 36: the relaxation the dual bounds
    for m in (1, 3):
        r = optimize_dense(wl, small, max_iterations=m)
        assert np.isfinite(r.relative_gap) and 0 < r.lower_bound <= opt * (1 + 1e-9) <= r.loss * (
            1 + 1e-9
        )
    p64 = Participation.fixed_epoch(64, 4)
    early = optimize_dense(wl, p64, max_iterations=1)
    full = optimize_dense(wl, p64, tol=1e-4)
    assert np.isfinite(early.relative_gap) and early.relative_gap < 0.5 and not early.converged
    assert (
        early.lower_bound <= full.loss
        and full.lower_bound <= full.loss
        and full.relative_gap <= 1e-4
    )


def test_iteration_budget_is_deterministic():
    wl, part = Workload.sgd_momentum(0.9, 0.25), Participation.fixed_epoch(48, 4)
    a = optimize_dense(wl, part, max_iterations=40)
    b = optimize_dense(wl, part, max_iterations=40)
    assert (
        a.iterations == b.iterations == 40
        and np.array_equal(a.X, b.X)
        and a.lower_bound == b.lower_bound
    )
