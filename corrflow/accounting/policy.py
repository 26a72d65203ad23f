"""Which bound holds for a run as it happens, and whether a round may still happen: the accounting
policy the strategy applies without knowing how ε is computed.

* The plan's ε holds while an amplified plan's pattern is followed: participation came from the
  sampler's randomness alone. An accepted separation violation, or an operator forcing an item in,
  leaves that pattern (amplification assumes nobody chose who trains), and from then on the run is
  accounted post hoc on its realised participation (one Gaussian of the realised sensitivity, 000
  App. D.2: Choquette-Choo et al., "Multi-Epoch Matrix Factorization Mechanisms for Private Machine
  Learning", arXiv 2211.06530).
* The budget guard refuses a round whose participation would take the realised ε above the target.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from corrflow.accounting.tracking import (
    IncrementalSensitivity,
    PrivacyPlan,
    RealizedPrivacy,
    RunPrivacy,
)
from corrflow.factorization.base import Factorization

#: Relative tolerance of the budget guard (ε computed twice from the same inputs may differ in the
# last bits).
BUDGET_TOLERANCE = 1e-9


def pattern_followed(overrides: Iterable[Mapping]) -> bool:
    """Whether the run still follows the sampler's pattern (the condition of an amplified plan's ε).

    Args:
        overrides: the run's override records, each with ``"action"`` and ``"source"``.

    Returns:
        False once the pattern was left: a min-sep break was accepted and accounted, or an operator
        forced an item in (an override that was not rejected); else True.
    """
    return not any(
        o["action"] == "accepted-and-accounted"
        or (o["source"] == "override" and o["action"] != "rejected")
        for o in overrides
    )


def with_round(
    selected: Mapping[str, Sequence[int]], round_index: int, users: Iterable[str]
) -> Mapping[str, Sequence[int]]:
    """The participation after a prospective round.

    Args:
        selected: user → the rounds the user contributed to so far (not modified).
        round_index: the round, 0-based.
        users: the round's cohort (a user listed twice contributes twice).

    Returns:
        A user → rounds mapping with ``round_index`` added for each of ``users``: a read-only
        overlay on ``selected`` built in O(cohort) (a round never copies the population's ledger).
    """
    extra: dict[str, list[int]] = {}
    for u in users:
        extra.setdefault(u, []).append(round_index)
    return _WithRound(selected, extra)


class _WithRound(Mapping):
    """``selected`` with a round's extra participations appended (see `with_round`)."""

    def __init__(self, selected: Mapping[str, Sequence[int]], extra: dict[str, list[int]]):
        self._selected, self._extra = selected, extra

    def __getitem__(self, user: str) -> list[int]:
        if user in self._extra:
            return [*self._selected.get(user, ()), *self._extra[user]]
        return self._selected[user]

    def __iter__(self):
        yield from self._selected
        yield from (u for u in self._extra if u not in self._selected)

    def __len__(self) -> int:
        return len(self._selected) + sum(u not in self._selected for u in self._extra)


@dataclass(frozen=True)
class RunAccounting:
    """ε of a run's participation under the policy above, and the budget guard.

    Attributes:
        privacy: the run's memoised `RunPrivacy`.
        target_epsilon: the guard's limit (None: no guard).
    """

    privacy: RunPrivacy
    target_epsilon: float | None

    @classmethod
    def of(
        cls,
        factorization: Factorization,
        plan: PrivacyPlan,
        delta: float,
        target_epsilon: float | None,
    ) -> RunAccounting:
        """The accounting of one run.

        Args:
            factorization: the run's normalised factorization (its encoder C gives realised
                sensitivities).
            plan: σ, the planned ε and whether it is amplified.
            delta: the training's δ.
            target_epsilon: the budget guard's limit (None: no guard).

        Returns:
            The `RunAccounting`.
        """
        return cls(RunPrivacy(factorization, plan, delta), target_epsilon)

    @property
    def plan(self) -> PrivacyPlan:
        """The run's privacy plan."""
        return self.privacy.plan

    def realized(
        self,
        selected: Mapping[str, Sequence[int]],
        overrides: Iterable[Mapping],
        tracker: IncrementalSensitivity | None = None,
    ) -> RealizedPrivacy:
        """ε of the participation so far: the plan's while an amplified plan's pattern is followed,
        else post hoc.

        Args:
            selected: user → rounds contributed to (with multiplicity).
            overrides: the run's override records (see `pattern_followed`).
            tracker: the run's incremental sensitivity at ``selected`` (O(1); without it, a pass
                over every user).

        Returns:
            The `RealizedPrivacy`: sensitivity, whether it is exact, ε (None for a non-private run)
            and how ε was obtained.
        """
        followed = pattern_followed(overrides)
        if tracker is not None:
            return self.privacy.of_sensitivity(tracker.value(), pattern_followed=followed)
        return self.privacy.realized(selected, pattern_followed=followed)

    def realized_after(
        self,
        tracker: IncrementalSensitivity,
        selected: Mapping[str, Sequence[int]],
        overrides: Iterable[Mapping],
        round_index: int,
        users: Iterable[str],
    ) -> RealizedPrivacy:
        """ε after a prospective round, in O(cohort) (nothing changes).

        Args:
            tracker: the run's incremental sensitivity at ``selected``.
            selected: user → rounds so far.
            overrides: the override records, the round's included.
            round_index: the round.
            users: its cohort.

        Returns:
            The `RealizedPrivacy` after the round.
        """
        return self.privacy.of_sensitivity(
            tracker.after(selected, round_index, users),
            pattern_followed=pattern_followed(overrides),
        )

    def budget_exceeded(
        self,
        selected: Mapping[str, Sequence[int]],
        overrides: Iterable[Mapping],
        round_index: int,
        users: Iterable[str],
        tracker: IncrementalSensitivity | None = None,
    ) -> float | None:
        """The budget guard: would this round take the realised ε above the target?

        Args:
            selected: user → rounds contributed to so far.
            overrides: the run's override records.
            round_index: the prospective round, 0-based.
            users: its cohort.
            tracker: the run's incremental sensitivity at ``selected`` (O(cohort)).

        Returns:
            The ε after the round when it exceeds the target (to a relative `BUDGET_TOLERANCE`),
            else None (also without a target).
        """
        if not self.target_epsilon:
            return None
        eps = self.after_round(selected, overrides, round_index, users, tracker).epsilon
        return eps if self.over_budget(eps) else None

    def after_round(
        self,
        selected: Mapping[str, Sequence[int]],
        overrides: Iterable[Mapping],
        round_index: int,
        users: Iterable[str],
        tracker: IncrementalSensitivity | None = None,
    ) -> RealizedPrivacy:
        """ε after a prospective round (nothing changes).

        Args:
            selected: user → rounds contributed to so far.
            overrides: the override records, the round's included.
            round_index: the round, 0-based.
            users: its cohort.
            tracker: the run's incremental sensitivity at ``selected`` (O(cohort); without it, a
                pass over every user).

        Returns:
            The `RealizedPrivacy` after the round.
        """
        if tracker is not None:
            return self.realized_after(tracker, selected, overrides, round_index, users)
        return self.realized(with_round(selected, round_index, users), overrides)

    def over_budget(self, epsilon: float | None) -> bool:
        """Whether a realised ε exceeds the target (to a relative `BUDGET_TOLERANCE`).

        Args:
            epsilon: ε after a prospective round (None: a non-private run).

        Returns:
            False without a target or without ε.
        """
        return bool(
            self.target_epsilon
            and epsilon is not None
            and epsilon > self.target_epsilon * (1 + BUDGET_TOLERANCE)
        )
