"""Participation samplers (004: Dong, Ganesh, "Privacy Amplification for BandMF via b-Min-Sep
Subsampling", arXiv 2602.09338): who trains in round t.

Every sampler draws round t's randomness from ``np.random.default_rng([seed, 0, t])``, so a run is a
pure function of (seed, rounds so far, availability): replaying from round 0 — or restoring the
small ``state()`` — reproduces it exactly for an audit. Items are 0..N−1 (a SuperNode, or an example
in cross-silo training).

* `BMinSepSampler`: 004 Alg. 1 (cold) / Alg. 2 (warm start): Poisson with probability p among
  items not selected in the last b−1 rounds; per-round participation rate p0 with 1/p0 = 1/p + (b −
  1).
* `MultiAttributionSampler`: 004 Alg. 3: an interim Poisson sample S_t from all items; an
  item is blocked if any item sharing a user with it was *sampled* (in S_j, not only in B_j) in the
  last b−1 rounds.
* `BallsInBinsSampler`: each item gets one of T bins once; bin t mod T trains in round t.
* `CyclicPoissonSampler`: items split into b parts; part t mod b is Poisson-sampled with
  probability q (001 Alg. 2).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from corrflow.errors import require

NEVER = np.iinfo(np.int64).min // 2


def _round_rng(seed: int, t: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), 0, int(t)])


def _setup_rng(seed: int) -> np.random.Generator:
    """Randomness drawn once (warm-start states, bins, parts): a stream separate from every
    round's."""
    return np.random.default_rng([int(seed), 1])


def _poisson_subset(rng: np.random.Generator, candidates: np.ndarray, p: float) -> np.ndarray:
    """Each candidate independently with probability p (drawn as Binomial count + uniform
    subset)."""
    if p >= 1.0 or candidates.size == 0:
        return candidates.copy()
    k = rng.binomial(candidates.size, p)
    return np.sort(rng.choice(candidates, size=k, replace=False)) if k else candidates[:0]


def _check_available(available, n: int) -> np.ndarray | None:
    if available is None:
        return None
    mask = np.asarray(available, dtype=bool)
    require(mask.shape == (n,), "available", f"a boolean mask over the {n} items", mask.shape)
    return mask


#: Relative rounding a probability may carry where the algebra makes it exactly 1 (population/cohort
# = b).
PROBABILITY_ROUNDING = 1e-9


def clamp_probability(x: float) -> float:
    """x, with values above 1 by rounding only (≤ 1 + 1e-9) returned as exactly 1."""
    return 1.0 if 1.0 < x <= 1.0 + PROBABILITY_ROUNDING else float(x)


def rate_limit(min_sep: int) -> float:
    """The largest participation rate p0 a sampler with separation b can realise: 1/b, plus
    rounding."""
    return (1.0 / min_sep) * (1.0 + PROBABILITY_ROUNDING)


