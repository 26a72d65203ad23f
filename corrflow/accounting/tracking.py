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

import heapq
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from corrflow.accounting.mechanisms import gaussian_epsilon
from corrflow.accounting.posthoc import pattern_sensitivity, realized_sensitivity
from corrflow.factorization.base import Factorization
from corrflow.factorization.encoders import Encoder
from corrflow.factorization.sensitivity import Sensitivity


@dataclass(frozen=True)
class PrivacyPlan:
    """σ and the planned ε of a run, with the report's ``accountant`` section.

    Attributes:
        noise_multiplier: σ (0 for a non-private baseline).
        epsilon: the planned ε (None: non-private).
        accountant: the report's ``accountant`` section.
        amplified: ε comes from the sampler's randomness (valid while its pattern is followed).
        items_per_user: k_u: the sensitivity of a user's sum of items is ≤ k_u.
        delta: δ of the training's ε (None: the run's δ; less when a DP vocabulary spent part of
            it).
        target_epsilon: the training's share of the run's target ε (the budget guard's limit).
        vocabulary: the report's ``vocabulary`` section (a run on a dataset file), or None.
    """

    noise_multiplier: float  # 0 for a non-private baseline
    epsilon: float | None  # planned ε (None: non-private)
    accountant: dict = field(default_factory=dict)
    amplified: bool = False  # ε from the sampler's randomness (valid while its pattern is followed)
    items_per_user: int = 1  # k_u: the sensitivity of a user's sum of items is ≤ k_u
    # δ of the training's ε (None: the run's δ; less when a DP vocabulary
    delta: float | None = None
    #                                       spent part of it — the report's ``total`` composes the
    #                                       two)
    # the training's share of the run's target ε (the budget guard's limit)
    target_epsilon: float | None = None
    vocabulary: dict | None = None  # the report's ``vocabulary`` section (a run on a dataset file)

    @property
    def private(self) -> bool:
        """Whether noise is added (σ > 0)."""
        return self.noise_multiplier > 0


