"""Small synthetic federated tasks generated on the fly (seeded, no downloads): a per-user linear
regression used by the numpy client (users share a global model with a user-specific shift, so
federated averaging helps)."""

from __future__ import annotations

import numpy as np


def regression_partition(
    partition_id: int, dim: int, seed: int = 0, examples: int = 32
) -> tuple[np.ndarray, np.ndarray]:
    """(X, y) of one user: y = X·(w* + 0.1·u_i) + 1 + noise, X ~ N(0, I) (float32)."""
    w_star = np.random.default_rng([seed, 0]).normal(size=dim)
    rng = np.random.default_rng([seed, 1, int(partition_id)])
    shift = 0.1 * rng.normal(size=dim)
    X = rng.normal(size=(examples, dim))
    y = X @ (w_star + shift) + 1.0 + 0.1 * rng.normal(size=examples)
    return X.astype(np.float32), y.astype(np.float32)


def regression_test_set(
    dim: int, seed: int = 0, examples: int = 2000
) -> tuple[np.ndarray, np.ndarray]:
    w_star = np.random.default_rng([seed, 0]).normal(size=dim)
    rng = np.random.default_rng([seed, 2])
    X = rng.normal(size=(examples, dim))
    return X.astype(np.float32), (X @ w_star + 1.0).astype(np.float32)


def regression_loss(params: list[np.ndarray], X: np.ndarray, y: np.ndarray) -> float:
    w, b = params
    r = X @ w + b[0] - y
    return float(np.mean(r.astype(np.float64) ** 2))
