"""Participation control: samplers that decide who trains when (004), replayable from a seed.

Contribution bounding, attribution graphs and separation monitoring in the strategy follow (issue 7).
"""

from corrflow.participation.samplers import (
    BallsInBinsSampler,
    BMinSepSampler,
    CyclicPoissonSampler,
    MultiAttributionSampler,
)

__all__ = ["BMinSepSampler", "BallsInBinsSampler", "CyclicPoissonSampler", "MultiAttributionSampler"]
