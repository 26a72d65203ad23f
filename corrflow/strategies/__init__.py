"""The Flower strategy that trains with correlated noise: schedule, server-side clipping, noise, server optimizer,
privacy ledger, budget guard and atomic checkpoints. Thin: the math lives in factorization/noise/accounting.
"""

from corrflow.strategies.config import StrategyConfig
from corrflow.strategies.correlated import CorrelatedNoiseStrategy

__all__ = ["CorrelatedNoiseStrategy", "StrategyConfig"]
