"""One accountant interface: ε for a σ, or σ for an ε, under a sampling description.

Every accountant implements `Accountant` (``epsilon`` and ``noise_multiplier``) and returns
an `AccountingResult` whose (epsilon, delta) is a pair the accountant guarantees.
`accountant_for` maps a `SamplingSpec` (sampling kind, plus an optional ``accountant``
choice) to the implementation:

* ``none`` → `UnamplifiedAccountant`: one Gaussian with σ/sensitivity (000 App. D.2) — its
  exact (ε, δ) curve (Balle & Wang 2018, arXiv 1805.06530);
* ``cyclic-poisson`` → `CyclicPoissonAccountant` (001 Prop. 2.1: ⌈n/b⌉ subsampled Gaussians,
  b-banded C) or, with ``accountant="mmcc"``, `MMCCAccountant` (Generalized-MMCC, 002 App. D:
  any non-negative C);
* ``poisson`` (every round, probability B/N) → `MMCCAccountant` (002 Alg. 1) or, for banded
  non-negative encoders with ≤ 12 bands, `MonteCarloEVRAccountant` over the exact likelihood
  (forward algorithm);
* ``bminsep`` / ``balls-in-bins`` / ``multi-attribution`` → `MonteCarloEVRAccountant` (004
  Eq. 1, Thm 6.1, Estimate-Verify-Release, Alg. 5).

With no accountant named (``SamplingSpec.accountant=None``) an amplified sampling gets
`TightestAccountant`: every accountant that applies is computed and the tightest bound
verified at the target δ is used; the result names it and lists the others with their values.

`account` keeps the dict interface of the CLI and the strategy (``to_dict`` plus sensitivity
fields).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field, replace
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
from corrflow.accounting.montecarlo import (
    DEFAULT_MAX_SAMPLES,
    MAX_FORWARD_BANDS,
    EVRRun,
    MonteCarloAccountant,
    adaptive_evr,
    first_verification_size,
    minimum_samples,
    overall_delta,
)
from corrflow.accounting.noise_scale import noise_std_per_round
from corrflow.errors import InvalidArgumentError, require
from corrflow.factorization.base import Factorization
from corrflow.factorization.encoders import BandedEncoder, BLTEncoder, ToeplitzEncoder

#: The sampling kinds a `SamplingSpec` accepts (`corrflow.choices.Sampling`).
SAMPLINGS = choices.values(choices.Sampling)
#: Accountants valid for each sampling kind; the first is the default
# (`corrflow.choices.ACCOUNTANTS_FOR`).
ACCOUNTANTS_FOR = {k.value: tuple(a.value for a in v) for k, v in choices.ACCOUNTANTS_FOR.items()}
ACCOUNTANT_NAMES = choices.values(choices.Accountant)
#: Monte Carlo releases ε at the z = 3 upper confidence end of its estimate, so that the fresh
# verification passes almost always (at 1.96 about one run in ten fell back to the unamplified
# bound).
RELEASE_Z = 3.0
#: The report's accountant name for the exact Gaussian curve (unamplified accounting): the same
# name as the ``--accountant`` choice, so plan, simulate, compare and the report agree.
GAUSSIAN_NAME = "unamplified"
#: Names earlier versions wrote for the same accountant (read from checkpoints on resume).
LEGACY_NAMES = {"analytic-gaussian": GAUSSIAN_NAME}


@dataclass(frozen=True)
class SamplingSpec:
    """How the users of each round are chosen, as the accountants read it.

    Attributes:
        kind: one of `SAMPLINGS` (``none``: deterministic participation, accounted unamplified).
        dataset_size: N, the items sampled from (required unless ``kind`` is ``none``).
        expected_batch_size: B, the expected items per round, in (0, N] (required unless ``kind`` is
            ``none``).
        items_per_user: k_u, items a user may hold (multi-attribution only).
        sampling_probability: the sampler's Poisson probability p when known (else derived from
            B/N).
        accountant: one of ``ACCOUNTANTS_FOR[kind]``; None: for an amplified sampling, the tightest
            of every accountant that applies (`TightestAccountant`), for ``none`` the unamplified
            one.

    Raises:
        InvalidArgumentError: a field is out of range or inconsistent with ``kind`` (the error names
            it).
    """

    kind: str = "none"
    dataset_size: int | None = None
    expected_batch_size: float | None = None
    items_per_user: int = 1  # k_u (multi-attribution)
    # the sampler's Poisson p, when known (else derived from B/N)
    sampling_probability: float | None = None
    accountant: str | None = None  # one of ACCOUNTANTS_FOR[kind]; None: the default

    def __post_init__(self) -> None:
        require(self.kind in SAMPLINGS, "sampling", f"one of {SAMPLINGS}", self.kind)
        require(
            isinstance(self.items_per_user, int) and self.items_per_user >= 1,
            "items_per_user",
            "a positive integer",
            self.items_per_user,
        )
        require(
            self.items_per_user == 1 or self.kind == "multi-attribution",
            "items_per_user",
            "1 unless sampling=multi-attribution",
            self.items_per_user,
        )
        require(
            self.sampling_probability is None
            or (np.isfinite(self.sampling_probability) and 0 < self.sampling_probability <= 1),
            "sampling_probability",
            "a probability in (0, 1]",
            self.sampling_probability,
        )
        require(
            self.accountant is None or self.accountant in ACCOUNTANTS_FOR[self.kind],
            "accountant",
            f"one of {ACCOUNTANTS_FOR[self.kind]} for sampling={self.kind}",
            self.accountant,
        )
        if self.kind != "none":
            require(
                self.dataset_size is not None and self.dataset_size >= 1,
                "dataset_size",
                f"a positive integer for sampling={self.kind}",
                self.dataset_size,
            )
            require(
                self.expected_batch_size is not None
                and 0 < self.expected_batch_size <= self.dataset_size,
                "expected_batch_size",
                f"in (0, dataset_size] for sampling={self.kind}",
                self.expected_batch_size,
            )

    @property
    def method(self) -> str:
        """``accountant``, or the kind's first valid accountant (``ACCOUNTANTS_FOR[kind][0]``)."""
        return self.accountant or ACCOUNTANTS_FOR[self.kind][0]


