"""Participation schemas: who may contribute in which rounds (000 §2, 001 §5, 004).

* ``fixed-epoch`` (k, b): users split once into b groups in a fixed order; group p trains in rounds
  p, p+b, …, p+(k−1)b. n = k·b exactly (000 §2, "(k,b)-participation").
* ``min-sep`` (b-min-separation): at most k participations, any two at least b rounds apart.
  Every fixed-epoch pattern is also a b-min-sep pattern.

Rounds are 0-based.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from corrflow.errors import require

PARTICIPATION_KINDS = ("fixed-epoch", "min-sep")


@dataclass(frozen=True)
class Participation:
    """A participation schema over ``rounds`` rounds: at most ``epochs`` (k) times, ``min_sep`` (b)
    apart.

    Attributes:
        kind: ``"fixed-epoch"`` (000 §2: b = n/k, the same order every epoch) or ``"min-sep"``
            (b-min-separation with at most k participations, 004).
        rounds: n.
        epochs: k.
        min_sep: b.
    """

    kind: str
    rounds: int
    epochs: int
    min_sep: int

    def __post_init__(self) -> None:
        require(
            self.kind in PARTICIPATION_KINDS,
            "participation",
            f"one of {PARTICIPATION_KINDS}",
            self.kind,
        )
        for name in ("rounds", "epochs", "min_sep"):
            v = getattr(self, name)
            require(
                isinstance(v, int | np.integer) and v >= 1,
                name.replace("_", "-"),
                "a positive integer",
                v,
            )
        n, k, b = self.rounds, self.epochs, self.min_sep
        require(b <= n, "min-sep", f"at most rounds={n}", b)
        if self.kind == "fixed-epoch":
            require(
                n == k * b,
                "epochs",
                f"a divisor of rounds={n} with min_sep = rounds/epochs (got min_sep={b})",
                k,
            )
        else:
            most = -(-n // b)
            require(
                k <= most,
                "epochs",
                f"at most ceil(rounds/min_sep) = {most}: more participations cannot be "
                f"{b} rounds apart within {n} rounds",
                k,
            )

    @classmethod
    def fixed_epoch(cls, rounds: int, epochs: int) -> Participation:
        """(k, b)-participation with b = n / k (000 §2, arXiv 2211.06530).

        Args:
            rounds: n.
            epochs: k, a divisor of n.

        Returns:
            The fixed-epoch schema; user group p trains in rounds p, p + b, …, p + (k − 1)b.
        """
        require(
            isinstance(epochs, int | np.integer) and epochs >= 1,
            "epochs",
            "a positive integer",
            epochs,
        )
        require(
            isinstance(rounds, int | np.integer) and rounds >= 1,
            "rounds",
            "a positive integer",
            rounds,
        )
        require(
            rounds % epochs == 0,
            "epochs",
            f"a divisor of rounds={rounds} for fixed-epoch participation",
            epochs,
        )
        return cls("fixed-epoch", int(rounds), int(epochs), int(rounds // epochs))

    @classmethod
    def min_separation(cls, rounds: int, min_sep: int, epochs: int | None = None) -> Participation:
        """b-min-separation with at most k participations.

        Args:
            rounds: n.
            min_sep: b ≥ 1.
            epochs: k (default ⌈n/b⌉, the most b allows).

        Returns:
            The min-sep schema.
        """
        require(
            isinstance(min_sep, int | np.integer) and min_sep >= 1,
            "min-sep",
            "a positive integer",
            min_sep,
        )
        k = -(-rounds // min_sep) if epochs is None else epochs
        return cls("min-sep", int(rounds), int(k), int(min_sep))

    @classmethod
    def single(cls, rounds: int) -> Participation:
        """Single participation (k = 1).

        Args:
            rounds: n.

        Returns:
            Fixed-epoch participation with k = 1, b = n.
        """
        return cls.fixed_epoch(rounds, 1)

    @property
    def max_participations(self) -> int:
        return min(self.epochs, -(-self.rounds // self.min_sep))

    def patterns(self) -> np.ndarray:
        """The fixed-epoch patterns.

        Returns:
            int array of shape (b, k): row p lists the rounds p, p + b, …, p + (k − 1)b.
        """
        require(
            self.kind == "fixed-epoch",
            "participation",
            "fixed-epoch for an explicit pattern list",
            self.kind,
        )
        return np.arange(self.rounds).reshape(self.epochs, self.min_sep).T.copy()

    def contribution_matrix(self) -> np.ndarray:
        """The contribution matrix H of 000 §3.4.

        Returns:
            float64 array of shape (n, b), 0/1: column p is the indicator of pattern p.
        """
        H = np.zeros((self.rounds, self.min_sep))
        for p, rows in enumerate(self.patterns()):
            H[rows, p] = 1.0
        return H

    def same_pattern_mask(self) -> np.ndarray:
        """The pairs of rounds one user can both contribute to (Π̂ of 000 Eq. 36).

        Returns:
            bool array of shape (n, n), True at (i, j), i ≠ j, when one user can train in both
            rounds.
        """
        idx = np.arange(self.rounds)
        if self.kind == "fixed-epoch":
            m = (idx[:, None] % self.min_sep) == (idx[None, :] % self.min_sep)
        else:
            m = np.abs(idx[:, None] - idx[None, :]) >= self.min_sep
        np.fill_diagonal(m, False)
        return m

    def describe(self) -> str:
        """Returns:
        A one-line description, e.g. ``fixed-epoch (rounds=12, epochs=3, min_sep=4)``.
        """
        return f"{self.kind} (rounds={self.rounds}, epochs={self.epochs}, min_sep={self.min_sep})"

    def to_dict(self) -> dict:
        """Returns:
        ``{"kind", "rounds", "epochs", "min_sep"}``, as stored in factorization files.
        """
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Participation:
        """The inverse of `to_dict`.

        Args:
            d: a dict with exactly the keys kind, rounds, epochs, min_sep.

        Returns:
            The validated schema.
        """
        unknown = set(d) - {"kind", "rounds", "epochs", "min_sep"}
        require(not unknown, "participation", "keys kind, rounds, epochs, min_sep", sorted(unknown))
        return cls(**d)
