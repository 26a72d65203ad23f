"""Who trains in round t, at the level the privacy guarantee is stated: the *user* (a person), whose
contributions may come through several items (SuperNodes they own, or examples — an arXiv paper
belongs to all its authors).

`CohortPlanner` turns a sampler over items into per-round cohorts and the users behind them:
* ``fixed-epoch``: the (k, b) schedule of 000 §2 over items;
* ``bminsep``: 004 Alg. 2 (warm start) over items, participation rate p0 (1/p0 = 1/p + (b − 1));
* ``multi-attribution``: 004 Alg. 3 — an item is blocked while any of its users is cooling down, so
  every user's distinct participation rounds are ≥ b apart by construction;
* ``poisson``: every item independently with probability p0 in every round (min_sep 1) — what MMCC
  (002 Alg. 1) accounts for;
* ``cyclic-poisson``: items in b parts, part t mod b sampled with probability q = b·p0 (001 Alg. 2;
  002 App. D's "b-min-sep") — what the cyclic Poisson reduction and Generalized-MMCC account for.

Because every sampler is a pure function of (seed, round), the planner restores by replaying rounds
0..t−1 from the seed (about 2 ms a round at 10⁶ items), so the checkpoint needs no sampler state.
The seed is public (``schedule-seed``) unless the run's ε is amplified by the sampling:
amplification bounds what an adversary learns when it does *not* know who was sampled, so such runs
draw cohorts from a private key instead (`CohortPlanner.seed_privately`), which the checkpoint
keeps as a 0600 file.

`SeparationMonitor` checks the *user-level* pattern that actually happens against the design
min-sep: a user reaching the server through a second device, an operator override, or a late reply
can break it even when the item sampler is correct. Gaps count distinct rounds; several items of one
user in one round are a multiplicity (bounded by k_u), not a gap.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from corrflow.choices import Participation, values
from corrflow.errors import InvalidArgumentError, require
from corrflow.participation.samplers import (
    BMinSepSampler,
    CyclicPoissonSampler,
    MultiAttributionSampler,
    clamp_probability,
    rate_limit,
)

PARTICIPATIONS = values(Participation)


@dataclass(frozen=True)
class PlanSummary:
    """The planned participation of a run, as written to the privacy report's
    ``planned.participation``."""

    kind: str
    items: int
    users: int
    rounds: int
    min_sep: int
    max_participations: int  # k: distinct rounds per user the factorization allows
    items_per_user: int  # k_u: the most items one user holds (after bounding)
    participation_rate: float  # p0 per item and round
    sampling_probability: float  # p of the Poisson step (1 for fixed-epoch)
    expected_cohort: float  # items per round the update is divided by

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class CohortPlanner:
    """Who trains in each round: the fixed-epoch schedule (000 §2) or one of the samplers (004, 001
    Alg. 2).

    Args:
        kind: one of `PARTICIPATIONS` (``fixed-epoch``, ``bminsep``, ``multi-attribution``,
            ``poisson``, ``cyclic-poisson``).
        items: the item ids (SuperNodes' user ids, or examples in cross-silo mode), distinct.
        item_users: for each item, the indices of its users in ``users``.
        users: the user ids.
        rounds: n.
        min_sep: b (fixed-epoch: n/k; poisson: 1).
        rate: p0, the probability an item is offered in a round (samplers; 0: 1/(2b)); the sampler's
            own p follows (b-min-sep: 1/p0 = 1/p + (b − 1); cyclic Poisson: q = b·p0).
        seed: the public schedule seed (amplified runs replace it with `seed_privately`).
    """

    def __init__(
        self,
        kind: str,
        items: Sequence[str],
        item_users: Sequence[Sequence[int]],
        users: Sequence[str],
        rounds: int,
        min_sep: int,
        *,
        rate: float = 0.0,
        seed: int = 0,
    ):
        require(kind in PARTICIPATIONS, "participation", f"one of {PARTICIPATIONS}", kind)
        require(
            len(items) == len(item_users) and len(items) >= 1,
            "items",
            "one user list per item, ≥ 1 item",
        )
        require(len(set(items)) == len(items), "items", "distinct item ids")
        require(1 <= min_sep <= rounds, "min-sep", f"in [1, rounds = {rounds}]", min_sep)
        self.kind, self.items, self.users = kind, list(items), list(users)
        self.item_users = [list(map(int, u)) for u in item_users]
        self.rounds, self.min_sep, self.seed = int(rounds), int(min_sep), int(seed)
        self.index = {item: i for i, item in enumerate(self.items)}
        per_user = np.zeros(len(self.users), dtype=np.int64)
        for us in self.item_users:
            per_user[us] += 1
        self.items_per_user = int(per_user.max())
        n = len(self.items)
        if kind == "fixed-epoch":
            require(
                rounds % min_sep == 0,
                "min-sep",
                f"a divisor of rounds = {rounds} for fixed-epoch",
                min_sep,
            )
            require(
                n >= min_sep,
                "num-users",
                f"at least b = {min_sep} items for a fixed-epoch schedule",
                n,
            )
            order = np.random.default_rng(seed).permutation(n)  # public: the order is not secret
            self.groups = [sorted(int(i) for i in order[g::min_sep]) for g in range(min_sep)]
            self.p0, self.p = 1.0 / min_sep, 1.0
            self.expected = n / min_sep
        else:
            p0 = rate or 0.5 / min_sep
            require(
                0 < p0 <= rate_limit(min_sep),
                "participation-rate",
                f"in (0, 1/min_sep = {1 / min_sep:g}]",
                rate,
            )
            require(
                kind != "poisson" or min_sep == 1,
                "min-sep",
                "1 for poisson participation (any round)",
                min_sep,
            )
            self.p0 = p0
            # The sampler's own probability: b-min-sep's p (1/p0 = 1/p + b − 1), cyclic Poisson's q
            # = b·p0.
            self.p = (
                clamp_probability(min_sep * p0)
                if kind == "cyclic-poisson"
                else BMinSepSampler.probability_for_rate(p0, min_sep)
            )
            self.expected = n * p0
        self._sampler = self._new_sampler()
        self._cohorts: dict[int, list[int]] = {}

    def _new_sampler(self):
        if self.kind == "bminsep":
            return BMinSepSampler(len(self.items), self.min_sep, self.p, self.seed, warm=True)
        if self.kind == "multi-attribution":
            return MultiAttributionSampler(
                self.item_users, len(self.users), self.min_sep, self.p, self.seed
            )
        if self.kind == "poisson":
            return BMinSepSampler(len(self.items), 1, self.p, self.seed, warm=False)
        if self.kind == "cyclic-poisson":
            return CyclicPoissonSampler(len(self.items), self.min_sep, self.p, self.seed)
        return None

    def seed_privately(self, key: bytes) -> None:
        """Draw the random sampler's cohorts from a private key (≥ 32 bytes) instead of the public
        seed. Amplified ε (Poisson subsampling in 002 Thm 3.1 / Alg. 1, 001 Alg. 2, 004 Alg. 2–3)
        assumes the adversary does not know who was sampled; a public seed would let anyone replay
        the cohorts. Call before the first cohort.

        Args:
            key: the private sampler key, at least 32 bytes.
        """
        require(
            self.kind != "fixed-epoch",
            "participation",
            "a random sampler (fixed-epoch has no sampling)",
            self.kind,
        )
        require(len(key) >= 32, "sampler key", "at least 32 bytes", len(key))
        self.seed = int.from_bytes(key, "big")
        self._sampler, self._cohorts = self._new_sampler(), {}

    @property
    def max_participations(self) -> int:
        if self.kind == "fixed-epoch":
            return self.rounds // self.min_sep
        return math.ceil(self.rounds / self.min_sep)

    def summary(self) -> PlanSummary:
        """Returns:
        The planned participation (items, users, k, k_u, rates, expected cohort).
        """
        return PlanSummary(
            self.kind,
            len(self.items),
            len(self.users),
            self.rounds,
            self.min_sep,
            self.max_participations,
            self.items_per_user,
            self.p0,
            self.p,
            self.expected,
        )

    def cohort(self, t: int) -> list[str]:
        """The cohort of one round.

        Args:
            t: the round, 0-based, in [0, n).

        Returns:
            The item ids of round t, sorted. Rounds are drawn in order; an earlier round is replayed
            from the seed.
        """
        if not 0 <= t < self.rounds:
            raise InvalidArgumentError("round", f"in [0, {self.rounds})", t)
        if self.kind == "fixed-epoch":
            return sorted(self.items[i] for i in self.groups[t % self.min_sep])
        # an old round: replay from the seed
        if t not in self._cohorts and t < self._sampler.next_round:
            self._sampler, self._cohorts = self._new_sampler(), {}
        while self._sampler.next_round <= t:
            r = self._sampler.next_round
            self._cohorts[r] = [int(i) for i in self._sampler.sample()]
            self._cohorts.pop(r - 2, None)  # memory stays O(cohort), not O(rounds · cohort)
        return sorted(self.items[i] for i in self._cohorts[t])

    def users_of(self, item: str) -> list[str]:
        """The users behind an item.

        Args:
            item: an item id.

        Returns:
            Their user ids.
        """
        return [self.users[u] for u in self.item_users[self.index[item]]]

    def planned_rounds(self, item: str) -> list[int] | None:
        """The rounds a fixed-epoch item trains in.

        Args:
            item: an item id.

        Returns:
            Its rounds, or None for random samplers (decided round by round).
        """
        if self.kind != "fixed-epoch":
            return None
        i = self.index[item]
        g = next(g for g, members in enumerate(self.groups) if i in members)
        return list(range(g, self.rounds, self.min_sep))

    def to_dict(self) -> dict:
        """Returns:
        `summary` as a dict, with the fixed-epoch cohort sizes.
        """
        d = self.summary().to_dict()
        if self.kind == "fixed-epoch":
            d["cohort_sizes"] = sorted({len(g) for g in self.groups})
        return d


class SeparationMonitor:
    """Smallest realised gap per user against the design ``min_sep`` (pure; the strategy applies the
    policy)."""

    def __init__(self, min_sep: int):
        self.min_sep = int(min_sep)

    def gap(self, included: Mapping[str, Sequence[int]], user: str, t: int) -> int | None:
        """The gap a participation in round t would have.

        Args:
            included: user id → the rounds the user was included in so far.
            user: a user id.
            t: the round.

        Returns:
            t minus the user's latest included round before t, or None if it would be their first.
        """
        earlier = [r for r in included.get(user, ()) if r < t]
        return t - max(earlier) if earlier else None

    def violates(self, included: Mapping[str, Sequence[int]], user: str, t: int) -> int | None:
        """Whether including ``user`` in round t breaks the design min-sep.

        Args:
            included: user id → the rounds the user was included in so far.
            user: a user id.
            t: the round.

        Returns:
            The too-small gap (< min_sep), or None when the inclusion keeps the design.
        """
        g = self.gap(included, user, t)
        return g if g is not None and g < self.min_sep else None
