import numpy as np
import pytest

from corrflow.factorization.banded import banded_loss_and_grad, normalize_columns, optimize_banded
from corrflow.factorization.encoders import BandedEncoder, ToeplitzEncoder
from corrflow.factorization.toeplitz import (
    ToeplitzLoss,
    best_one_over_i_plus_c,
    optimize_toeplitz,
    sqrt_coefs,
)
from corrflow.factorization.workloads import Workload

PREFIX = Workload.prefix()
EXAMPLE_B1 = np.array(
    [
        [0.740, 0, 0, 0, 0, 0, 0, 0, 0],
        [0.500, 0.822, 0, 0, 0, 0, 0, 0, 0],
        [0.450, 0.492, 0.876, 0, 0, 0, 0, 0, 0],
        [0, 0.286, 0.395, 0.821, 0, 0, 0, 0, 0],
        [0, 0, 0.278, 0.462, 0.855, 0, 0, 0, 0],
        [0, 0, 0, 0.335, 0.442, 0.882, 0, 0, 0],
        [0, 0, 0, 0, 0.272, 0.403, 0.892, 0, 0],
        [0, 0, 0, 0, 0, 0.243, 0.409, 0.936, 0],
        [0, 0, 0, 0, 0, 0, 0.194, 0.353, 1.000],
    ]
)


def test_algorithm3_equals_dense():
    # 001 digest §9.2: Θ uniform(0.1, 1) (12×4, seed 0), columns normalised over in-range entries →
    # 1477.28844.
    theta = np.random.default_rng(0).uniform(0.1, 1, size=(12, 4))
    band = normalize_columns(theta)
    loss, _ = banded_loss_and_grad(band, PREFIX)
    assert loss == pytest.approx(1477.28844, rel=1e-8)
    C = BandedEncoder(band).matrix()
    assert loss == pytest.approx(np.sum((PREFIX.matrix(12) @ np.linalg.inv(C)) ** 2), rel=1e-10)


def test_banded_gradient_finite_difference(rng):
    band = normalize_columns(rng.uniform(0.2, 1, (10, 3)))
    w = Workload.sgd_momentum(0.9, 0.3)
    _, g = banded_loss_and_grad(band, w, block_bytes=8 * 10 * 3 * 3)  # force several blocks
    eps = 1e-6
    for i, r in [(0, 0), (3, 1), (7, 2), (8, 1)]:
        up, dn = band.copy(), band.copy()
        up[i, r] += eps
        dn[i, r] -= eps
        fd = (banded_loss_and_grad(up, w)[0] - banded_loss_and_grad(dn, w)[0]) / (2 * eps)
        assert g[i, r] == pytest.approx(fd, rel=1e-6)


def test_example_b1():
    # 001 Example B.1: the optimal column-normalised 3-banded C for n = 9; ‖AC⁻¹‖²_F = 24.88087.
    res = optimize_banded(PREFIX, 9, 3)
    assert res.loss == pytest.approx(24.88087, abs=1e-5)
    np.testing.assert_allclose(BandedEncoder(res.band).matrix(), EXAMPLE_B1, atol=6e-4)
    assert res.loss < 45.0  # DP-SGD: n(n+1)/2


def test_prop31_check_values():
    # 001 digest §9.2: θ = [1, .5, .375], n = 8 → Σ(n−i+1)w_i² = 15.365032196044922, loss 21.36700.
    loss = ToeplitzLoss.build(PREFIX, 8, 8, 1)
    val, _ = loss(np.array([1, 0.5, 0.375]))
    assert val / 1.390625 == pytest.approx(15.365032196044922, rel=1e-13)
    enc = ToeplitzEncoder([1, 0.5, 0.375], 8)
    np.testing.assert_allclose(
        enc.per_query_error(PREFIX),
        [1, 1.25, 1.390625, 1.78125, 2.080322, 2.322571, 2.623783, 2.916481],
        atol=1e-6,
    )


