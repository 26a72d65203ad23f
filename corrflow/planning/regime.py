"""How a run's per-round noise compares with its signal — the quantity a small-model preset matches
to the papers' StackOverflow regime (README References: 000 §5.3 and Table 3).

A round's released update is the average of the cohort's clipped updates plus noise. Each update
has ℓ2 norm at most c (the clip norm); the noise on the average has norm about σ·c·√d / m in d
coordinates (σ: the noise multiplier of a factorization normalised to sensitivity 1, as corrflow
calibrates it; m: the cohort). Against a signal of at most c, the per-round noise-to-signal ratio
is r = σ·√d / m. 000's StackOverflow runs (d ≈ 4.05·10⁶, m = 1,000, σ = 0.600 at ε ≈ 8.84) have
r ≈ 1.2. r is a matching rule, not an equivalence: real updates are often below the clip (the
signal is smaller, r understates the noise), they point in different directions (their average
is shorter still), and the correlated noise of one round is not independent of the next (how much
of it the decoder cancels is in the pre-flight ρ, `corrflow.planning.learnability`, not in r).
"""

from __future__ import annotations

import math

#: r of 000's StackOverflow setting: σ = 0.600 (MF, ε ≈ 8.84, δ = 1e-6), √d ≈ 2,012, m = 1,000.
PAPERS_NOISE_TO_SIGNAL = 0.600 * math.sqrt(4.05e6) / 1000


def per_round_noise_to_signal(sigma: float, dim: int, cohort: float) -> float:
    """r = σ·√d / m (module docstring).

    Args:
        sigma: the noise multiplier, sensitivity-1 convention.
        dim: d, the trained parameters.
        cohort: m, the number the summed update is divided by.

    Returns:
        r (0 without noise).
    """
    return float(sigma * math.sqrt(dim) / cohort) if sigma > 0 else 0.0


def matching_cohort(sigma: float, dim: int, target: float = PAPERS_NOISE_TO_SIGNAL) -> int:
    """The cohort m that makes r = σ·√d / m closest to ``target``.

    Args:
        sigma: the noise multiplier, sensitivity-1 convention.
        dim: d, the trained parameters.
        target: the r to match (default: the papers').

    Returns:
        m ≥ 1.
    """
    return max(1, round(sigma * math.sqrt(dim) / target))


def regime_section(sigma: float, dim: int, cohort: float) -> dict:
    """The privacy report's ``regime`` section.

    Args:
        sigma: the run's noise multiplier.
        dim: d, the trained parameters.
        cohort: m, the planned cohort.

    Returns:
        ``{"per_round_noise_to_signal", "noise_multiplier", "model_parameters", "cohort",
        "papers_noise_to_signal", "rule"}``.
    """
    sigma = float(sigma or 0.0)  # a non-private run has no noise multiplier
    return {
        "per_round_noise_to_signal": per_round_noise_to_signal(sigma, dim, cohort),
        "noise_multiplier": sigma,
        "model_parameters": int(dim),
        "cohort": float(cohort),
        "papers_noise_to_signal": PAPERS_NOISE_TO_SIGNAL,
        "rule": "r = σ·√d/m: per-round noise norm on the averaged update against a signal at the "
        "clip norm (updates below the clip or pointing apart make the true ratio larger)",
    }


def regime_lines(report: dict) -> list[str]:
    """The run summary's regime line: m, d, r and ρ (none for a report without a ``regime``).

    Args:
        report: a privacy report.

    Returns:
        Zero or one line.
    """
    regime = report.get("regime")
    if not regime:
        return []
    rho = (report.get("learning") or {}).get("noise_to_signal")
    return [
        f"regime      m = {regime['cohort']:g} clients per round, "
        f"d = {regime['model_parameters']:,} parameters: per-round noise-to-signal σ·√d/m = "
        f"{regime['per_round_noise_to_signal']:.3g} "
        f"(000's StackOverflow runs: {regime['papers_noise_to_signal']:.2g})"
        + ("" if rho is None else f"; pre-flight ρ = {rho:.3g}")
    ]
