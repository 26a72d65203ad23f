"""Sensitivity of an encoder C under a participation schema (ℓ2 clipping to 1, vector
contributions).

sens(C) = sup over one user's contributions G (rows ≤ 1 in ℓ2, on one allowed pattern) of ‖C G‖_F
(000 Def. 1, Eq. 2; arXiv 2211.06530). Which formula applies:

* ``X = CᵀC ≥ 0`` on every pair one user can share: exact, ``max_π 1ᵀ X[π,π] 1`` (000 Cor. 2.1, Eq.
  3);
* otherwise for fixed-epoch: ``λ·√k`` with ``λ = max_π ‖C[:, π]‖₂`` (000 Thm. 2.1), an upper bound;
* b-min-sep, general X: ``VecSens(v)`` with ``v_i = VecSens(|X[i, :]|)``, an upper bound
  (Choquette-Choo et al., "(Amplified) Banded Matrix Factorization", arXiv 2306.08153, Alg. 3/4;
  sound for vectors since ⟨g_i, g_j⟩ ≤ 1);
* X banded with bandwidth ≤ b (banded C with ``bands ≤ min_sep``): exact, ``VecSens(diag X)`` (001
  §1.4);
* lower-triangular Toeplitz C with non-negative, non-increasing coefficients under b-min-sep: exact,
  ``‖Σ_{j<k} C[:, j·b]‖`` in O(n) (Kalinin & Lampert, arXiv 2405.13763, Thm. 2; 001 §1.4, 003 Thm.
  1).

Every result says whether it is exact or a bound, and which rule produced it.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

import numpy as np

from corrflow.errors import InvalidArgumentError, require
from corrflow.factorization.participation import Participation

NONNEG_TOL = 1e-12


@dataclass(frozen=True)
class Sensitivity:
    """A sensitivity value, whether it is exact, and the rule (``method``) that produced it.

    Attributes:
        value: sup ‖C G‖_F over one user's allowed contributions (000 Def. 1, Eq. 2).
        exact: True when ``value`` is the sensitivity itself, False when it is an upper bound.
        method: the rule that produced it (e.g. ``eq3-nonnegative-gram``, ``vecsens-upper-bound``).
    """

    value: float
    exact: bool
    method: str

    def scaled(self, factor: float) -> Sensitivity:
        """The sensitivity of c·C for a scale c.

        Args:
            factor: c > 0.

        Returns:
            The same rule and exactness with value c·value.
        """
        return Sensitivity(self.value * factor, self.exact, self.method)

    def to_dict(self) -> dict:
        """Returns:
        ``{"value", "exact", "method"}``.
        """
        return asdict(self)


def vec_sens(x: np.ndarray, min_sep: int, max_participations: int) -> np.ndarray:
    """max over b-min-sep sets π (|π| ≤ k) of Σ_{i∈π} x_i ("VecSens", arXiv 2306.08153 Alg. 3).

    Args:
        x: array of shape (..., n); each row is scored separately.
        min_sep: b.
        max_participations: k.

    Returns:
        float64 array of shape ``x.shape[:-1]``.

    Dynamic program f_j[i] = max_{i'≥i} (x_{i'} + f_{j−1}[i'+b]), vectorised over positions and
    rows: O(n·k) per row. Negative entries are never worth taking (fewer participations are
    allowed).
    """
    x = np.maximum(np.asarray(x, dtype=np.float64), 0.0)
    n = x.shape[-1]
    f = np.zeros(x.shape[:-1] + (n + min_sep,))
    for _ in range(max_participations):
        take = x + f[..., min_sep : min_sep + n]
        g = np.zeros_like(f)
        g[..., :n] = np.maximum.accumulate(take[..., ::-1], axis=-1)[..., ::-1]
        f = g
    return f[..., 0]


def _pattern_blocks(X: np.ndarray, participation: Participation) -> np.ndarray:
    """The (b, k, k) principal submatrices X[π_p, π_p] of the fixed-epoch patterns."""
    k, b = participation.epochs, participation.min_sep
    return np.einsum("ipjp->pij", X.reshape(k, b, k, b))


def fixed_epoch_sensitivity_from_gram(X: np.ndarray, participation: Participation) -> Sensitivity:
    """Sensitivity under (k, b) fixed-epoch participation from the Gram matrix (000 Eq. 3 or Thm.
    2.1).

    Args:
        X: CᵀC, float64 of shape (n, n).
        participation: a fixed-epoch schema over n rounds.

    Returns:
        Exact (Eq. 3) when X ≥ 0 on every pattern block, else the tighter of the Thm. 2.1 and
        VecSens upper bounds.
    """
    require(participation.kind == "fixed-epoch", "participation", "fixed-epoch", participation.kind)
    blocks = _pattern_blocks(X, participation)
    scale = max(float(np.max(np.abs(np.diagonal(blocks, axis1=1, axis2=2)))), 1e-300)
    if np.all(blocks >= -NONNEG_TOL * scale):
        return Sensitivity(
            float(np.sqrt(blocks.sum(axis=(1, 2)).max())), True, "eq3-nonnegative-gram"
        )
    lam = np.sqrt(max(float(np.linalg.eigvalsh(blk)[-1]) for blk in blocks))
    bound = lam * np.sqrt(participation.epochs)
    # The min-sep bound is also valid for fixed-epoch patterns (they are b-min-sep); keep the
    # tighter one.
    other = min_sep_bound_from_gram(X, participation.min_sep, participation.epochs)
    if other < bound:
        return Sensitivity(other, False, "vecsens-upper-bound")
    return Sensitivity(float(bound), False, "thm2.1-upper-bound")


def min_sep_bound_from_gram(X: np.ndarray, min_sep: int, max_participations: int) -> float:
    """Upper bound √VecSens(v), v_i = VecSens(|X[i,:]|) (arXiv 2306.08153 Alg. 4).

    Args:
        X: CᵀC, shape (n, n).
        min_sep: b.
        max_participations: k.

    Returns:
        A sensitivity bound sound for any C and vector contributions.
    """
    v = vec_sens(np.abs(X), min_sep, max_participations)
    return float(np.sqrt(vec_sens(v, min_sep, max_participations)))


def gram_bandwidth(X: np.ndarray, tol: float = 0.0) -> int:
    """The bandwidth of a square matrix.

    Args:
        X: shape (n, n).
        tol: entries below ``tol`` × max |X| count as zero.

    Returns:
        The smallest w with X[i, j] = 0 whenever |i − j| ≥ w (a diagonal X has w = 1).
    """
    n = X.shape[0]
    scale = tol * max(float(np.abs(X).max()), 1e-300)
    for off in range(n - 1, 0, -1):
        if np.any(np.abs(np.diagonal(X, off)) > scale):
            return off + 1
    return 1


def min_sep_sensitivity_from_gram(X: np.ndarray, participation: Participation) -> Sensitivity:
    """Sensitivity under b-min-sep with ≤ k participations from the Gram matrix.

    Args:
        X: CᵀC, shape (n, n).
        participation: a min-sep schema over n rounds.

    Returns:
        Exact, √VecSens(diag X), when X is b-banded (001 §1.4); otherwise the VecSens upper bound.
    """
    b, k = participation.min_sep, participation.max_participations
    if gram_bandwidth(X) <= b:
        return Sensitivity(float(np.sqrt(vec_sens(np.diag(X), b, k))), True, "banded-gram-disjoint")
    return Sensitivity(min_sep_bound_from_gram(X, b, k), False, "vecsens-upper-bound")


def sensitivity_from_gram(X: np.ndarray, participation: Participation) -> Sensitivity:
    """The sensitivity of an encoder from its Gram matrix, by the best rule that applies (see the
    module doc).

    Args:
        X: CᵀC, finite, shape (n, n) with n = ``participation.rounds``.
        participation: the (k, b) schema.

    Returns:
        The sensitivity, labelled exact or an upper bound, with the rule used.
    """
    X = np.asarray(X, dtype=np.float64)
    require(
        X.ndim == 2 and X.shape == (participation.rounds,) * 2,
        "encoder",
        f"a {participation.rounds}×{participation.rounds} Gram matrix",
        X.shape,
    )
    require(bool(np.all(np.isfinite(X))), "encoder", "finite entries (no NaN/Inf)")
    if participation.kind == "fixed-epoch":
        return fixed_epoch_sensitivity_from_gram(X, participation)
    return min_sep_sensitivity_from_gram(X, participation)


def is_nonneg_nonincreasing(coef: np.ndarray, tol: float = 1e-12) -> bool:
    c = np.asarray(coef, dtype=np.float64)
    scale = tol * max(float(np.abs(c).max()), 1e-300)
    return bool(np.all(c >= -scale) and np.all(np.diff(c) <= scale))


def toeplitz_min_sep_sensitivity(
    coef: np.ndarray, n: int, min_sep: int, max_participations: int
) -> float:
    """Exact b-min-sep sensitivity of a lower-triangular Toeplitz C in O(n) (003 Thm. 1; arXiv
    2405.13763 Thm. 2).

    Args:
        coef: the first column of C (its leading entries; the rest are zero), non-negative and
            non-increasing.
        n: rounds.
        min_sep: b.
        max_participations: k.

    Returns:
        ‖Σ_{j<k} C[:, j·b]‖.

    Raises:
        InvalidArgumentError: the coefficients are not non-negative and non-increasing.
    """
    c = np.zeros(n)
    m = min(len(coef), n)
    c[:m] = np.asarray(coef, dtype=np.float64)[:m]
    if not is_nonneg_nonincreasing(c):
        raise InvalidArgumentError(
            "encoder",
            "Toeplitz coefficients that are non-negative and non-increasing for "
            "the O(n) min-sep formula",
        )
    k = min(max_participations, -(-n // min_sep))
    total = np.zeros(n)
    for j in range(k):
        total[j * min_sep :] += c[: n - j * min_sep]
    return float(np.sqrt(total @ total))


def brute_force_sensitivity(
    C: np.ndarray, participation: Participation, max_vectors: int = 2_000_000
) -> float:
    """Exact scalar (d = 1) sensitivity by enumerating every allowed pattern and sign vector (000
    §2.1).

    Args:
        C: the encoder, shape (n, n).
        participation: the schema whose patterns are enumerated.
        max_vectors: refuse problems with more sign vectors than this.

    Returns:
        max over patterns π and signs s of ‖C[:, π] s‖.

    Test oracle for small n. For vector contributions the true sensitivity can exceed this by up to
    √(π/2) when CᵀC has negative entries (000 App. H.2).
    """
    C = np.asarray(C, dtype=np.float64)
    n = participation.rounds
    if participation.kind == "fixed-epoch":
        pats = [tuple(p) for p in participation.patterns()]
    else:
        pats = list(_min_sep_patterns(n, participation.min_sep, participation.max_participations))
    count = sum(2 ** (len(p) - 1) for p in pats)
    require(
        count <= max_vectors,
        "rounds",
        f"a problem small enough to enumerate (≤ {max_vectors} vectors)",
        count,
    )
    best = 0.0
    for p in pats:
        cols = C[:, list(p)]
        signs = np.array(list(itertools.product((1.0, -1.0), repeat=len(p) - 1)))
        signs = np.hstack([np.ones((len(signs), 1)), signs]) if len(p) > 1 else np.ones((1, 1))
        best = max(best, float(np.max(np.sum((cols @ signs.T) ** 2, axis=0))))
    return float(np.sqrt(best))


def _min_sep_patterns(n: int, b: int, k: int):
    """All maximal-by-inclusion b-separated sets of size ≤ k (smaller subsets are dominated for d =
    1)."""

    def rec(start: int, chosen: tuple):
        extended = False
        if len(chosen) < k:
            for i in range(start, n):
                extended = True
                yield from rec(i + b, chosen + (i,))
        if not extended and chosen:
            yield chosen

    yield from rec(0, ())
