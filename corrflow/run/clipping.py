"""Validation, zeroing and clipping of client replies (server side: clients' own clipping is never
trusted).

`ClippedSum` adds one reply at a time into the round's sum g = Σ clipped, in place: the
update (reply − model sent) is formed block by block in a reused float32 scratch, and its ℓ∞ norm,
NaN/Inf check and ℓ2 norm are taken while each block is in cache; a second pass scales (when
clipping) and adds it to g. No model-sized temporary is allocated per reply, and float64 is used
only where exactness needs it: the difference of a float64 reply, and the sum of squares behind the
ℓ2 norm.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: Coordinates per block of the in-cache passes (256 KiB of float32).
_BLOCK = 1 << 16


class RejectedReplyError(Exception):
    """A reply that cannot be used; ``reason`` is logged and recorded in the ledger."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def clip_scale(norm: float, clip: float) -> np.float32:
    """The float32 factor that brings an update of ℓ2 norm ``norm`` to ≤ ``clip``, a little inside
    so that float32 rounding of the scaled update cannot push it over."""
    return np.float32(clip / norm * (1 - 1e-6))


class ClippedSum:
    """g = Σ_i clip(u_i) over accepted replies, u_i = reply − model sent (000 App. F.3: zeroed when
    ‖u_i‖_∞ > zeroing threshold, else scaled to ‖u_i‖_2 ≤ bound). ``total``: float32 arrays of
    ``shapes``.

    Adding in the same order gives the same bits: the caller adds replies in id order, so a restart
    that receives the same replies reproduces g exactly."""

    def __init__(self, shapes: Sequence[tuple[int, ...]], names: Sequence[str] | None = None):
        self.total = [np.zeros(s, dtype=np.float32) for s in shapes]
        self._scratch = [np.empty(s, dtype=np.float32) for s in shapes]
        self._names = list(names) if names is not None else [str(i) for i in range(len(self.total))]
        self._square = np.empty(_BLOCK, dtype=np.float32)

    def add(
        self,
        replied: Sequence[np.ndarray],
        sent: Sequence[np.ndarray] | None,
        bound: float,
        zeroing: float,
        *,
        allow_clip: bool = True,
    ) -> str:
        """Add one update: ``replied − sent`` (full weights) or ``replied`` itself (``sent`` None: a
        delta). Returns "kept", "clipped" or "zeroed" (zero threshold ``zeroing`` on ℓ∞; 0 disables
        it). Raises `RejectedReplyError` — before changing ``total`` — for NaN/Inf values (or
        a difference beyond float32), and for an update that needs clipping when ``allow_clip`` is
        False."""
        linf, sq = 0.0, 0.0
        for i, scratch in enumerate(self._scratch):
            a, s = replied[i].reshape(-1), None if sent is None else sent[i].reshape(-1)
            u = scratch.reshape(-1)
            hi_val, lo_val, part = self._difference(a, s, u)
            if not (np.isfinite(hi_val) and np.isfinite(lo_val)):  # max/min propagate NaN
                raise RejectedReplyError(f"array {i} ({self._names[i]}): NaN or Inf values")
            linf, sq = max(linf, hi_val, -lo_val), sq + part
        if zeroing > 0 and linf > zeroing:
            return "zeroed"  # adds nothing: g is exactly what adding zeros would give
        norm = float(np.sqrt(sq))
        if norm > bound:
            if not allow_clip:
                raise RejectedReplyError("needs clipping")
            self._accumulate(clip_scale(norm, bound))
            return "clipped"
        self._accumulate(None)
        return "kept"

    def _difference(
        self, a: np.ndarray, s: np.ndarray | None, u: np.ndarray
    ) -> tuple[float, float, float]:
        """u = a − s rounded once to float32 (computed in the wider dtype); (max u, min u, Σ u² in
        float64)."""
        n = u.size
        if n == 0:
            return 0.0, 0.0, 0.0
        hi_val, lo_val, sq = -np.inf, np.inf, 0.0
        with np.errstate(over="ignore", invalid="ignore"):
            for lo in range(0, n, _BLOCK):
                hi = min(n, lo + _BLOCK)
                ub = u[lo:hi]
                if s is None:
                    np.copyto(ub, a[lo:hi], casting="unsafe")
                else:
                    np.subtract(
                        a[lo:hi],
                        s[lo:hi],
                        out=ub,
                        dtype=np.result_type(a.dtype, s.dtype, np.float32),
                        casting="unsafe",
                    )
                mx, mn = float(ub.max()), float(ub.min())
                if not (np.isfinite(mx) and np.isfinite(mn)):
                    return mx, mn, np.inf
                hi_val, lo_val = max(hi_val, mx), min(lo_val, mn)
                # float32 squares, summed in float64
                sqb = np.square(ub, out=self._square[: hi - lo])
                sq += float(np.add.reduce(sqb, dtype=np.float64))
        return hi_val, lo_val, sq

    def _accumulate(self, scale: np.float32 | None) -> None:
        for acc, scratch in zip(self.total, self._scratch, strict=True):
            g, u = acc.reshape(-1), scratch.reshape(-1)
            if scale is None:
                g += u
                continue
            for lo in range(0, u.size, _BLOCK):  # scale and add while the block is in cache
                ub = u[lo : lo + _BLOCK]
                ub *= scale
                g[lo : lo + _BLOCK] += ub