@dataclass(frozen=True)
class AccountingOptions:
    """Knobs of the accountants that have them (Monte Carlo, MMCC); each accountant reads its own.

    Attributes:
        mc_samples: Monte Carlo: the first batch per direction (None: what the target δ needs).
        seed: the Monte Carlo seed.
        grid_ratio: Monte Carlo σ search: each candidate is the previous one divided by this.
        max_candidates: Monte Carlo σ search: at most this many candidates.
        verify_target: σ calibration (Monte Carlo): draw the samples per candidate the target δ
            needs.
        max_samples: Monte Carlo: the sample budget per direction, all batches together.
        time_limit: Monte Carlo: seconds after which the search aborts, releasing nothing (None:
            none).
        workers: Monte Carlo: sampler processes for ε (None: the CPU count).
        mmcc_grid: MMCC's Δ2 grid (None: the largest sensitivity entry / 256).
        delta_split: MMCC: the share of δ spent on tail bounds.
        progress: progress lines on stderr for long runs.
    """

    # Monte Carlo: first batch per direction (None: what the target δ needs)
    mc_samples: int | None = None
    seed: int = 0
    grid_ratio: float = 1.02
    max_candidates: int = 40
    verify_target: bool = False  # σ calibration (Monte Carlo): draw the samples the target δ needs
    max_samples: int = DEFAULT_MAX_SAMPLES  # Monte Carlo: sample budget per direction, all batches
    # Monte Carlo: seconds after which the search aborts (nothing released)
    time_limit: float | None = None
    workers: int | None = None  # Monte Carlo: sampler processes (None: the CPU count)
    mmcc_grid: float | None = None  # Δ2; None: the largest sensitivity entry / 256
    delta_split: float = 0.5  # MMCC: share of δ spent on tail bounds
    progress: bool = False


@dataclass(frozen=True)
class AccountingResult:
    """A guaranteed (epsilon, delta) pair at ``noise_multiplier`` and how it was obtained.

    ``delta`` is the δ actually guaranteed with ``epsilon`` (for Monte Carlo: the δ
    Estimate-Verify-Release verified with the samples drawn, which may exceed ``target_delta``);
    ``guarantee`` says whether it meets the target. ``slack``: the part of δ not spent on the
    privacy-loss distribution itself (EVR's failure term, MMCC's tail bounds), or 0."""

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
        """Whether the guaranteed ``delta`` meets ``target_delta`` (to 1e-12 relative)."""
        return self.delta <= self.target_delta * (1 + 1e-12)

    def to_dict(self) -> dict:
        """The result in the privacy report's shape.

        Returns:
            ``{"epsilon", "delta", "noise_multiplier", "target_delta", "guarantee", "accountant":
            {"name", ... parameters, "slack", "delta", "guarantee"}}``, plus ``target_epsilon`` when
            one was given.
        """
        out = {
            "epsilon": self.epsilon,
            "delta": self.delta,
            "noise_multiplier": self.noise_multiplier,
            "target_delta": self.target_delta,
            "guarantee": self.guarantee,
            "accountant": {
                "name": self.accountant,
                **self.parameters,
                "slack": self.slack,
                "delta": self.delta,
                "guarantee": self.guarantee,
            },
        }
        if self.target_epsilon is not None:
            out["target_epsilon"] = self.target_epsilon
        return out


@runtime_checkable
class Accountant(Protocol):
    """ε for σ, or the smallest σ (to the accountant's precision, rounded up) for a target ε, of a
    factorization under one sampling scheme."""

    name: str

    def epsilon(
        self, fac: Factorization, noise_multiplier: float, delta: float, *, coarse: bool = False
    ) -> AccountingResult:
        """ε at σ.

        Args:
            fac: the factorization, normalised to sensitivity 1 under its participation.
            noise_multiplier: σ (the noise's standard deviation per unit clip norm).
            delta: δ in (0, 1).
            coarse: a cheaper, possibly looser bound that is still valid (a coarser PLD grid), for σ
                searches and plots.

        Returns:
            The guaranteed (ε, δ) at σ and how it was obtained.

        Raises:
            InvalidArgumentError: δ or σ out of range, or a factorization or sampling this
                accountant cannot analyse.
        """
        ...

    def noise_multiplier(
        self, fac: Factorization, target_epsilon: float, delta: float
    ) -> AccountingResult:
        """The smallest σ (to the accountant's precision, rounded up) whose ε is at most
        ``target_epsilon``.

        Args:
            fac: the factorization, normalised to sensitivity 1 under its participation.
            target_epsilon: ε > 0.
            delta: δ in (0, 1).

        Returns:
            The guaranteed (ε, δ) at the calibrated σ, with the target ε.

        Raises:
            InvalidArgumentError: ε or δ out of range, or a factorization or sampling this
                accountant cannot analyse.
        """
        ...


def _band(fac: Factorization) -> np.ndarray:
    enc = fac.encoder
    if isinstance(enc, ToeplitzEncoder):
        return enc.band_array()
    if isinstance(enc, BandedEncoder):
        return enc.band
    raise InvalidArgumentError(
        "factorization",
        "a banded encoder (banded, toeplitz, dpsgd) for this accountant "
        "(MMCC, --accountant mmcc, takes any non-negative encoder)",
        f"{fac.kind} ({enc.structure})",
    )


class _Calibrating:
    """σ for a target ε by `calibrate_log_sigma` over ``_epsilon`` (ε must decrease in σ):
    probes with ``coarse=True`` (a coarser PLD where the accountant has one), the answer verified at
    full precision."""

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
        return AccountingResult(
            res.accountant,
            res.epsilon,
            res.delta,
            cal.noise_multiplier,
            delta,
            target_epsilon,
            res.slack,
            {
                **res.parameters,
                "calibration": {
                    "method": "Brent search on log σ, verified at full precision",
                    "rtol": self.rtol,
                    "probes": cal.probes,
                    "verifications": cal.verifications,
                    "probe_discretization": self.probe_discretization,
                },
            },
        )


