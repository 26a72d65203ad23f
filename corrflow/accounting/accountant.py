"""One entry point for the CLI and the strategy: ε for a σ, or σ for an ε, under a sampling scheme.

Sampling schemes and the accountant each uses:
* ``none``: unamplified, one Gaussian with σ/sensitivity (000 App. D.2) — PLD;
* ``cyclic-poisson``: 001 Prop. 2.1 reduction to ⌈n/b⌉ subsampled Gaussians — PLD;
* ``bminsep``: warm-start b-min-sep sampling (004 Alg. 2) — Monte Carlo (004 Eq. 1), EVR over a σ grid to calibrate;
* ``balls-in-bins``: the same with p = 1 and b = N/B bins (004 §1.6) — Monte Carlo;
* ``multi-attribution``: 004 Alg. 3 with users holding ≤ k_u items, each available round drawing Binom(k_u, p) of
  them (Thm 6.1, cold start) — Monte Carlo.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import dp_accounting as dpa
import numpy as np

from corrflow.accounting.mechanisms import (
    CyclicPoisson,
    calibrate_on_grid,
    check_delta,
    check_epsilon,
    check_sigma,
    epsilon_of,
    unamplified_event,
)
from corrflow.accounting.montecarlo import MonteCarloAccountant, minimum_samples, overall_delta
from corrflow.errors import InvalidArgumentError, require
from corrflow.factorization.base import Factorization
from corrflow.factorization.encoders import BandedEncoder, ToeplitzEncoder

SAMPLINGS = ("none", "cyclic-poisson", "bminsep", "balls-in-bins", "multi-attribution")


@dataclass(frozen=True)
class SamplingSpec:
    kind: str = "none"
    dataset_size: int | None = None
    expected_batch_size: float | None = None
    items_per_user: int = 1                    # k_u (multi-attribution)
    sampling_probability: float | None = None  # the sampler's Poisson p, when known (else derived from B/N)

    def __post_init__(self) -> None:
        require(self.kind in SAMPLINGS, "sampling", f"one of {SAMPLINGS}", self.kind)
        require(isinstance(self.items_per_user, int) and self.items_per_user >= 1, "items_per_user",
                "a positive integer", self.items_per_user)
        require(self.items_per_user == 1 or self.kind == "multi-attribution", "items_per_user",
                "1 unless sampling=multi-attribution", self.items_per_user)
        require(self.sampling_probability is None or 0 < self.sampling_probability <= 1, "sampling_probability",
                "a probability in (0, 1]", self.sampling_probability)
        if self.kind != "none":
            require(self.dataset_size is not None and self.dataset_size >= 1, "dataset_size",
                    f"a positive integer for sampling={self.kind}", self.dataset_size)
            require(self.expected_batch_size is not None and 0 < self.expected_batch_size <= self.dataset_size,
                    "expected_batch_size", f"in (0, dataset_size] for sampling={self.kind}",
                    self.expected_batch_size)


def _band(fac: Factorization) -> np.ndarray:
    enc = fac.encoder
    if isinstance(enc, ToeplitzEncoder):
        return enc.band_array()
    if isinstance(enc, BandedEncoder):
        return enc.band
    raise InvalidArgumentError("factorization", "a banded encoder (banded, toeplitz, dpsgd) for amplified "
                               "accounting", f"{fac.kind} ({enc.structure})")


def _monte_carlo(fac: Factorization, sampling: SamplingSpec) -> tuple[MonteCarloAccountant, dict]:
    band = _band(fac)
    p0 = sampling.expected_batch_size / sampling.dataset_size
    if sampling.kind == "balls-in-bins":
        bins = round(1 / p0)
        require(abs(bins * p0 - 1) < 1e-9, "expected_batch_size", "a divisor of dataset_size (N/B bins)",
                sampling.expected_batch_size)
        b, p = bins, 1.0
    else:
        b = fac.participation.min_sep
        require(p0 <= 1.0 / b, "expected_batch_size", f"at most dataset_size/min_sep = "
                f"{sampling.dataset_size / b:g} for b-min-sep sampling", sampling.expected_batch_size)
        p = sampling.sampling_probability or p0 / (1 - p0 * (b - 1))  # 004 §1.5: 1/p0 = 1/p + (b − 1)
    require(band.shape[1] <= b, "factorization", f"at most {b} bands (the sampler's separation) for the banded "
            "recursion", band.shape[1])
    warm = sampling.kind != "multi-attribution"     # Thm 6.1 is a cold-start analysis (004 §6.2)
    k_u = sampling.items_per_user
    params = {"min_sep": b, "sampling_probability": p, "participation_rate": p0, "warm_start": warm,
              "items_per_user": k_u}
    return MonteCarloAccountant(band, b, p, warm=warm, k_u=k_u), params


def account(fac: Factorization, *, delta: float, noise_multiplier: float | None = None,
            target_epsilon: float | None = None, sampling: SamplingSpec = SamplingSpec(),
            mc_samples: int = 100_000, seed: int = 0, grid_ratio: float = 1.02,
            max_candidates: int = 40) -> dict:
    """ε for ``noise_multiplier`` or σ for ``target_epsilon`` (exactly one), with the accountant's parameters."""
    check_delta(delta)
    require((noise_multiplier is None) != (target_epsilon is None), "noise_multiplier",
            "exactly one of noise_multiplier and target_epsilon")
    if noise_multiplier is not None:
        check_sigma(noise_multiplier)
    else:
        check_epsilon(target_epsilon)
    sens = fac.sensitivity.value
    out = {"delta": delta, "sampling": sampling.kind, "sensitivity": sens,
           "sensitivity_exact": fac.sensitivity.exact, "factorization_sha256": fac.sha256()}

    if sampling.kind == "none":
        def eps(s):
            return epsilon_of(unamplified_event(s, sens), delta)
        acc = {"name": "pld", "sampling": "none", "normalisation": "sensitivity 1 under the factorization's "
               f"participation ({fac.participation.describe()})", "slack": 0.0}
    elif sampling.kind == "cyclic-poisson":
        _band(fac)
        cp = CyclicPoisson(fac.rounds, fac.participation.min_sep, sampling.dataset_size,
                           sampling.expected_batch_size)
        require(fac.bands <= cp.cycle, "factorization", f"at most min_sep = {cp.cycle} bands for cyclic Poisson",
                fac.bands)
        col = float(fac.encoder.column_norms().max())

        def eps(s):
            return epsilon_of(cp.event(s, col), delta)
        acc = {"name": "pld", "sampling": "cyclic-poisson", "cycle": cp.cycle, "compositions": cp.compositions,
               "sampling_probability": cp.sampling_probability, "normalisation": "max column norm = 1 "
               f"(noise multiplier divided by {col:.6g}, 001 Prop. 2.1)", "slack": 0.0}
    else:
        return {**out, **_account_monte_carlo(fac, delta, noise_multiplier, target_epsilon, sampling, mc_samples,
                                              seed, grid_ratio, max_candidates)}
    if noise_multiplier is not None:
        out.update(noise_multiplier=noise_multiplier, epsilon=eps(noise_multiplier))
    else:
        # The unamplified σ is the natural starting guess (amplification only lowers it).
        guess = sens * dpa.get_sigma_gaussian(target_epsilon, delta)
        sigma, e = calibrate_on_grid(eps, target_epsilon, guess=guess)
        out.update(noise_multiplier=sigma, epsilon=e, target_epsilon=target_epsilon, grid_ratio=1.001)
    out["accountant"] = acc
    return out


