"""The exact (ε, δ) curve of one Gaussian mechanism, and ε or σ from it by root-finding in double
precision.

Balle & Wang 2018, "Improving the Gaussian Mechanism for Differential Privacy: Analytical
Calibration and Optimal Denoising", arXiv 1805.06530, Thm. 8: a Gaussian mechanism with sensitivity
Δ and noise standard deviation σ is (ε, δ)-DP (add/remove or replace-one, the curve is symmetric)
iff

    δ ≥ δ(ε) = Φ(μ/2 − ε/μ) − e^ε Φ(−μ/2 − ε/μ),   μ = Δ/σ.

An unamplified matrix mechanism normalised to sensitivity Δ is one such mechanism (000 App. D.2), so
its ε needs no discretised privacy-loss distribution: this curve is exact, where a PLD rounds
pessimistically.

Numerics: log δ(ε) = log Φ(a) + log1p(−e^r), r = ε + log Φ(b) − log Φ(a), with
``scipy.special.log_ndtr`` (accurate to a few ulps far into both tails). `log_delta_bound`
adds a bound on the rounding error of that evaluation (a few ulps of each term, amplified by the
cancellation e^r/(1 − e^r)); roots are found by ``scipy.optimize.brentq`` on that upper bound and
then moved to its safe side, so a returned ε or σ satisfies δ(ε) ≤ δ with the rounding accounted for
— every ε is an upper bound, every σ at least the exact one — while staying within ~1e-12 relative
of the exact root. Where the cancellation is too severe to certify δ to 1e-6 (far outside any
practical (ε, δ)), `IllConditionedError` is raised and the caller falls back to
dp-accounting's PLD.
"""

from __future__ import annotations

import math

import numpy as np

#: Relative rounding error of one ``log_ndtr`` or ``log``/``exp`` evaluation, generously (a few
# ulps).
ULP = 8 * 2.0**-52
#: Widest certified error in log δ an answer may carry (else `IllConditionedError`: the
# caller uses a PLD).
MAX_LOG_ERROR = 1e-6


class IllConditionedError(ArithmeticError):
    """δ(ε) cannot be certified to `MAX_LOG_ERROR` relative accuracy in double precision
    here."""


def _terms(epsilon: float, mu: float) -> tuple[float, float, float, float]:
    """(log Φ(a), its error bound, r = ε + log Φ(b) − log Φ(a), its error bound)."""
    from scipy.special import log_ndtr  # lazy: scipy.special costs every CLI start ~0.4 s

    a = mu / 2 - epsilon / mu
    b = -mu / 2 - epsilon / mu
    la = float(log_ndtr(a))
    lb = float(log_ndtr(b))
    # a and b carry ~ulp·(μ/2 + ε/μ), turned into log Φ by its slope (≤ |x| + 1 in the lower tail)
    err_ab = ULP * (abs(mu / 2) + abs(epsilon / mu)) * (max(abs(a), abs(b)) + 1.0)
    err_la = ULP * max(1.0, abs(la)) + err_ab
    err_r = ULP * (abs(epsilon) + abs(lb) + abs(la)) + 2 * err_la
    return la, err_la, epsilon + lb - la, err_r


def log_delta_bound(epsilon: float, mu: float) -> tuple[float, float]:
    """log δ(ε) and a certified upper bound on it (Balle & Wang, arXiv 1805.06530, Thm. 8).

    δ(ε) = Φ(a)·(1 − e^r) with r = ε + log Φ(b) − log Φ(a) ≤ 0; the bound moves log Φ(a) up and r
    down by their rounding errors (1 − e^r falls in r).

    Args:
        epsilon: ε.
        mu: μ = sensitivity/σ.

    Returns:
        (log δ(ε), its certified upper bound); −inf where δ(ε) = 0 (and both −inf when μ ≤ 0).
    """
    if mu <= 0:
        return -math.inf, -math.inf
    la, err_la, r, err_r = _terms(epsilon, mu)
    value = la + math.log(-math.expm1(r)) if r < 0 else -math.inf
    upper = la + err_la + math.log(-math.expm1(r - err_r)) if r - err_r < 0 else -math.inf
    return value, upper


