"""The privacy ledger: who was selected in which round (selected-but-silent counts as participating), what was
rejected and why, and ε planned and realised after every round (post-hoc accounting, 000 App. D.2 with the
realised sensitivity of accounting.posthoc)."""

from __future__ import annotations

from dataclasses import dataclass, field

from corrflow.accounting.mechanisms import epsilon_of, unamplified_event
from corrflow.accounting.posthoc import realized_sensitivity
from corrflow.factorization.base import Factorization


@dataclass
class Ledger:
    selected: dict[str, list[int]] = field(default_factory=dict)        # user -> rounds selected
    replied: dict[str, list[int]] = field(default_factory=dict)         # user -> rounds with an accepted update
    rejections: list[dict] = field(default_factory=list)                # {"round", "user", "reason"}
    overrides: list[dict] = field(default_factory=list)
    rounds_completed: int = 0
    epsilon_history: list[float] = field(default_factory=list)

    def select(self, round_index: int, users: list[str]) -> None:
        """Record round ``round_index`` for each listed user; a user listed m times contributes m items in it."""
        for u in users:
            self.selected.setdefault(u, []).append(round_index)

    def accept(self, round_index: int, user: str) -> None:
        self.replied.setdefault(user, []).append(round_index)

    def reject(self, round_index: int, user: str | None, reason: str) -> None:
        self.rejections.append({"round": round_index, "user": user, "reason": reason})

    def to_dict(self) -> dict:
        return {"selected": self.selected, "replied": self.replied, "rejections": self.rejections,
                "overrides": self.overrides, "rounds_completed": self.rounds_completed,
                "epsilon_history": self.epsilon_history}

    @classmethod
    def from_dict(cls, d: dict) -> Ledger:
        return cls(**d)


class PrivacyTracker:
    """ε of the run for the participation recorded so far (and for a prospective cohort, for the budget guard)."""

    def __init__(self, factorization: Factorization, noise_multiplier: float, delta: float):
        self.fac, self.sigma, self.delta = factorization, noise_multiplier, delta
        self._eps_cache: dict[float, float] = {}

    def epsilon_for_sensitivity(self, sens: float) -> float | None:
        if self.sigma == 0:
            return None  # a non-private baseline has no ε
        key = round(sens, 12)
        if key not in self._eps_cache:
            self._eps_cache[key] = 0.0 if sens == 0 else epsilon_of(unamplified_event(self.sigma, sens), self.delta)
        return self._eps_cache[key]

    def realized(self, selected: dict[str, list[int]]):
        sens, worst = realized_sensitivity(self.fac.encoder, selected)
        return sens, self.epsilon_for_sensitivity(sens.value), worst
