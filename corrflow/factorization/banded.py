"""Column-normalised banded strategies, BandMF (001 §2.2–2.3, Problem 2.1: McKenna, "Scaling up the
Banded Matrix Factorization Mechanism for Differentially Private ML", arXiv 2405.15913).

C(Θ)[j + r, j] = Θ[j, r] / ‖Θ[j, :]‖ (in-range entries only), so every column has unit norm and, for
``bands ≤ min_sep``, the sensitivity is exactly √k. Objective ‖A C(Θ)⁻¹‖²_F (001 Alg. 3) with
gradient ∇_C = −2 Bᵀ W, B = A C⁻¹, W = A C⁻¹ C⁻ᵀ, evaluated on the band only and blockwise over
columns: O(n²·bands) time and O(n·(bands + block)) memory. L-BFGS from the optimal banded Toeplitz
start (001 Example B.1 is reproduced this way).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.linalg import solve_banded

from corrflow.errors import require
from corrflow.factorization.encoders import ToeplitzEncoder
from corrflow.factorization.optim import lbfgs
from corrflow.factorization.toeplitz import optimize_toeplitz
from corrflow.factorization.workloads import Workload
from corrflow.progress import ProgressCallback


def _valid_mask(n: int, p: int) -> np.ndarray:
    return (np.arange(n)[:, None] + np.arange(p)[None, :]) < n


def normalize_columns(theta: np.ndarray) -> np.ndarray:
    """Θ → the band of C(Θ) (001 §2.2).

    Args:
        theta: shape (n, bands), layout theta[j, r] = C[j + r, j].

    Returns:
        The same shape: in-range entries divided by their column's norm (out-of-range entries 0).
    """
    theta = np.where(_valid_mask(*theta.shape), theta, 0.0)
    return theta / np.linalg.norm(theta, axis=1, keepdims=True)


def banded_loss_and_grad(
    band: np.ndarray, workload: Workload, block_bytes: int = 1 << 26
) -> tuple[float, np.ndarray]:
    """The BandMF objective and its gradient (001 Alg. 3, arXiv 2405.15913).

    Args:
        band: shape (n, bands), layout band[j, r] = C[j + r, j].
        workload: A.
        block_bytes: memory for the blockwise evaluation.

    Returns:
        (‖A C⁻¹‖²_F, its gradient with respect to ``band``, same shape).
    """
    n, p = band.shape
    ab = band.T  # lower-banded storage for solve_banded((p−1, 0), ...)
    ab_upper = np.zeros((p, n))  # Cᵀ in upper-banded storage: ab_upper[p−1−r, j+r] = C[j+r, j]
    for r in range(p):
        ab_upper[p - 1 - r, r:] = band[: n - r, r]
    m = int(max(1, min(n, block_bytes // (8 * n * 3))))
    loss = 0.0
    grad = np.zeros((n, p))
    for j0 in range(0, n, m):
        j1 = min(n, j0 + m)
        hi = min(n, j1 + p - 1)
        E = np.zeros((n, hi - j0))
        E[np.arange(j0, hi), np.arange(hi - j0)] = 1.0
        # columns j0..hi−1 of B
        B = workload.apply(solve_banded((p - 1, 0), ab, E, check_finite=False))
        loss += float(np.sum(B[:, : j1 - j0] ** 2))
        V = solve_banded((0, p - 1), ab_upper, E[:, : j1 - j0], check_finite=False)  # C⁻ᵀ e_j
        # columns j0..j1−1 of W
        W = workload.apply(solve_banded((p - 1, 0), ab, V, check_finite=False))
        for r in range(p):
            cols = min(j1, n - r) - j0
            if cols <= 0:
                break
            grad[j0 : j0 + cols, r] = -2.0 * np.einsum("ij,ij->j", B[:, r : r + cols], W[:, :cols])
    return loss, grad


@dataclass(frozen=True)
class BandedResult:
    """An optimised column-normalised banded encoder: ``band`` (shape (n, bands)), ``loss`` ‖A
    C⁻¹‖²_F and the optimizer's ``iterations``."""

    band: np.ndarray  # column-normalised band of C
    loss: float  # ‖A C⁻¹‖²_F (unit column norms)
    iterations: int


def optimize_banded(
    workload: Workload,
    n: int,
    bands: int,
    *,
    init: np.ndarray | None = None,
    max_iterations: int = 2000,
    callback: ProgressCallback | None = None,
) -> BandedResult:
    """Optimal column-normalised ``bands``-banded C for ``workload`` (001 Problem 2.1, arXiv
    2405.15913).

    Args:
        workload: A.
        n: rounds.
        bands: p.
        init: a starting band, shape (n, bands) (default: the optimal banded Toeplitz).
        max_iterations: L-BFGS iterations.
        callback: progress callback.

    Returns:
        The band of shape (n, bands), its loss and the iterations.
    """
    require(1 <= bands <= n, "bands", f"between 1 and rounds={n}", bands)
    valid = _valid_mask(n, bands)
    if init is None:
        coef = optimize_toeplitz(workload.toeplitz_part(), n, bands).coef
        init = ToeplitzEncoder(coef, n).band_array()
    theta0 = normalize_columns(np.asarray(init, dtype=np.float64))

    def fun(theta: np.ndarray, need_grad: bool):
        norms = np.linalg.norm(np.where(valid, theta, 0.0), axis=1, keepdims=True)
        if np.any(np.abs(theta[:, 0]) < 1e-12 * norms[:, 0]):
            return np.inf, None
        band = np.where(valid, theta, 0.0) / norms
        with np.errstate(over="ignore", invalid="ignore"):
            loss, g = banded_loss_and_grad(band, workload)
        if not np.isfinite(loss):
            return np.inf, None
        if not need_grad:
            return np.log(loss), None
        # Chain rule through the column normalisation: project out the radial component, divide by
        # the norm.
        g = np.where(valid, g, 0.0)
        g = (g - band * np.sum(g * band, axis=1, keepdims=True)) / norms
        return np.log(loss), g / loss

    def report(it, theta, logval, g):
        if callback is not None:
            callback(it, float(np.exp(logval)))
        return False

    res = lbfgs(
        fun,
        theta0,
        max_iterations=max_iterations,
        memory=20,
        rel_improvement=1e-12,
        window=10,
        on_iteration=report,
    )
    band = normalize_columns(res.x)
    return BandedResult(band, float(np.exp(fun(band, False)[0])), res.iterations)
