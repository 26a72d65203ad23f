"""The privacy of a run as it happens: the plan (σ, planned ε, the accountant) and ε of the
participation recorded so far — for the report after every round, and for a prospective round, for
the budget guard.

Two regimes, chosen by what the plan's accountant analysed, never by its name:
* deterministic patterns (fixed-epoch, any unamplified plan): post-hoc accounting of the realised
  participation, one Gaussian with the realised sensitivity (000 App. D.2;
  `realized_sensitivity`), scaled by k_u;
* amplified plans (Monte Carlo for b-min-sep / multi-attribution samplers, 004; MMCC for Poisson /
  cyclic Poisson, 002; or, with no accountant named, the tightest verified bound that applies, even
  when that is the sampler's unamplified worst-case bound): their ε is a property of the sampler's
  randomness and stands while the sampler's pattern is followed; once it is broken (an accepted
  separation violation or override), the run falls back to post-hoc accounting.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from corrflow.accounting.mechanisms import gaussian_epsilon
from corrflow.accounting.posthoc import realized_sensitivity
from corrflow.factorization.base import Factorization


@dataclass(frozen=True)
class PrivacyPlan:
    """σ and the planned ε of a run, with the report's ``accountant`` section.

    Attributes: noise_multiplier: σ (0 for a non-private baseline). epsilon: the planned ε (None:
    non-private). accountant: the report's ``accountant`` section. amplified: ε comes from the
    sampler's randomness (valid while its pattern is followed). items_per_user: k_u: the sensitivity
    of a user's sum of items is ≤ k_u. delta: δ of the training's ε (None: the run's δ; less when a
    DP vocabulary spent part of it). target_epsilon: the training's share of the run's target ε (the
    budget guard's limit). vocabulary: the report's ``vocabulary`` section (a run on a dataset
    file), or None.
    """

    noise_multiplier: float  # 0 for a non-private baseline
    epsilon: float | None  # planned ε (None: non-private)
    accountant: dict = field(default_factory=dict)
    amplified: bool = False  # ε from the sampler's randomness (valid while its pattern is followed)
    items_per_user: int = 1  # k_u: the sensitivity of a user's sum of items is ≤ k_u
    delta: float | None = (
        None  # δ of the training's ε (None: the run's δ; less when a DP vocabulary
    )
    #                                       spent part of it — the report's ``total`` composes the
    #                                       two)
    target_epsilon: float | None = (
        None  # the training's share of the run's target ε (the budget guard's limit)
    )
    vocabulary: dict | None = None  # the report's ``vocabulary`` section (a run on a dataset file)

    @property
    def private(self) -> bool:
        """Whether noise is added (σ > 0)."""
        return self.noise_multiplier > 0


@dataclass(frozen=True)
class RealizedPrivacy:
    """ε of the participation recorded so far.

    Attributes: sensitivity: the realised sensitivity (000 Def. 1 on the realised patterns).
    sensitivity_exact: whether it is exact (else an upper bound). epsilon: ε (None for a non-private
    run). accounting: how ε was obtained, for the report. worst_user: the raw id of a user with the
    largest sensitivity, or None. delta: the δ at which ``epsilon`` holds, verified (the run's δ, or
    the larger δ an amplified plan's accountant verified).
    """

    sensitivity: float
    sensitivity_exact: bool
    epsilon: float | None
    accounting: str  # how ε was obtained, for the report
    worst_user: str | None = None
    delta: float | None = None  # the δ at which ``epsilon`` holds (verified)


class RunPrivacy:
    """ε of the participation recorded so far (pure given its inputs).

    Memoised, since the strategy asks several times a round (budget guard, release, record): each
    user pattern's sensitivity is computed once (a round adds only its cohort's new patterns), ε
    once per distinct sensitivity (the exact Gaussian curve, microseconds), and the whole answer is
    reused while the participation is unchanged.

    Args:
        factorization: the run's normalised factorization.
        plan: the run's `PrivacyPlan`.
        delta: the training's δ.
    """

    def __init__(self, factorization: Factorization, plan: PrivacyPlan, delta: float):
        self.fac, self.plan, self.delta = factorization, plan, delta
        self._eps_cache: dict[float, float] = {}
        self._pattern_cache: dict = {}
        self._last: tuple | None = None

    def _epsilon_for_sensitivity(self, sens: float) -> float | None:
        if not self.plan.private:
            return None
        key = float(sens)  # exact: a larger sensitivity never reuses a smaller ε
        if key not in self._eps_cache:
            self._eps_cache[key] = (
                0.0 if sens == 0 else gaussian_epsilon(self.plan.noise_multiplier, sens, self.delta)
            )
        return self._eps_cache[key]

    def realized(
        self, selected: Mapping[str, Sequence[int]], *, pattern_followed: bool = True
    ) -> RealizedPrivacy:
        """ε of the participation so far: the plan's when it is amplified and its pattern was
        followed, else post hoc on the realised sensitivity (one Gaussian, 000 App. D.2).

        Args:
            selected: user → rounds contributed to (with multiplicity).
            pattern_followed: whether the sampler's pattern was followed (see
                `corrflow.accounting.policy.pattern_followed`).

        Returns:
            The `RealizedPrivacy`.
        """
        key = (pattern_followed, tuple((u, tuple(r)) for u, r in selected.items()))
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        sens, worst = realized_sensitivity(self.fac.encoder, selected, self._pattern_cache)
        if self.plan.amplified and pattern_followed:
            planned_delta = float(self.plan.accountant.get("delta", self.delta))
            out = RealizedPrivacy(
                sens.value,
                sens.exact,
                self.plan.epsilon,
                "as planned (the sampler's pattern was followed)",
                worst,
                max(self.delta, planned_delta),
            )
        else:
            # One Gaussian of the realised sensitivity (the exact curve): it holds at the run's δ,
            # verified, whatever δ the plan's (amplified) accountant verified.
            out = RealizedPrivacy(
                sens.value,
                sens.exact,
                self._epsilon_for_sensitivity(sens.value),
                "post-hoc (unamplified, realised pattern)",
                worst,
                self.delta,
            )
        self._last = (key, out)
        return out
