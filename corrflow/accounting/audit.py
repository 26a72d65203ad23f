"""Empirical privacy auditing with canaries: the statistics (Flower-free; numpy and scipy).

Two estimators from the literature, and a test statistic that keeps them valid under correlated
noise:

* **One-shot estimate ε̂** — Andrew, Kairouz, Oh, Oprea, McMahan, Suriyakumar, "One-shot Empirical
  Privacy Estimation for Federated Learning" (ICLR 2024, arXiv 2302.03098): canaries with fixed
  random unit directions, a Gaussian fitted to the inserted canaries' scores, and ε̂ = ε_G(μ̂/σ̂;
  δ), the ε of the Gaussian mechanism whose sensitivity/σ is μ̂/σ̂ (`gaussian_epsilon`, Balle
  & Wang, "Improving the Gaussian Mechanism for Differential Privacy", arXiv 1805.06530, Thm. 8).
* **95% lower bound ε_lo** — Steinke, Nasr, Jagielski, "Privacy Auditing with One (1) Training Run"
  (NeurIPS 2023, arXiv 2305.08846), Thm. 3.1 with its (ε, δ) extension (Prop. 5.4): each of m
  candidate canaries is inserted by an independent fair coin; the auditor guesses "in" for the k₊
  highest scores and "out" for the k₋ lowest; if the run is (ε, δ)-DP for every canary, the number W
  of correct guesses among r = k₊ + k₋ obeys P[W ≥ v] ≤ β + 2mδ·α with β = P[Bin(r, q) ≥ v], q =
  e^ε/(1 + e^ε), α = max_{1≤i≤v} (P[Bin(r, q) ≥ v − i] − β)/i (`one_run_p_value`). The guess
  counts are fixed before the scores are seen (`GUESS_FRACTIONS`, Bonferroni-corrected over
  them).

**Why the statistic holds for the matrix mechanism** (the derivation behind
`whitened_scores`). The server releases x̃_t = (Σ clipped updates + σ·ζ·(C⁻¹Z)_t)/cohort in
round t (ζ the clip norm, Z i.i.d. N(0, 1) of shape n × d), and the model moves by D = M·x̃ with M
the public, lower-triangular linear server optimizer (momentum β and the learning-rate schedule; D_t
= θ_{t+1} − θ_t). A canary with unit direction c (independent of Z and of the users' data) that
takes part in the rounds of the 0/1 vector u adds ζ·u ⊗ c. Its projections p = D·c ∈ ℝⁿ are

    p = ζ·M u + (σζ/cohort)·M C⁻¹ (Z c) + (real users' updates)·c,      Z c ~ N(0, Iₙ) exactly (c is
    a unit vector),

so the correlated noise, projected on any fixed direction, is an n-dimensional Gaussian with
covariance Σ = (σζ/cohort)²·M C⁻¹C⁻ᵀMᵀ — the cross-round correlation is the only structure, and it
is the same for every direction. The likelihood-ratio test of "canary in rounds u" against "not in"
for a Gaussian with known Σ is the generalised-least-squares matched filter s = aᵀΣ⁻¹p / √(aᵀΣ⁻¹a)
with a = M u: N(0, 1) for a held-out canary and N(ζ·√(aᵀΣ⁻¹a), 1) = N(‖C u‖/σ, 1) for an inserted
one. The Gaussian-fit estimate therefore targets ε_G(‖Cu‖/σ; δ), and since a factorization is
normalised to sensitivity max_u ‖Cu‖ = 1 over its participation pattern, ε_G(1/σ; δ) = the
unamplified ε the accountant claims: a run with the claimed noise audits *at* its claim for a
worst-case pattern (fixed-epoch participation realises it) and below it otherwise.

Σ is not taken from the claim: it is estimated from the release itself, Σ̂ = D Dᵀ/d. For a direction
uniform on the sphere E[c cᵀ] = I/d, so E[p pᵀ] = Σ̂ *exactly* for any D: the held-out canaries'
scores have unit variance whatever the run did, and the test adapts to the noise actually added.
Noise scaled down makes Σ̂ small; noise omitted leaves only the users' updates in Σ̂; noise reused
in rounds t and t+1 makes D_t − D_{t+1} almost free of noise, so a canary in one of them stands out.
The final-model threat model of Andrew et al. is the special case a = 1 with the cosine ⟨c, θ_T −
θ_0⟩/‖θ_T − θ_0‖ (`final_model_cosines`); it cannot see noise that cancels or repeats across
rounds and is reported alongside.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from corrflow.accounting import gaussian, mechanisms
from corrflow.errors import require

#: Fractions of the m candidates the one-run bound guesses on (half "in" from the top, half "out"
# from the bottom), fixed before any score is seen; ε_lo is Bonferroni-corrected over them.
GUESS_FRACTIONS = (0.1, 0.2, 0.5, 1.0)


# -- canaries --------------------------------------------------------------------------------------
def canary_direction(seed: int, index: int, dim: int) -> np.ndarray:
    """Canary ``index``'s unit direction, uniform on the sphere (Andrew et al., arXiv 2302.03098,
    §3).

    Args:
        seed: the audit seed.
        index: the canary's index among the candidates.
        dim: d, the model's parameters.

    Returns:
        c, float64, shape (dim,), ‖c‖ = 1: a N(0, I) draw keyed by (seed, index), normalised.
    """
    z = np.random.default_rng([int(seed), 2302_03098, int(index)]).standard_normal(int(dim))
    return z / np.linalg.norm(z)


def canary_coins(seed: int, count: int) -> np.ndarray:
    """Which candidate canaries are inserted: independent fair coins (the randomisation Steinke,
    Nasr, Jagielski, arXiv 2305.08846, Thm. 3.1 needs); the others are the held-out null.

    Args:
        seed: the audit seed (the coins are a function of it alone).
        count: m, the number of candidates.

    Returns:
        bool, shape (count,): True for an inserted canary.
    """
    return np.random.default_rng([int(seed), 2305_08846]).random(int(count)) < 0.5


# -- the Gaussian mechanism's exact ε --------------------------------------------------------------
def gaussian_delta(epsilon: float, mu: float) -> float:
    """δ(ε) of the Gaussian mechanism with sensitivity/σ = μ (Balle & Wang, arXiv 1805.06530, Thm.
    8; the one implementation is `corrflow.accounting.gaussian`).

    Args:
        epsilon: ε ≥ 0.
        mu: μ = sensitivity/σ.

    Returns:
        δ(ε) = Φ(μ/2 − ε/μ) − e^ε Φ(−μ/2 − ε/μ); 0 when μ ≤ 0.
    """
    return gaussian.delta(epsilon, mu) if mu > 0 else 0.0


def gaussian_epsilon(mu: float, delta: float) -> float:
    """ε_G(μ; δ): the smallest ε ≥ 0 with δ(ε) ≤ δ for the Gaussian mechanism with sensitivity/σ = μ
    (Balle & Wang, arXiv 1805.06530, Thm. 8) — the accountants' own exact curve
    (`corrflow.accounting.mechanisms.gaussian_epsilon`), read at σ = 1, Δ = μ.

    Args:
        mu: μ = sensitivity/σ (may be inf).
        delta: δ in (0, 1).

    Returns:
        ε_G(μ; δ), rounded up; 0 when μ ≤ 0, inf when μ is not finite.

    Raises:
        InvalidArgumentError: ``delta`` is not in (0, 1).
    """
    require(0 < delta < 1, "delta", "a number in (0, 1)", delta)
    if not math.isfinite(mu):
        return math.inf
    if mu <= 0:
        return 0.0
    return mechanisms.gaussian_epsilon(1.0, float(mu), delta)


# -- test statistics -------------------------------------------------------------------------------
def whitened_scores(
    deltas: np.ndarray, projections: np.ndarray, patterns: np.ndarray
) -> np.ndarray:
    """GLS matched-filter scores s_j = a_jᵀΣ̂⁻¹p_j / √(a_jᵀΣ̂⁻¹a_j) (module docstring).

    Σ̂ = D Dᵀ/d; eigenvalues below 1e-12 of the largest are floored (noise omitted: Σ̂ is the users'
    updates alone and may be singular).

    Args:
        deltas: D, shape (n', d): the model changes of the n' released rounds.
        projections: p_j = D c_j, shape (m, n'), one row per candidate canary.
        patterns: a_j = M u_j, shape (m, n'): each canary's (possibly hypothetical) rounds mapped
            through the server optimizer.

    Returns:
        s, shape (m,): N(0, 1) for a held-out canary, N(‖C u_j‖/σ, 1) for an inserted one.
    """
    d = deltas.shape[1]
    sigma = deltas @ deltas.T / d
    w, v = np.linalg.eigh(sigma)
    w = np.maximum(w, max(float(w.max()), 1e-300) * 1e-12)
    inv = (v / w) @ v.T
    num = np.einsum("mi,ij,mj->m", patterns, inv, projections)
    den = np.sqrt(np.einsum("mi,ij,mj->m", patterns, inv, patterns))
    return num / den


def final_model_cosines(total_delta: np.ndarray, projections_total: np.ndarray) -> np.ndarray:
    """The final-model statistic of Andrew et al. (arXiv 2302.03098): the cosine ⟨c_j, Δ⟩/‖Δ‖.

    Args:
        total_delta: Δ = θ_T − θ_0, flattened, shape (d,).
        projections_total: ⟨c_j, Δ⟩, shape (m,).

    Returns:
        The cosines, shape (m,) (zeros when Δ = 0).
    """
    norm = float(np.linalg.norm(total_delta))
    return projections_total / norm if norm > 0 else np.zeros_like(projections_total)


# -- estimators ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Estimate:
    """The one-shot Gaussian-fit estimate from the inserted canaries' scores, with a bootstrap
    interval (Andrew et al., arXiv 2302.03098).

    Attributes:
        epsilon: ε̂ = ε_G(mean/std; δ).
        interval: the percentile bootstrap interval of ε̂.
        mean: μ̂ of the inserted scores.
        std: σ̂ (ddof 1) of the inserted scores.
        null_mean: mean of the held-out scores (≈ 0 when the test is calibrated).
        null_std: their standard deviation (≈ 1; NaN for fewer than two).
    """

    epsilon: float
    interval: tuple[float, float]
    mean: float
    std: float
    null_mean: float
    null_std: float

    def to_dict(self) -> dict:
        """Returns:
        The fields as a JSON-serialisable dict (the interval as a list).
        """
        return {**asdict(self), "interval": list(self.interval)}


def gaussian_fit_epsilon(inserted: np.ndarray, delta: float) -> float:
    """ε̂ = ε_G(μ̂/σ̂; δ), the equal-variance Gaussian fit of Andrew et al. (arXiv 2302.03098, §3).

    Args:
        inserted: the inserted canaries' scores, shape (m₊,), m₊ ≥ 2.
        delta: δ in (0, 1).

    Returns:
        ε̂ with μ̂, σ̂ the mean and standard deviation (ddof 1) of the scores; 0 when μ̂ ≤ 0, inf
        when σ̂ = 0 < μ̂.

    Raises:
        InvalidArgumentError: fewer than two inserted scores, or ``delta`` not in (0, 1) when σ̂ >
            0.
    """
    s = np.asarray(inserted, dtype=np.float64)
    require(s.size >= 2, "inserted", "at least two inserted canaries", s.size)
    mu, sd = float(s.mean()), float(s.std(ddof=1))
    if sd == 0:
        return math.inf if mu > 0 else 0.0
    return gaussian_epsilon(mu / sd, delta)


def one_shot_estimate(
    inserted: np.ndarray,
    held_out: np.ndarray,
    delta: float,
    confidence: float = 0.95,
    resamples: int = 1000,
    seed: int = 0,
) -> Estimate:
    """ε̂ (`gaussian_fit_epsilon`) with a percentile bootstrap interval over the inserted
    scores (``scipy.stats.bootstrap``; Andrew et al., arXiv 2302.03098).

    Args:
        inserted: the inserted canaries' scores, shape (m₊,), m₊ ≥ 2.
        held_out: the held-out canaries' scores, shape (m₋,) (reported as the null's mean and
            spread).
        delta: δ in (0, 1).
        confidence: the bootstrap interval's level.
        resamples: bootstrap resamples.
        seed: the bootstrap's seed.

    Returns:
        The `Estimate`.
    """
    from scipy import stats  # lazy: scipy.stats's import slows every CLI start

    s = np.asarray(inserted, dtype=np.float64)
    eps = gaussian_fit_epsilon(s, delta)
    res = stats.bootstrap(
        (s,),
        lambda x: gaussian_fit_epsilon(x, delta),
        n_resamples=resamples,
        confidence_level=confidence,
        method="percentile",
        vectorized=False,
        random_state=np.random.default_rng([int(seed), 1000]),
    )
    lo, hi = res.confidence_interval
    out = np.asarray(held_out, dtype=np.float64)
    return Estimate(
        eps,
        (float(lo), float(hi)),
        float(s.mean()),
        float(s.std(ddof=1)),
        float(out.mean()),
        float(out.std(ddof=1)) if out.size > 1 else math.nan,
    )


def one_run_p_value(m: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """An upper bound on P[W ≥ correct] for an (ε, δ)-DP run (Steinke, Nasr, Jagielski, arXiv
    2305.08846, Thm. 3.1 and Prop. 5.4; module docstring).

    Args:
        m: the number of candidate canaries.
        guesses: r = k₊ + k₋, the number of guesses.
        correct: v, the number of correct guesses.
        epsilon: ε of the null hypothesis.
        delta: δ of the null hypothesis.

    Returns:
        min(1, β + 2mδ·α), with β = P[Bin(r, q) ≥ v], q = e^ε/(1 + e^ε).
    """
    from scipy.stats import binom  # lazy: scipy.stats's import slows every CLI start

    q = 1.0 / (1.0 + math.exp(-epsilon))
    beta = float(binom.sf(correct - 1, guesses, q))
    if delta == 0 or correct == 0:
        return min(1.0, beta)
    i = np.arange(1, correct + 1)
    alpha = float(np.max((binom.sf(correct - i - 1, guesses, q) - beta) / i))
    return min(1.0, beta + 2 * m * delta * alpha)


def one_run_epsilon(
    m: int, guesses: int, correct: int, delta: float, significance: float = 0.05
) -> float:
    """The largest ε whose p-value (`one_run_p_value`) is ≤ ``significance`` (Steinke et al.,
    arXiv 2305.08846).

    Args:
        m: the number of candidate canaries.
        guesses: the number of guesses.
        correct: the number of correct guesses.
        delta: the run's δ.
        significance: the test's level.

    Returns:
        A lower bound on the run's ε at confidence 1 − significance (to 1e-7; 0 when even ε = 0 is
        not rejected, inf above 1000).
    """
    if guesses == 0 or one_run_p_value(m, guesses, correct, 0.0, delta) > significance:
        return 0.0
    from scipy import optimize  # lazy: scipy.optimize slows every CLI start

    hi = 1.0
    while one_run_p_value(m, guesses, correct, hi, delta) <= significance:
        hi *= 2
        if hi > 1e3:
            return math.inf
    return float(
        optimize.brentq(
            lambda e: one_run_p_value(m, guesses, correct, e, delta) - significance,
            0.0,
            hi,
            xtol=1e-7,
        )
    )


@dataclass(frozen=True)
class LowerBound:
    """ε_lo and the guess count that gave it (Steinke et al., arXiv 2305.08846).

    Attributes:
        epsilon: ε_lo.
        confidence: its confidence level.
        candidates: m.
        guesses_in: k₊, the "in" guesses (the highest scores).
        guesses_out: k₋, the "out" guesses (the lowest scores).
        correct: correct guesses among them.
        fractions: the guess fractions tried (Bonferroni-corrected over them).
        method: the bound's name and source.
    """

    epsilon: float
    confidence: float
    candidates: int
    guesses_in: int
    guesses_out: int
    correct: int
    fractions: tuple[float, ...]
    method: str = (
        "Steinke, Nasr, Jagielski 2023 one-run bound (arXiv 2305.08846), (ε, δ) version, guess "
        "counts fixed in advance, Bonferroni over them"
    )

    def to_dict(self) -> dict:
        """Returns:
        The fields as a JSON-serialisable dict (the fractions as a list).
        """
        return {**asdict(self), "fractions": list(self.fractions)}


def one_run_lower_bound(
    scores: np.ndarray,
    inserted: np.ndarray,
    delta: float,
    confidence: float = 0.95,
    fractions: Sequence[float] = GUESS_FRACTIONS,
) -> LowerBound:
    """The one-run lower bound ε_lo (Steinke, Nasr, Jagielski, arXiv 2305.08846, Thm. 3.1, (ε, δ)
    version).

    For each fraction f, guess "in" for the ⌊f·m/2⌋ highest scores and "out" for as many of the
    lowest; the best bound at significance (1 − confidence)/len(fractions) (Bonferroni).

    Args:
        scores: one score per candidate canary, shape (m,), m ≥ 2.
        inserted: which candidates were inserted (`canary_coins`), bool, shape (m,).
        delta: the run's δ.
        confidence: the bound's confidence level.
        fractions: the guess fractions, fixed before the scores are seen.

    Returns:
        The `LowerBound`.

    Raises:
        InvalidArgumentError: (field ``scores``) fewer than two scores, or ``inserted`` of another
            shape.
    """
    scores = np.asarray(scores, dtype=np.float64)
    inserted = np.asarray(inserted, dtype=bool)
    m = scores.size
    require(
        m >= 2 and inserted.shape == scores.shape, "scores", "one score per candidate canary", m
    )
    order = np.argsort(-scores, kind="stable")
    sig = (1 - confidence) / len(fractions)
    best = LowerBound(0.0, confidence, m, 0, 0, 0, tuple(fractions))
    for f in fractions:
        k = int(f * m) // 2
        if k == 0:
            continue
        top, bottom = order[:k], order[m - k :]
        correct = int(inserted[top].sum() + (~inserted[bottom]).sum())
        eps = one_run_epsilon(m, 2 * k, correct, delta, sig)
        if eps > best.epsilon or best.guesses_in == 0:
            best = LowerBound(eps, confidence, m, k, k, correct, tuple(fractions))
    return best


def lower_bound_ceiling(
    candidates: int,
    confidence: float = 0.95,
    fractions: Sequence[float] = GUESS_FRACTIONS,
    delta: float = 0.0,
) -> float:
    """The largest ε_lo an audit of this size can show: every guess correct at the largest guess
    count.

    Args:
        candidates: m, the number of candidate canaries.
        confidence: the bound's confidence level.
        fractions: the guess fractions.
        delta: the run's δ.

    Returns:
        The ceiling on ε_lo (an audit that shows it could not have shown more).
    """
    k = int(max(fractions) * candidates) // 2
    return one_run_epsilon(candidates, 2 * k, 2 * k, delta, (1 - confidence) / len(fractions))


def candidates_for_ceiling(
    claimed: float, delta: float = 0.0, start: int = 20, largest: int = 10**6
) -> int | None:
    """The fewest candidate canaries (on a grid of powers of two times ``start``, so at most 2× the
    exact count) whose ceiling `lower_bound_ceiling` exceeds ``claimed``: below it an audit
    cannot prove a violation of that claim. None when no size up to ``largest`` lifts it — with δ >
    0 the ceiling peaks (≈ 6.8 at δ = 1e-5 near 10⁴ candidates) and falls again, as the δ term of
    Steinke, Nasr, Jagielski (arXiv 2305.08846, Thm 5.2) grows with the count. The default
    ``largest`` (10⁶) keeps the search to a few CPU-seconds: the bound's cost grows with the count.

    Args:
        claimed: the claimed ε.
        delta: the run's δ.
        start: the smallest count tried.
        largest: the largest count tried (an audit with more canaries than this is impractical).

    Returns:
        The candidate count, or None.
    """
    m = start
    while m <= largest:
        if lower_bound_ceiling(m, delta=delta) > claimed:
            return m
        m *= 2
    return None


__all__ = [
    "GUESS_FRACTIONS",
    "candidates_for_ceiling",
    "Estimate",
    "LowerBound",
    "canary_coins",
    "canary_direction",
    "final_model_cosines",
    "gaussian_delta",
    "gaussian_epsilon",
    "gaussian_fit_epsilon",
    "lower_bound_ceiling",
    "one_run_epsilon",
    "one_run_lower_bound",
    "one_run_p_value",
    "one_shot_estimate",
    "whitened_scores",
]
