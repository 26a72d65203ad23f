"""The Flower strategies that train with correlated noise: :class:`CorrelatedNoiseStrategy` (full control) and the
drop-in wrapper :class:`DifferentialPrivacyCorrelatedNoise` around a FedAvg-style strategy. Thin: plan, collect,
commit, aggregate, step and record call the layers below. Imported lazily, so that Flower-free modules of this
package (config, journal, run state) load without Flower.
"""

__all__ = ["CorrelatedNoiseStrategy", "DifferentialPrivacyCorrelatedNoise", "StrategyConfig"]


def __getattr__(name: str):
    if name == "CorrelatedNoiseStrategy":
        from corrflow.strategies.correlated import CorrelatedNoiseStrategy

        return CorrelatedNoiseStrategy
    if name == "DifferentialPrivacyCorrelatedNoise":
        from corrflow.strategies.wrapper import DifferentialPrivacyCorrelatedNoise

        return DifferentialPrivacyCorrelatedNoise
    if name == "StrategyConfig":
        from corrflow.strategies.config import StrategyConfig

        return StrategyConfig
    raise AttributeError(f"module 'corrflow.strategies' has no attribute {name!r}")
