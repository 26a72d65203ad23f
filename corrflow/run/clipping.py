"""Validation, zeroing and clipping of client replies (server side: clients' own clipping is never
trusted).

Each reply is checked and clipped one at a time, in two passes over its coordinates (compiled,
`corrflow.run.clip_kernels`): the first forms the update (reply − model sent) in a reused float32
scratch and takes its ℓ∞ norm and ℓ2 norm (Σ u² in float64, which is not finite exactly when the
update is not: the NaN/Inf check); the second scales it (when clipping) and adds it into the round's
sum. No model-sized temporary is allocated per reply, so the reply's own buffer can be freed as soon
as it is added. Two sums share that path:

- `ExactSum` (the run's): g = Σ clipped in int64 fixed point, exactly associative, so the round's
  sum has the same bits whatever order the replies arrive in (and after any restart), and memory is
  O(d) however many replies a round receives;
- `ClippedSum`: the same clipped updates summed in float32 (the reference path of the benchmarks:
  its bits depend on the order of addition).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

#: Coordinates per block of the in-cache NumPy passes (256 KiB of float32).
_BLOCK = 1 << 16
#: Reply dtypes the compiled passes take (others: float16, longdouble go through NumPy).
_COMPILED = (np.dtype(np.float32), np.dtype(np.float64))


_KERNELS = None


def _load_kernels():
    """`corrflow.run.clip_kernels`, imported at a process's first reply (numba loads only when a
    reply is summed, never at import)."""
    global _KERNELS
    from corrflow.run import clip_kernels

    _KERNELS = clip_kernels
    return clip_kernels


class RejectedReplyError(Exception):
    """A reply that cannot be used; ``reason`` is logged and recorded in the ledger."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def clip_scale(norm: float, clip: float) -> np.float32:
    """The float32 factor that brings an update of ℓ2 norm ``norm`` to ≤ ``clip``, a little inside
    so that float32 rounding of the scaled update cannot push it over."""
    return np.float32(clip / norm * (1 - 1e-6))


