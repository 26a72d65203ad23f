"""The exact (ε, δ) curve of one Gaussian mechanism, and ε or σ from it by root-finding in double precision.

Balle & Wang 2018, "Improving the Gaussian Mechanism for Differential Privacy: Analytical Calibration and Optimal
Denoising", arXiv 1805.06530, Thm. 8: a Gaussian mechanism with sensitivity Δ and noise standard deviation σ is
(ε, δ)-DP (add/remove or replace-one, the curve is symmetric) iff

    δ ≥ δ(ε) = Φ(μ/2 − ε/μ) − e^ε Φ(−μ/2 − ε/μ),   μ = Δ/σ.

An unamplified matrix mechanism normalised to sensitivity Δ is one such mechanism (000 App. D.2), so its ε needs
no discretised privacy-loss distribution: this curve is exact, where a PLD rounds pessimistically.

Numerics: log δ(ε) = log Φ(a) + log1p(−e^{ε + log Φ(b) − log Φ(a)}) with ``scipy.special.log_ndtr`` (accurate to a
few ulps far into both tails). Roots are bracketed, found by ``scipy.optimize.brentq`` and then moved to the safe
side — a returned ε or σ satisfies δ(ε) ≤ δ·(1 − :data:`DELTA_MARGIN`) evaluated here — so every ε reported is an
upper bound and every σ is at least the exact one up to that margin, never below it. Where the subtraction inside
δ(ε) is too ill-conditioned for that margin (e^ε Φ(b) within 10⁻⁶ relative of Φ(a), far outside any practical
(ε, δ)), :class:`IllConditionedError` is raised and the caller falls back to dp-accounting's PLD.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.optimize import brentq
from scipy.special import log_ndtr

#: Relative slack on δ a returned pair keeps: it covers the rounding of δ(ε) (≈ 1e-15 relative times the
#: cancellation factor, which :func:`log_delta` refuses above 1e6).
DELTA_MARGIN = 1e-9
#: Largest cancellation factor e^ε Φ(b) / (Φ(a) − e^ε Φ(b)) accepted (its rounding error times 1e-15 stays < margin).
MAX_CANCELLATION = 1e6


class IllConditionedError(ArithmeticError):
    """δ(ε) cannot be evaluated to :data:`DELTA_MARGIN` relative accuracy in double precision here."""


def log_delta(epsilon: float, mu: float) -> float:
    """log δ(ε) of a Gaussian mechanism with μ = sensitivity/σ (Balle & Wang 2018, Thm. 8); −inf when δ(ε) = 0."""
    if mu <= 0:
        return -math.inf
    a = mu / 2 - epsilon / mu
    b = -mu / 2 - epsilon / mu
    la = float(log_ndtr(a))
    r = epsilon + float(log_ndtr(b)) - la    # log of e^ε Φ(b) / Φ(a) ≤ 0 (δ(ε) ≥ 0)
    if r >= 0:
        return -math.inf
    if r > -1e-6 and math.exp(r) / -math.expm1(r) > MAX_CANCELLATION:
        raise IllConditionedError(f"δ(ε) at ε = {epsilon:g}, μ = {mu:g} cancels to below 1e-6 relative")
    return la + math.log(-math.expm1(r))


def delta(epsilon: float, mu: float) -> float:
    """δ(ε) of a Gaussian mechanism with μ = sensitivity/σ (Balle & Wang 2018, Thm. 8)."""
    return math.exp(log_delta(epsilon, mu))


def _safe(target: float, margin: float = DELTA_MARGIN) -> float:
    return math.log(target) + math.log1p(-margin)


def epsilon(mu: float, target_delta: float) -> float:
    """The smallest ε (to ~1e-12 relative, rounded up) with δ(ε) ≤ ``target_delta`` for μ = sensitivity/σ."""
    goal = _safe(target_delta)
    if log_delta(0.0, mu) <= goal:
        return 0.0
    hi = 1.0
    while log_delta(hi, mu) > goal:
        hi *= 2.0
        if hi > 1e12:
            return math.inf
    lo = hi / 2.0 if hi > 1.0 else 0.0
    e = brentq(lambda x: log_delta(x, mu) - goal, lo, hi, xtol=1e-13, rtol=4 * np.finfo(float).eps)
    step = max(abs(e), 1e-12) * 1e-12
    while log_delta(e, mu) > goal:   # brentq's answer may sit a few ulps on the wrong side
        e += step
        step *= 2.0
    return float(e)


def noise_multiplier(target_epsilon: float, target_delta: float, sensitivity: float = 1.0) -> float:
    """The smallest σ (to ~1e-12 relative, rounded up) with δ(target ε) ≤ ``target_delta`` for this sensitivity.

    Root of log δ(ε; μ = Δ/σ) = log δ in log σ (δ(ε) falls monotonically as σ grows)."""
    goal = _safe(target_delta)

    def f(log_sigma: float) -> float:
        return log_delta(target_epsilon, sensitivity / math.exp(log_sigma)) - goal

    lo = hi = math.log(sensitivity)
    while f(hi) > 0:
        hi += 1.0
    while f(lo) <= 0 and lo > hi - 60:
        lo -= 1.0
    sigma = math.exp(brentq(f, lo, hi, xtol=1e-13, rtol=4 * np.finfo(float).eps))
    step = 1e-12
    while log_delta(target_epsilon, sensitivity / sigma) > goal:   # move to the safe side of the root
        sigma *= 1.0 + step
        step *= 2.0
    return float(sigma)
