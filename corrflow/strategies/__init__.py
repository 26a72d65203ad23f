"""The Flower strategies that train with correlated noise: `CorrelatedNoiseStrategy` (full
control) and the drop-in wrapper `DifferentialPrivacyCorrelatedNoise` around a FedAvg-style
strategy. Thin: plan, collect, commit, aggregate, step and record call the layers below. Imported
lazily, so that Flower-free modules of this package (journal, run state) load without Flower. The
run's settings are `corrflow.config.RunConfig`.
"""

__all__ = ["CorrelatedNoiseStrategy", "DifferentialPrivacyCorrelatedNoise"]


def __getattr__(name: str):
    if name == "CorrelatedNoiseStrategy":
        from corrflow.strategies.correlated import CorrelatedNoiseStrategy

        return CorrelatedNoiseStrategy
    if name == "DifferentialPrivacyCorrelatedNoise":
        from corrflow.strategies.wrapper import DifferentialPrivacyCorrelatedNoise

        return DifferentialPrivacyCorrelatedNoise
    raise AttributeError(f"module 'corrflow.strategies' has no attribute {name!r}")