def log_delta(epsilon: float, mu: float) -> float:
    """log δ(ε) of a Gaussian mechanism (Balle & Wang, arXiv 1805.06530, Thm. 8).

    Args:
        epsilon: ε.
        mu: μ = sensitivity/σ.

    Returns:
        log δ(ε); −inf when δ(ε) = 0.
    """
    return log_delta_bound(epsilon, mu)[0]


def delta(epsilon: float, mu: float) -> float:
    """δ(ε) of a Gaussian mechanism (Balle & Wang, arXiv 1805.06530, Thm. 8).

    Args:
        epsilon: ε.
        mu: μ = sensitivity/σ.

    Returns:
        δ(ε) = Φ(μ/2 − ε/μ) − e^ε Φ(−μ/2 − ε/μ).
    """
    return math.exp(log_delta(epsilon, mu))


def _upper(epsilon: float, mu: float) -> float:
    return log_delta_bound(epsilon, mu)[1]


def _certify(epsilon: float, mu: float) -> None:
    """Refuse an answer whose certified bound is looser than `MAX_LOG_ERROR` (the caller then
    uses a PLD)."""
    value, upper = log_delta_bound(epsilon, mu)
    if not upper - value <= MAX_LOG_ERROR:
        raise IllConditionedError(
            f"δ(ε) at ε = {epsilon:g}, μ = {mu:g} cannot be certified to "
            f"{MAX_LOG_ERROR:g} relative in double precision"
        )


def epsilon(mu: float, target_delta: float) -> float:
    """The smallest ε with δ(ε) ≤ ``target_delta`` (Balle & Wang, arXiv 1805.06530, Thm. 8; module
    docstring).

    Args:
        mu: μ = sensitivity/σ.
        target_delta: δ in (0, 1).

    Returns:
        ε to ~1e-12 relative, on the safe side of the certified bound; 0 when δ(0) ≤ δ already, inf
        when no ε ≤ 1e12 suffices.

    Raises:
        IllConditionedError: δ cannot be certified to `MAX_LOG_ERROR` there (the caller uses a PLD).
    """
    from scipy.optimize import brentq  # lazy: scipy's import slows every CLI start

    goal = math.log(target_delta)
    if _upper(0.0, mu) <= goal:
        return 0.0
    hi = 1.0
    while _upper(hi, mu) > goal:
        hi *= 2.0
        if hi > 1e12:
            return math.inf
    lo = hi / 2.0 if hi > 1.0 else 0.0
    e = brentq(lambda x: _upper(x, mu) - goal, lo, hi, xtol=1e-13, rtol=4 * np.finfo(float).eps)
    step = max(abs(e), 1e-12) * 1e-13
    while _upper(e, mu) > goal:  # brentq's answer may sit a few ulps on the wrong side
        e += step
        step *= 2.0
    _certify(e, mu)
    return float(e)


def noise_multiplier(target_epsilon: float, target_delta: float, sensitivity: float = 1.0) -> float:
    """The smallest σ with δ(target ε) ≤ ``target_delta`` (Balle & Wang, arXiv 1805.06530, Thm. 8).

    Root of log δ(ε; μ = Δ/σ) = log δ in log σ (δ(ε) falls monotonically as σ grows).

    Args:
        target_epsilon: ε.
        target_delta: δ in (0, 1).
        sensitivity: Δ.

    Returns:
        σ to ~1e-12 relative, rounded up (on the safe side of the certified bound).

    Raises:
        IllConditionedError: δ cannot be certified to `MAX_LOG_ERROR` there (the caller uses a PLD).
    """
    from scipy.optimize import brentq  # lazy: scipy's import slows every CLI start

    goal = math.log(target_delta)

    def f(log_sigma: float) -> float:
        return _upper(target_epsilon, sensitivity / math.exp(log_sigma)) - goal

    lo = hi = math.log(sensitivity)
    while f(hi) > 0:
        hi += 1.0
    while f(lo) <= 0 and lo > hi - 60:
        lo -= 1.0
    sigma = math.exp(brentq(f, lo, hi, xtol=1e-13, rtol=4 * np.finfo(float).eps))
    step = 1e-13
    while _upper(target_epsilon, sensitivity / sigma) > goal:  # move to the safe side of the root
        sigma *= 1.0 + step
        step *= 2.0
    _certify(target_epsilon, sensitivity / sigma)
    return float(sigma)
