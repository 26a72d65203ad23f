"""The privacy ledger: who was selected in which round (selected-but-silent counts as
participating), what was rejected and why, overrides, and the ε history. ε itself is computed by
``corrflow.accounting.tracking``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Ledger:
    selected: dict[str, list[int]] = field(default_factory=dict)  # user -> rounds selected
    replied: dict[str, list[int]] = field(
        default_factory=dict
    )  # user -> rounds with an accepted update
    rejections: list[dict] = field(default_factory=list)  # {"round", "user", "reason"}
    overrides: list[dict] = field(default_factory=list)
    rounds_completed: int = 0
    epsilon_history: list[float] = field(default_factory=list)

    def select(self, round_index: int, users: list[str]) -> None:
        """Record round ``round_index`` for each listed user; a user listed m times contributes m
        items in it."""
        for u in users:
            self.selected.setdefault(u, []).append(round_index)

    def accept(self, round_index: int, user: str) -> None:
        self.replied.setdefault(user, []).append(round_index)

    def reject(self, round_index: int, user: str | None, reason: str) -> None:
        self.rejections.append({"round": round_index, "user": user, "reason": reason})

    def to_dict(self) -> dict:
        return {
            "selected": self.selected,
            "replied": self.replied,
            "rejections": self.rejections,
            "overrides": self.overrides,
            "rounds_completed": self.rounds_completed,
            "epsilon_history": self.epsilon_history,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Ledger:
        return cls(**d)