class UnamplifiedAccountant:
    """One Gaussian mechanism with noise multiplier σ/sensitivity (000 App. D.2), through its exact
    (ε, δ) curve (Balle & Wang 2018, "Improving the Gaussian Mechanism for Differential Privacy",
    arXiv 1805.06530, Thm. 8): ε and σ by root-finding in double precision, rounded to the safe
    side."""

    name = "unamplified"

    def _result(self, fac, sigma, eps, delta, target_epsilon=None):
        return AccountingResult(
            GAUSSIAN_NAME,
            eps,
            delta,
            sigma,
            delta,
            target_epsilon,
            parameters={
                "sampling": "none",
                "method": (
                    "exact Gaussian (ε, δ) curve (Balle & Wang 2018, arXiv 1805.06530, Thm. 8)"
                ),
                "normalisation": "sensitivity 1 under the factorization's participation "
                f"({fac.participation.describe()})",
            },
        )

    # exact: nothing coarser is cheaper
    def epsilon(self, fac, noise_multiplier, delta, *, coarse=False):
        """ε at σ from the exact Gaussian curve at sensitivity ``fac.sensitivity`` (see
        `Accountant.epsilon`).

        Args:
            fac: the factorization, normalised to sensitivity 1 under its participation.
            noise_multiplier: σ.
            delta: δ in (0, 1).
            coarse: ignored (the exact curve is the cheapest).

        Returns:
            The `AccountingResult`.
        """
        check_delta(delta)
        # The same floor as every other accountant (ε would be in the thousands): one answer to a σ
        # that small.
        check_pld_size(noise_multiplier, fac.sensitivity.value)
        return self._result(
            fac,
            noise_multiplier,
            gaussian_epsilon(noise_multiplier, fac.sensitivity.value, delta),
            delta,
        )

    def noise_multiplier(self, fac, target_epsilon, delta):
        """The smallest σ, rounded up, whose exact Gaussian ε is at most ``target_epsilon``.

        Args:
            fac: the factorization, normalised to sensitivity 1 under its participation.
            target_epsilon: ε > 0.
            delta: δ in (0, 1).

        Returns:
            The `AccountingResult` at that σ.
        """
        sigma = gaussian_noise_multiplier(target_epsilon, delta, fac.sensitivity.value)
        eps = gaussian_epsilon(sigma, fac.sensitivity.value, delta)
        return self._result(fac, sigma, eps, delta, target_epsilon)


@dataclass
class CyclicPoissonAccountant(_Calibrating):
    """Cyclic Poisson sampling of a b-banded encoder (001: McKenna, "Scaling up the Banded Matrix
    Factorization Mechanism for Differentially Private ML", arXiv 2405.15913, Prop. 2.1): the
    mechanism is ⌈n/b⌉ compositions of a Poisson-subsampled Gaussian with probability q = b·B/N and
    noise multiplier σ / max column norm of C, accounted by dp-accounting's PLD; at q = 1, one
    Gaussian through its exact curve (Balle & Wang, arXiv 1805.06530, Thm. 8). σ for a target ε by a
    Brent search on log σ.

    Args:
        sampling: a ``cyclic-poisson`` `SamplingSpec`.
    """

    sampling: SamplingSpec
    name = "cyclic-poisson"

    def _reduction(self, fac) -> tuple[CyclicPoisson, float]:
        _band(fac)
        cp = CyclicPoisson(
            fac.rounds,
            fac.participation.min_sep,
            self.sampling.dataset_size,
            self.sampling.expected_batch_size,
        )
        require(
            fac.bands <= cp.cycle,
            "factorization",
            f"at most min_sep = {cp.cycle} bands for the cyclic Poisson "
            "reduction (use --accountant mmcc for more bands)",
            fac.bands,
        )
        return cp, float(fac.encoder.column_norms().max())

    def _result(self, cp, col, sigma, eps, delta, target_epsilon=None, exact=False):
        params = {
            "sampling": "cyclic-poisson",
            "cycle": cp.cycle,
            "compositions": cp.compositions,
            "sampling_probability": cp.sampling_probability,
            "normalisation": (
                f"max column norm = 1 (noise multiplier divided by {col:.6g}, 001 Prop. 2.1)"
            ),
        }
        if exact:
            params["method"] = (
                "q = 1 (no amplification): the ⌈n/b⌉ Gaussians compose to one Gaussian with "
                "sensitivity √⌈n/b⌉ · max column norm, through its exact (ε, δ) curve (Balle & "
                "Wang 2018, arXiv 1805.06530, Thm. 8)"
            )
        return AccountingResult(
            GAUSSIAN_NAME if exact else "pld",
            eps,
            delta,
            sigma,
            delta,
            target_epsilon,
            parameters=params,
        )

    @staticmethod
    def _unamplified(cp: CyclicPoisson) -> bool:
        # q = 1 (up to rounding: a q below 1 only lowers ε, so treating it as 1 stays an upper
        # bound)
        return cp.sampling_probability >= 1.0 - 1e-12

    def _epsilon(self, fac, noise_multiplier, delta, coarse=False):
        check_delta(delta)
        cp, col = self._reduction(fac)
        if self._unamplified(cp):
            check_pld_size(noise_multiplier, col * math.sqrt(cp.compositions))
            e = gaussian_epsilon(noise_multiplier, col * math.sqrt(cp.compositions), delta)
            return self._result(cp, col, noise_multiplier, e, delta, exact=True)
        e = epsilon_of(
            cp.event(noise_multiplier, col),
            delta,
            discretization=self.probe_discretization if coarse else PLD_DISCRETIZATION,
        )
        return self._result(cp, col, noise_multiplier, e, delta)

    def noise_multiplier(self, fac, target_epsilon, delta):
        """The smallest σ (to ``rtol``, rounded up) whose ε is at most ``target_epsilon``: a Brent
        search on log σ over the PLD (exact when q = 1).

        Args:
            fac: a banded factorization with at most b bands.
            target_epsilon: ε > 0.
            delta: δ in (0, 1).

        Returns:
            The `AccountingResult` at that σ, with the calibration's details.
        """
        check_epsilon(target_epsilon)
        check_delta(delta)
        cp, col = self._reduction(fac)
        if not self._unamplified(cp):
            return super().noise_multiplier(fac, target_epsilon, delta)
        sens = col * math.sqrt(cp.compositions)
        sigma = gaussian_noise_multiplier(target_epsilon, delta, sens)
        return self._result(
            cp, col, sigma, gaussian_epsilon(sigma, sens, delta), delta, target_epsilon, exact=True
        )


