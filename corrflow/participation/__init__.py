"""Participation control: samplers that decide who trains when (004), replayable from a seed; attribution graphs
(items → users) and per-user contribution bounding. Separation monitoring in the strategy follows (issue 7).
"""

from corrflow.participation.attribution import AttributionGraph, bound_contributions, load_attribution
from corrflow.participation.samplers import (
    BallsInBinsSampler,
    BMinSepSampler,
    CyclicPoissonSampler,
    MultiAttributionSampler,
)

__all__ = ["AttributionGraph", "BMinSepSampler", "BallsInBinsSampler", "CyclicPoissonSampler",
           "MultiAttributionSampler", "bound_contributions", "load_attribution"]
