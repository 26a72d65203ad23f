"""Which bound holds for a run as it happens, and whether a round may still happen: the accounting policy the
strategy applies without knowing how ε is computed.

* The plan's ε holds while an amplified plan's pattern is followed: participation came from the sampler's
  randomness alone. An accepted separation violation, or an operator forcing an item in, leaves that pattern
  (amplification assumes nobody chose who trains), and from then on the run is accounted post hoc on its realised
  participation (one Gaussian of the realised sensitivity, 000 App. D.2).
* The budget guard refuses a round whose participation would take the realised ε above the target.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from corrflow.accounting.tracking import PrivacyPlan, RealizedPrivacy, RunPrivacy
from corrflow.factorization.base import Factorization

#: Relative tolerance of the budget guard (ε computed twice from the same inputs may differ in the last bits).
BUDGET_TOLERANCE = 1e-9


def pattern_followed(overrides: Iterable[Mapping]) -> bool:
    """False once the sampler's pattern was left: a min-sep break was accounted, or an operator forced an item in."""
    return not any(o["action"] == "accepted-and-accounted" or (o["source"] == "override" and o["action"] != "rejected")
                   for o in overrides)


def with_round(selected: Mapping[str, Sequence[int]], round_index: int, users: Iterable[str]) -> dict[str, list[int]]:
    """``selected`` (user → rounds) with ``round_index`` added for each of ``users`` (with multiplicity)."""
    out = {u: list(r) for u, r in selected.items()}
    for u in users:
        out.setdefault(u, []).append(round_index)
    return out


@dataclass(frozen=True)
class RunAccounting:
    """ε of a run's participation under the policy above, and the budget guard.

    ``target_epsilon``: the guard's limit (None: no guard)."""

    privacy: RunPrivacy
    target_epsilon: float | None

    @classmethod
    def of(cls, factorization: Factorization, plan: PrivacyPlan, delta: float,
           target_epsilon: float | None) -> RunAccounting:
        return cls(RunPrivacy(factorization, plan, delta), target_epsilon)

    @property
    def plan(self) -> PrivacyPlan:
        return self.privacy.plan

    def realized(self, selected: Mapping[str, Sequence[int]], overrides: Iterable[Mapping]) -> RealizedPrivacy:
        """ε of ``selected``: the plan's while an amplified plan's pattern is followed, else post hoc."""
        return self.privacy.realized(selected, pattern_followed=pattern_followed(overrides))

    def budget_exceeded(self, selected: Mapping[str, Sequence[int]], overrides: Iterable[Mapping],
                        round_index: int, users: Iterable[str]) -> float | None:
        """The ε round ``round_index`` with ``users`` would spend when that exceeds the target, else None."""
        if not self.target_epsilon:
            return None
        eps = self.realized(with_round(selected, round_index, users), overrides).epsilon
        if eps is not None and eps > self.target_epsilon * (1 + BUDGET_TOLERANCE):
            return eps
        return None
