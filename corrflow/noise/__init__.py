"""Streaming correlated noise (C⁻¹Z)_t for model-sized updates, regenerated from a secret key.

Counter-based Gaussian sources (`prng`), the generation modes (`engine`), owner-only,
hash-checked checkpoints that resume bit for bit, and key segments (`segments`): a restarted
server draws the rows after its checkpoint with a fresh key; a model too large for one process is
split into coordinate shards (`shards`). Knows nothing of Flower.
"""

from corrflow.noise.engine import MODES, CorrelatedNoise, default_mode, restore_state, save_state
from corrflow.noise.keys import new_secret
from corrflow.noise.prng import PRNGS, key_from_seed

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