class BMinSepSampler:
    """b-min-sep Poisson sampling (004 Alg. 1/2, arXiv 2602.09338): each item not selected in the
    last b − 1 rounds is selected with probability p.

    Args:
        num_items: N.
        min_sep: b.
        p: the Poisson probability among eligible items (`probability_for_rate` from a rate p0).
        seed: round t draws from ``default_rng([seed, 0, t])``.
        warm: start from the stationary distribution (004 Alg. 2) so that every round has rate p0;
            else cold (Alg. 1: every item eligible at round 0).
    """

    def __init__(self, num_items: int, min_sep: int, p: float, seed: int, warm: bool = True):
        require(num_items >= 1, "num_items", "a positive integer", num_items)
        require(min_sep >= 1, "min_sep", "a positive integer", min_sep)
        require(0 < p <= 1, "sampling_probability", "a probability in (0, 1]", p)
        self.n, self.b, self.p, self.seed, self.warm = (
            int(num_items),
            int(min_sep),
            float(p),
            int(seed),
            warm,
        )
        self.last = np.full(self.n, NEVER, dtype=np.int64)
        self.next_round = 0
        if warm and self.b > 1:
            # Stationary start (004 Alg. 2): barred for s ~ U{1..b−1} more rounds w.p.
            # (b−1)p/(1+(b−1)p).
            rng = _setup_rng(self.seed)
            barred = rng.random(self.n) >= 1.0 / (1.0 + (self.b - 1) * self.p)
            s = rng.integers(1, self.b, size=self.n)
            self.last[barred] = s[barred] - self.b  # available again at round s

    @staticmethod
    def probability_for_rate(p0: float, min_sep: int) -> float:
        """The Poisson probability that gives a participation rate (004 §1.5).

        Args:
            p0: the per-round participation rate, in (0, 1/b].
            min_sep: b.

        Returns:
            p = p0/(1 − p0(b − 1)), i.e. 1/p0 = 1/p + (b − 1). At p0 = 1/b (population/cohort = b
            exactly) the algebra gives p = 1, returned exactly (rounding never leaves [0, 1]).
        """
        require(
            0 < p0 <= rate_limit(min_sep),
            "participation_rate",
            f"in (0, 1/min_sep = {1 / min_sep:g}]",
            p0,
        )
        return clamp_probability(1.0 / (1.0 / p0 - (min_sep - 1)))

    def sample(self, available: Sequence[bool] | None = None) -> np.ndarray:
        """Draw the next round's cohort.

        Args:
            available: optional bool mask of shape (num_items,): the items reachable this round
                (offline items are not selected).

        Returns:
            The selected item indices, int64, sorted, shape (cohort,).
        """
        t = self.next_round
        eligible = self.last <= t - self.b
        mask = _check_available(available, self.n)
        if mask is not None:
            eligible &= mask
        chosen = _poisson_subset(_round_rng(self.seed, t), np.flatnonzero(eligible), self.p)
        self.last[chosen] = t
        self.next_round += 1
        return chosen

    def state(self) -> dict:
        """The sampler's small state, for checkpoints.

        Returns:
            ``{"next_round", "last"}``: the next round and each item's last selected round (int64,
            (num_items,)).
        """
        return {"next_round": self.next_round, "last": self.last.copy()}

    def load_state(self, state: dict) -> None:
        """Continue from a saved `state`.

        Args:
            state: a dict returned by `state` for the same number of items.
        """
        last = np.asarray(state["last"], dtype=np.int64)
        require(last.shape == (self.n,), "state", f"{self.n} items", last.shape)
        self.last, self.next_round = last.copy(), int(state["next_round"])


