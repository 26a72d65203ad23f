"""(ε, δ) of correlated-noise mechanisms through ``dp-accounting`` events, and calibration of σ.

* Unamplified MF (000 App. D.2): with C normalised to sensitivity s under the participation that
  really holds, the whole run is one Gaussian mechanism with noise multiplier σ/s (add/remove
  adjacency). Its ε is exact: the closed-form (ε, δ) curve of the Gaussian mechanism (Balle & Wang
  2018, arXiv 1805.06530, Thm. 8; `corrflow.accounting.gaussian`), which `epsilon_of`
  uses for a single ``GaussianDpEvent``.
* Amplified banded MF with cyclic Poisson sampling (001 Prop. 2.1): with C ``bands``-banded and the
  data split into ``cycle ≥ bands`` parts, the run is ⌈n/cycle⌉ compositions of a Poisson-subsampled
  Gaussian with q = cycle·B/N and noise multiplier σ/max‖C[:, j]‖ (the accountant applies this
  column-norm rescaling, not the caller).

PLD (``dp_accounting.pld``) is the default for compositions and amplified events; RDP where asked.
Amplified calibration (`calibrate_log_sigma`) finds σ with a few probes: a Brent search on log
σ with a coarse PLD discretisation, then the answer verified (and nudged up if needed) at full
precision.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from corrflow.accounting import gaussian, pld_speed
from corrflow.errors import InvalidArgumentError, require

if TYPE_CHECKING:  # dp-accounting takes ~1 s to import (scipy.signal): only the PLD paths load it
    import dp_accounting as dpa

#: dp-accounting's accountants `epsilon_of` can compose an event with.
ACCOUNTANTS = ("pld", "rdp")
#: PLD discretisation; 1e-4 is dp-accounting's default and moves ε by < 0.1% against 1e-3 at these
# sizes.
PLD_DISCRETIZATION = 1e-4
#: Discretisation of the probes of a σ search (`calibrate_log_sigma`); the answer is verified
# at `PLD_DISCRETIZATION`.
PROBE_DISCRETIZATION = 1e-3


def check_delta(delta: float) -> None:
    """Refuse a δ outside (0, 1).

    Args:
        delta: δ.

    Raises:
        InvalidArgumentError: (field ``delta``) not a finite number in (0, 1).
    """
    require(
        isinstance(delta, int | float) and np.isfinite(delta) and 0.0 < delta < 1.0,
        "delta",
        "a number in (0, 1)",
        delta,
    )


#: The largest ε corrflow calibrates for. Its σ (≈ 0.025 at δ = 1e-5) is near the smallest a PLD can
# still account (`check_pld_size`); far above it the calibration itself overflows (ε = 1e308).
MAX_EPSILON = 1000.0
#: The smallest ε corrflow calibrates for. Below it σ grows past what a run can use and the PLD's
# discretisation rounds ε to 0.0 (a target of 1e-300 once trained and reported ε 0.0).
MIN_EPSILON = 1e-6
#: The words every ε check uses.
EPSILON_EXPECTED = f"a finite ε in [{MIN_EPSILON:g}, {MAX_EPSILON:g}]"


def check_epsilon(epsilon: float, field: str = "target_epsilon") -> None:
    """Refuse an ε that is not a finite number in [`MIN_EPSILON`, `MAX_EPSILON`].

    Args:
        epsilon: ε.
        field: the name the error gives it.

    Raises:
        InvalidArgumentError: naming ``field``.
    """
    require(
        isinstance(epsilon, int | float)
        and np.isfinite(epsilon)
        and MIN_EPSILON <= epsilon <= MAX_EPSILON,
        field,
        EPSILON_EXPECTED,
        epsilon,
    )


def check_sigma(sigma: float, field: str = "noise_multiplier") -> None:
    """Refuse a noise multiplier that is not a finite positive number.

    Args:
        sigma: σ.
        field: the name the error gives it.

    Raises:
        InvalidArgumentError: naming ``field``.
    """
    require(
        isinstance(sigma, int | float) and np.isfinite(sigma) and sigma > 0,
        field,
        "a positive number",
        sigma,
    )


#: Most privacy-loss grid points a PLD may need; beyond it dp-accounting would try to allocate far
# more memory than exists (σ = 1e-6 asked for 71 PiB), and the ε it would report is in the
# thousands anyway.
PLD_MAX_POINTS = 1e8


def check_pld_size(
    noise_multiplier: float,
    sensitivity: float,
    field: str = "noise_multiplier",
    discretization: float = PLD_DISCRETIZATION,
) -> None:
    """Refuse σ/sensitivity so small that the Gaussian privacy loss cannot be put on the PLD grid.

    With μ = sensitivity/σ the loss of N(μ, 1) against N(0, 1) spans about μ²/2 + 2·μ·t (t ≈ 10
    standard deviations, dp-accounting's tail truncation at e^{−50}), i.e. that many /
    ``discretization`` grid points.

    Args:
        noise_multiplier: σ.
        sensitivity: the sensitivity σ is divided by.
        field: the name the error gives σ.
        discretization: the PLD's value discretisation interval.

    Raises:
        InvalidArgumentError: naming ``field``, with the smallest σ that can be accounted, when more
            than `PLD_MAX_POINTS` grid points would be needed (or σ is not a positive number).
    """
    check_sigma(noise_multiplier, field)
    mu = sensitivity / noise_multiplier
    points = (0.5 * mu * mu + 20.0 * mu) / discretization
    if not points <= PLD_MAX_POINTS:
        smallest = sensitivity / (math.sqrt(400.0 + 2.0 * PLD_MAX_POINTS * discretization) - 20.0)
        raise InvalidArgumentError(
            field,
            f"at least {smallest:.3g} (= sensitivity {sensitivity:.4g} / "
            f"{sensitivity / smallest:.4g}); a smaller noise multiplier gives a privacy loss "
            f"too wide to account (≈ {points:.2g} PLD grid points)",
            noise_multiplier,
        )


def _accountant(name: str, discretization: float = PLD_DISCRETIZATION) -> dpa.PrivacyAccountant:
    import dp_accounting as dpa

    require(name in ACCOUNTANTS, "accountant", f"one of {ACCOUNTANTS}", name)
    if name == "pld":
        pld_speed.install()
        return dpa.pld.PLDAccountant(value_discretization_interval=discretization)
    return dpa.rdp.RdpAccountant()


def epsilon_of(
    event: dpa.DpEvent,
    delta: float,
    accountant: str = "pld",
    *,
    discretization: float = PLD_DISCRETIZATION,
) -> float:
    """ε of a dp-accounting event at ``delta``.

    Args:
        event: a ``dp_accounting.DpEvent``.
        delta: δ in (0, 1).
        accountant: ``"pld"`` or ``"rdp"`` (`ACCOUNTANTS`).
        discretization: the PLD's value discretisation interval.

    Returns:
        ε: exact for one ``GaussianDpEvent`` under ``"pld"`` (`gaussian_epsilon`), else
        dp-accounting's PLD (pessimistic at ``discretization``) or RDP bound.

    Raises:
        InvalidArgumentError: δ out of range or an unknown accountant.
    """
    import dp_accounting as dpa

    check_delta(delta)
    if accountant == "pld" and isinstance(event, dpa.GaussianDpEvent):
        return gaussian_epsilon(event.noise_multiplier, 1.0, delta)
    return float(_accountant(accountant, discretization).compose(event).get_epsilon(delta))


def gaussian_epsilon(noise_multiplier: float, sensitivity: float, delta: float) -> float:
    """Exact ε of one Gaussian mechanism (Balle & Wang 2018, "Improving the Gaussian Mechanism for
    Differential Privacy", arXiv 1805.06530, Thm. 8).

    Args:
        noise_multiplier: σ, the noise's standard deviation.
        sensitivity: Δ.
        delta: δ in (0, 1).

    Returns:
        ε, rounded up; dp-accounting's PLD ε where double precision cannot certify the exact curve.

    Raises:
        InvalidArgumentError: δ or σ out of range, or σ/Δ too small to account.
    """
    check_delta(delta)
    check_sigma(noise_multiplier)
    try:
        return gaussian.epsilon(sensitivity / noise_multiplier, delta)
    except gaussian.IllConditionedError:
        import dp_accounting as dpa

        check_pld_size(noise_multiplier, sensitivity)
        return float(
            _accountant("pld")
            .compose(dpa.GaussianDpEvent(noise_multiplier / sensitivity))
            .get_epsilon(delta)
        )


def gaussian_noise_multiplier(
    target_epsilon: float, delta: float, sensitivity: float = 1.0
) -> float:
    """The smallest σ whose Gaussian mechanism is (ε, δ)-DP (Balle & Wang 2018, arXiv 1805.06530,
    Thm. 8).

    Args:
        target_epsilon: ε > 0.
        delta: δ in (0, 1).
        sensitivity: Δ > 0.

    Returns:
        σ, rounded up; where double precision cannot certify the exact curve, the smallest σ on a
        1.001-ratio grid whose PLD ε meets the target.

    Raises:
        InvalidArgumentError: ε, δ or Δ out of range.
    """
    check_epsilon(target_epsilon)
    check_delta(delta)
    require(
        np.isfinite(sensitivity) and sensitivity > 0,
        "sensitivity",
        "a positive number",
        sensitivity,
    )
    try:
        return gaussian.noise_multiplier(target_epsilon, delta, sensitivity)
    except gaussian.IllConditionedError:
        import dp_accounting as dpa

        return calibrate_on_grid(
            lambda s: float(
                _accountant("pld").compose(dpa.GaussianDpEvent(s / sensitivity)).get_epsilon(delta)
            ),
            target_epsilon,
            guess=sensitivity * dpa.get_sigma_gaussian(target_epsilon, delta),
        )[0]


def unamplified_event(noise_multiplier: float, sensitivity: float = 1.0) -> dpa.DpEvent:
    """The whole unamplified run as one Gaussian release (000 App. D.2: Choquette-Choo et al.,
    "Multi-Epoch Matrix Factorization Mechanisms for Private Machine Learning", arXiv 2211.06530).

    Args:
        noise_multiplier: σ.
        sensitivity: the factorization's sensitivity s under the participation that really holds.

    Returns:
        ``dp_accounting.GaussianDpEvent(σ/s)``.

    Raises:
        InvalidArgumentError: σ or s not positive, or σ/s too small to account.
    """
    import dp_accounting as dpa

    check_sigma(noise_multiplier)
    require(
        np.isfinite(sensitivity) and sensitivity > 0,
        "sensitivity",
        "a positive number",
        sensitivity,
    )
    check_pld_size(noise_multiplier, sensitivity)
    return dpa.GaussianDpEvent(noise_multiplier / sensitivity)


@dataclass(frozen=True)
class CyclicPoisson:
    """Cyclic Poisson sampling (001 Alg. 2: McKenna, "Scaling up the Banded Matrix Factorization
    Mechanism for Differentially Private ML", arXiv 2405.15913): N examples in ``cycle`` parts, part
    t mod cycle trains in round t, each of its examples with probability q = cycle·B/N.

    Args:
        rounds: n.
        cycle: b, the number of parts (1 ≤ b ≤ n; at least the encoder's bands for `event`).
        dataset_size: N.
        expected_batch_size: B, in (0, N/b].

    Raises:
        InvalidArgumentError: a field out of range (the error names it).
    """

    rounds: int
    cycle: int
    dataset_size: int
    expected_batch_size: float

    def __post_init__(self) -> None:
        require(self.dataset_size >= 1, "dataset_size", "a positive integer", self.dataset_size)
        require(
            0 < self.expected_batch_size <= self.dataset_size,
            "expected_batch_size",
            f"in (0, dataset_size={self.dataset_size}]",
            self.expected_batch_size,
        )
        require(
            1 <= self.cycle <= self.rounds,
            "cycle",
            f"between 1 and rounds={self.rounds}",
            self.cycle,
        )
        require(
            self.sampling_probability <= 1.0,
            "expected_batch_size",
            f"at most dataset_size/cycle = {self.dataset_size / self.cycle:g} (q = cycle·B/N must "
            "be ≤ 1)",
            self.expected_batch_size,
        )

    @property
    def sampling_probability(self) -> float:
        """q = cycle·B/N (1 where rounding puts it within 1e-9 above 1)."""
        q = self.cycle * self.expected_batch_size / self.dataset_size
        # N/B = cycle exactly: rounding must not leave [0, 1]
        return 1.0 if 1.0 < q <= 1.0 + 1e-9 else q

    @property
    def compositions(self) -> int:
        """⌈n/cycle⌉: how many times each part trains."""
        return math.ceil(self.rounds / self.cycle)

    def event(self, noise_multiplier: float, max_column_norm: float) -> dpa.DpEvent:
        """The run as a dp-accounting event (001 Prop. 2.1): ⌈n/cycle⌉ × PoissonSampled(q,
        Gaussian(σ/max‖C[:,j]‖)).

        Args:
            noise_multiplier: σ.
            max_column_norm: max_j ‖C[:, j]‖ of a b-banded encoder C with b ≤ cycle.

        Returns:
            A ``dp_accounting.SelfComposedDpEvent``.

        Raises:
            InvalidArgumentError: σ not positive, or too small to account.
        """
        import dp_accounting as dpa

        check_pld_size(noise_multiplier, max_column_norm)
        inner = dpa.GaussianDpEvent(noise_multiplier / max_column_norm)
        return dpa.SelfComposedDpEvent(
            dpa.PoissonSampledDpEvent(self.sampling_probability, inner), self.compositions
        )


def calibrate_on_grid(
    epsilon_of_sigma: Callable[[float], float],
    target_epsilon: float,
    *,
    guess: float = 1.0,
    base: float = 1e-3,
    ratio: float = 1.001,
    limit: float = 1e4,
) -> tuple[float, float]:
    """Smallest σ on the grid base·ratio^i whose ε ≤ target; returns (σ, ε(σ)). ε must decrease in
    σ.

    Brackets geometrically (×1.25) from ``guess``, then bisects on grid indices: O(log) accountant
    calls.

    Args:
        epsilon_of_sigma: σ → ε, decreasing in σ.
        target_epsilon: ε > 0.
        guess: a starting σ.
        base: the grid's smallest σ.
        ratio: the grid's ratio.
        limit: the largest σ tried.

    Returns:
        (σ, ε(σ)) for the smallest grid σ with ε(σ) ≤ target.

    Raises:
        InvalidArgumentError: (field ``target_epsilon``) not reachable with σ ≤ ``limit``; or a bad
            ``guess``.
    """
    check_epsilon(target_epsilon)
    require(np.isfinite(guess) and guess > 0, "guess", "a positive number", guess)
    cache: dict[int, float] = {}

    def eps(i: int) -> float:
        if i not in cache:
            cache[i] = epsilon_of_sigma(base * ratio**i)
        return cache[i]

    def index(sigma: float) -> int:
        return max(0, round(math.log(sigma / base) / math.log(ratio)))

    step = max(1, round(math.log(1.25) / math.log(ratio)))
    hi = index(guess)
    while eps(hi) > target_epsilon:
        hi += step
        if base * ratio**hi > limit:
            raise InvalidArgumentError(
                "target_epsilon", f"reachable with σ ≤ {limit:g}", target_epsilon
            )
    lo = hi
    while lo > 0 and eps(lo) <= target_epsilon:
        lo = max(0, lo - step)
    if eps(lo) <= target_epsilon:
        return base * ratio**lo, eps(lo)
    while hi - lo > 1:  # invariant: eps(lo) > target ≥ eps(hi)
        mid = (lo + hi) // 2
        if eps(mid) <= target_epsilon:
            hi = mid
        else:
            lo = mid
    return base * ratio**hi, eps(hi)


@dataclass(frozen=True)
class Calibration:
    """σ from `calibrate_log_sigma`: its verified ε and how many probes and verifications it
    took."""

    noise_multiplier: float
    epsilon: float
    probes: int
    verifications: int


def calibrate_log_sigma(
    probe: Callable[[float], float],
    verify: Callable[[float], float],
    target_epsilon: float,
    *,
    guess: float,
    rtol: float = 1e-4,
    limit: float = 1e4,
) -> Calibration:
    """σ for a target ε with few accountant calls. ε must decrease in σ.

    ``probe(σ)``: a cheap ε (a coarse PLD); ``verify(σ)``: the full-precision ε that is reported.
    The probes bracket the root of probe(σ) = target geometrically (×1.25) from ``guess`` and a
    Brent search on log σ finds it to ``rtol``; the result is verified, then moved once toward the
    verified root by a secant step when the verified ε leaves more than ``rtol`` of the target
    unused (kept only if it verifies), or stepped up until it verifies. The σ returned always has
    verify(σ) ≤ target.

    Args:
        probe: σ → a cheap ε (a coarse PLD), decreasing in σ.
        verify: σ → the full-precision ε that is reported.
        target_epsilon: ε > 0.
        guess: a starting σ (e.g. the unamplified one).
        rtol: the relative precision of σ.
        limit: the largest σ tried.

    Returns:
        The `Calibration`: σ, its verified ε and the numbers of probes and verifications.

    Raises:
        InvalidArgumentError: (field ``target_epsilon``) not reachable with σ ≤ ``limit``; or a bad
            ``guess``.
    """
    from scipy.optimize import brentq  # lazy: scipy's import slows every CLI start

    check_epsilon(target_epsilon)
    require(np.isfinite(guess) and guess > 0, "guess", "a positive number", guess)
    calls = _CountedCalls(probe, verify, target_epsilon)
    lo, hi = _bracket(calls.p, guess, limit, target_epsilon)
    if calls.p(lo) <= 0:
        log_s = lo
    else:
        log_s = brentq(calls.p, lo, hi, xtol=rtol / 2, rtol=4 * np.finfo(float).eps)
        if calls.p(log_s) > 0:  # brentq's answer may sit just below the root: take the safe end
            log_s = min(
                (x for x, e in calls.probed.items() if e <= target_epsilon and x >= log_s),
                default=hi,
            )
    sigma = math.exp(log_s)
    eps = calls.v(sigma)
    up = rtol
    # the fine PLD above the coarse one (rare): step up until it verifies
    while eps > target_epsilon:
        sigma *= 1 + up
        up *= 2
        eps = calls.v(sigma)
        if sigma > limit:
            raise InvalidArgumentError(
                "target_epsilon", f"reachable with σ ≤ {limit:g}", target_epsilon
            )
    sigma, eps = _secant_step(calls, sigma, eps, log_s, target_epsilon, rtol)
    return Calibration(sigma, eps, calls.probes, calls.verifications)


class _CountedCalls:
    """`calibrate_log_sigma`'s accountant calls, counted: ``p(log σ)`` = probe(σ) − target (each
    log σ probed once, kept in ``probed`` as log σ → ε) and ``v(σ)`` = verify(σ)."""

    def __init__(self, probe, verify, target_epsilon: float):
        self.probe, self.verify, self.target = probe, verify, target_epsilon
        self.probed: dict[float, float] = {}
        self.probes = self.verifications = 0

    def p(self, log_s: float) -> float:
        if log_s not in self.probed:
            self.probes += 1
            self.probed[log_s] = self.probe(math.exp(log_s))
        return self.probed[log_s] - self.target

    def v(self, sigma: float) -> float:
        self.verifications += 1
        return self.verify(sigma)


def _bracket(p, guess: float, limit: float, target_epsilon: float) -> tuple[float, float]:
    """(lo, hi) in log σ with p(hi) ≤ 0 < p(lo), stepping ×1.25 from ``guess``; lo = hi when σ
    reaches 1e-6 with p still ≤ 0."""
    step = math.log(1.25)
    hi = math.log(guess)
    while p(hi) > 0:
        hi += step
        if math.exp(hi) > limit:
            raise InvalidArgumentError(
                "target_epsilon", f"reachable with σ ≤ {limit:g}", target_epsilon
            )
    lo = hi - step
    while p(lo) <= 0:
        lo, hi = lo - step, lo
        if lo < math.log(1e-6):
            break
    return lo, hi


def _secant_step(calls: _CountedCalls, sigma, eps, log_s, target_epsilon, rtol):
    """When the verified ε leaves more than ``rtol`` of the target unused: one secant step on the
    verified curve, with the slope dε/dlog σ of the two probes closest to the root; kept only if
    it verifies."""
    unused = (target_epsilon - eps) / target_epsilon
    if unused > rtol and len(calls.probed) >= 2:
        (x0, e0), (x1, e1) = sorted(calls.probed.items(), key=lambda kv: abs(kv[0] - log_s))[:2]
        slope = (e1 - e0) / (x1 - x0) if x1 != x0 else 0.0
        if slope < 0:
            cand = sigma * math.exp((target_epsilon - eps) / slope * (1 - rtol))
            e_c = calls.v(cand)
            if e_c <= target_epsilon:
                sigma, eps = cand, e_c
    return sigma, eps
