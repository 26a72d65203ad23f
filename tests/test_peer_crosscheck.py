"""Cross-checks against jax-privacy (the peer); skipped cleanly when it is not installed."""

import numpy as np
import pytest

jp = pytest.importorskip("jax_privacy.matrix_factorization")
jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", True)

from corrflow.factorization.encoders import ToeplitzEncoder  # noqa: E402
from corrflow.factorization.participation import Participation  # noqa: E402
from corrflow.factorization.sensitivity import sensitivity_from_gram  # noqa: E402
from corrflow.factorization.toeplitz import ToeplitzLoss, optimize_toeplitz  # noqa: E402
from corrflow.factorization.workloads import Workload  # noqa: E402


def test_toeplitz_loss_and_sensitivity_agree():
    from jax_privacy.matrix_factorization import toeplitz

    n, bands = 256, 16
    coef = optimize_toeplitz(Workload.prefix(), n, bands).coef
    ours = ToeplitzLoss.build(Workload.prefix(), n, n, 1)(coef)[0] / n  # jax: mean error × ‖θ‖²
    assert float(toeplitz.loss(coef, n=n)) == pytest.approx(ours, rel=1e-9)
    for sep, k in ((4, 5), (16, 16), (7, 3)):
        peer = float(toeplitz.minsep_sensitivity_squared(coef, sep, k, n=n))
        enc = ToeplitzEncoder(coef, n)
        mine = enc.sensitivity(Participation.min_separation(n, sep, min(k, -(-n // sep))))
        assert mine.value**2 == pytest.approx(peer, rel=1e-9)


def test_fixed_epoch_sensitivity_agrees(rng):
    from jax_privacy.matrix_factorization import sensitivity

    C = np.tril(rng.uniform(0, 1, (24, 24))) + np.eye(24)
    peer = float(sensitivity.fixed_epoch_sensitivity(C, 4))
    assert sensitivity_from_gram(C.T @ C, Participation.fixed_epoch(24, 4)).value == pytest.approx(
        peer, rel=1e-9
    )