@dataclass
class MMCCAccountant(_Calibrating):
    """MMCC (002 Alg. 1) for Poisson sampling in every round; Generalized-MMCC (002 Alg. 3) for
    cyclic Poisson.

    002: Choquette-Choo, Ganesh, Steinke, Thakurta, "Privacy Amplification for Matrix Mechanisms",
    arXiv 2310.15526. Any non-negative encoder C; σ for a target ε by a Brent search on log σ.

    Args:
        sampling: a ``poisson`` or ``cyclic-poisson`` `SamplingSpec`.
        options: reads ``mmcc_grid``, ``delta_split`` and ``progress``.
    """

    sampling: SamplingSpec
    options: AccountingOptions = field(default_factory=AccountingOptions)
    name = "mmcc"
    rtol = 1e-3  # each probe is a full Generalized-MMCC run
    probe_discretization = 4 * MMCC_DISCRETIZATION

    def _setting(self, fac) -> tuple[int, float, list[int] | None]:
        s = self.sampling
        p = s.sampling_probability or s.expected_batch_size / s.dataset_size
        if s.kind == "poisson":
            return 1, p, None
        cycle = fac.participation.min_sep
        q = s.sampling_probability or cycle * s.expected_batch_size / s.dataset_size
        # N/B = cycle exactly: rounding must not leave [0, 1]
        q = 1.0 if 1.0 < q <= 1.0 + 1e-9 else q
        require(
            q <= 1,
            "expected_batch_size",
            f"at most dataset_size/cycle = {s.dataset_size / cycle:g} (q = cycle·B/N must be ≤ 1)",
            s.expected_batch_size,
        )
        enc = fac.encoder
        toeplitz = isinstance(enc, BLTEncoder) or (
            isinstance(enc, ToeplitzEncoder) and not enc.column_normalize
        )
        return cycle, q, [0] if toeplitz else None

    def _epsilon(self, fac, noise_multiplier, delta, coarse=False):
        check_delta(delta)
        check_sigma(noise_multiplier)
        cycle, q, groups = self._setting(fac)
        o = self.options
        vdi = self.probe_discretization if coarse else MMCC_DISCRETIZATION
        run = mmcc_epsilon(
            fac.encoder.matrix(),
            q,
            noise_multiplier,
            delta,
            cycle=cycle,
            groups=groups,
            delta_split=o.delta_split,
            grid=o.mmcc_grid,
            discretization=vdi,
            progress=o.progress,
        )
        variant = "MMCC (002 Alg. 1)" if cycle == 1 else "Generalized-MMCC (002 Alg. 3)"
        return AccountingResult(
            "mmcc",
            run.epsilon,
            delta,
            noise_multiplier,
            delta,
            slack=run.delta1,
            parameters={
                "sampling": self.sampling.kind,
                "variant": variant,
                "cycle": cycle,
                "sampling_probability": q,
                "delta_tail_bounds": run.delta1,
                "delta_pld": run.delta2,
                "grid": run.grid,
                "pld_discretization": vdi,
                "rows": run.rows,
                "distinct_rows": run.distinct_rows,
                "tail_bound_pairs": run.tail_bound_pairs,
                "max_p_tilde": run.max_p_tilde,
                "groups_analysed": run.groups_analysed,
                "normalisation": (
                    "σ multiplies the clip norm; C's entries are the per-round sensitivities"
                ),
            },
        )


