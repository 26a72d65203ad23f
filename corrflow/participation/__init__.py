"""Participation control: samplers that decide who trains when (004), replayable from a public seed
(from a private key in amplified runs); attribution graphs (items → users), per-user contribution
bounding, the cohort planner and the separation monitor the strategy uses to keep (or account for)
the user-level pattern the guarantee assumes.
"""

from corrflow.participation.attribution import (
    AttributionGraph,
    bound_contributions,
    load_attribution,
)
from corrflow.participation.planner import PARTICIPATIONS, CohortPlanner, SeparationMonitor
from corrflow.participation.samplers import (
    BallsInBinsSampler,
    BMinSepSampler,
    CyclicPoissonSampler,
    MultiAttributionSampler,
)

__all__ = [
    "PARTICIPATIONS",
    "AttributionGraph",
    "BMinSepSampler",
    "BallsInBinsSampler",
    "CohortPlanner",
    "CyclicPoissonSampler",
    "MultiAttributionSampler",
    "SeparationMonitor",
    "bound_contributions",
    "load_attribution",
]
