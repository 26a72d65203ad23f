"""What preparation decides about a run, frozen before round 1: `RunPlan`.

The settings, the model's layout, the factorization and its workload's server optimizer, the cohort
planner, the accounting (σ, planned ε, the budget guard's target), the silo of each item
(cross-silo), and what the report says about them (identity source, notes, the pre-flight
noise-to-signal ratio ρ). Nothing here changes while the run trains: the changing part is the
`Run`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from corrflow.accounting.policy import RunAccounting
from corrflow.config import RunConfig
from corrflow.factorization.base import Factorization
from corrflow.participation.planner import CohortPlanner, SeparationMonitor
from corrflow.run.clipping import fixed_point_scale
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

    # Facts of the plan every round reads, derived once here (a round never recomputes them).
    #: σ, the noise multiplier: the noise added to a round's sum is σ·clip·(C⁻¹Z)_t.
    sigma: float = field(init=False, compare=False)
    #: the separation policy's check of the design min-sep b
    monitor: SeparationMonitor = field(init=False, compare=False)
    #: the exponent s of the round's exact sum (`corrflow.run.clipping.ExactSum`), fixed for the
    # run: s = ⌊62 − log₂(items · clip)⌋, with the cohort cap taken as every item of the
    # population once — the most a round can accept (a reply per item id at most; a Poisson or
    # b-min-sep cohort and operator overrides have no smaller hard bound)
    sum_scale: int = field(init=False, compare=False)
    #: replies are full weights (the update is reply − model sent), not deltas
    replies_are_weights: bool = field(init=False, compare=False)

    def __post_init__(self):
        derived = {
            "sigma": float(self.accounting.plan.noise_multiplier),
            "monitor": SeparationMonitor(self.planner.min_sep),
            "sum_scale": fixed_point_scale(len(self.planner.items), self.cfg.clip_norm),
            "replies_are_weights": self.cfg.reply_kind == "weights",
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)

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