@dataclass
class MonteCarloEVRAccountant:
    """Monte Carlo accounting over the exact likelihood, released by Estimate-Verify-Release (004
    App. A, Thm A.1).

    Schemes: b-min-sep (004 Eq. 1, warm start) and multi-attribution (Thm 6.1, cold start) with
    bands ≤ b; Poisson sampling in every round of a banded encoder with ≤ 12 bands (a forward
    algorithm over the last bands − 1 participation bits); balls-in-bins (the N/B phases enumerated,
    any bands). Both adjacency directions.

    ``epsilon``: `adaptive_evr` — batches of samples,
    deterministic given the seed, until verification at the target δ passes (the verifier's failure
    probability is part of that δ) or the ``max_samples`` budget is spent; then the scheme's other
    verified bound is released (unamplified ⌈n/b⌉ participations, or MMCC for Poisson) and both
    numbers are named on stderr and in the result.

    004: Dong & Ganesh, "Privacy Amplification for BandMF via b-Min-Sep Subsampling", arXiv
    2602.09338.

    Args:
        sampling: a ``bminsep``, ``multi-attribution``, ``balls-in-bins`` or ``poisson``
            `SamplingSpec`.
        options: reads ``mc_samples``, ``seed``, ``max_samples``, ``time_limit``, ``workers`` and
            ``progress`` (ε), and ``grid_ratio``, ``max_candidates`` and ``verify_target`` (σ).
    """

    sampling: SamplingSpec
    options: AccountingOptions = field(default_factory=AccountingOptions)
    name = "monte-carlo"

    def _mc(self, fac) -> tuple[MonteCarloAccountant, dict]:
        sampling = self.sampling
        band = _band(fac)
        p0 = sampling.expected_batch_size / sampling.dataset_size
        k_u = sampling.items_per_user
        if sampling.kind == "balls-in-bins":
            bins = round(1 / p0)
            require(
                abs(bins * p0 - 1) < 1e-9,
                "expected_batch_size",
                "a divisor of dataset_size (N/B bins)",
                sampling.expected_batch_size,
            )
            params = {
                "sampling": "balls-in-bins",
                "bins": bins,
                "min_sep": bins,
                "sampling_probability": 1.0,
                "participation_rate": p0,
                "items_per_user": 1,
                "likelihood": "exact: the N/B phases enumerated (004 §1.4)",
            }
            return MonteCarloAccountant(band, bins, 1.0, scheme="balls-in-bins"), params
        if sampling.kind == "poisson":
            p = sampling.sampling_probability or p0
            require(
                band.shape[1] <= MAX_FORWARD_BANDS,
                "factorization",
                f"at most {MAX_FORWARD_BANDS} bands for the Monte Carlo accountant under Poisson "
                "sampling (2^(bands−1) states; use mmcc)",
                band.shape[1],
            )
            params = {
                "sampling": "poisson",
                "min_sep": 1,
                "sampling_probability": p,
                "participation_rate": p,
                "items_per_user": 1,
                "likelihood": f"exact: forward algorithm over the last {band.shape[1] - 1} "
                f"participation bits ({1 << (band.shape[1] - 1)} states)",
            }
            return MonteCarloAccountant(band, 1, p, scheme="poisson"), params
        b = fac.participation.min_sep
        require(
            p0 <= (1.0 / b) * (1 + 1e-9),
            "expected_batch_size",
            f"at most dataset_size/min_sep = {sampling.dataset_size / b:g} for b-min-sep sampling",
            sampling.expected_batch_size,
        )
        # 004 §1.5: 1/p0 = 1/p + b − 1
        p = sampling.sampling_probability or min(1.0, 1.0 / (1.0 / p0 - (b - 1)))
        require(
            band.shape[1] <= b,
            "factorization",
            f"at most {b} bands (the sampler's separation) for the banded recursion",
            band.shape[1],
        )
        warm = sampling.kind != "multi-attribution"  # Thm 6.1 is a cold-start analysis (004 §6.2)
        params = {
            "sampling": sampling.kind,
            "min_sep": b,
            "sampling_probability": p,
            "participation_rate": p0,
            "warm_start": warm,
            "items_per_user": k_u,
            "likelihood": "exact: 004 Eq. 1 recursion",
        }
        return MonteCarloAccountant(band, b, p, warm=warm, k_u=k_u), params

    def _verify_samples(self, delta_prime: float, delta: float) -> tuple[int, int]:
        o = self.options
        needed = minimum_samples(delta_prime, delta)
        base = o.mc_samples or 100_000
        if not o.verify_target:
            return base, needed
        require(
            isinstance(o.max_samples, int) and o.max_samples >= 2,
            "max_samples",
            "an integer ≥ 2",
            o.max_samples,
        )
        if needed > o.max_samples:
            print(
                f"monte carlo: the target δ = {delta:g} needs {needed} samples per direction, "
                f"above --max-samples {o.max_samples}; verifying with {o.max_samples} (the δ "
                "reported is what they verify)",
                file=sys.stderr,
            )
        return max(base, min(needed, o.max_samples)), needed

    def fallback(self, fac, noise_multiplier: float, delta: float) -> AccountingResult:
        """The scheme's other bound, needing no Monte Carlo: MMCC (002) for Poisson; else one
        Gaussian of the sensitivity of ⌈n/b⌉ participations b apart (k_u items each), which every
        run of the sampler obeys (000 App. D.2).

        Args:
            fac: the factorization.
            noise_multiplier: σ.
            delta: δ in (0, 1).

        Returns:
            The MMCC or exact-Gaussian (``unamplified``) `AccountingResult`.
        """
        if self.sampling.kind == "poisson":
            spec = SamplingSpec(
                "poisson",
                self.sampling.dataset_size,
                self.sampling.expected_batch_size,
                sampling_probability=self.sampling.sampling_probability,
                accountant="mmcc",
            )
            return MMCCAccountant(spec, self.options).epsilon(fac, noise_multiplier, delta)
        sens, k, sep = self.fallback_sensitivity(fac)
        e = gaussian_epsilon(noise_multiplier, sens, delta)
        return AccountingResult(
            GAUSSIAN_NAME,
            e,
            delta,
            noise_multiplier,
            delta,
            parameters=self._fallback_parameters(sens, k, sep),
        )

    def fallback_noise_multiplier(
        self, fac, target_epsilon: float, delta: float
    ) -> AccountingResult:
        """σ for ``target_epsilon`` under the scheme's unamplified bound (`fallback`'s
        sensitivity), exact (Balle & Wang 2018, arXiv 1805.06530): what every run of the sampler
        obeys, with no Monte Carlo.

        Args:
            fac: the factorization.
            target_epsilon: ε > 0.
            delta: δ in (0, 1).

        Returns:
            The ``unamplified`` (exact Gaussian curve) `AccountingResult`.
        """
        sens, k, sep = self.fallback_sensitivity(fac)
        sigma = gaussian_noise_multiplier(target_epsilon, delta, sens)
        return AccountingResult(
            GAUSSIAN_NAME,
            gaussian_epsilon(sigma, sens, delta),
            delta,
            sigma,
            delta,
            target_epsilon,
            parameters=self._fallback_parameters(sens, k, sep),
        )

    def fallback_sensitivity(self, fac) -> tuple[float, int, int]:
        """(sensitivity, k, b) of the sampler's worst pattern: at most k = ⌈n/b⌉ participations b
        rounds apart, k_u items each; √k per item when the bands fit between participations
        (disjoint supports), else k (the triangle inequality), times the largest column norm of
        C."""
        sep = self._separation(fac)
        k = math.ceil(fac.rounds / sep)
        per = math.sqrt(k) if (fac.bands or fac.rounds) <= sep else k
        return self.sampling.items_per_user * per * float(fac.encoder.column_norms().max()), k, sep

    def _fallback_parameters(self, sens: float, k: int, sep: int) -> dict:
        return {
            "sampling": (
                f"none ({self.sampling.kind}: at most {k} participations {sep} rounds apart, "
                "unamplified)"
            ),
            "sensitivity": sens,
            "normalisation": (
                "one Gaussian of the sensitivity of the sampler's worst pattern (000 App. D.2)"
            ),
        }

    def _separation(self, fac) -> int:
        if self.sampling.kind == "balls-in-bins":
            return round(self.sampling.dataset_size / self.sampling.expected_batch_size)
        return fac.participation.min_sep

    def verified_epsilon(self, fac, noise_multiplier, delta) -> AccountingResult:
        """Adaptive Estimate-Verify-Release at the target δ (004 App. A, Thm A.1;
        `adaptive_evr`).

        Args:
            fac: a banded, entrywise non-negative factorization the scheme can analyse.
            noise_multiplier: σ.
            delta: the target δ in (0, 1).

        Returns:
            The verified `AccountingResult`; when the sample budget was spent before a verification
            passed, ``guarantee`` is False, ``delta`` is 1 and ``epsilon`` the point estimate (never
            a released pair).

        Raises:
            InvalidArgumentError: δ, σ or ``max_samples`` out of range, or a factorization the
                scheme cannot analyse.
        """
        check_delta(delta)
        check_sigma(noise_multiplier)
        mc, params = self._mc(fac)
        o = self.options
        # the fallback is a PLD: refuse a σ it cannot represent first
        if self.sampling.kind != "poisson":
            k = math.ceil(fac.rounds / self._separation(fac))
            check_pld_size(
                noise_multiplier,
                params["items_per_user"] * k * float(fac.encoder.column_norms().max()),
            )
        require(
            isinstance(o.max_samples, int) and o.max_samples >= 4,
            "max_samples",
            "an integer ≥ 4",
            o.max_samples,
        )
        run = adaptive_evr(
            mc,
            noise_multiplier,
            delta,
            o.seed,
            max_samples=o.max_samples,
            first_samples=o.mc_samples,
            release_z=RELEASE_Z,
            time_limit=o.time_limit,
            progress=o.progress,
            workers=o.workers,
        )
        return self._evr_result(run, params, noise_multiplier, delta)

    def _evr_result(self, run: EVRRun, params: dict, noise_multiplier, delta) -> AccountingResult:
        """The `AccountingResult` of an Estimate-Verify-Release run: the verified pair, or the
        unverified estimate with δ = 1 when the sample budget ran out."""
        acc = {
            **params,
            **run.to_dict(),
            "directions": "add and remove",
            "release_z": RELEASE_Z,
            "seed": self.options.seed,
            "verify_rule": (
                "attempt i: fresh samples, sized from the earlier ones; threshold δ' with "
                "wrong-pass probability ≤ β/2^(i+1); released δ = δ_mechanism + β"
            ),
            "normalisation": (
                "σ multiplies the clip norm; per-participation sensitivity = column norm of C"
            ),
        }
        if run.passed:
            return AccountingResult(
                "monte-carlo",
                run.epsilon,
                delta,
                noise_multiplier,
                delta,
                slack=run.failure_budget,
                parameters=acc,
            )
        # Not a guarantee: the estimate with δ = 1 marks it unverified (never released as a pair).
        return AccountingResult(
            "monte-carlo",
            run.estimate,
            1.0,
            noise_multiplier,
            delta,
            parameters={
                **acc,
                "released": "nothing: the sample budget was spent before a verification passed",
            },
        )

    def epsilon(self, fac, noise_multiplier, delta, *, coarse=False):  # nothing coarser is cheaper
        """ε at σ: `verified_epsilon`, or `fallback` (named on stderr and in the result)
        when no verification passed within the sample budget.

        Args:
            fac: a banded, entrywise non-negative factorization the scheme can analyse.
            noise_multiplier: σ.
            delta: δ in (0, 1).
            coarse: ignored.

        Returns:
            The `AccountingResult` (the fallback's carries the Monte Carlo attempt under
            ``monte_carlo``).
        """
        res = self.verified_epsilon(fac, noise_multiplier, delta)
        if res.guarantee:
            return res
        fb = self.fallback(fac, noise_multiplier, delta)
        note = (
            f"monte carlo: no verification passed within --max-samples {self.options.max_samples} "
            f"per direction (estimate ε ≈ {res.epsilon:.4g} at δ = {delta:g}, not a guarantee); "
            f"releasing the {fb.accountant} bound ε = {fb.epsilon:.4g} — raise --max-samples for "
            "the Monte Carlo bound"
        )
        print(note, file=sys.stderr)
        return replace(
            fb,
            parameters={
                **fb.parameters,
                "released": "fallback",
                "fallback_reason": note,
                "monte_carlo": res.parameters,
            },
        )

    def noise_multiplier(self, fac, target_epsilon, delta):
        """The smallest verified σ for ``target_epsilon``: candidates from the unamplified fallback
        σ down by ``grid_ratio``, each verified by Monte Carlo on fresh samples (004 Alg. 5), until
        one fails.

        Args:
            fac: a banded factorization with at most b bands.
            target_epsilon: ε > 0.
            delta: δ in (0, 1).

        Returns:
            The `AccountingResult` at the last verified σ; the unamplified fallback σ (named on
            stderr and in the result) when none passed, or when the samples per candidate verify
            only a δ above the target.

        Raises:
            InvalidArgumentError: Poisson sampling (calibrate σ with MMCC there), or ε or δ out of
                range.
        """
        # Estimate-Verify-Release over candidates from the fallback σ down by ``grid_ratio``; the
        # fallback (the unamplified σ for ≤ ⌈n/b⌉ participations of each of k_u items, DP without
        # Monte Carlo) is always valid.
        check_delta(delta)
        check_epsilon(target_epsilon)
        require(
            self.sampling.kind != "poisson",
            "accountant",
            "mmcc to calibrate σ under Poisson sampling (the "
            "Monte Carlo accountant gives ε for a σ there)",
            "monte-carlo",
        )
        mc, params = self._mc(fac)
        o = self.options
        delta_prime = delta / 2
        verify_n, needed = self._verify_samples(delta_prime, delta)
        # the same rule as fallback(): √k only where bands ≤ b
        sens_fb = self.fallback_sensitivity(fac)[0]
        fallback = gaussian_noise_multiplier(target_epsilon, delta, sens_fb)
        chosen, tried = self._verify_candidates(mc, fallback, target_epsilon, delta_prime, verify_n)
        d_overall = overall_delta(verify_n, delta_prime)
        acc = {
            **params,
            "samples": verify_n,
            "verify_delta": delta_prime,
            "samples_needed_for_target_delta": needed,
            "directions": "add and remove",
            "fallback_noise_multiplier": fallback,
            "candidates": tried,
            "grid_ratio": o.grid_ratio,
            "overall_delta": d_overall,
            "normalisation": (
                "σ multiplies the clip norm; per-participation sensitivity = column norm of C"
            ),
        }
        # no candidate below the fallback verified: release the bound that holds without one
        if chosen == fallback:
            res = self.fallback_noise_multiplier(fac, target_epsilon, delta)
            return replace(
                res, parameters={**res.parameters, "released": "fallback", "monte_carlo": acc}
            )
        if d_overall > delta * (1 + 1e-12):
            return self._larger_delta_fallback(
                acc, chosen, fallback, sens_fb, target_epsilon, delta
            )
        return AccountingResult(
            "monte-carlo",
            target_epsilon,
            delta,
            chosen,
            delta,
            target_epsilon,
            slack=d_overall - delta_prime,
            parameters=acc,
        )

    def _verify_candidates(self, mc, fallback, target_epsilon, delta_prime, verify_n):
        """Candidates from ``fallback`` down by ``grid_ratio``, each verified on fresh samples,
        until one fails; returns the last verified σ (``fallback`` when none passed) and every
        candidate tried."""
        o = self.options
        chosen, tried = fallback, []
        for child in np.random.SeedSequence(o.seed).spawn(o.max_candidates):
            cand = chosen / o.grid_ratio
            passed, d_hat = mc.verify(cand, target_epsilon, delta_prime, verify_n, child)
            tried.append({"noise_multiplier": cand, "delta_hat": d_hat, "passed": bool(passed)})
            if not passed:
                break
            chosen = cand
        return chosen, tried

    def _larger_delta_fallback(self, acc, chosen, fallback, sens_fb, target_epsilon, delta):
        """The samples per candidate verify only a larger δ than the target: release the fallback
        σ, which holds at the target, and name both (never an unverified pair)."""
        verify_n, d_overall = acc["samples"], acc["overall_delta"]
        needed = acc["samples_needed_for_target_delta"]
        note = (
            f"monte carlo: {verify_n} samples per candidate verify σ = {chosen:.4g} only at δ "
            f"= {d_overall:.3g} > {delta:g}; releasing the unamplified σ = {fallback:.4g} "
            f"(--verify-target draws the {needed} samples per candidate the target needs)"
        )
        print(note, file=sys.stderr)
        fb_eps = gaussian_epsilon(fallback, sens_fb, delta)
        return AccountingResult(
            GAUSSIAN_NAME,
            fb_eps,
            delta,
            fallback,
            delta,
            target_epsilon,
            parameters={
                **acc,
                "released": "fallback",
                "fallback_reason": note,
                "monte_carlo_noise_multiplier": chosen,
                "sensitivity": sens_fb,
            },
        )