class _Clipper:
    """The checks and clipping shared by the sums: u_i = reply − model sent (000 App. F.3: zeroed
    when ‖u_i‖_∞ > zeroing threshold, else scaled to ‖u_i‖_2 ≤ bound), formed in a float32
    scratch; a subclass's ``_accumulate`` adds the scratch (scaled) into its sum."""

    def __init__(self, shapes: Sequence[tuple[int, ...]], names: Sequence[str] | None = None):
        self._scratch = [np.empty(s, dtype=np.float32) for s in shapes]
        self._names = (
            list(names) if names is not None else [str(i) for i in range(len(self._scratch))]
        )

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
        False.

        The first pass forms u = a − s rounded once to float32 (computed in the wider dtype) with
        max |u| and Σ u² in float64 (not finite exactly when some u is not): compiled for float32
        and float64 replies (``clip_kernels``), block by block in NumPy for the others."""
        kernels = _KERNELS or _load_kernels()
        linf, sq = 0.0, 0.0
        for i, scratch in enumerate(self._scratch):
            a, s = replied[i].reshape(-1), None if sent is None else sent[i].reshape(-1)
            u = scratch.reshape(-1)
            if u.size == 0:
                continue
            if a.dtype in _COMPILED and (s is None or s.dtype in _COMPILED):
                part, top = (
                    kernels.copy_norms(a, u) if s is None else kernels.difference_norms(a, s, u)
                )
            else:
                top, part = self._difference_numpy(a, s, u)
            if not (np.isfinite(top) and np.isfinite(part)):
                raise RejectedReplyError(f"array {i} ({self._names[i]}): NaN or Inf values")
            linf, sq = max(linf, float(top)), sq + float(part)
        if zeroing > 0 and linf > zeroing:
            return "zeroed"  # adds nothing: g is exactly what adding zeros would give
        norm = float(np.sqrt(sq))
        if norm > bound and not allow_clip:
            raise RejectedReplyError("needs clipping")
        clipped = norm > bound
        self._accumulate(clip_scale(norm, bound) if clipped else None, bound, kernels)
        return "clipped" if clipped else "kept"

    def _accumulate(self, scale: np.float32 | None, bound: float, kernels) -> None:
        """Add the scratch, times ``scale`` (None: as it is), into the sum; ``bound`` is the
        update's ℓ2 bound. Raises `RejectedReplyError`, changing nothing, when it cannot be
        added."""
        raise NotImplementedError

    def _difference_numpy(
        self, a: np.ndarray, s: np.ndarray | None, u: np.ndarray
    ) -> tuple[float, float]:
        """The first pass of `add` for the other floating dtypes (float16, longdouble), block by
        block: (max |u|, Σ u² in float64)."""
        n = u.size
        linf, sq = 0.0, 0.0
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
                top = float(np.abs(ub).max())  # NaN propagates
                if not np.isfinite(top):
                    return top, np.inf
                linf = max(linf, top)
                # float64 squares of the float32 values: no overflow, as the compiled pass
                sq += float(np.dot(ub.astype(np.float64), ub.astype(np.float64)))
        return linf, sq


class ClippedSum(_Clipper):
    """g = Σ_i clip(u_i) in float32 (``total``: float32 arrays of ``shapes``), added in place.

    Adding in the same order gives the same bits, another order may not (float32 addition is not
    associative): the run sums with `ExactSum`; this is the float32 reference path."""

    def __init__(self, shapes: Sequence[tuple[int, ...]], names: Sequence[str] | None = None):
        super().__init__(shapes, names)
        self.total = [np.zeros(s, dtype=np.float32) for s in shapes]

    def _accumulate(self, scale: np.float32 | None, bound: float, kernels) -> None:
        for acc, scratch in zip(self.total, self._scratch, strict=True):
            g, u = acc.reshape(-1), scratch.reshape(-1)
            if scale is None:
                g += u
                continue
            for lo in range(0, u.size, _BLOCK):  # scale and add while the block is in cache
                ub = u[lo : lo + _BLOCK]
                ub *= scale
                g[lo : lo + _BLOCK] += ub


def fixed_point_scale(cap: float, bound: float) -> int:
    """The exponent s of `ExactSum`'s fixed point: ⌊62 − log₂(cap · bound)⌋, lowered if float
    rounding of the logarithm left cap · bound · 2^s above 2^62.

    Args:
        cap: the most contributions one round can add (cross-silo: items).
        bound: each contribution's ℓ2 bound (the clip norm).

    Returns:
        s, with cap · bound · 2^s ≤ 2^62.

    Raises:
        ValueError: a cap or bound that is not a positive finite number.
    """
    if not (math.isfinite(cap) and math.isfinite(bound) and cap > 0 and bound > 0):
        raise ValueError(f"cap {cap!r} and bound {bound!r} must be positive and finite")
    s = math.floor(62 - math.log2(cap * bound))
    while math.ldexp(cap * bound, s) > 2.0**62:  # ldexp is exact: only the log can be off
        s -= 1
    return s


class ExactSum(_Clipper):
    """g = Σ_i clip(u_i), exactly associative: int64 fixed point at scale 2^s.

    Each clipped float32 update u_i is converted as q_i = trunc(u_i · 2^s) (multiplying by a power
    of two is exact; truncation toward zero), and Q = Σ_i q_i is an integer sum: the same
    bits for any order of addition, so for any arrival order and after any restart. Only checked
    updates are converted (NaN/Inf are rejected before), a zeroed one adds nothing.

    - **Scale.** s = ⌊62 − log₂(cap · c)⌋ (`fixed_point_scale`), fixed for the run: ``cap`` is the
      most contributions a round can accept, ``c`` the clip norm.
    - **Overflow.** |q_ij| ≤ |u_ij| · 2^s ≤ b_i · 2^s for a contribution of ℓ2 bound b_i, so
      |Q_j| ≤ 2^s · Σ_i b_i. ``add`` refuses a contribution that would take Σ_i b_i to 2^(63−s) or
      more, so no int64 can overflow; cap contributions of bound c (or silos of n items with bound
      n·c·(1 + 10⁻⁵)) stay below 1.00001 · 2^62.
    - **Sensitivity.** Truncation never increases a magnitude: ‖q_i · 2^−s‖₂ ≤ ‖u_i‖₂ ≤ b_i.
    - **Bound to the float64 sum.** With S = Σ_i u_i exactly, |Q_j · 2^−s − S_j| < m · 2^−s for m
      contributions; the float64 sum S64 of the same updates in any order is within
      (m − 1) · 2^−53 · Σ_i |u_ij| of S; so |Q_j · 2^−s − S64_j| < m · 2^−s + (m − 1) · 2^−53 ·
      Σ_i |u_ij|. `total` rounds Q_j · 2^−s once to float64 and once to float32.

    Memory: the int64 sum and a float32 scratch of the model's size, whatever the number of replies.
    """

    def __init__(
        self,
        shapes: Sequence[tuple[int, ...]],
        scale: int,
        names: Sequence[str] | None = None,
    ):
        super().__init__(shapes, names)
        self.scale = int(scale)
        self.sums = [np.zeros(s, dtype=np.int64) for s in shapes]
        self._limit = math.ldexp(1.0, 63 - self.scale)
        self._admitted = 0.0  # Σ b_i over the updates added so far
        # u · 2^s is exact in float32 too (a power-of-two scaling of a float32; a product ≥ 1 is a
        # normal float32, a smaller one truncates to 0 either way) and float32 is faster: float64
        # only where 2^s itself is not a float32
        wide = np.float32 if -126 <= self.scale <= 127 else np.float64
        self._to_int = wide(math.ldexp(1.0, self.scale))

    def _accumulate(self, scale: np.float32 | None, bound: float, kernels) -> None:
        if self._admitted + bound >= self._limit:
            raise RejectedReplyError(
                f"the round's exact sum is full: Σ ℓ2 bounds {self._admitted + bound:g} would "
                f"reach 2^{63 - self.scale} (fixed point 2^{self.scale})"
            )
        self._admitted += bound
        # u · scale in float32, as `ClippedSum` (the ℓ2 bound is met before conversion), then the
        # exact product by 2^s, truncated toward zero by the cast
        factor = np.float32(1.0) if scale is None else np.float32(scale)
        for acc, scratch in zip(self.sums, self._scratch, strict=True):
            kernels.add_fixed_point(scratch.reshape(-1), factor, self._to_int, acc.reshape(-1))

    def total(self) -> list[np.ndarray]:
        """The sum as float32 arrays: fl32(fl64(Q) · 2^−s), block by block.

        Returns:
            One float32 array per shape.
        """
        back = np.float64(math.ldexp(1.0, -self.scale))
        out = []
        for acc in self.sums:
            g = np.empty(acc.shape, dtype=np.float32)
            flat, q = g.reshape(-1), acc.reshape(-1)
            for lo in range(0, q.size, _BLOCK):
                np.multiply(q[lo : lo + _BLOCK], back, out=flat[lo : lo + _BLOCK], casting="unsafe")
            out.append(g)
        return out
