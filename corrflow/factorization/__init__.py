"""Workloads A, participation schemas, encoders C (and decoders B = A C⁻¹), sensitivity and error
metrics.

Pure numpy/scipy, float64. Entry point: `factorize` builds a normalised `Factorization`
of any kind; the optimizers (dense, banded, Toeplitz) and closed forms (BISR, γ-BIFR, BSR, DP-λCGD,
FFT, tree) live beside it.
"""

from corrflow.factorization.base import Factorization
from corrflow.factorization.build import KINDS, factorize, participation_for
from corrflow.factorization.participation import Participation
from corrflow.factorization.sensitivity import Sensitivity
from corrflow.factorization.workloads import Workload

__all__ = [
    "KINDS",
    "Factorization",
    "Participation",
    "Sensitivity",
    "Workload",
    "factorize",
    "participation_for",
]