def _monte_carlo_applies(fac: Factorization, sampling: SamplingSpec) -> str | None:
    """Why the Monte Carlo accountant cannot analyse ``fac`` under ``sampling`` (None: it can)."""
    enc = fac.encoder
    if not isinstance(enc, ToeplitzEncoder | BandedEncoder):
        return f"not a banded encoder ({enc.structure})"
    if float(np.min(_band(fac))) < 0:
        return "the encoder has negative entries"
    if sampling.kind == "poisson" and (fac.bands or fac.rounds) > MAX_FORWARD_BANDS:
        return f"{fac.bands} bands > {MAX_FORWARD_BANDS} (2^(bands−1) forward states)"
    if (
        sampling.kind in ("bminsep", "multi-attribution")
        and (fac.bands or fac.rounds) > fac.participation.min_sep
    ):
        return f"{fac.bands} bands > min_sep {fac.participation.min_sep}"
    return None


#: Poisson sampling: the Monte Carlo accountant joins the default selection when its first attempt
# costs at most this many forward-algorithm state updates (samples × rounds × 2^(bands−1), both
# directions; ~ a minute on 2 cores).
MC_AFFORDABLE_WORK = 2e10


def poisson_monte_carlo_work(fac: Factorization, delta: float) -> float:
    """The cost of a first Monte Carlo attempt under Poisson sampling, in forward-algorithm state
    updates.

    Args:
        fac: a banded factorization.
        delta: the target δ.

    Returns:
        2 directions × samples × n × 2^(bands−1), with the samples of the first verification at
        ``delta``.
    """
    samples = 2 * first_verification_size(delta)
    return 2.0 * samples * fac.rounds * (1 << ((fac.bands or fac.rounds) - 1))


