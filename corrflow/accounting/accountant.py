"""One accountant interface: ε for a σ, or σ for an ε, under a sampling description.

Every accountant implements :class:`Accountant` (``epsilon`` and ``noise_multiplier``) and returns an
:class:`AccountingResult` whose (epsilon, delta) is a pair the accountant guarantees. :func:`accountant_for` maps a
:class:`SamplingSpec` (sampling kind, plus an optional ``accountant`` choice) to the implementation:

* ``none`` → :class:`UnamplifiedAccountant`: one Gaussian with σ/sensitivity (000 App. D.2) — its exact (ε, δ)
  curve (Balle & Wang 2018, arXiv 1805.06530);
* ``cyclic-poisson`` → :class:`CyclicPoissonAccountant` (001 Prop. 2.1: ⌈n/b⌉ subsampled Gaussians, b-banded C) or,
  with ``accountant="mmcc"``, :class:`MMCCAccountant` (Generalized-MMCC, 002 App. D: any non-negative C);
* ``poisson`` (every round, probability B/N) → :class:`MMCCAccountant` (002 Alg. 1);
* ``bminsep`` / ``balls-in-bins`` / ``multi-attribution`` → :class:`MonteCarloEVRAccountant` (004 Eq. 1, Thm 6.1,
  Estimate-Verify-Release, Alg. 5).

:func:`account` keeps the dict interface of the CLI and the strategy (``to_dict`` plus sensitivity fields).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from corrflow import choices
from corrflow.accounting.mechanisms import (
    PLD_DISCRETIZATION,
    PROBE_DISCRETIZATION,
    CyclicPoisson,
    calibrate_log_sigma,
    check_delta,
    check_epsilon,
    check_pld_size,
    check_sigma,
    epsilon_of,
    gaussian_epsilon,
    gaussian_noise_multiplier,
)
from corrflow.accounting.mmcc import MMCC_DISCRETIZATION, mmcc_epsilon
from corrflow.accounting.montecarlo import MonteCarloAccountant, minimum_samples, overall_delta
from corrflow.errors import InvalidArgumentError, require
from corrflow.factorization.base import Factorization
from corrflow.factorization.encoders import BandedEncoder, BLTEncoder, ToeplitzEncoder

SAMPLINGS = choices.values(choices.Sampling)
#: Accountants valid for each sampling kind; the first is the default (:data:`corrflow.choices.ACCOUNTANTS_FOR`).
ACCOUNTANTS_FOR = {k.value: tuple(a.value for a in v) for k, v in choices.ACCOUNTANTS_FOR.items()}
ACCOUNTANT_NAMES = choices.values(choices.Accountant)
#: Monte Carlo releases ε at the z = 3 upper confidence end of its estimate, so that the fresh verification passes
#: almost always (at 1.96 about one run in ten fell back to the unamplified bound).
RELEASE_Z = 3.0
#: The report's accountant name for the exact Gaussian curve (unamplified accounting).
GAUSSIAN_NAME = "analytic-gaussian"


@dataclass(frozen=True)
class SamplingSpec:
    kind: str = "none"
    dataset_size: int | None = None
    expected_batch_size: float | None = None
    items_per_user: int = 1                    # k_u (multi-attribution)
    sampling_probability: float | None = None  # the sampler's Poisson p, when known (else derived from B/N)
    accountant: str | None = None              # one of ACCOUNTANTS_FOR[kind]; None: the default

    def __post_init__(self) -> None:
        require(self.kind in SAMPLINGS, "sampling", f"one of {SAMPLINGS}", self.kind)
        require(isinstance(self.items_per_user, int) and self.items_per_user >= 1, "items_per_user",
                "a positive integer", self.items_per_user)
        require(self.items_per_user == 1 or self.kind == "multi-attribution", "items_per_user",
                "1 unless sampling=multi-attribution", self.items_per_user)
        require(self.sampling_probability is None or (np.isfinite(self.sampling_probability)
                                                      and 0 < self.sampling_probability <= 1),
                "sampling_probability", "a probability in (0, 1]", self.sampling_probability)
        require(self.accountant is None or self.accountant in ACCOUNTANTS_FOR[self.kind], "accountant",
                f"one of {ACCOUNTANTS_FOR[self.kind]} for sampling={self.kind}", self.accountant)
        if self.kind != "none":
            require(self.dataset_size is not None and self.dataset_size >= 1, "dataset_size",
                    f"a positive integer for sampling={self.kind}", self.dataset_size)
            require(self.expected_batch_size is not None and 0 < self.expected_batch_size <= self.dataset_size,
                    "expected_batch_size", f"in (0, dataset_size] for sampling={self.kind}",
                    self.expected_batch_size)

    @property
    def method(self) -> str:
        return self.accountant or ACCOUNTANTS_FOR[self.kind][0]


@dataclass(frozen=True)
class AccountingOptions:
    """Knobs of the accountants that have them (Monte Carlo, MMCC); each accountant reads its own."""

    mc_samples: int = 100_000
    seed: int = 0
    grid_ratio: float = 1.02
    max_candidates: int = 40
    verify_target: bool = False      # Monte Carlo: draw the samples the target δ needs (≈ 10.7 M at δ = 1e-5)
    max_samples: int = 20_000_000    # cap for verify_target
    mmcc_grid: float | None = None   # Δ2; None: the largest sensitivity entry / 256
    delta_split: float = 0.5         # MMCC: share of δ spent on tail bounds
    progress: bool = False


@dataclass(frozen=True)
class AccountingResult:
    """A guaranteed (epsilon, delta) pair at ``noise_multiplier`` and how it was obtained.

    ``delta`` is the δ actually guaranteed with ``epsilon`` (for Monte Carlo: the δ Estimate-Verify-Release verified
    with the samples drawn, which may exceed ``target_delta``); ``guarantee`` says whether it meets the target.
    ``slack``: the part of δ not spent on the privacy-loss distribution itself (EVR's failure term, MMCC's tail
    bounds), or 0."""

    accountant: str
    epsilon: float
    delta: float
    noise_multiplier: float
    target_delta: float
    target_epsilon: float | None = None
    slack: float = 0.0
    parameters: dict = field(default_factory=dict)

    @property
    def guarantee(self) -> bool:
        return self.delta <= self.target_delta * (1 + 1e-12)

    def to_dict(self) -> dict:
        out = {"epsilon": self.epsilon, "delta": self.delta, "noise_multiplier": self.noise_multiplier,
               "target_delta": self.target_delta, "guarantee": self.guarantee,
               "accountant": {"name": self.accountant, **self.parameters, "slack": self.slack,
                              "delta": self.delta, "guarantee": self.guarantee}}
        if self.target_epsilon is not None:
            out["target_epsilon"] = self.target_epsilon
        return out


@runtime_checkable
class Accountant(Protocol):
    """ε for σ, or the smallest σ (to the accountant's precision, rounded up) for a target ε, of a factorization
    under one sampling scheme."""

    name: str

    def epsilon(self, fac: Factorization, noise_multiplier: float, delta: float, *,
                coarse: bool = False) -> AccountingResult:
        """ε at σ. ``coarse``: a cheaper, possibly looser bound that is still valid (a coarser PLD grid), for σ
        searches and plots."""
        ...

    def noise_multiplier(self, fac: Factorization, target_epsilon: float, delta: float) -> AccountingResult: ...


def _band(fac: Factorization) -> np.ndarray:
    enc = fac.encoder
    if isinstance(enc, ToeplitzEncoder):
        return enc.band_array()
    if isinstance(enc, BandedEncoder):
        return enc.band
    raise InvalidArgumentError("factorization", "a banded encoder (banded, toeplitz, dpsgd) for this accountant "
                               "(MMCC, --accountant mmcc, takes any non-negative encoder)",
                               f"{fac.kind} ({enc.structure})")


class _Calibrating:
    """σ for a target ε by :func:`calibrate_log_sigma` over ``_epsilon`` (ε must decrease in σ): probes with
    ``coarse=True`` (a coarser PLD where the accountant has one), the answer verified at full precision."""

    #: relative precision of the σ search (the old grid's ratio was 1.001)
    rtol = 1e-4
    probe_discretization: float | None = PROBE_DISCRETIZATION

    def epsilon(self, fac, noise_multiplier, delta, *, coarse=False):
        return self._epsilon(fac, noise_multiplier, delta, coarse=coarse)

    def noise_multiplier(self, fac, target_epsilon, delta):
        check_epsilon(target_epsilon)
        check_delta(delta)
        # The unamplified σ is the natural starting guess (amplification only lowers it).
        guess = gaussian_noise_multiplier(target_epsilon, delta, fac.sensitivity.value)
        fine: dict[float, AccountingResult] = {}

        def verify(s):
            fine[s] = self._epsilon(fac, s, delta, coarse=False)
            return fine[s].epsilon

        def probe(s):
            if self.probe_discretization is None:
                return verify(s)
            return self._epsilon(fac, s, delta, coarse=True).epsilon
        cal = calibrate_log_sigma(probe, verify, target_epsilon, guess=guess, rtol=self.rtol)
        res = fine[cal.noise_multiplier]
        return AccountingResult(res.accountant, res.epsilon, res.delta, cal.noise_multiplier, delta, target_epsilon,
                                res.slack, {**res.parameters, "calibration": {
                                    "method": "Brent search on log σ, verified at full precision",
                                    "rtol": self.rtol, "probes": cal.probes, "verifications": cal.verifications,
                                    "probe_discretization": self.probe_discretization}})


class UnamplifiedAccountant:
    """One Gaussian mechanism with noise multiplier σ/sensitivity (000 App. D.2), through its exact (ε, δ) curve
    (Balle & Wang 2018, "Improving the Gaussian Mechanism for Differential Privacy", arXiv 1805.06530, Thm. 8):
    ε and σ by root-finding in double precision, rounded to the safe side."""

    name = "unamplified"

    def _result(self, fac, sigma, eps, delta, target_epsilon=None):
        return AccountingResult(GAUSSIAN_NAME, eps, delta, sigma, delta, target_epsilon, parameters={
            "sampling": "none", "method": "exact Gaussian (ε, δ) curve (Balle & Wang 2018, arXiv 1805.06530, "
            "Thm. 8)", "normalisation": "sensitivity 1 under the factorization's participation "
            f"({fac.participation.describe()})"})

    def epsilon(self, fac, noise_multiplier, delta, *, coarse=False):   # exact: nothing coarser is cheaper
        check_delta(delta)
        # The same floor as every other accountant (ε would be in the thousands): one answer to a σ that small.
        check_pld_size(noise_multiplier, fac.sensitivity.value)
        return self._result(fac, noise_multiplier,
                            gaussian_epsilon(noise_multiplier, fac.sensitivity.value, delta), delta)

    def noise_multiplier(self, fac, target_epsilon, delta):
        sigma = gaussian_noise_multiplier(target_epsilon, delta, fac.sensitivity.value)
        eps = gaussian_epsilon(sigma, fac.sensitivity.value, delta)
        return self._result(fac, sigma, eps, delta, target_epsilon)


@dataclass
class CyclicPoissonAccountant(_Calibrating):
    sampling: SamplingSpec
    name = "cyclic-poisson"

    def _reduction(self, fac) -> tuple[CyclicPoisson, float]:
        _band(fac)
        cp = CyclicPoisson(fac.rounds, fac.participation.min_sep, self.sampling.dataset_size,
                           self.sampling.expected_batch_size)
        require(fac.bands <= cp.cycle, "factorization", f"at most min_sep = {cp.cycle} bands for the cyclic Poisson "
                "reduction (use --accountant mmcc for more bands)", fac.bands)
        return cp, float(fac.encoder.column_norms().max())

    def _result(self, cp, col, sigma, eps, delta, target_epsilon=None, exact=False):
        params = {"sampling": "cyclic-poisson", "cycle": cp.cycle, "compositions": cp.compositions,
                  "sampling_probability": cp.sampling_probability, "normalisation": "max column norm = 1 "
                  f"(noise multiplier divided by {col:.6g}, 001 Prop. 2.1)"}
        if exact:
            params["method"] = ("q = 1 (no amplification): the ⌈n/b⌉ Gaussians compose to one Gaussian with "
                                "sensitivity √⌈n/b⌉ · max column norm, through its exact (ε, δ) curve (Balle & Wang "
                                "2018, arXiv 1805.06530, Thm. 8)")
        return AccountingResult(GAUSSIAN_NAME if exact else "pld", eps, delta, sigma, delta, target_epsilon,
                                parameters=params)

    @staticmethod
    def _unamplified(cp: CyclicPoisson) -> bool:
        # q = 1 (up to rounding: a q below 1 only lowers ε, so treating it as 1 stays an upper bound)
        return cp.sampling_probability >= 1.0 - 1e-12

    def _epsilon(self, fac, noise_multiplier, delta, coarse=False):
        check_delta(delta)
        cp, col = self._reduction(fac)
        if self._unamplified(cp):
            check_pld_size(noise_multiplier, col * math.sqrt(cp.compositions))
            e = gaussian_epsilon(noise_multiplier, col * math.sqrt(cp.compositions), delta)
            return self._result(cp, col, noise_multiplier, e, delta, exact=True)
        e = epsilon_of(cp.event(noise_multiplier, col), delta,
                       discretization=self.probe_discretization if coarse else PLD_DISCRETIZATION)
        return self._result(cp, col, noise_multiplier, e, delta)

    def noise_multiplier(self, fac, target_epsilon, delta):
        check_epsilon(target_epsilon)
        check_delta(delta)
        cp, col = self._reduction(fac)
        if not self._unamplified(cp):
            return super().noise_multiplier(fac, target_epsilon, delta)
        sens = col * math.sqrt(cp.compositions)
        sigma = gaussian_noise_multiplier(target_epsilon, delta, sens)
        return self._result(cp, col, sigma, gaussian_epsilon(sigma, sens, delta), delta, target_epsilon, exact=True)


@dataclass
class MMCCAccountant(_Calibrating):
    """MMCC (002 Alg. 1) for Poisson sampling in every round; Generalized-MMCC (002 Alg. 3) for cyclic Poisson."""

    sampling: SamplingSpec
    options: AccountingOptions = field(default_factory=AccountingOptions)
    name = "mmcc"
    rtol = 1e-3                      # each probe is a full Generalized-MMCC run
    probe_discretization = 4 * MMCC_DISCRETIZATION

    def _setting(self, fac) -> tuple[int, float, list[int] | None]:
        s = self.sampling
        p = s.sampling_probability or s.expected_batch_size / s.dataset_size
        if s.kind == "poisson":
            return 1, p, None
        cycle = fac.participation.min_sep
        q = s.sampling_probability or cycle * s.expected_batch_size / s.dataset_size
        require(q <= 1, "expected_batch_size", f"at most dataset_size/cycle = {s.dataset_size / cycle:g} "
                "(q = cycle·B/N must be ≤ 1)", s.expected_batch_size)
        enc = fac.encoder
        toeplitz = isinstance(enc, BLTEncoder) or (isinstance(enc, ToeplitzEncoder) and not enc.column_normalize)
        return cycle, q, [0] if toeplitz else None

    def _epsilon(self, fac, noise_multiplier, delta, coarse=False):
        check_delta(delta)
        check_sigma(noise_multiplier)
        cycle, q, groups = self._setting(fac)
        o = self.options
        vdi = self.probe_discretization if coarse else MMCC_DISCRETIZATION
        run = mmcc_epsilon(fac.encoder.matrix(), q, noise_multiplier, delta, cycle=cycle, groups=groups,
                           delta_split=o.delta_split, grid=o.mmcc_grid, discretization=vdi, progress=o.progress)
        variant = "MMCC (002 Alg. 1)" if cycle == 1 else "Generalized-MMCC (002 Alg. 3)"
        return AccountingResult("mmcc", run.epsilon, delta, noise_multiplier, delta, slack=run.delta1, parameters={
            "sampling": self.sampling.kind, "variant": variant, "cycle": cycle, "sampling_probability": q,
            "delta_tail_bounds": run.delta1, "delta_pld": run.delta2, "grid": run.grid,
            "pld_discretization": vdi, "rows": run.rows, "distinct_rows": run.distinct_rows,
            "tail_bound_pairs": run.tail_bound_pairs, "max_p_tilde": run.max_p_tilde,
            "groups_analysed": run.groups_analysed,
            "normalisation": "σ multiplies the clip norm; C's entries are the per-round sensitivities"})


@dataclass
class MonteCarloEVRAccountant:
    """004's Monte Carlo accountant with Estimate-Verify-Release (Alg. 5, Thm A.1).

    The released pair is the one EVR verified with the samples drawn: ε is estimated (upper confidence end, z = 3)
    on one set of samples and verified at δ' = δ/2 on a fresh set; the δ reported is the overall δ that verification
    implies, max(δ, δ'+failure term), which exceeds the target δ unless enough samples were drawn
    (``verify_target``). A failed verification releases the b-min-sep fallback (⌈n/b⌉ participations, no
    amplification), which needs no Monte Carlo."""

    sampling: SamplingSpec
    options: AccountingOptions = field(default_factory=AccountingOptions)
    name = "monte-carlo"

    def _mc(self, fac) -> tuple[MonteCarloAccountant, dict]:
        sampling = self.sampling
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
        require(band.shape[1] <= b, "factorization", f"at most {b} bands (the sampler's separation) for the "
                "banded recursion", band.shape[1])
        warm = sampling.kind != "multi-attribution"     # Thm 6.1 is a cold-start analysis (004 §6.2)
        k_u = sampling.items_per_user
        params = {"sampling": sampling.kind, "min_sep": b, "sampling_probability": p, "participation_rate": p0,
                  "warm_start": warm, "items_per_user": k_u}
        return MonteCarloAccountant(band, b, p, warm=warm, k_u=k_u), params

    def _verify_samples(self, delta_prime: float, delta: float) -> tuple[int, int]:
        o = self.options
        needed = minimum_samples(delta_prime, delta)
        if not o.verify_target:
            return o.mc_samples, needed
        require(isinstance(o.max_samples, int) and o.max_samples >= 2, "max_samples", "an integer ≥ 2",
                o.max_samples)
        if needed > o.max_samples:
            print(f"monte carlo: the target δ = {delta:g} needs {needed} samples per direction, above "
                  f"--max-samples {o.max_samples}; verifying with {o.max_samples} (the δ reported is what they "
                  "verify)", file=sys.stderr)
        return max(o.mc_samples, min(needed, o.max_samples)), needed

    def _fallback(self, fac, params, delta, sigma=None, target_epsilon=None):
        k = math.ceil(fac.rounds / params["min_sep"])
        sens_fb = params["items_per_user"] * float(np.sqrt(k)) * float(fac.encoder.column_norms().max())
        if sigma is not None:
            return gaussian_epsilon(sigma, sens_fb, delta)
        return gaussian_noise_multiplier(target_epsilon, delta, sens_fb)

    def epsilon(self, fac, noise_multiplier, delta, *, coarse=False):
        check_delta(delta)
        check_sigma(noise_multiplier)
        mc, params = self._mc(fac)
        o = self.options
        k = math.ceil(fac.rounds / params["min_sep"])
        # The fallback is a PLD: refuse a σ it cannot represent before spending any samples.
        check_pld_size(noise_multiplier, params["items_per_user"] * math.sqrt(k)
                       * float(fac.encoder.column_norms().max()))
        delta_prime = delta / 2  # 004 §7.1: verify at δ/2
        verify_n, needed = self._verify_samples(delta_prime, delta)
        ss = np.random.SeedSequence(o.seed)
        est_seed, ver_seed = ss.spawn(2)
        est = mc.sample_losses(noise_multiplier, o.mc_samples, est_seed)
        eps_hat = est.epsilon(delta_prime)
        eps_rel = est.epsilon(delta_prime, z=RELEASE_Z)
        ver = mc.sample_losses(noise_multiplier, verify_n, ver_seed, progress=o.progress)
        d_hat, _ = ver.delta(eps_rel)
        passed = d_hat <= delta_prime
        d_overall = overall_delta(ver.samples, delta_prime)
        acc = {**params, "samples": o.mc_samples, "verify_samples": ver.samples, "verify_delta": delta_prime,
               "samples_needed_for_target_delta": needed, "directions": "add and remove",
               "epsilon_estimate": eps_hat, "epsilon_upper_confidence": eps_rel, "release_z": RELEASE_Z,
               "verified_delta_hat": d_hat,
               "verification_passed": bool(passed), "overall_delta": d_overall,
               "normalisation": "σ multiplies the clip norm; per-participation sensitivity = column norm of C"}
        if passed:
            return AccountingResult("monte-carlo", eps_rel, max(delta, d_overall), noise_multiplier, delta,
                                    slack=d_overall - delta_prime, parameters=acc)
        e_fb = self._fallback(fac, params, delta, sigma=noise_multiplier)
        print("monte carlo: verification failed; releasing the unamplified b-min-sep bound", file=sys.stderr)
        return AccountingResult("monte-carlo", e_fb, delta, noise_multiplier, delta, parameters={
            **acc, "released": "fallback: unamplified, ⌈n/b⌉ participations"})

    def noise_multiplier(self, fac, target_epsilon, delta):
        # Estimate-Verify-Release over candidates from the fallback σ down by ``grid_ratio``; the fallback (the
        # unamplified σ for ≤ ⌈n/b⌉ participations of each of k_u items, DP without Monte Carlo) is always valid.
        check_delta(delta)
        check_epsilon(target_epsilon)
        mc, params = self._mc(fac)
        o = self.options
        delta_prime = delta / 2
        verify_n, needed = self._verify_samples(delta_prime, delta)
        fallback = self._fallback(fac, params, delta, target_epsilon=target_epsilon)
        chosen, tried = fallback, []
        for child in np.random.SeedSequence(o.seed).spawn(o.max_candidates):
            cand = chosen / o.grid_ratio
            passed, d_hat = mc.verify(cand, target_epsilon, delta_prime, verify_n, child)
            tried.append({"noise_multiplier": cand, "delta_hat": d_hat, "passed": bool(passed)})
            if not passed:
                break
            chosen = cand
        d_overall = overall_delta(verify_n, delta_prime)
        released = delta if chosen == fallback else max(delta, d_overall)
        acc = {**params, "samples": verify_n, "verify_delta": delta_prime,
               "samples_needed_for_target_delta": needed, "directions": "add and remove",
               "fallback_noise_multiplier": fallback, "candidates": tried, "grid_ratio": o.grid_ratio,
               "overall_delta": d_overall,
               "normalisation": "σ multiplies the clip norm; per-participation sensitivity = column norm of C"}
        return AccountingResult("monte-carlo", target_epsilon, released, chosen, delta, target_epsilon,
                                slack=(d_overall - delta_prime) if chosen != fallback else 0.0, parameters=acc)


def accountant_for(sampling: SamplingSpec, options: AccountingOptions | None = None) -> Accountant:
    """The accountant for a sampling description (``sampling.accountant`` picks among the valid ones)."""
    options = options or AccountingOptions()
    method = sampling.method
    if method == "unamplified":
        return UnamplifiedAccountant()
    if method == "cyclic-poisson":
        return CyclicPoissonAccountant(sampling)
    if method == "mmcc":
        return MMCCAccountant(sampling, options)
    return MonteCarloEVRAccountant(sampling, options)


def account(fac: Factorization, *, delta: float, noise_multiplier: float | None = None,
            target_epsilon: float | None = None, sampling: SamplingSpec = SamplingSpec(),
            mc_samples: int = 100_000, seed: int = 0, grid_ratio: float = 1.02,
            max_candidates: int = 40, **options) -> dict:
    """ε for ``noise_multiplier`` or σ for ``target_epsilon`` (exactly one), as a dict: :class:`AccountingResult`'s
    ``to_dict()`` plus the sensitivity fields. ``options``: further :class:`AccountingOptions` fields."""
    check_delta(delta)
    require((noise_multiplier is None) != (target_epsilon is None), "noise_multiplier",
            "exactly one of noise_multiplier and target_epsilon")
    require(isinstance(mc_samples, int) and mc_samples >= 2, "mc_samples", "an integer ≥ 2", mc_samples)
    opts = AccountingOptions(mc_samples=mc_samples, seed=seed, grid_ratio=grid_ratio, max_candidates=max_candidates,
                             **options)
    acc = accountant_for(sampling, opts)
    if noise_multiplier is not None:
        check_sigma(noise_multiplier)
        res = acc.epsilon(fac, noise_multiplier, delta)
    else:
        check_epsilon(target_epsilon)
        res = acc.noise_multiplier(fac, target_epsilon, delta)
    return {"sampling": sampling.kind, "sensitivity": fac.sensitivity.value,
            "sensitivity_exact": fac.sensitivity.exact, "factorization_sha256": fac.sha256(), **res.to_dict()}


__all__ = ["ACCOUNTANTS_FOR", "ACCOUNTANT_NAMES", "SAMPLINGS", "Accountant", "AccountingOptions", "AccountingResult",
           "CyclicPoissonAccountant", "MMCCAccountant", "MonteCarloEVRAccountant", "SamplingSpec",
           "UnamplifiedAccountant", "accountant_for", "account", "check_pld_size"]