def test_toeplitz_gradient_finite_difference():
    for min_sep, k in ((3, 4), (50, 1)):
        loss = ToeplitzLoss.build(Workload("momentum", 0.9), 50, min_sep, k)
        th = np.array([1, 0.5, 0.3, 0.2, 0.1, 0.05, 0.02])
        _, g = loss(th)
        eps = 1e-6
        fd = [(loss(th + eps * e)[0] - loss(th - eps * e)[0]) / (2 * eps) for e in np.eye(7)]
        np.testing.assert_allclose(g, fd, rtol=1e-6)


@pytest.mark.parametrize(
    "n, bands, rmse",
    [(4096, 16, 11.88388), (16384, 64, 12.27842), (16384, 8, 32.28250), (4096, 4, 22.82174)],
)
def test_optimal_banded_toeplitz_rmse(n, bands, rmse):
    # 001 digest §9.4 (unit noise, ‖θ‖ = 1, no column normalisation).
    res = optimize_toeplitz(PREFIX, n, bands)
    assert np.sqrt(res.loss / n) == pytest.approx(rmse, abs=1e-5)
    assert np.linalg.norm(res.coef) == pytest.approx(1.0)
    # Never worse than its two starting points (001 digest §11.3 regression).
    loss = ToeplitzLoss.build(PREFIX, n, n, 1)
    for start in (sqrt_coefs(bands), best_one_over_i_plus_c(loss, bands)):
        assert res.loss <= loss(start / np.linalg.norm(start))[0] * (1 + 1e-9)


def test_optimal_theta_n64_b4():
    res = optimize_toeplitz(PREFIX, 64, 4)
    np.testing.assert_allclose(res.coef, [0.708061, 0.474553, 0.397745, 0.339483], atol=2e-6)


def test_one_over_i_plus_c_ratio():
    # 001 digest §9.4: n = 4096, b = 16: best c = 0.99200, ratio 1.00123 against the optimum.
    n = 4096
    loss = ToeplitzLoss.build(PREFIX, n, n, 1)
    fam = best_one_over_i_plus_c(loss, 16)
    assert fam[0] - 1.0 == pytest.approx(0.99200, abs=1e-4)
    ratio = np.sqrt(loss(fam)[0] / optimize_toeplitz(PREFIX, n, 16).loss)
    assert ratio == pytest.approx(1.00123, abs=2e-5)


def test_taper_heuristic_check_values():
    """001 App. H taper, digest §9.7: n = 2000, k = 5, θ optimised for b = 400, taper from b₀ =
    200."""
    from corrflow.factorization import factorize, participation_for
    from corrflow.factorization.sensitivity import toeplitz_min_sep_sensitivity
    from corrflow.factorization.toeplitz import taper_coefficients

    theta = optimize_toeplitz(Workload.prefix(), 2000, 400, 400, 5).coef
    np.testing.assert_allclose(theta[:3], [0.53541, 0.27003, 0.20397], atol=2e-5)
    tapered = taper_coefficients(theta, 200)
    assert tapered.size == 399 and np.linalg.norm(tapered) == pytest.approx(1.0)
    # untouched below b₀
    np.testing.assert_allclose(tapered[:199] / theta[:199], tapered[0] / theta[0])

    def rmse(coef, s):
        err = ToeplitzEncoder(coef, 2000).per_query_error(Workload.prefix()).sum()
        return np.sqrt(toeplitz_min_sep_sensitivity(coef, 2000, s, 5) ** 2 * err / 2000)

    for s, plain, taper, ratio in [
        (200, 9.20244, 9.08831, 0.98760),
        (300, 8.66766, 8.36887, 0.96553),
        (400, 7.84910, 8.06395, 1.02737),
    ]:
        assert rmse(theta, s) == pytest.approx(plain, abs=2e-5)
        assert rmse(tapered, s) == pytest.approx(taper, abs=2e-5)
        assert rmse(tapered, s) / rmse(theta, s) == pytest.approx(ratio, abs=2e-5)
    fac = factorize("toeplitz", participation_for(2000, 5, 400, "min-sep"), bands=400, taper=200)
    assert fac.bands == 399 and fac.metadata["taper_lower_min_sep"] == 200
    assert fac.sensitivity.value == pytest.approx(1.0)
    with pytest.raises(Exception, match="taper"):
        factorize("banded", participation_for(20, 2), bands=4, taper=2)
