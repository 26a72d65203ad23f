"""A small L-BFGS (Nocedal & Wright Alg. 7.4/7.5) whose backtracking line search treats an infinite
loss as "step too long": the factorization losses are finite only inside a domain (X ≻ 0, a stable
recursion), which SciPy's L-BFGS-B handles poorly (it stops at the first non-finite trial). Works on
arrays of any shape.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

#: fun(x, need_grad) -> (f, grad or None); f = inf outside the domain.
Objective = Callable[[np.ndarray, bool], tuple[float, np.ndarray | None]]


@dataclass
class LbfgsResult:
    """The minimiser ``x``, its value ``f`` and gradient ``grad``, the ``iterations`` and why it
    stopped."""

    x: np.ndarray
    f: float
    grad: np.ndarray
    iterations: int
    stopped_by: str


def lbfgs(
    fun: Objective,
    x0: np.ndarray,
    *,
    max_iterations: int = 1000,
    memory: int = 10,
    rel_improvement: float = 1e-12,
    window: int = 10,
    grad_tol: float = 0.0,
    on_iteration: Callable[[int, np.ndarray, float, np.ndarray], bool] | None = None,
) -> LbfgsResult:
    """Minimise ``fun`` from ``x0``. ``on_iteration(it, x, f, g)`` may return True to stop.

    Stops when f improved by less than ``rel_improvement`` (relative) over ``window`` iterations,
    when the gradient norm is ≤ ``grad_tol``, or when no step along the direction decreases f.

    Args:
        fun: (x, need_gradient) → (f, ∇f or None), float64.
        x0: the starting point (any shape; the result has the same).
        max_iterations: the iteration limit.
        memory: the L-BFGS history.
        rel_improvement: the relative improvement below which it stops.
        window: iterations over which the improvement is measured.
        grad_tol: the gradient norm at which it stops.
        on_iteration: ``on_iteration(it, x, f, g)``; returning True stops.

    Returns:
        The result, with the reason it stopped.
    """
    x = np.array(x0, dtype=np.float64)
    f, g = fun(x, True)
    if not np.isfinite(f):
        raise ValueError("lbfgs: the starting point is outside the objective's domain")
    S: list[np.ndarray] = []
    Y: list[np.ndarray] = []
    history = [f]
    stopped = "max_iterations"
    it = 0
    for it in range(1, max_iterations + 1):
        d = _direction(g, S, Y)
        slope = float(np.vdot(g, d))
        if slope >= 0:
            S.clear()
            Y.clear()
            d, slope = -g, -float(np.vdot(g, g))
        gnorm = float(np.sqrt(np.vdot(g, g)))
        if gnorm <= grad_tol or gnorm == 0.0:
            stopped = "gradient"
            break
        step = 1.0 if S else min(1.0, 0.01 * max(float(np.sqrt(np.vdot(x, x))), 1.0) / gnorm)
        f_new = np.inf
        for _ in range(60):
            f_new, _ = fun(x + step * d, False)
            if np.isfinite(f_new) and f_new <= f + 1e-4 * step * slope:
                break
            step *= 0.5
        else:
            stopped = "line_search"
            break
        x_new = x + step * d
        f_new, g_new = fun(x_new, True)
        s, y = x_new - x, g_new - g
        sy = float(np.vdot(s, y))
        if sy > 1e-12 * float(np.sqrt(np.vdot(s, s) * np.vdot(y, y))):
            S.append(s)
            Y.append(y)
            if len(S) > memory:
                S.pop(0)
                Y.pop(0)
        x, f, g = x_new, f_new, g_new
        history.append(f)
        if on_iteration is not None and on_iteration(it, x, f, g):
            stopped = "callback"
            break
        if len(history) > window and (history[-window - 1] - f) <= rel_improvement * abs(f):
            stopped = "converged"
            break
    return LbfgsResult(x, float(f), g, it, stopped)


def _direction(g: np.ndarray, S: list[np.ndarray], Y: list[np.ndarray]) -> np.ndarray:
    """L-BFGS two-loop recursion: −H g."""
    q = g.copy()
    alphas = []
    for s, y in zip(reversed(S), reversed(Y), strict=True):
        rho = 1.0 / float(np.vdot(y, s))
        a = rho * float(np.vdot(s, q))
        q -= a * y
        alphas.append((rho, a))
    if S:
        q *= float(np.vdot(S[-1], Y[-1]) / np.vdot(Y[-1], Y[-1]))
    for (s, y), (rho, a) in zip(zip(S, Y, strict=True), reversed(alphas), strict=True):
        q += (a - rho * float(np.vdot(y, q))) * s
    return -q
