"""(ε, δ) of correlated-noise mechanisms through ``dp-accounting`` events, and grid calibration of σ.

* Unamplified MF (000 App. D.2): with C normalised to sensitivity s under the participation that really holds, the
  whole run is one Gaussian mechanism with noise multiplier σ/s (add/remove adjacency).
* Amplified banded MF with cyclic Poisson sampling (001 Prop. 2.1): with C ``bands``-banded and the data split into
  ``cycle ≥ bands`` parts, the run is ⌈n/cycle⌉ compositions of a Poisson-subsampled Gaussian with q = cycle·B/N and
  noise multiplier σ/max‖C[:, j]‖ (the accountant applies this column-norm rescaling, not the caller).

PLD (``dp_accounting.pld``) is the default; RDP where asked.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import dp_accounting as dpa
import numpy as np

from corrflow.errors import InvalidArgumentError, require

ACCOUNTANTS = ("pld", "rdp")
#: PLD discretisation; 1e-4 is dp-accounting's default and moves ε by < 0.1% against 1e-3 at these sizes.
PLD_DISCRETIZATION = 1e-4


def check_delta(delta: float) -> None:
    require(isinstance(delta, int | float) and np.isfinite(delta) and 0.0 < delta < 1.0, "delta",
            "a number in (0, 1)", delta)


def check_epsilon(epsilon: float, field: str = "target_epsilon") -> None:
    require(isinstance(epsilon, int | float) and np.isfinite(epsilon) and epsilon > 0, field,
            "a positive number", epsilon)


def check_sigma(sigma: float, field: str = "noise_multiplier") -> None:
    require(isinstance(sigma, int | float) and np.isfinite(sigma) and sigma > 0, field, "a positive number", sigma)


#: Most privacy-loss grid points a PLD may need; beyond it dp-accounting would try to allocate far more memory than
#: exists (σ = 1e-6 asked for 71 PiB), and the ε it would report is in the thousands anyway.
PLD_MAX_POINTS = 1e8


def check_pld_size(noise_multiplier: float, sensitivity: float, field: str = "noise_multiplier",
                   discretization: float = PLD_DISCRETIZATION) -> None:
    """Refuse σ/sensitivity so small that the Gaussian privacy loss cannot be put on the PLD grid.

    With μ = sensitivity/σ the loss of N(μ, 1) against N(0, 1) spans about μ²/2 + 2·μ·t (t ≈ 10 standard
    deviations, dp-accounting's tail truncation at e^{−50}), i.e. that many / ``discretization`` grid points.
    """
    check_sigma(noise_multiplier, field)
    mu = sensitivity / noise_multiplier
    points = (0.5 * mu * mu + 20.0 * mu) / discretization
    if not points <= PLD_MAX_POINTS:
        smallest = sensitivity / (math.sqrt(400.0 + 2.0 * PLD_MAX_POINTS * discretization) - 20.0)
        raise InvalidArgumentError(field, f"at least {smallest:.3g} (= sensitivity {sensitivity:.4g} / "
                                   f"{sensitivity / smallest:.4g}); a smaller noise multiplier gives a privacy loss "
                                   f"too wide to account (≈ {points:.2g} PLD grid points)", noise_multiplier)


def _accountant(name: str) -> dpa.PrivacyAccountant:
    require(name in ACCOUNTANTS, "accountant", f"one of {ACCOUNTANTS}", name)
    if name == "pld":
        return dpa.pld.PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION)
    return dpa.rdp.RdpAccountant()


def epsilon_of(event: dpa.DpEvent, delta: float, accountant: str = "pld") -> float:
    check_delta(delta)
    return float(_accountant(accountant).compose(event).get_epsilon(delta))


def unamplified_event(noise_multiplier: float, sensitivity: float = 1.0) -> dpa.DpEvent:
    """One Gaussian release with noise multiplier σ/sensitivity (000 App. D.2)."""
    check_sigma(noise_multiplier)
    require(np.isfinite(sensitivity) and sensitivity > 0, "sensitivity", "a positive number", sensitivity)
    check_pld_size(noise_multiplier, sensitivity)
    return dpa.GaussianDpEvent(noise_multiplier / sensitivity)


@dataclass(frozen=True)
class CyclicPoisson:
    """Cyclic Poisson sampling (001 Alg. 2): N examples in ``cycle`` parts, part t mod cycle trains in round t."""

    rounds: int
    cycle: int
    dataset_size: int
    expected_batch_size: float

    def __post_init__(self) -> None:
        require(self.dataset_size >= 1, "dataset_size", "a positive integer", self.dataset_size)
        require(0 < self.expected_batch_size <= self.dataset_size, "expected_batch_size",
                f"in (0, dataset_size={self.dataset_size}]", self.expected_batch_size)
        require(1 <= self.cycle <= self.rounds, "cycle", f"between 1 and rounds={self.rounds}", self.cycle)
        require(self.sampling_probability <= 1.0, "expected_batch_size",
                f"at most dataset_size/cycle = {self.dataset_size / self.cycle:g} (q = cycle·B/N must be ≤ 1)",
                self.expected_batch_size)

    @property
    def sampling_probability(self) -> float:
        q = self.cycle * self.expected_batch_size / self.dataset_size
        return 1.0 if 1.0 < q <= 1.0 + 1e-9 else q     # N/B = cycle exactly: rounding must not leave [0, 1]

    @property
    def compositions(self) -> int:
        return math.ceil(self.rounds / self.cycle)

    def event(self, noise_multiplier: float, max_column_norm: float) -> dpa.DpEvent:
        """⌈n/cycle⌉ × PoissonSampled(q, Gaussian(σ/max‖C[:,j]‖)) (001 Prop. 2.1)."""
        check_pld_size(noise_multiplier, max_column_norm)
        inner = dpa.GaussianDpEvent(noise_multiplier / max_column_norm)
        return dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(self.sampling_probability, inner),
                                       self.compositions)


def calibrate_on_grid(epsilon_of_sigma: Callable[[float], float], target_epsilon: float, *, guess: float = 1.0,
                      base: float = 1e-3, ratio: float = 1.001, limit: float = 1e4) -> tuple[float, float]:
    """Smallest σ on the grid base·ratio^i whose ε ≤ target; returns (σ, ε(σ)). ε must decrease in σ.

    Brackets geometrically (×1.25) from ``guess``, then bisects on grid indices: O(log) accountant calls.
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
            raise InvalidArgumentError("target_epsilon", f"reachable with σ ≤ {limit:g}", target_epsilon)
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
