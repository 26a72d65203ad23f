"""corrflow: federated learning with differential privacy through correlated noise.

Layers, bottom up: ``factorization`` (workload, encoder, sensitivity), ``noise`` (streaming correlated noise),
``accounting`` (ε, δ), ``participation`` (who trains when), ``strategies``/``server``/``clients`` (Flower).
"""

__version__ = "0.1.0"

__all__ = ["DifferentialPrivacyCorrelatedNoise", "corrflow_identity_mod"]


def __getattr__(name: str):
    # Lazy, so that `import corrflow` does not import Flower.
    if name == "corrflow_identity_mod":
        from corrflow.clients.identity import corrflow_identity_mod

        return corrflow_identity_mod
    if name == "DifferentialPrivacyCorrelatedNoise":
        from corrflow.strategies.wrapper import DifferentialPrivacyCorrelatedNoise

        return DifferentialPrivacyCorrelatedNoise
    raise AttributeError(f"module 'corrflow' has no attribute {name!r}")
