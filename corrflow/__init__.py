"""corrflow: federated learning with differential privacy through correlated noise.

Layers, bottom up: ``factorization`` (workload, encoder, sensitivity), ``noise`` (streaming correlated noise),
``accounting`` (ε, δ), ``participation`` (who trains when), ``strategies``/``server``/``clients`` (Flower).
"""

__version__ = "0.1.0"