def candidate_accountants(
    fac: Factorization, sampling: SamplingSpec, delta: float
) -> tuple[list[str], list[dict]]:
    """The accountants `TightestAccountant` computes for ``sampling`` when none is named.

    Poisson: MMCC (002) and, for banded non-negative encoders with ≤ 12 bands, Monte Carlo over the
    exact likelihood (where affordable, see `MC_AFFORDABLE_WORK`); b-min-sep, balls-in-bins,
    multi-attribution: Monte Carlo and its unamplified bound; cyclic Poisson: 001 Prop. 2.1 when
    bands ≤ the cycle (Generalized-MMCC equals it there, 002 §6.1), else Generalized-MMCC.

    Args:
        fac: the factorization.
        sampling: the sampling.
        delta: the target δ (it sets the cost of Monte Carlo under Poisson sampling).

    Returns:
        (accountant names to compute, skipped accountants as ``{"accountant", "reason"}``).
    """
    kind = sampling.kind
    if kind == "none":
        return ["unamplified"], []
    if kind == "cyclic-poisson":
        if (fac.bands or fac.rounds) <= fac.participation.min_sep and isinstance(
            fac.encoder, ToeplitzEncoder | BandedEncoder
        ):
            return ["cyclic-poisson"], [
                {
                    "accountant": "mmcc",
                    "reason": "equals cyclic-poisson for encoders with ≤ cycle bands (002 App. D)",
                }
            ]
        return ["mmcc"], [{"accountant": "cyclic-poisson", "reason": "more bands than the cycle"}]
    why = _monte_carlo_applies(fac, sampling)
    if kind == "poisson":
        if not why and (fac.bands or fac.rounds) == 1:
            why = (
                "MMCC is exact for a one-band (diagonal) encoder: no tail bounds, the rows are "
                "independent"
            )
        if not why:
            work = poisson_monte_carlo_work(fac, delta)
            if work > MC_AFFORDABLE_WORK:
                why = (
                    f"too costly by default (~{work:.2g} state updates for δ = {delta:g}; name "
                    "--accountant monte-carlo to run it)"
                )
        return (
            (["mmcc"], [{"accountant": "monte-carlo", "reason": why}])
            if why
            else (["monte-carlo", "mmcc"], [])
        )
    if why:
        return ["unamplified"], [{"accountant": "monte-carlo", "reason": why}]
    return ["monte-carlo", "unamplified"], []


@dataclass
class TightestAccountant:
    """Every accountant that applies to the sampling (`candidate_accountants`), and the
    tightest bound verified at the target δ: each is a valid (ε, δ) for the same mechanism, so their
    minimum is too. The result names the one used and lists every bound with its value
    (``parameters["bounds"]``).

    Args:
        sampling: an amplified `SamplingSpec` with no accountant named.
        options: passed to each accountant.
    """

    sampling: SamplingSpec
    options: AccountingOptions = field(default_factory=AccountingOptions)
    name = "tightest"

    def _one(self, name: str, fac, sigma: float, delta: float) -> AccountingResult:
        if name == "monte-carlo":
            return MonteCarloEVRAccountant(self.sampling, self.options).verified_epsilon(
                fac, sigma, delta
            )
        if name == "unamplified" and self.sampling.kind != "none":
            return MonteCarloEVRAccountant(self.sampling, self.options).fallback(fac, sigma, delta)
        spec = replace(self.sampling, accountant=name)
        return accountant_for(spec, self.options).epsilon(fac, sigma, delta)

    def epsilon(self, fac, noise_multiplier, delta, *, coarse=False):
        """The smallest ε verified at ``delta`` among the accountants that apply.

        Args:
            fac: the factorization.
            noise_multiplier: σ.
            delta: δ in (0, 1).
            coarse: ignored.

        Returns:
            The selected `AccountingResult`, with ``selected``, ``bounds`` and ``skipped`` in its
            parameters.

        Raises:
            InvalidArgumentError: no accountant verified the target δ.
        """
        check_delta(delta)
        check_sigma(noise_multiplier)
        names, skipped = candidate_accountants(fac, self.sampling, delta)
        results = [(n, self._one(n, fac, noise_multiplier, delta)) for n in names]
        return _pick(results, skipped, delta, "epsilon")

    def noise_multiplier(self, fac, target_epsilon, delta):
        """The smallest σ calibrated for ``target_epsilon`` among the accountants that apply (Monte
        Carlo under Poisson sampling gives ε for a σ only, and is skipped here).

        Args:
            fac: the factorization.
            target_epsilon: ε > 0.
            delta: δ in (0, 1).

        Returns:
            The selected `AccountingResult`, with ``selected``, ``bounds`` and ``skipped`` in its
            parameters.

        Raises:
            InvalidArgumentError: no accountant verified the target δ.
        """
        check_delta(delta)
        check_epsilon(target_epsilon)
        names, skipped = candidate_accountants(fac, self.sampling, delta)
        if self.sampling.kind == "poisson" and "monte-carlo" in names:
            names = [n for n in names if n != "monte-carlo"]
            skipped = [
                *skipped,
                {"accountant": "monte-carlo", "reason": "gives ε for a σ, not σ for an ε"},
            ]
        results = []
        for n in names:
            if n == "unamplified" and self.sampling.kind != "none":
                # else the Monte Carlo calibration starts from and falls back to it
                if "monte-carlo" not in names:
                    results.append(
                        (
                            n,
                            MonteCarloEVRAccountant(
                                self.sampling, self.options
                            ).fallback_noise_multiplier(fac, target_epsilon, delta),
                        )
                    )
                continue
            spec = replace(self.sampling, accountant=n)
            results.append(
                (n, accountant_for(spec, self.options).noise_multiplier(fac, target_epsilon, delta))
            )
        return _pick(results, skipped, delta, "noise_multiplier")


