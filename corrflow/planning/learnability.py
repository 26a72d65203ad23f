"""Before training: will the model drown in its noise? A pre-flight estimate from the factorization alone.

The server's model is θ_t = θ_0 + η·(A x̂)_t with x̂_t = (Σ clipped updates + σ·clip·(C⁻¹Z)_t) / cohort, so the
noise it carries at round t has per-coordinate standard deviation η·σ·clip·‖B_t‖ / cohort (B = A C⁻¹; ‖B_t‖² is
the factorization's per-iterate error) and norm ≈ that × √d over d parameters, while the clipped signal moves it at
most η·clip·(A·1)_t. Their ratio at the last round,

    ρ = σ · √d · ‖B_{n−1}‖ / (cohort · (A·1)_{n−1}),

does not depend on η or clip. Measured at ε = 8, δ = 1e-5: runs that learn had ρ ≤ 0.2 (numpy regression, the
README's first command: 0.04; nextword ``compare --preset quick``, banded Toeplitz: 0.06; the README's arXiv
cross-silo example: 0.2; DP-SGD on the quick preset, 0.17, gains accuracy while its held-out loss rises); runs at
ρ ≥ 0.39 ended worse than the initial model (``--preset tiny``: 0.39 Toeplitz, 0.71 DP-SGD; the Keras LSTM with 5
users per round: 2.2). Above ``THRESHOLD`` corrflow warns before training starts.
"""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger("corrflow")
THRESHOLD = 0.3


def noise_to_signal(fac, sigma: float, dim: int, cohort: float) -> float:
    """ρ above (0 without noise). ``fac``: a normalised Factorization; ``dim``: model parameters; ``cohort``: the
    number the summed update is divided by."""
    if sigma <= 0:
        return 0.0
    n = fac.rounds
    b_last = float(np.sqrt(fac.per_query_error()[-1]))
    signal = float(fac.workload.apply(np.ones((n, 1)))[-1, 0])
    return float(sigma * np.sqrt(dim) * b_last / (cohort * signal))


def check_learnable(fac, sigma: float, weights, cohort: float) -> float:
    """Compute ρ for a model (list of arrays) and warn when it exceeds ``THRESHOLD``; returns ρ."""
    dim = int(sum(np.size(w) for w in weights))
    rho = noise_to_signal(fac, sigma, dim, cohort)
    if rho > THRESHOLD:
        log.warning("this configuration is unlikely to learn: the model will carry noise %.1f× the largest "
                    "signal the clipped updates can give it (σ = %.3f, %d parameters, cohort %g; configurations "
                    "that learn have ≤ %.2f). Raise the cohort (users per round), lower ε's noise (higher "
                    "target ε), use a smaller model or a correlated-noise kind with lower error.", rho, sigma, dim,
                    cohort, THRESHOLD)
    return rho
