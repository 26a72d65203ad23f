"""The per-round noise standard deviation per unit clip: the z of DP-SGD papers, Opacus and Flower,
next to corrflow's σ.

corrflow's σ multiplies a sensitivity-1 encoder C (DESIGN normalisation): the noise added to round
t's sum of clipped updates is σ·clip·w_t with w = C⁻¹Z and Z i.i.d. N(0, 1), so each coordinate of
it has standard deviation σ·clip·‖(C⁻¹)_{t,:}‖₂. Per unit clip that is z_t = σ·‖(C⁻¹)_{t,:}‖₂. For
DP-SGD with k participations C = I/√k and z_t = σ·√k in every round: the noise multiplier z a DP-SGD
paper, Opacus or Flower would state for the same noise. For a correlated C, z_t varies with t and is
not a privacy parameter by itself (the noise of different rounds is correlated and cancels in the
model); its range says how much noise each round's update carries.

The papers quote a different number for a correlated C: the noise multiplier per participation,
the σ of the Gaussian each participation is accounted as once C is scaled to max column norm 1
(000 App. D.2 and 001 Prop. 2.1: Choquette-Choo et al., arXiv 2211.06530; McKenna, arXiv
2405.15913). It is σ_pp = σ · raw_sensitivity(C) / max_j ‖C_raw[:, j]‖, which for the stored,
sensitivity-1 C is σ · sens(C) / max_j ‖C[:, j]‖ (`per_participation_factor`): √k for DP-SGD with
k participations and for a banded C with bands ≤ b; for DP-SGD with Poisson sampling (k = n) σ_pp
is the z of every DP-SGD paper.
"""

from __future__ import annotations

import numpy as np

from corrflow.factorization.base import Factorization

#: Relative spread of z_t under which it is reported as one z (DP-SGD and any C with equal rows of
# C⁻¹).
CONSTANT_RTOL = 1e-9


def noise_std_per_round(
    factorization: Factorization, noise_multiplier: float | None
) -> dict | None:
    """z_t = σ·‖(C⁻¹)_{t,:}‖₂, the per-coordinate noise standard deviation on round t's sum of
    clipped updates per unit clip (module docstring), summarised.

    Args:
        factorization: the normalised factorization (sensitivity-1 C, n rounds).
        noise_multiplier: σ; None gives None.

    Returns:
        ``{"z", "min", "max", "rms", "first", "last", "min_round", "max_round"}``: ``z`` is the one
        value when z_t is the same in every round (to ``CONSTANT_RTOL``), else None; ``rms`` =
        √(mean_t z_t²); rounds are 0-based.
    """
    if noise_multiplier is None:
        return None
    z = float(noise_multiplier) * factorization.encoder.noise_row_norms()
    lo, hi = float(z.min()), float(z.max())
    return {
        "z": float(np.sqrt(np.mean(z * z))) if hi - lo <= CONSTANT_RTOL * hi else None,
        "min": lo,
        "max": hi,
        "rms": float(np.sqrt(np.mean(z * z))),
        "first": float(z[0]),
        "last": float(z[-1]),
        "min_round": int(np.argmin(z)),
        "max_round": int(np.argmax(z)),
    }


def per_participation_factor(factorization: Factorization) -> float:
    """σ_pp / σ: the papers' noise multiplier per participation over corrflow's σ (module
    docstring), sens(C) / max_j ‖C[:, j]‖₂ of the stored encoder, which equals
    raw_sensitivity(C) / max_j ‖C_raw[:, j]‖₂ since normalising scales both by the same factor.

    Args:
        factorization: the normalised factorization (sensitivity-1 C).

    Returns:
        The factor, ≥ 1 (a column's norm never exceeds the sensitivity).
    """
    column = float(np.max(factorization.encoder.column_norms()))
    return float(factorization.sensitivity.value) / column


def per_participation_noise_multiplier(
    factorization: Factorization, noise_multiplier: float
) -> float:
    """The papers' noise multiplier per participation for corrflow's σ (module docstring).

    Args:
        factorization: the normalised factorization.
        noise_multiplier: corrflow's σ (sensitivity-1 C).

    Returns:
        σ_pp = σ · `per_participation_factor`.
    """
    return float(noise_multiplier) * per_participation_factor(factorization)


def noise_multiplier_from_per_participation(
    factorization: Factorization, per_participation: float
) -> float:
    """corrflow's σ for a paper's noise multiplier per participation (module docstring): the
    inverse of `per_participation_noise_multiplier`.

    Args:
        factorization: the normalised factorization.
        per_participation: σ_pp, as the papers quote it (e.g. 000 Table 3's z).

    Returns:
        σ = σ_pp / `per_participation_factor`.
    """
    return float(per_participation) / per_participation_factor(factorization)


def both_conventions(factorization: Factorization, noise_multiplier: float) -> str:
    """One line with σ in both conventions, as account, plan and simulate print it.

    Args:
        factorization: the normalised factorization.
        noise_multiplier: corrflow's σ.

    Returns:
        ``σ (corrflow, sensitivity-1 C) = …; per participation (the papers' noise multiplier) = …``.
    """
    pp = per_participation_noise_multiplier(factorization, noise_multiplier)
    return (
        f"σ (corrflow, sensitivity-1 C) = {noise_multiplier:.6g}; per participation (the papers' "
        f"noise multiplier) = {pp:.6g}"
    )


def resolve_noise_multiplier(
    factorization: Factorization,
    noise_multiplier: float | None,
    per_participation: float | None,
    flags: tuple[str, str] = ("--noise-multiplier", "--noise-multiplier-per-participation"),
) -> float | None:
    """corrflow's σ from either convention: ``noise_multiplier`` as is, or ``per_participation``
    (the papers' noise multiplier) converted through this factorization.

    Args:
        factorization: the normalised factorization the run or account uses.
        noise_multiplier: σ in corrflow's convention, or None.
        per_participation: σ_pp in the papers' convention, or None.
        flags: the two inputs' names, for the error.

    Returns:
        σ, or None when neither is given.

    Raises:
        InvalidArgumentError: both given, or σ_pp not a finite positive number (naming the flag).
    """
    import math

    from corrflow.errors import InvalidArgumentError

    if per_participation is None:
        return noise_multiplier
    if noise_multiplier is not None:
        raise InvalidArgumentError(flags[1], f"at most one of {flags[0]} and {flags[1]}")
    if not (math.isfinite(per_participation) and per_participation > 0):
        raise InvalidArgumentError(flags[1], "a finite, positive σ", per_participation)
    return noise_multiplier_from_per_participation(factorization, per_participation)


def describe(summary: dict | None) -> str:
    """One line for people: the DP-SGD z, or the range of z_t over the rounds (1-based rounds).

    Args:
        summary: `noise_std_per_round`'s dict, or None.

    Returns:
        The line ("n/a" for None).
    """
    if summary is None:
        return "n/a"
    if summary["z"] is not None:
        return f"z = {summary['z']:.4g} (noise std per unit clip on each round's sum)"
    return (
        f"z_t = {summary['min']:.4g} (round {summary['min_round'] + 1}) … {summary['max']:.4g} "
        f"(round {summary['max_round'] + 1}), rms {summary['rms']:.4g} (noise std per unit clip "
        "on a round's sum; correlated across rounds)"
    )


__all__ = [
    "CONSTANT_RTOL",
    "both_conventions",
    "describe",
    "noise_multiplier_from_per_participation",
    "noise_std_per_round",
    "per_participation_factor",
    "per_participation_noise_multiplier",
    "resolve_noise_multiplier",
]