class MultiAttributionSampler:
    """b-min-sep with shared items (004 Alg. 3): blocking follows the users of every *sampled* item.

    Args:
        item_users: for each item, the indices of its users.
        num_users: the number of users.
        min_sep: b: a user whose item was sampled is blocked for b − 1 rounds.
        p: the Poisson probability of the interim sample S_t.
        seed: round t draws from ``default_rng([seed, 0, t])``.
    """

    def __init__(
        self, item_users: Sequence[Sequence[int]], num_users: int, min_sep: int, p: float, seed: int
    ):
        require(min_sep >= 1, "min_sep", "a positive integer", min_sep)
        require(0 < p <= 1, "sampling_probability", "a probability in (0, 1]", p)
        lengths = np.array([len(u) for u in item_users], dtype=np.int64)
        require(
            lengths.size >= 1 and lengths.min() >= 1,
            "item_users",
            "every item attributed to ≥ 1 user",
        )
        self.indptr = np.concatenate([[0], np.cumsum(lengths)])
        self.users = np.concatenate([np.asarray(u, dtype=np.int64) for u in item_users])
        require(
            self.users.min() >= 0 and self.users.max() < num_users,
            "item_users",
            f"user ids in [0, {num_users})",
        )
        self.n, self.b, self.p, self.seed = len(item_users), int(min_sep), float(p), int(seed)
        self.user_last = np.full(int(num_users), NEVER, dtype=np.int64)
        self.next_round = 0

    def _item_users(self, items: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(owner item position, user) pairs for the given items."""
        starts, ends = self.indptr[items], self.indptr[items + 1]
        counts = ends - starts
        pos = np.repeat(np.arange(items.size), counts)
        offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        return pos, self.users[np.repeat(starts, counts) + offsets]

    def sample(self, available: Sequence[bool] | None = None) -> np.ndarray:
        """Draw the next round's cohort: the interim Poisson sample minus items with a user in
        cooldown.

        Args:
            available: optional bool mask of shape (num_items,): the items reachable this round
                (offline items are not selected).

        Returns:
            The selected item indices, int64, sorted, shape (cohort,).
        """
        t = self.next_round
        rng = _round_rng(self.seed, t)
        interim = _poisson_subset(rng, np.arange(self.n), self.p)  # S_t, drawn from all items
        pos, users = self._item_users(interim)
        blocked_pair = self.user_last[users] > t - self.b
        blocked = np.zeros(interim.size, dtype=bool)
        np.logical_or.at(blocked, pos, blocked_pair)
        chosen = interim[~blocked]
        mask = _check_available(available, self.n)
        if mask is not None:
            chosen = chosen[mask[chosen]]
        # every user of every sampled item starts a cooldown, selected or not
        self.user_last[users] = t
        self.next_round += 1
        return chosen

    def state(self) -> dict:
        """Returns:
        The next round and each user's last blocking round (int64, (num_users,)).
        """
        return {"next_round": self.next_round, "user_last": self.user_last.copy()}


class BallsInBinsSampler:
    """Balls-in-bins (004 §1.4): item i is in bin h(i) ∈ [0, T); bin t mod T trains in round t.

    Args:
        num_items: N.
        bins: T.
        seed: seeds the bins, drawn once.
    """

    def __init__(self, num_items: int, bins: int, seed: int):
        require(bins >= 1, "bins", "a positive integer", bins)
        self.bin = _setup_rng(seed).integers(0, bins, size=num_items)
        self.T, self.n, self.next_round = int(bins), int(num_items), 0

    def sample(self, available: Sequence[bool] | None = None) -> np.ndarray:
        """The next round's bin.

        Args:
            available: optional bool mask of shape (num_items,): the items reachable this round
                (offline items are not selected).

        Returns:
            The selected item indices, int64, sorted, shape (cohort,).
        """
        chosen = np.flatnonzero(self.bin == self.next_round % self.T)
        mask = _check_available(available, self.n)
        self.next_round += 1
        return chosen if mask is None else chosen[mask[chosen]]


class CyclicPoissonSampler:
    """Cyclic Poisson (001 Alg. 2, arXiv 2405.15913): items in ``cycle`` parts; part t mod cycle is
    sampled with probability q.

    Args:
        num_items: N.
        cycle: b, the number of parts.
        q: the Poisson probability within the round's part (b·p0 for a rate p0).
        seed: seeds the parts (drawn once) and each round's draw.
    """

    def __init__(self, num_items: int, cycle: int, q: float, seed: int):
        require(cycle >= 1, "cycle", "a positive integer", cycle)
        require(0 < q <= 1, "sampling_probability", "a probability in (0, 1]", q)
        self.part = _setup_rng(seed).permutation(num_items) % cycle
        self.cycle, self.q, self.seed, self.n, self.next_round = (
            int(cycle),
            float(q),
            int(seed),
            int(num_items),
            0,
        )

    def sample(self, available: Sequence[bool] | None = None) -> np.ndarray:
        """Draw the next round's cohort from part t mod cycle.

        Args:
            available: optional bool mask of shape (num_items,): the items reachable this round
                (offline items are not selected).

        Returns:
            The selected item indices, int64, sorted, shape (cohort,).
        """
        t = self.next_round
        candidates = np.flatnonzero(self.part == t % self.cycle)
        mask = _check_available(available, self.n)
        if mask is not None:
            candidates = candidates[mask[candidates]]
        self.next_round += 1
        return _poisson_subset(_round_rng(self.seed, t), candidates, self.q)
