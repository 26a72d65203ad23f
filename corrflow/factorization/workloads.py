"""Workload matrices A: what the server's optimizer computes from the stream of noisy gradient sums.

000 §5.3 (arXiv 2211.06530) and the reference code's optimizer: ``A = tri(n) · diag(η) · M_β`` with
``M_β[i, j] = β^(i-j)``, i.e. ``A[i, j] = Σ_{t=j..i} η_t β^(t-j)``: the iterates of ``m_t = β
m_{t-1} + g_t; θ_{t+1} = θ_t − η_t m_t`` (θ_0 = 0, unit base learning rate). The prefix sum is β =
0, η = 1. The linear cooldown decays η from 1 to ``cooldown_final`` over the last ``int(n ·
cooldown_fraction)`` rounds (reference code: ``n // 4`` for the StackOverflow runs).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from corrflow.errors import InvalidArgumentError, require
from corrflow.factorization.filters import lfilter

WORKLOAD_KINDS = ("prefix", "momentum")


@dataclass(frozen=True)
class Workload:
    """SGD with momentum and a learning-rate schedule, as a lower-triangular n×n matrix (streamed,
    never stored).

    A = tri(n)·diag(η)·M_β (000 §5.3): ``A[i, j] = Σ_{t=j..i} η_t β^(t−j)``.

    Attributes:
        kind: ``"prefix"`` (β = 0, η = 1: prefix sums) or ``"momentum"``.
        momentum: β in [0, 1).
        cooldown_fraction: the fraction of the last rounds over which η decays linearly.
        cooldown_final: η at the last round of the cooldown.
    """

    kind: str = "prefix"
    momentum: float = 0.0
    cooldown_fraction: float = 0.0
    cooldown_final: float = 0.05

    def __post_init__(self) -> None:
        require(self.kind in WORKLOAD_KINDS, "workload", f"one of {WORKLOAD_KINDS}", self.kind)
        require(
            np.isfinite(self.momentum) and 0.0 <= self.momentum < 1.0,
            "momentum",
            "a number in [0, 1)",
            self.momentum,
        )
        if self.kind == "prefix":
            require(
                self.momentum == 0.0,
                "momentum",
                "0 for the prefix workload (use --workload momentum)",
                self.momentum,
            )
        require(
            np.isfinite(self.cooldown_fraction) and 0.0 <= self.cooldown_fraction <= 1.0,
            "cooldown_fraction",
            "a number in [0, 1]",
            self.cooldown_fraction,
        )
        require(
            np.isfinite(self.cooldown_final) and 0.0 < self.cooldown_final <= 1.0,
            "cooldown_final",
            "a number in (0, 1]",
            self.cooldown_final,
        )

    @classmethod
    def prefix(cls) -> Workload:
        """Returns:
        The prefix-sum workload (A = all-ones lower triangle; plain SGD with learning rate 1).
        """
        return cls("prefix")

    @classmethod
    def sgd_momentum(
        cls, momentum: float = 0.95, cooldown_fraction: float = 0.25, cooldown_final: float = 0.05
    ) -> Workload:
        """SGD with momentum and a linear learning-rate cooldown.

        Args:
            momentum: β (000 §5.3's StackOverflow runs: 0.95).
            cooldown_fraction: fraction of rounds in the cooldown (0.25: the last quarter).
            cooldown_final: η at the end of the cooldown (0.05).

        Returns:
            The workload.
        """
        return cls("momentum", float(momentum), float(cooldown_fraction), float(cooldown_final))

    @property
    def is_toeplitz(self) -> bool:
        """True when A is Toeplitz (no learning-rate schedule), enabling O(n·bands) error formulas
        (001 Prop. D.1)."""
        return self.cooldown_fraction == 0.0

    def toeplitz_part(self) -> Workload:
        """Returns:
        The same workload without its learning-rate schedule (Toeplitz).
        """
        return Workload(self.kind, self.momentum) if not self.is_toeplitz else self

    def cooldown_rounds(self, n: int) -> int:
        """The number of cooldown rounds.

        Args:
            n: rounds.

        Returns:
            ⌊n · cooldown_fraction⌋.
        """
        return int(n * self.cooldown_fraction)

    def learning_rates(self, n: int) -> np.ndarray:
        """Per-round learning-rate multipliers.

        Args:
            n: rounds.

        Returns:
            η, float64 of shape (n,): ones, then a linear decay to ``cooldown_final`` over the
            cooldown rounds.
        """
        _check_rounds(n)
        eta = np.ones(n)
        m = self.cooldown_rounds(n)
        if m > 0:
            eta[n - m :] = np.linspace(1.0, self.cooldown_final, m)
        return eta

    def toeplitz_coefs(self, n: int) -> np.ndarray:
        """First column λ of a Toeplitz workload.

        Args:
            n: rounds.

        Returns:
            λ, float64 of shape (n,): λ_j = Σ_{t≤j} β^t (all ones for the prefix sum).

        Raises:
            InvalidArgumentError: the workload has a learning-rate schedule (not Toeplitz).
        """
        if not self.is_toeplitz:
            raise InvalidArgumentError(
                "workload", "a workload without learning-rate cooldown (Toeplitz)", self.to_dict()
            )
        return self.apply(_unit(n))

    def apply(self, x: np.ndarray) -> np.ndarray:
        """A @ x along axis 0 in O(n) per column (a 2-buffer streaming operator, 001 App. D).

        Args:
            x: array of shape (n, ...).

        Returns:
            float64 array of the same shape.
        """
        x = np.asarray(x, dtype=np.float64)
        n = x.shape[0]
        m = lfilter([1.0], [1.0, -self.momentum], x, axis=0) if self.momentum else x
        eta = self.learning_rates(n)
        if not np.all(eta == 1.0):
            m = m * eta.reshape((n,) + (1,) * (x.ndim - 1))
        return np.cumsum(m, axis=0)

    def matrix(self, n: int) -> np.ndarray:
        """The dense workload matrix; only for small n (it holds n² numbers).

        Args:
            n: rounds.

        Returns:
            A, float64 of shape (n, n), lower-triangular.
        """
        return self.apply(np.eye(n))

    def to_dict(self) -> dict:
        """Returns:
        ``{"kind", "momentum", "cooldown_fraction", "cooldown_final"}``.
        """
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Workload:
        """The inverse of `to_dict`.

        Args:
            d: a dict with the keys of `to_dict` (no others).

        Returns:
            The validated workload.
        """
        unknown = set(d) - {"kind", "momentum", "cooldown_fraction", "cooldown_final"}
        require(
            not unknown,
            "workload",
            "keys kind, momentum, cooldown_fraction, cooldown_final",
            sorted(unknown),
        )
        return cls(**d)


def _unit(n: int) -> np.ndarray:
    e = np.zeros(n)
    e[0] = 1.0
    return e


def _check_rounds(n: int) -> None:
    require(isinstance(n, int | np.integer) and n >= 1, "rounds", "a positive integer", n)