def _pick(
    results: list[tuple[str, AccountingResult]], skipped: list[dict], delta: float, key: str
) -> AccountingResult:
    """The verified result with the smallest ``key`` (ε, or σ), with every bound listed."""
    bounds = [
        {
            "accountant": n,
            "method": r.accountant,
            "epsilon": r.epsilon,
            "noise_multiplier": r.noise_multiplier,
            "delta": r.delta,
            "verified": r.guarantee,
            **(
                {
                    "note": (
                        "Monte Carlo estimate only: the sample budget was spent before a "
                        "verification passed"
                    )
                }
                if not r.guarantee
                else {}
            ),
        }
        for n, r in results
    ]
    verified = [(n, r) for n, r in results if r.guarantee]
    require(
        bool(verified),
        "accountant",
        "an accountant that verifies the target δ",
        [b["accountant"] for b in bounds],
    )
    name, best = min(verified, key=lambda nr: getattr(nr[1], key))
    unverified = [b for b in bounds if not b["verified"]]
    for b in unverified:
        print(
            f"accounting: {b['accountant']} did not verify δ = {delta:g} within its sample budget "
            f"(estimate ε ≈ {b['epsilon']:.4g}); using {name} ε = {best.epsilon:.4g}",
            file=sys.stderr,
        )
    return replace(
        best,
        parameters={
            **best.parameters,
            "selected": name,
            "selection": "the tightest bound verified at the target δ",
            "bounds": bounds,
            "skipped": skipped,
        },
    )


def accountant_for(sampling: SamplingSpec, options: AccountingOptions | None = None) -> Accountant:
    """The accountant for a sampling description (module docstring).

    Args:
        sampling: the sampling; ``sampling.accountant`` picks among the valid ones (None: the
            tightest for an amplified sampling, unamplified for ``none``).
        options: the accountants' knobs (default `AccountingOptions`).

    Returns:
        An `Accountant`: `TightestAccountant`, `UnamplifiedAccountant`, `CyclicPoissonAccountant`,
        `MMCCAccountant` or `MonteCarloEVRAccountant`.
    """
    options = options or AccountingOptions()
    if sampling.accountant is None and sampling.kind != "none":
        return TightestAccountant(sampling, options)
    method = sampling.method
    if method == "unamplified":
        return UnamplifiedAccountant()
    if method == "cyclic-poisson":
        return CyclicPoissonAccountant(sampling)
    if method == "mmcc":
        return MMCCAccountant(sampling, options)
    return MonteCarloEVRAccountant(sampling, options)


def account(
    fac: Factorization,
    *,
    delta: float,
    noise_multiplier: float | None = None,
    target_epsilon: float | None = None,
    sampling: SamplingSpec = SamplingSpec(),
    mc_samples: int | None = None,
    seed: int = 0,
    grid_ratio: float = 1.02,
    max_candidates: int = 40,
    **options,
) -> dict:
    """ε for ``noise_multiplier`` or σ for ``target_epsilon`` (exactly one), as the CLI and the
    strategy read it.

    Args:
        fac: the factorization, normalised to sensitivity 1 under its participation.
        delta: δ in (0, 1).
        noise_multiplier: σ, to account; or None.
        target_epsilon: ε, to calibrate σ for; or None.
        sampling: the sampling (default: none, unamplified).
        mc_samples: the Monte Carlo first batch per direction (≥ 2; None: what the target δ needs).
        seed: the Monte Carlo seed.
        grid_ratio: the Monte Carlo σ search's ratio.
        max_candidates: the Monte Carlo σ search's length.
        **options: further `AccountingOptions` fields.

    Returns:
        `AccountingResult.to_dict` plus ``sampling``, ``sensitivity``, ``sensitivity_exact``,
        ``factorization_sha256`` and ``noise_std_per_round`` (z_t = σ·‖(C⁻¹)_{t,:}‖, the DP-SGD
        noise multiplier z of round t; module ``corrflow.accounting.noise_scale``).

    Raises:
        InvalidArgumentError: not exactly one of ``noise_multiplier`` and ``target_epsilon``, or a
            value out of range (the error names it).
    """
    check_delta(delta)
    require(
        (noise_multiplier is None) != (target_epsilon is None),
        "noise_multiplier",
        "exactly one of noise_multiplier and target_epsilon",
    )
    require(
        mc_samples is None or (isinstance(mc_samples, int) and mc_samples >= 2),
        "mc_samples",
        "an integer ≥ 2",
        mc_samples,
    )
    opts = AccountingOptions(
        mc_samples=mc_samples,
        seed=seed,
        grid_ratio=grid_ratio,
        max_candidates=max_candidates,
        **options,
    )
    acc = accountant_for(sampling, opts)
    if noise_multiplier is not None:
        check_sigma(noise_multiplier)
        res = acc.epsilon(fac, noise_multiplier, delta)
    else:
        check_epsilon(target_epsilon)
        res = acc.noise_multiplier(fac, target_epsilon, delta)
    out = {
        "sampling": sampling.kind,
        "sensitivity": fac.sensitivity.value,
        "sensitivity_exact": fac.sensitivity.exact,
        "factorization_sha256": fac.sha256(),
    }
    for key, value in res.to_dict().items():
        out[key] = value
        if key == "noise_multiplier":  # next to σ where the result is printed in order
            out["noise_std_per_round"] = noise_std_per_round(fac, value)
    return out


__all__ = [
    "ACCOUNTANTS_FOR",
    "ACCOUNTANT_NAMES",
    "SAMPLINGS",
    "Accountant",
    "AccountingOptions",
    "AccountingResult",
    "CyclicPoissonAccountant",
    "MMCCAccountant",
    "MonteCarloEVRAccountant",
    "SamplingSpec",
    "TightestAccountant",
    "UnamplifiedAccountant",
    "accountant_for",
    "account",
    "candidate_accountants",
    "check_pld_size",
]
