"""The Flower adapter: the strategies that train with correlated noise —
`CorrelatedNoiseStrategy` (full control) and the drop-in wrapper
`DifferentialPrivacyCorrelatedNoise` around a FedAvg-style strategy — over the Flower-free
`corrflow.run`. Modules: ``correlated`` (the strategy), ``wrapper``, ``messaging`` (Flower
messages ↔ corrflow's value types), ``identity`` (stable user ids of SuperNodes), ``session`` (one
run, start to end) and ``canaries`` (empirical privacy audits). The run's settings are
`corrflow.config.RunConfig`.
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