def _account_monte_carlo(fac, delta, sigma, target_epsilon, sampling, samples, seed, ratio, max_candidates):
    mc, params = _monte_carlo(fac, sampling)
    delta_prime = delta / 2  # 004 §7.1: verify at δ/2
    needed = minimum_samples(delta_prime, delta)
    acc = {"name": "monte-carlo", "sampling": sampling.kind, **params, "samples": samples,
           "verify_delta": delta_prime, "samples_needed_for_guarantee": needed, "directions": "add and remove",
           "normalisation": "σ multiplies the clip norm; per-participation sensitivity = column norm of C"}
    if sigma is not None:
        est = mc.sample_losses(sigma, samples, seed)
        eps_hat = est.epsilon(delta_prime)
        eps_hi = est.epsilon(delta_prime, z=1.96)
        d_overall = overall_delta(est.samples, delta_prime)
        acc.update(slack=d_overall - delta_prime, overall_delta=d_overall, epsilon_ci95_upper=eps_hi,
                   guarantee=d_overall <= delta)
        return {"noise_multiplier": sigma, "epsilon": eps_hat, "accountant": acc}
    # Estimate-Verify-Release (004 Alg. 5): candidates from the fallback σ down by ``ratio``; the fallback (the
    # unamplified σ for ≤ ⌈n/b⌉ participations of each of k_u items, DP without Monte Carlo) is always valid.
    k = math.ceil(fac.rounds / params["min_sep"])
    sens_fb = params["items_per_user"] * float(np.sqrt(k)) * float(fac.encoder.column_norms().max())
    fallback, _ = calibrate_on_grid(lambda s: epsilon_of(unamplified_event(s, sens_fb), delta), target_epsilon,
                                    guess=sens_fb * dpa.get_sigma_gaussian(target_epsilon, delta))
    chosen, tried = fallback, []
    ss = np.random.SeedSequence(seed)
    for child in ss.spawn(max_candidates):
        cand = chosen / ratio
        passed, d_hat = mc.verify(cand, target_epsilon, delta_prime, samples, child)
        tried.append({"noise_multiplier": cand, "delta_hat": d_hat, "passed": bool(passed)})
        if not passed:
            break
        chosen = cand
    d_overall = overall_delta(samples, delta_prime)
    acc.update(fallback_noise_multiplier=fallback, candidates=tried, grid_ratio=ratio,
               overall_delta=d_overall, slack=d_overall - delta_prime, guarantee=d_overall <= delta)
    return {"noise_multiplier": chosen, "epsilon": target_epsilon, "target_epsilon": target_epsilon,
            "accountant": acc}
