"""Validation, zeroing and clipping of client replies (server side: clients' own clipping is never trusted)."""

from __future__ import annotations

import numpy as np


class RejectedReplyError(Exception):
    """A reply that cannot be used; ``reason`` is logged and recorded in the ledger."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def zero_or_clip(update: list[np.ndarray], clip: float, zeroing_factor: float) -> tuple[list[np.ndarray], str]:
    """000 App. F.3: zero an update whose ℓ∞ norm exceeds zeroing_factor·clip; then scale to ℓ2 ≤ clip."""
    linf = max((float(np.max(np.abs(a))) if a.size else 0.0) for a in update)
    if zeroing_factor > 0 and linf > zeroing_factor * clip:
        return [np.zeros_like(a) for a in update], "zeroed"
    # Squares in float32, summed in float64 (pairwise): one temporary per array, no float64 copy of the update.
    norm = float(np.sqrt(sum(float(np.add.reduce(np.square(a).ravel(), dtype=np.float64)) for a in update)))
    if norm > clip:
        s = np.float32(clip / norm * (1 - 1e-6))  # stay ≤ clip after float32 rounding
        return [a * s for a in update], "clipped"
    return update, "kept"
