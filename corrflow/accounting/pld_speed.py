"""dp-accounting's subsampled-Gaussian PLD, built with the same bits at array speed.

``dp_accounting.pld`` builds the privacy loss distribution of a (subsampled) Gaussian mechanism
by evaluating the hockey-stick divergence δ(ε) on its whole ε grid
(``GaussianPrivacyLoss.get_delta_for_epsilon``, Meiser & Mohammadi, "Tight on Budget? Tight
Bounds for r-Fold Approximate Differential Privacy", CCS 2018; Doroshenko, Ghazi, Kamath, Kumar,
Manurangsi, "Connect the Dots: Tighter Discrete Approximations of Privacy Loss Distributions",
arXiv 2207.04380). It inverts the privacy loss one ε at a time in Python: at corrflow's
discretisation that is ~10⁴ scalar calls per PLD, most of a calibration's time.

`install` replaces that one method with the same formulas applied to the whole grid at once,
with the same NumPy operations in the same order, so every δ — and every ε corrflow prints — is
bit for bit what dp-accounting computes. It installs itself only after checking exactly that on
a set of mechanisms (both adjacencies, with and without subsampling); if any bit differs (another
NumPy or dp-accounting release), dp-accounting's own method stays.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

_ORIGINAL = None
_STATE: dict[str, bool] = {}


def _isclose(x: np.ndarray, target: float) -> np.ndarray:
    """``math.isclose(x, target)`` elementwise (rel_tol 1e-9, abs_tol 0)."""
    with np.errstate(invalid="ignore"):
        near = np.abs(x - target) <= 1e-9 * np.maximum(np.abs(x), abs(target))
    return (x == target) | (np.isfinite(x) & math.isfinite(target) & near)


def _log_a_times_exp_b_plus_c(a: float, b: np.ndarray, c: float) -> np.ndarray:
    """``dp_accounting.pld.common.log_a_times_exp_b_plus_c`` for a > 0 > c, elementwise."""
    d = b + np.log(a)
    lc = np.log(-c)
    if np.any(lc >= d[b != 0]):  # dp-accounting's _log_sub refuses these
        raise ValueError(f"a must be greater than b. Got a={d} and b={lc}.")
    with np.errstate(invalid="ignore", divide="ignore"):
        out = d + np.log1p(-np.exp(lc - d))
    zero = b == 0
    if np.any(zero):
        out[zero] = np.log(a + c)
    return out


def _inverse_without_subsampling(loss, losses: np.ndarray, add: bool) -> np.ndarray:
    s, var = loss.sensitivity, loss._standard_deviation**2
    x = -0.5 * s - losses * var / s
    return s + x if add else x


def _inverse_privacy_loss(loss, losses: np.ndarray) -> np.ndarray:
    """``GaussianPrivacyLoss.inverse_privacy_loss`` elementwise (ADD and REMOVE adjacency)."""
    from dp_accounting.pld.privacy_loss_mechanism import AdjacencyType

    add = loss.adjacency_type == AdjacencyType.ADD
    q = loss.sampling_prob
    if q == 1.0:
        return _inverse_without_subsampling(loss, losses, add)
    edge = -math.log(1 - q) if add else math.log(1 - q)
    at_edge = _isclose(losses, edge)
    inner = losses[~at_edge]
    if np.any(inner > edge) if add else np.any(inner <= edge):
        raise ValueError(f"privacy loss beyond ±log(1 - sampling_prob) ({edge})")
    out = np.empty_like(losses)
    unsubsampled = _log_a_times_exp_b_plus_c(1 / q, -inner if add else inner, 1 - 1 / q)
    out[~at_edge] = _inverse_without_subsampling(loss, -unsubsampled if add else unsubsampled, add)
    out[at_edge] = _inverse_without_subsampling(
        loss, np.array([math.inf if add else -math.inf]), add
    )[0]
    return out


def _get_delta_for_epsilon(self, epsilon):
    """dp-accounting's ``AdditiveNoisePrivacyLoss.get_delta_for_epsilon`` with the inverse
    privacy loss taken over the whole grid at once (module docstring)."""
    from dp_accounting.pld.privacy_loss_mechanism import AdjacencyType

    if self.adjacency_type not in (AdjacencyType.ADD, AdjacencyType.REMOVE):
        return _ORIGINAL(self, epsilon)
    is_scalar = isinstance(epsilon, numbers.Number)
    epsilons = np.array([epsilon]) if is_scalar else np.asarray(epsilon)
    deltas = np.zeros_like(epsilons, dtype=float)
    if self.sampling_prob == 1.0:
        inverse = np.full_like(epsilons, True, dtype=bool)
    elif self.adjacency_type == AdjacencyType.ADD:
        inverse = epsilons < -math.log1p(-self.sampling_prob)
    else:
        inverse = epsilons > math.log1p(-self.sampling_prob)
        other = np.logical_not(inverse)
        deltas[other] = -np.expm1(epsilons[other])
    x_cutoffs = _inverse_privacy_loss(self, np.asarray(epsilons[inverse], dtype=float))
    deltas[inverse] = self.mu_upper_cdf(x_cutoffs) - np.exp(
        epsilons[inverse] + self.mu_lower_log_cdf(x_cutoffs)
    )
    deltas = np.clip(deltas, 0, 1)
    return float(deltas[0]) if is_scalar else deltas


def _agrees() -> bool:
    """The array path gives dp-accounting's bits on a spread of mechanisms and ε grids."""
    from dp_accounting.pld.privacy_loss_mechanism import AdjacencyType, GaussianPrivacyLoss

    grid = np.concatenate([np.linspace(-3.0, 6.0, 301), [0.0, -1e-300, 1e-12]])
    for q in (1.0, 0.5, 0.01, 1e-4):
        for adjacency in (AdjacencyType.ADD, AdjacencyType.REMOVE):
            for sigma in (0.3, 1.0, 7.0):
                loss = GaussianPrivacyLoss(
                    sigma, sensitivity=1.0, sampling_prob=q, adjacency_type=adjacency
                )
                edge = math.log1p(-q) if q < 1 else -math.inf
                eps = grid[grid < -edge] if adjacency == AdjacencyType.ADD else grid[grid > edge]
                try:
                    want = _ORIGINAL(loss, eps)
                except ValueError:
                    continue
                got = _get_delta_for_epsilon(loss, eps)
                if not np.array_equal(want, got, equal_nan=True):
                    return False
                if _ORIGINAL(loss, float(eps[7])) != _get_delta_for_epsilon(loss, float(eps[7])):
                    return False
    return True


def install() -> bool:
    """Speed up dp-accounting's Gaussian PLDs where the result is bit-identical (module
    docstring); idempotent.

    Returns:
        Whether the array path is in use.
    """
    global _ORIGINAL
    if "installed" in _STATE:
        return _STATE["installed"]
    from dp_accounting.pld.privacy_loss_mechanism import GaussianPrivacyLoss

    _ORIGINAL = GaussianPrivacyLoss.get_delta_for_epsilon
    ok = _agrees()
    if ok:
        GaussianPrivacyLoss.get_delta_for_epsilon = _get_delta_for_epsilon
    _STATE["installed"] = ok
    return ok
