"""Fixed-epoch (k, b) participation schedule (000 §2): users are split once into b groups in a fixed order, and
group t mod b trains in round t — the pattern the factorization's sensitivity assumes (000 digest §10 pitfall 0)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from corrflow.errors import require


class FixedEpochSchedule:
    def __init__(self, users: Sequence[str], rounds: int, epochs: int, seed: int = 0):
        users = sorted(set(users))
        b = rounds // epochs
        require(len(users) >= b, "num-users", f"at least b = {b} users for a fixed-epoch schedule", len(users))
        order = np.random.default_rng(seed).permutation(len(users))  # public: the order is not secret
        self.groups: list[list[str]] = [[] for _ in range(b)]
        for pos, idx in enumerate(order):
            self.groups[pos % b].append(users[idx])
        for g in self.groups:
            g.sort()
        self.rounds, self.epochs, self.min_sep = rounds, epochs, b

    def cohort(self, round_index: int) -> list[str]:
        require(0 <= round_index < self.rounds, "round", f"in [0, {self.rounds})", round_index)
        return list(self.groups[round_index % self.min_sep])

    def planned_rounds(self, user: str) -> list[int]:
        for g, members in enumerate(self.groups):
            if user in members:
                return list(range(g, self.rounds, self.min_sep))
        return []

    def to_dict(self) -> dict:
        return {"kind": "fixed-epoch", "epochs": self.epochs, "min_sep": self.min_sep,
                "users": sum(len(g) for g in self.groups), "cohort_sizes": sorted({len(g) for g in self.groups})}
