"""Streaming correlated noise (C⁻¹Z)_t for model-sized updates, regenerated from a secret key.

Counter-based Gaussian sources (`prng`), the four generation modes (`engine`) and
owner-only, hash-checked checkpoints that resume bit for bit. Knows nothing of Flower.
"""

from corrflow.noise.engine import MODES, CorrelatedNoise, default_mode, restore_state, save_state
from corrflow.noise.prng import PRNGS, key_from_seed, new_secret

__all__ = [
    "MODES",
    "PRNGS",
    "CorrelatedNoise",
    "default_mode",
    "key_from_seed",
    "new_secret",
    "restore_state",
    "save_state",
]
