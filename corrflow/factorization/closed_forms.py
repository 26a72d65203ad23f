"""Closed-form banded and banded-inverse Toeplitz families (003: Kalinin, Rehn, Andersson, Honkela,
Lampert, "Beyond Square Roots: Explicit Memory-Efficient Factorization for Multi-Epoch Private
Learning", arXiv 2605.18379, §2–3).

Generating functions: the workload A ↔ a(x) = 1/((1 − x)(1 − βx)) (prefix: β = 0). Then
* γ-BIFR (003 Def. 2): noising C⁻¹ = the first ``bands`` coefficients of a(x)^(−γ); γ = 1/2 is BISR,
  bands = 2 is DP-λCGD with λ = γ (prefix workload), γ = 0 is DP-SGD;
* BSR (Kalinin & Lampert, "Banded Square Root Matrix Factorization for Differentially Private Model
  Training", arXiv 2405.13763): strategy C = the first ``bands`` coefficients of a(x)^(1/2);
* γ-BFR: strategy C = the first ``bands`` coefficients of a(x)^γ. A learning-rate schedule is not
  Toeplitz; the families use its Toeplitz part (momentum only) and the errors are still computed for
  the full workload. γ is chosen by a bounded 1-D search on the unamplified RMSE sens(C)·‖A
  C⁻¹‖_F/√n under the run's participation (003 §3.3).
"""

from __future__ import annotations

import numpy as np

from corrflow.errors import require
from corrflow.factorization.encoders import Encoder, InverseToeplitzEncoder, ToeplitzEncoder
from corrflow.factorization.participation import Participation
from corrflow.factorization.toeplitz import binomial_series
from corrflow.factorization.workloads import Workload


def workload_power_series(workload: Workload, power: float, p: int) -> np.ndarray:
    """Power series of the workload's generating function (003 §2, arXiv 2605.18379).

    Args:
        workload: A, with a(x) = 1/((1 − x)(1 − βx)) (prefix: β = 0); its learning-rate schedule is
            ignored.
        power: the exponent (1/2: square root; −γ: γ-BIFR's noising).
        p: how many coefficients.

    Returns:
        float64 array of shape (p,): the first p coefficients of (1−x)^(−power)·(1−βx)^(−power).
    """
    first = binomial_series(-power, p)
    if workload.momentum == 0.0:
        return first
    second = binomial_series(-power, p) * workload.momentum ** np.arange(p)
    return np.convolve(first, second)[:p]


def bifr_noising(workload: Workload, gamma: float, bands: int) -> np.ndarray:
    """γ-BIFR noising coefficients (003 Def. 2, arXiv 2605.18379).

    Args:
        workload: A.
        gamma: γ in [0, 1] (1/2: BISR; 0: DP-SGD).
        bands: p, the bands of C⁻¹.

    Returns:
        r, float64 of shape (bands,): the first column of the banded Toeplitz C⁻¹ (prefix workload:
        r_0 = 1, r_j = r_{j−1}(j − 1 − γ)/j).
    """
    require(0.0 <= gamma <= 1.0, "gamma", "a number in [0, 1]", gamma)
    return workload_power_series(workload, -gamma, bands)


def bifr_encoder(workload: Workload, n: int, bands: int, gamma: float) -> InverseToeplitzEncoder:
    """The γ-BIFR encoder: C⁻¹ banded Toeplitz with `bifr_noising` (003, arXiv 2605.18379).

    Args:
        workload: A.
        n: rounds.
        bands: p, the bands of C⁻¹.
        gamma: γ in [0, 1].

    Returns:
        The encoder (n × n, unnormalised: `factorize` scales it).
    """
    return InverseToeplitzEncoder(bifr_noising(workload, gamma, bands), n)


def bsr_encoder(workload: Workload, n: int, bands: int, gamma: float = 0.5) -> ToeplitzEncoder:
    """Banded (fractional) root: C = first ``bands`` coefficients of a(x)^γ (γ = 1/2: BSR, Kalinin &
    Lampert, arXiv 2405.13763; other γ: γ-BFR of 003).

    Args:
        workload: A.
        n: rounds.
        bands: p, the bands of C.
        gamma: γ (default 1/2).

    Returns:
        The banded Toeplitz encoder (n × n, unnormalised).
    """
    return ToeplitzEncoder(workload_power_series(workload, gamma, bands), n)


def unamplified_rmse(encoder: Encoder, workload: Workload, participation: Participation) -> float:
    """The unamplified RMSE at unit σ (003 Eqs. 3, 6; σ_{ε,δ} factored out).

    Args:
        encoder: C (n × n).
        workload: A.
        participation: the pattern the sensitivity is computed for.

    Returns:
        sens(C)·‖A C⁻¹‖_F/√n.
    """
    sens = encoder.sensitivity(participation).value
    return float(sens * np.sqrt(encoder.per_query_error(workload).sum() / encoder.n))


def best_gamma(
    build,
    workload: Workload,
    participation: Participation,
    lo: float = 0.0,
    hi: float = 1.0,
    xatol: float = 1e-5,
) -> tuple[float, float]:
    """Bounded golden-section search of γ minimising the unamplified RMSE (003 §3.3).

    Args:
        build: γ → encoder.
        workload: A.
        participation: the pattern the sensitivity is computed for.
        lo: the smallest γ.
        hi: the largest γ.
        xatol: the search's absolute tolerance on γ.

    Returns:
        (γ, its RMSE).
    """
    from scipy.optimize import minimize_scalar  # lazy: scipy.optimize slows every CLI start

    res = minimize_scalar(
        lambda g: unamplified_rmse(build(g), workload, participation),
        bounds=(lo, hi),
        method="bounded",
        options={"xatol": xatol},
    )
    return float(res.x), float(res.fun)


def nu_dpftrl_noising(n: int, nu: float) -> np.ndarray:
    """ν-DP-FTRL noising coefficients over the full horizon (003 §2.5, arXiv 2605.18379).

    Args:
        n: rounds.
        nu: ν in (0, 1].

    Returns:
        float64 array of shape (n,): a_j(1/2)·ν^j, the first column of C⁻¹.
    """
    require(0.0 < nu <= 1.0, "nu", "a number in (0, 1]", nu)
    return binomial_series(0.5, n) * nu ** np.arange(n)
