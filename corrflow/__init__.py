"""corrflow: federated learning with differential privacy through correlated noise.

Layers, bottom up: ``factorization`` (workload, encoder, sensitivity), ``noise`` (streaming
correlated noise), ``accounting`` (ε, δ), ``participation`` (who trains when), ``data`` (federated
datasets) and ``config`` (the settings model), ``planning`` (a run's plan before it trains), ``run``
(the run without Flower: state, noise stream, the round, its files), then Flower:
``strategies``/``clients`` and ``server`` (ServerApp, CLI).
"""

__version__ = "0.1.0"

__all__ = ["DifferentialPrivacyCorrelatedNoise", "RunConfig", "register_identity"]


def __getattr__(name: str):
    # Lazy, so that `import corrflow` does not import Flower.
    if name == "register_identity":
        from corrflow.clients.identity import register_identity

        return register_identity
    if name == "RunConfig":
        from corrflow.config import RunConfig

        return RunConfig
    if name == "DifferentialPrivacyCorrelatedNoise":
        from corrflow.strategies.wrapper import DifferentialPrivacyCorrelatedNoise

        return DifferentialPrivacyCorrelatedNoise
    raise AttributeError(f"module 'corrflow' has no attribute {name!r}")
