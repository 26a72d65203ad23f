"""Post-hoc accounting of the participation that really happened (000: Choquette-Choo, McMahan,
Rush, Thakurta, "Multi-Epoch Matrix Factorization Mechanisms for Private Machine Learning", arXiv
2211.06530, Def. 1 applied to the realised patterns).

For user u with realised rounds S_u, the contribution of u is C G_u with G_u supported on S_u (rows
≤ 1), so the realised sensitivity is max_u sup ‖C G_u‖_F. For one fixed pattern π:
* X_π = C[:, π]ᵀ C[:, π] ≥ 0 entrywise → exactly ‖C·1_π‖ = √(1ᵀX_π1) (000 Cor. 2.1 / App. H Thm H.1
  claim 2);
* otherwise the smaller of √(λ_max(X_π)·|π|) (000 Thm. 2.1) and √(Σ|X_π|), both valid for vectors,
  labelled. The ε it implies is that of one Gaussian mechanism with noise multiplier σ / realised
  sensitivity (000 App. D.2).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from corrflow.errors import require
from corrflow.factorization.encoders import Encoder
from corrflow.factorization.sensitivity import NONNEG_TOL, Sensitivity


def pattern_sensitivity(encoder: Encoder, rounds: Iterable[int]) -> Sensitivity:
    """Worst-case ‖C G‖_F over contributions G on exactly these rounds (row i ≤ m_i in ℓ2; 000 Def.
    1).

    A round listed m times is a user contributing m items (each clipped to 1) in it —
    multi-attribution, 004 §6 (Dong & Ganesh, arXiv 2602.09338) — so the row bound is m_i: exact
    √(mᵀXm) when X = C[:, π]ᵀC[:, π] ≥ 0 entrywise (000 Cor. 2.1), else min(√(λ_max(X)·Σm²) (000
    Thm. 2.1), √(Σ|X_ij| m_i m_j)).

    Args:
        encoder: C, an n × n encoder (only the columns of these rounds are read).
        rounds: 0-based round indices in [0, n), repeated for multiplicity.

    Returns:
        The `Sensitivity`: its value, whether it is exact and the method
        (``"realized-nonnegative-gram"``, ``"realized-upper-bound"`` or ``"no-participation"``).

    Raises:
        InvalidArgumentError: (field ``rounds``) a round outside [0, n).
    """
    idx, mult = np.unique(np.fromiter((int(r) for r in rounds), dtype=np.int64), return_counts=True)
    if not idx.size:
        return Sensitivity(0.0, True, "no-participation")
    require(
        idx[0] >= 0 and idx[-1] < encoder.n,
        "rounds",
        f"round indices in [0, {encoder.n})",
        idx.tolist(),
    )
    cols = encoder.columns(idx.tolist())
    X = cols.T @ cols
    m = mult.astype(np.float64)
    if np.all(X >= -NONNEG_TOL * max(float(np.abs(X).max()), 1e-300)):
        return Sensitivity(float(np.sqrt(max(m @ X @ m, 0.0))), True, "realized-nonnegative-gram")
    bound = min(
        float(np.sqrt(np.linalg.eigvalsh(X)[-1] * (m @ m))), float(np.sqrt(m @ np.abs(X) @ m))
    )
    return Sensitivity(bound, False, "realized-upper-bound")


def realized_sensitivity(
    encoder: Encoder,
    user_rounds: Mapping[str, Sequence[int]],
    cache: dict[tuple[int, ...], Sensitivity] | None = None,
) -> tuple[Sensitivity, str | None]:
    """The realised sensitivity: the maximum over users of `pattern_sensitivity` (000 Def. 1).

    Users with the same rounds (and multiplicities) share one computation.

    Args:
        encoder: C, n × n.
        user_rounds: user id → the rounds the user contributed to (with multiplicity).
        cache: pattern (sorted rounds) → sensitivity, for this ``encoder`` only; updated in place,
            so a run recomputes only the patterns a round changed.

    Returns:
        (sensitivity, raw id of a worst user or None without participation); exact only when every
        pattern's value is.
    """
    by_pattern: dict[tuple[int, ...], str] = {}
    for user, rounds in user_rounds.items():
        by_pattern.setdefault(tuple(sorted(int(r) for r in rounds)), user)
    best, worst, exact = Sensitivity(0.0, True, "no-participation"), None, True
    for pattern, user in by_pattern.items():
        s = cache.get(pattern) if cache is not None else None
        if s is None:
            s = pattern_sensitivity(encoder, pattern)
            if cache is not None:
                cache[pattern] = s
        exact = exact and s.exact
        if s.value > best.value:
            best, worst = s, user
    return Sensitivity(best.value, exact, best.method if exact else "realized-upper-bound"), worst


def min_gap(rounds: Sequence[int]) -> int | None:
    """The smallest gap between two distinct participation rounds.

    Args:
        rounds: round indices (any order, repeats allowed).

    Returns:
        The smallest difference between distinct rounds; None for fewer than two distinct rounds.
    """
    r = np.unique(np.asarray(list(rounds), dtype=np.int64))
    return int(np.diff(r).min()) if r.size > 1 else None
