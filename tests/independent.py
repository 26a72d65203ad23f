"""ε recomputed without corrflow's accountants: the sensitivity from the stored encoder C for each
user's realised rounds (sens² = max over users of Σ_{i,j ∈ rounds} |(CᵀC)_ij|, exact for CᵀC ≥ 0 —
000 Thm. 2.1 with non-negative X), then dp-accounting's Gaussian-mechanism ε at σ / sens."""

import dp_accounting
import numpy as np


def independent_epsilon(fac, users: dict, sigma: float, delta: float) -> float:
    """``fac``: a Factorization; ``users``: the report's ``realized.participation.users`` (hashed id
    → {rounds})."""
    C = fac.encoder.matrix()
    X = np.abs(C.T @ C)
    sens = max(float(np.sqrt(X[np.ix_(u["rounds"], u["rounds"])].sum())) for u in users.values())
    return float(dp_accounting.get_epsilon_gaussian(sigma / sens, delta))
