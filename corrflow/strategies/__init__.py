"""Flower strategies that train with correlated noise over the Flower-free `corrflow.run`:
`CorrelatedNoiseStrategy` (full control) and `DifferentialPrivacyCorrelatedNoise`, a drop-in wrapper
around a FedAvg-style strategy; both resolve stable user identities, can aggregate under SecAgg+ and
can audit a run with canaries. Their settings are `corrflow.config.RunConfig`.
"""

# The classes load on first use, not with the package: `import corrflow` (which names the wrapper
# lazily) must not import Flower.

__all__ = ["CorrelatedNoiseStrategy", "DifferentialPrivacyCorrelatedNoise"]


def __getattr__(name: str):
    if name == "CorrelatedNoiseStrategy":
        from corrflow.strategies.correlated import CorrelatedNoiseStrategy

        return CorrelatedNoiseStrategy
    if name == "DifferentialPrivacyCorrelatedNoise":
        from corrflow.strategies.wrapper import DifferentialPrivacyCorrelatedNoise

        return DifferentialPrivacyCorrelatedNoise
    raise AttributeError(f"module 'corrflow.strategies' has no attribute {name!r}")
