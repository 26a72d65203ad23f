"""The per-round noise standard deviation per unit clip: the z of DP-SGD papers, Opacus and Flower,
next to corrflow's σ.

corrflow's σ multiplies a sensitivity-1 encoder C (DESIGN normalisation): the noise added to round
t's sum of clipped updates is σ·clip·w_t with w = C⁻¹Z and Z i.i.d. N(0, 1), so each coordinate of
it has standard deviation σ·clip·‖(C⁻¹)_{t,:}‖₂. Per unit clip that is z_t = σ·‖(C⁻¹)_{t,:}‖₂. For
DP-SGD with k participations C = I/√k and z_t = σ·√k in every round: the noise multiplier z a DP-SGD
paper, Opacus or Flower would state for the same noise. For a correlated C, z_t varies with t and is
not a privacy parameter by itself (the noise of different rounds is correlated and cancels in the
model); its range says how much noise each round's update carries.
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


__all__ = ["CONSTANT_RTOL", "describe", "noise_std_per_round"]