@dataclass(frozen=True)
class RealizedPrivacy:
    """ε of the participation recorded so far.

    Attributes:
        sensitivity: the realised sensitivity (000 Def. 1 on the realised patterns).
        sensitivity_exact: whether it is exact (else an upper bound).
        epsilon: ε (None for a non-private run).
        accounting: how ε was obtained, for the report.
        worst_user: the raw id of a user with the largest sensitivity, or None.
        delta: the δ at which ``epsilon`` holds, verified (the run's δ, or the larger δ an amplified
            plan's accountant verified).
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
        out = self.of_sensitivity(sens, pattern_followed=pattern_followed, worst=worst)
        self._last = (key, out)
        return out

    def of_sensitivity(
        self, sens: Sensitivity, *, pattern_followed: bool = True, worst: str | None = None
    ) -> RealizedPrivacy:
        """ε of a participation whose realised sensitivity is ``sens`` (kept incrementally by
        `IncrementalSensitivity`, or recomputed by `realized`): the plan's when it is amplified
        and its pattern was followed, else one Gaussian of ``sens`` (000 App. D.2).

        Args:
            sens: the realised sensitivity.
            pattern_followed: whether the sampler's pattern was followed.
            worst: the raw id of a user with the largest sensitivity, when known.

        Returns:
            The `RealizedPrivacy`.
        """
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
        return out


class IncrementalSensitivity:
    """The realised sensitivity max_u sens(π_u) (000 Def. 1 on the realised patterns,
    `corrflow.accounting.posthoc.pattern_sensitivity`) kept from each round's cohort alone:
    O(cohort · log) per round, never a pass over the population.

    It holds, for every pattern π some user has now (sorted rounds with multiplicity), its
    sensitivity and how many users have it, and a max-heap of the patterns (stale entries are
    dropped when they reach the top, and the heap is rebuilt once it holds twice the live
    patterns, so its size stays O(patterns)). The value equals `realized_sensitivity` over the
    whole ledger exactly — also for upper bounds, which need not grow with the pattern: a user
    leaving π gives π up. Users' patterns are read from the ledger (``selected``) handed in, so no
    second per-user copy is kept.

    Args:
        encoder: C, n × n (the run's normalised encoder).
    """

    def __init__(self, encoder: Encoder):
        self.encoder = encoder
        self._live: dict[tuple[int, ...], list] = {}  # π → [Sensitivity, users with π]
        self._heap: list[tuple[float, tuple[int, ...]]] = []  # (−value, π); may hold stale π
        self._heaped: set[tuple[int, ...]] = set()
        self._inexact = 0  # users whose pattern's value is an upper bound
        # the patterns the last prospective round computed (`after`): the round itself reuses them
        self._recent: dict[tuple[int, ...], Sensitivity] = {}
        self._recent_round: int | None = None

    @classmethod
    def of(cls, encoder: Encoder, selected: Mapping[str, Sequence[int]]) -> IncrementalSensitivity:
        """The tracker of a whole ledger (a resumed run: one pass over the population).

        Args:
            encoder: C.
            selected: user → rounds (ascending, with multiplicity).

        Returns:
            The tracker, at the ledger's participation.
        """
        out = cls(encoder)
        for rounds in selected.values():
            out._enter(tuple(rounds))
        return out

    def value(self) -> Sensitivity:
        """The realised sensitivity now: exact only when every user's pattern value is."""
        heap, live = self._heap, self._live
        while heap and heap[0][1] not in live:
            self._heaped.discard(heapq.heappop(heap)[1])
        if not heap:
            return Sensitivity(0.0, True, "no-participation")
        top = live[heap[0][1]][0]
        exact = self._inexact == 0
        return Sensitivity(top.value, exact, top.method if exact else "realized-upper-bound")

    def add(
        self, selected: Mapping[str, Sequence[int]], round_index: int, users: Iterable[str]
    ) -> None:
        """Record round ``round_index`` for ``users`` (a user listed m times contributes m items).

        Args:
            selected: user → rounds *before* this round (the ledger, not yet updated: the caller
                appends the round to it after).
            round_index: a round after every recorded one.
            users: the round's cohort.
        """
        for user, m in Counter(users).items():
            old = tuple(selected.get(user, ()))
            self._enter((*old, *(round_index,) * m))
            if old:
                self._leave(old)
        self._recent, self._recent_round = {}, None

    def after(
        self, selected: Mapping[str, Sequence[int]], round_index: int, users: Iterable[str]
    ) -> Sensitivity:
        """The sensitivity a prospective round would give (the budget guard; nothing changes).

        Args:
            selected: user → rounds so far.
            round_index: the prospective round.
            users: its cohort.

        Returns:
            The realised sensitivity after the round.
        """
        if round_index != self._recent_round:  # the guard and the release ask about one round
            self._recent, self._recent_round = {}, round_index
        moves = [
            (old := tuple(selected.get(u, ())), (*old, *(round_index,) * m))
            for u, m in Counter(users).items()
        ]
        for old, new in moves:
            self._enter(new, remember=True)
            if old:
                self._leave(old, remember=True)  # (its value is needed back right after)
        try:
            return self.value()
        finally:
            for old, new in moves:
                if old:
                    self._enter(old)
                self._leave(new)

    def _enter(self, pattern: tuple[int, ...], remember: bool = False) -> None:
        slot = self._live.get(pattern)
        if slot is None:
            sens = self._recent.get(pattern)
            if sens is None:
                sens = pattern_sensitivity(self.encoder, pattern)
                if remember:
                    self._recent[pattern] = sens
            slot = self._live[pattern] = [sens, 0]
            if pattern not in self._heaped:
                if len(self._heap) > 2 * len(self._live) + 1024:
                    self._rebuild()
                else:
                    heapq.heappush(self._heap, (-slot[0].value, pattern))
                    self._heaped.add(pattern)
        slot[1] += 1
        self._inexact += not slot[0].exact

    def _leave(self, pattern: tuple[int, ...], remember: bool = False) -> None:
        slot = self._live[pattern]
        slot[1] -= 1
        self._inexact -= not slot[0].exact
        if slot[1] == 0:
            del self._live[pattern]
            if remember:
                self._recent[pattern] = slot[0]

    def _rebuild(self) -> None:
        self._heap = [(-s.value, p) for p, (s, _) in self._live.items()]
        heapq.heapify(self._heap)
        self._heaped = set(self._live)
