"""What preparation decides about a run, frozen before round 1: `RunPlan`.

The settings, the model's layout, the factorization and its workload's server optimizer, the cohort
planner, the accounting (σ, planned ε, the budget guard's target), the silo of each item
(cross-silo), and what the report says about them (identity source, notes, the pre-flight
noise-to-signal ratio ρ). Nothing here changes while the run trains: the changing part is the
`Run`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from corrflow.accounting.policy import RunAccounting
from corrflow.config import RunConfig
from corrflow.factorization.base import Factorization
from corrflow.participation.planner import CohortPlanner, SeparationMonitor
from corrflow.run.model import ModelLayout
from corrflow.run.optimizer import MomentumServerOptimizer


@dataclass(frozen=True)
class RunPlan:
    """The frozen plan of a run (see the module docstring). ``planner`` is seeded once by the run
    that starts from this plan (an amplified run draws its cohorts from the run's private key)."""

    cfg: RunConfig
    layout: ModelLayout
    factorization: Factorization
    planner: CohortPlanner
    accounting: RunAccounting
    optimizer: MomentumServerOptimizer
    item_home: dict[str, str] | None = None  # cross-silo: item → the silo (user) that holds it
    identity: str = "user-id"  # where a node's user id comes from (reported)
    notes: tuple[str, ...] = ()  # what was built where it differs from what the settings name
    rho: float | None = None  # the pre-flight noise-to-signal ratio (the report's learning section)

    @property
    def sigma(self) -> float:
        """σ, the noise multiplier: the noise added to a round's sum is σ·clip·(C⁻¹Z)_t."""
        return float(self.accounting.plan.noise_multiplier)

    @property
    def monitor(self) -> SeparationMonitor:
        return SeparationMonitor(self.planner.min_sep)

    def planned_cohort(self, t: int) -> np.float32:
        """The planned cohort size of round ``t`` — not the number of replies, which must not
        change the denominator of x̂_t.

        Args:
            t: the round, 0-based.

        Returns:
            The fixed-epoch group's size, or the sampler's expected batch.
        """
        return np.float32(
            len(self.planner.cohort(t))
            if self.planner.kind == "fixed-epoch"
            else self.planner.expected
        )
