"""corrflow: federated learning with differential privacy through correlated noise.

Layers, bottom up (an import never climbs; tests/test_layers.py): ``factorization`` (workload,
encoder, sensitivity); ``noise`` (streaming correlated noise), ``accounting`` (ε, δ) and
``participation`` (who trains when); ``data`` (datasets, vocabularies, partitions) and ``config``
(the settings model); ``planning`` (the run's factorization, cohorts and σ; ``corrflow plan``);
``run`` (the Flower-free round); ``strategies`` and ``clients`` (Flower); ``server`` (the ServerApp
and the ``corrflow`` command). Beneath them all, one-job modules: ``errors``, ``fileio``,
``choices``, ``hashing``, ``paths``, ``progress``, ``protocol``, ``schemas``.
"""

import os as _os

# TensorFlow (the keras client, the tensorflow noise backend, or any library corrflow imports that
# pulls it in) prints its C++ start-up log lines to stderr at import; only a value set before that
# import silences them. An explicit setting of the user's wins.
_os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

__version__ = "0.1.0"

__all__ = [
    "DifferentialPrivacyCorrelatedNoise",
    "RunConfig",
    "register_identity",
    "secure_aggregation_mods",
    "secure_client_fn_app",
]


def __getattr__(name: str):
    # Lazy, so that `import corrflow` does not import Flower.
    if name == "register_identity":
        from corrflow.clients.identity import register_identity

        return register_identity
    if name == "secure_aggregation_mods":
        from corrflow.clients.secagg import secure_aggregation_mods

        return secure_aggregation_mods
    if name == "secure_client_fn_app":
        from corrflow.clients.secagg import secure_client_fn_app

        return secure_client_fn_app
    if name == "RunConfig":
        from corrflow.config import RunConfig

        return RunConfig
    if name == "DifferentialPrivacyCorrelatedNoise":
        from corrflow.strategies.wrapper import DifferentialPrivacyCorrelatedNoise

        return DifferentialPrivacyCorrelatedNoise
    raise AttributeError(f"module 'corrflow' has no attribute {name!r}")
