"""Buffered linear Toeplitz (BLT) mechanisms: streaming noise with B buffers and one Gaussian draw
per round.

Dvijotham, McMahan, Pillutla, Steinke, Thakurta 2024, "Efficient and Near-Optimal Noise Generation
for Streaming Differential Privacy", arXiv 2404.16706 (DMPST24); McMahan, Xu, Zhang 2024, "A
Hassle-free Algorithm for Private Learning in Practice: Don't Use Tree Aggregation, Use BLTs", arXiv
2408.08868 (MXZ24).

A BLT with buffer decays θ ∈ (0, 1)^B and output scales ω ∈ ℝ^B is the lower-triangular Toeplitz
encoder C whose first column is c₀ = 1, c_k = Σ_j ω_j θ_j^(k−1) (k ≥ 1); its generating function is
C(x) = P(x)/Q(x) with Q(x) = Π_j (1 − θ_j x) and P(x) = Π_j (1 − θ̂_j x) (DMPST24 §4–5). C⁻¹ (the
noising matrix) is again a BLT with decays θ̂ — the roots of the secular equation 1 + Σ_j ω_j/(λ −
θ_j) = 0 — and scales given by the pole-pair formula of DMPST24 Lemma 5.2: ω_i = Π_j (θ_i − θ̂_j) /
Π_{j≠i} (θ_i − θ_j), and symmetrically ω̂ with the roles swapped.

corrflow accepts only BLTs with 0 < θ_j < 1, ω_j > 0 and Pillutla score Σ_j ω_j/θ_j < 1. Then the θ̂
interlace the θ (1 > θ₁ > θ̂₁ > θ₂ > … > θ_B > θ̂_B > 0), every ω̂_j < 0, and c is positive and
non-increasing (c₁ = Σω < 1), so the multi-participation sensitivity under b-min-separation has the
exact O(n) form of Kalinin & Lampert 2024 (arXiv 2405.13763, Thm 2): sens² = ‖Σ_{i<k} C e_{i·b}‖².
Conversely every strictly interlaced sequence of 2B points in (0, 1) is such a BLT, which is the
parameterisation optimised here (MXZ24 optimise the same pole pairs).

The loss is the total squared error of the workload A times the sensitivity², ``‖A C⁻¹‖_F² ·
sens²(C)`` (invariant to the scale of C), with analytic gradients: O(n·B) per evaluation for
Toeplitz workloads (prefix sums, momentum), O(n·m) for m rounds of learning-rate cooldown (rows
before the cooldown are Toeplitz, the m others are formed). Pure numpy, float64, deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from corrflow.errors import InvalidArgumentError, require
from corrflow.factorization.filters import lfilter
from corrflow.factorization.optim import lbfgs
from corrflow.factorization.participation import Participation
from corrflow.factorization.workloads import Workload
from corrflow.progress import ProgressCallback

#: Most buffers accepted: the pole-pair formula divides by products of pole gaps, which lose
# precision beyond this.
MAX_BUFFERS = 12
#: Buffers tried at most when none are given (DMPST24 and MXZ24 find 3–7 typical).
AUTO_MAX_BUFFERS = 8
#: With buffers chosen automatically, one more buffer is kept only if it lowers the loss by more
# than this factor.
AUTO_RTOL = 1.01
#: With B buffers given, fewer are returned when their loss is within this factor of the best (the
# extra buffers duplicate a pole or are nearly dead); well inside the 0.1% agreement with the peer
# optimum that the benchmarks check.
MERGE_RTOL = 1e-4
#: Output scales below this mark a dead buffer (the threshold of MXZ24's reference implementation).
DEAD_SCALE = 1e-8
#: Cooldown rows × rounds above which the optimiser uses the workload's Toeplitz part (the errors
# stay exact).
EXACT_COOLDOWN_LIMIT = 1 << 23
_BLOCK = 1 << 20  # entries per block of the cooldown rows


# -- the BLT and its inverse -----------------------------------------------------------------------
def pole_weights(poles: np.ndarray, other: np.ndarray) -> np.ndarray:
    """ω_i = Π_j (p_i − o_j) / Π_{j≠i} (p_i − p_j) (DMPST24 Lemma 5.2): the output scales of the BLT
    with decays ``poles`` whose inverse has decays ``other`` (or, with the arguments swapped, the
    inverse's scales). Shapes (B,)."""
    p, o = np.asarray(poles, dtype=np.float64), np.asarray(other, dtype=np.float64)
    num = np.prod(p[:, None] - o[None, :], axis=1)
    diff = p[:, None] - p[None, :]
    np.fill_diagonal(diff, 1.0)
    return num / np.prod(diff, axis=1)


def inverse_decays(buf_decay: np.ndarray, output_scale: np.ndarray) -> np.ndarray:
    """θ̂: the roots of 1 + Σ_j ω_j/(λ − θ_j) (the eigenvalues of diag(θ) − ω·1ᵀ, DMPST24 §5), one
    in each gap (θ_{j+1}, θ_j) and one below θ_B, found by bisection-safe root finding (requires ω >
    0, distinct θ)."""
    from scipy.optimize import brentq  # lazy: scipy.optimize slows every CLI start

    theta = np.asarray(buf_decay, dtype=np.float64)
    omega = np.asarray(output_scale, dtype=np.float64)
    order = np.argsort(-theta)
    th, om = theta[order], omega[order]

    def f(lam: float) -> float:
        return 1.0 + float(np.sum(om / (lam - th)))

    roots = []
    for j in range(len(th)):
        hi = th[j]
        lo = th[j + 1] if j + 1 < len(th) else min(0.0, th[-1]) - 1.0 - float(np.sum(om))
        # f → +∞ just above θ_{j+1} and → −∞ just below θ_j; f(lo) > 0 below θ_B since f(λ) > 0 for
        # λ ≪ θ_B.
        eps_hi = max(abs(hi), 1.0) * 4e-16
        a = lo + (max(abs(lo), 1.0) * 4e-16 if j + 1 < len(th) else 0.0)
        b = hi - eps_hi
        if not (f(a) > 0 > f(b)):
            raise InvalidArgumentError(
                "encoder",
                "a BLT whose inverse has real, distinct decays (ω > 0, distinct θ)",
                {"buf_decay": theta.tolist(), "output_scale": omega.tolist()},
            )
        roots.append(brentq(f, a, b, xtol=1e-300, rtol=4 * np.finfo(float).eps, maxiter=500))
    out = np.empty_like(theta)
    out[order] = roots
    return out


def blt_coefs(buf_decay: np.ndarray, output_scale: np.ndarray, n: int) -> np.ndarray:
    """First column of the BLT (length n): c₀ = 1, c_k = Σ_j ω_j θ_j^(k−1) (DMPST24 Def. 4.1).
    O(n·B)."""
    theta = np.asarray(buf_decay, dtype=np.float64)
    c = np.empty(n)
    c[0] = 1.0
    if n > 1:
        c[1:] = _powers(theta, n - 1) @ np.asarray(output_scale, dtype=np.float64)
    return c


def _powers(theta: np.ndarray, m: int) -> np.ndarray:
    """V[k, j] = θ_j^k for k < m (m × B), as exp(k·log θ_j): accurate for θ near 1. Powers below
    e^−230 ≈ 1e−100 are set to 0: they do not change any sum, and subnormal numbers further on would
    slow numpy a hundredfold."""
    with np.errstate(divide="ignore"):
        logs = np.log(theta)
    e = np.arange(m)[:, None] * logs[None, :]
    return np.where(e > -230.0, np.exp(np.maximum(e, -230.0)), 0.0)


def validate_blt(buf_decay, output_scale) -> tuple[np.ndarray, np.ndarray]:
    """Check 0 < θ < 1 (distinct), ω > 0 and Pillutla score Σω/θ < 1 (module docstring); return them
    as float64."""
    theta = np.array(buf_decay, dtype=np.float64).ravel()
    omega = np.array(output_scale, dtype=np.float64).ravel()
    require(
        1 <= theta.size <= MAX_BUFFERS and omega.shape == theta.shape,
        "buffers",
        f"between 1 and {MAX_BUFFERS} buffers with one output scale each",
        (theta.size, omega.size),
    )
    require(
        bool(np.all(np.isfinite(theta)) and np.all(np.isfinite(omega))),
        "encoder",
        "finite BLT buffer decays and output scales",
    )
    require(
        bool(np.all((theta > 0) & (theta < 1))),
        "encoder",
        "BLT buffer decays in (0, 1)",
        theta.tolist(),
    )
    require(
        bool(np.all(omega > 0)),
        "encoder",
        "positive BLT output scales (a non-negative, decreasing C)",
        omega.tolist(),
    )
    require(
        len(np.unique(theta)) == theta.size, "encoder", "distinct BLT buffer decays", theta.tolist()
    )
    score = float(np.sum(omega / theta))
    require(
        score < 1.0,
        "encoder",
        "a BLT with Pillutla score Σω/θ < 1 (a stable inverse with decays in (0, 1))",
        score,
    )
    return theta, omega


# -- the loss --------------------------------------------------------------------------------------
def _momentum_transposed(g: np.ndarray, beta: float) -> np.ndarray:
    """M_βᵀ g (M_β lower-triangular Toeplitz with entries β^(i−j)): the time-reversed momentum
    filter."""
    return lfilter([1.0], [1.0, -beta], g[::-1])[::-1] if beta else g


def workload_row_errors(noising: np.ndarray, workload: Workload) -> np.ndarray:
    """Squared row norms of B = A·C⁻¹ (length n) for a Toeplitz C⁻¹ with first column ``noising``.

    Rows before the cooldown are Toeplitz: e_i = Σ_{s≤i} w_s² with w = A's first column convolved
    with the noising coefficients (001 Prop. D.1); each cooldown row is formed from the previous one
    (module docstring). O(n·m)."""
    return _workload_error(np.asarray(noising, dtype=np.float64), workload, rows=True)[0]


def _workload_error(chat: np.ndarray, workload: Workload, rows: bool = False, grad: bool = False):
    """(row errors or total squared error ‖A C⁻¹‖_F², gradient with respect to ĉ or None)."""
    n = chat.size
    beta = workload.momentum
    m = workload.cooldown_rounds(n)
    n0 = n - m
    u = lfilter([1.0], [1.0, -beta], chat) if beta else chat
    w = np.cumsum(u)
    w2 = w * w
    if rows:
        out = np.empty(n)
        out[:n0] = np.cumsum(w2[:n0])
    else:
        out = float(np.sum((n0 - np.arange(n0)) * w2[:n0]))
    gw = 2.0 * np.maximum(n0 - np.arange(n), 0) * w if grad else None
    if m:
        eta = workload.learning_rates(n)
        base = np.zeros(n)
        base[:n0] = w[:n0][::-1]  # row n0 − 1 of the Toeplitz part: w_{n0−1−j}
        rb = max(1, _BLOCK // n)
        starts = list(range(0, m, rb))
        carries = []
        carry = base
        cols = np.arange(n)
        for r0 in starts:
            r1 = min(m, r0 + rb)
            brows = carry + np.cumsum(_cooldown_block(u, eta, n0, r0, r1, cols), axis=0)
            if rows:
                out[n0 + r0 : n0 + r1] = np.sum(brows * brows, axis=1)
            else:
                out += float(np.sum(brows * brows))
            carries.append(carry)
            carry = brows[-1]
        if grad:
            gu = np.zeros(n)
            dbase = np.zeros(n)
            q_carry = np.zeros(n)
            for r0, carry in zip(reversed(starts), reversed(carries), strict=True):
                r1 = min(m, r0 + rb)
                g = 2.0 * (carry + np.cumsum(_cooldown_block(u, eta, n0, r0, r1, cols), axis=0))
                dbase += g.sum(axis=0)
                q = q_carry + np.cumsum(g[::-1], axis=0)[::-1]
                q_carry = q[0]
                idx = (n0 + np.arange(r0, r1))[:, None] - cols[None, :]
                valid = idx >= 0
                gu += np.bincount(
                    idx[valid], weights=(eta[n0 + r0 : n0 + r1, None] * q)[valid], minlength=n
                )
            gw[:n0] += dbase[:n0][::-1]
    if not grad:
        return out, None
    gu_total = np.cumsum(gw[::-1])[::-1]  # w = cumsum(u)
    if m:
        gu_total += gu
    return out, _momentum_transposed(gu_total, beta)


def _cooldown_block(
    u: np.ndarray, eta: np.ndarray, n0: int, r0: int, r1: int, cols: np.ndarray
) -> np.ndarray:
    """Rows r0..r1 of U[r, j] = η_{n0+r}·u_{n0+r−j} (0 for j > n0 + r)."""
    idx = (n0 + np.arange(r0, r1))[:, None] - cols[None, :]
    vals = u[np.clip(idx, 0, None)]
    vals[idx < 0] = 0.0
    return vals * eta[n0 + r0 : n0 + r1, None]


def min_sep_sensitivity_squared(
    c: np.ndarray, min_sep: int, max_participations: int, grad: bool = False
) -> tuple[float, np.ndarray | None]:
    """‖Σ_{i<k′} C e_{i·b}‖² for Toeplitz C with first column c ≥ 0 non-increasing (Kalinin &
    Lampert 2024, arXiv 2405.13763 Thm 2; k′ = min(k, ⌈n/b⌉)), in O(n), with its gradient in c when
    ``grad``."""
    n = c.size
    b = min_sep
    rows = -(-n // b)
    k = min(max_participations, rows)
    pad = np.zeros(rows * b)
    pad[:n] = c
    cs = np.cumsum(pad.reshape(rows, b), axis=0)
    v2 = cs.copy()
    v2[k:] -= cs[:-k] if k < rows else 0.0
    v = v2.ravel()[:n]
    s2 = float(v @ v)
    if not grad:
        return s2, None
    pad[:] = 0.0
    pad[:n] = v
    rc = np.cumsum(pad.reshape(rows, b)[::-1], axis=0)[::-1]
    g2 = rc.copy()
    if k < rows:
        g2[:-k] -= rc[k:]
    return s2, 2.0 * g2.ravel()[:n]


@dataclass(frozen=True)
class BLTLoss:
    """L(θ, θ̂) = ‖A C⁻¹‖_F² · sens²(C) over pole pairs (module docstring), with its gradient."""

    workload: Workload
    n: int
    min_sep: int
    max_participations: int

    @classmethod
    def build(cls, workload: Workload, participation: Participation) -> BLTLoss:
        return cls(
            workload, participation.rounds, participation.min_sep, participation.max_participations
        )

    def parts(self, theta: np.ndarray, theta_hat: np.ndarray) -> tuple[float, float]:
        """(total squared error ‖A C⁻¹‖_F², sens²(C)) of the un-normalised BLT."""
        omega, omega_hat = pole_weights(theta, theta_hat), pole_weights(theta_hat, theta)
        err = _workload_error(blt_coefs(theta_hat, omega_hat, self.n), self.workload)[0]
        sens2 = min_sep_sensitivity_squared(
            blt_coefs(theta, omega, self.n), self.min_sep, self.max_participations
        )[0]
        return float(err), sens2

    def __call__(
        self, theta: np.ndarray, theta_hat: np.ndarray
    ) -> tuple[float, np.ndarray, np.ndarray]:
        """(L, ∂L/∂θ, ∂L/∂θ̂)."""
        n = self.n
        omega, omega_hat = pole_weights(theta, theta_hat), pole_weights(theta_hat, theta)
        V, Vh = _powers(theta, n - 1), _powers(theta_hat, n - 1)
        c = np.concatenate(([1.0], V @ omega))
        chat = np.concatenate(([1.0], Vh @ omega_hat))
        err, g_chat = _workload_error(chat, self.workload, grad=True)
        sens2, g_c = min_sep_sensitivity_squared(
            c, self.min_sep, self.max_participations, grad=True
        )
        loss = err * sens2
        g_c *= err
        g_chat *= sens2
        d_omega, d_theta = _coef_grads(V, omega, g_c)
        d_omega_hat, d_theta_hat = _coef_grads(Vh, omega_hat, g_chat)
        a, b = _weight_grads(theta, theta_hat, omega, d_omega)
        d_theta += a
        d_theta_hat += b
        b, a = _weight_grads(theta_hat, theta, omega_hat, d_omega_hat)
        d_theta += a
        d_theta_hat += b
        return float(loss), d_theta, d_theta_hat


def _coef_grads(V: np.ndarray, omega: np.ndarray, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Given ∂L/∂c for c_k = Σ_j ω_j θ_j^(k−1): (∂L/∂ω, ∂L/∂θ at fixed ω)."""
    d_omega = V.T @ g[1:]
    k = np.arange(1, V.shape[0])
    d_theta = omega * (V[:-1].T @ (k * g[2:])) if V.shape[0] > 1 else np.zeros_like(omega)
    return d_omega, d_theta


def _weight_grads(poles, other, weights, d_weights) -> tuple[np.ndarray, np.ndarray]:
    """Chain ∂L/∂ω through ω = pole_weights(poles, other): (∂L/∂poles, ∂L/∂other)."""
    diff_o = poles[:, None] - other[None, :]
    diff_p = poles[:, None] - poles[None, :]
    np.fill_diagonal(diff_p, np.inf)
    gw = d_weights * weights  # ∂L/∂log|ω_i|
    inv_o, inv_p = 1.0 / diff_o, 1.0 / diff_p
    d_poles = gw * (inv_o.sum(axis=1) - inv_p.sum(axis=1))
    d_poles += (gw[:, None] * inv_p).sum(axis=0)  # ∂log|ω_i|/∂p_l = 1/(p_i − p_l), l ≠ i
    d_other = -(gw[:, None] * inv_o).sum(axis=0)
    return d_poles, d_other


# -- parameterisation: 2B interlaced points in (0, 1) from unconstrained x -------------------------
def _points(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Gaps g = softmax([x, 0]) (2B + 1 of them, summing to 1); r_m = Σ_{i≤m} g_i; points p_m = 1 −
    r_m, so 1 > p₁ > … > p_{2B} > 0. Returns (r, g)."""
    z = np.concatenate((x, [0.0]))
    z = np.exp(z - z.max())
    g = z / z.sum()
    return np.cumsum(g[:-1]), g


def _from_x(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    r = _points(x)[0]
    p = 1.0 - r
    return p[0::2], p[1::2]


def _to_x(theta: np.ndarray, theta_hat: np.ndarray) -> np.ndarray:
    p = np.empty(2 * theta.size)
    p[0::2], p[1::2] = np.sort(theta)[::-1], np.sort(theta_hat)[::-1]
    gaps = np.diff(np.concatenate(([1.0], p, [0.0])) * -1.0)
    require(
        bool(np.all(gaps > 0)), "encoder", "interlaced BLT poles 1 > θ₁ > θ̂₁ > … > θ_B > θ̂_B > 0"
    )
    return np.log(gaps[:-1]) - np.log(gaps[-1])


def _x_objective(loss: BLTLoss):
    def f(x: np.ndarray, need_grad: bool):
        r, g = _points(x)
        p = 1.0 - r
        theta, theta_hat = p[0::2], p[1::2]
        if np.any(np.diff(p) >= 0) or p[-1] <= 0:
            return np.inf, None
        with np.errstate(all="ignore"):
            val, dth, dthh = loss(theta, theta_hat)
        if not (
            np.isfinite(val) and val > 0 and np.all(np.isfinite(dth)) and np.all(np.isfinite(dthh))
        ):
            return np.inf, None
        a = np.empty(p.size)
        a[0::2], a[1::2] = dth / val, dthh / val  # ∂ log L/∂p_m
        # ∂p_m/∂x_l = −(g_l [l ≤ m] − g_l r_m)
        tail = np.cumsum(a[::-1])[::-1]
        dx = -g[:-1] * (tail - float(a @ r))
        return float(np.log(val)), dx

    return f


# -- optimisation ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class BLTResult:
    """An optimised BLT (un-normalised: c₀ = 1) and its loss ‖A C⁻¹‖_F²·sens²(C)."""

    buf_decay: np.ndarray
    output_scale: np.ndarray
    inverse_decay: np.ndarray
    inverse_scale: np.ndarray
    loss: float
    iterations: int
    optimized_for: Workload
    losses_by_buffers: dict[int, float]


def _starts(
    buffers: int, n: int, min_sep: int, previous: tuple[np.ndarray, np.ndarray] | None
) -> list[np.ndarray]:
    """Deterministic starting points: 2B points with 1 − p log-spaced over a few ranges, and the
    previous optimum (fewer buffers) with pole pairs added below or above its poles until it has B
    (the warm start that lets B buffers reach at least the (B − 1)-buffer optimum)."""
    out = []
    for lo, hi in ((0.5 / n, 0.5), (0.5 / max(min_sep, 1), 0.5), (0.5 / n, 0.05)):
        if lo < hi:
            r = np.geomspace(lo, hi, 2 * buffers)
            out.append(_to_x(1.0 - r[0::2], 1.0 - r[1::2]))
    if previous is not None and previous[0].size < buffers:
        below = np.sort(previous[0])[::-1], np.sort(previous[1])[::-1]
        above = below
        while below[0].size < buffers:
            low = below[1][-1]
            below = np.append(below[0], 0.6 * low), np.append(below[1], 0.3 * low)
            top = 1.0 - above[0][0]
            above = np.insert(above[0], 0, 1.0 - 0.3 * top), np.insert(above[1], 0, 1.0 - 0.6 * top)
        out += [_to_x(*below), _to_x(*above)]
    return out


def _optimize_fixed(
    loss: BLTLoss,
    buffers: int,
    previous,
    max_iterations: int,
    callback: ProgressCallback | None,
    offset: int,
) -> tuple[np.ndarray, float, int]:
    f = _x_objective(loss)
    best, its = None, 0
    for x0 in _starts(buffers, loss.n, loss.min_sep, previous):
        if not np.isfinite(f(x0, False)[0]):
            continue

        def report(it, x, logval, g, base=offset + its):
            if callback is not None:
                callback(base + it, float(np.exp(logval)))
            return False

        res = lbfgs(
            f,
            x0,
            max_iterations=max_iterations,
            memory=20,
            rel_improvement=1e-12,
            window=10,
            on_iteration=report,
        )
        its += res.iterations
        if best is None or res.f < best[1]:
            best = (res.x, res.f)
    require(best is not None, "buffers", "a BLT the optimiser can start from", buffers)
    return best[0], float(np.exp(best[1])), its


def optimize_blt(
    workload: Workload,
    participation: Participation,
    buffers: int | None = None,
    *,
    max_buffers: int = AUTO_MAX_BUFFERS,
    rtol: float = AUTO_RTOL,
    max_iterations: int = 2000,
    callback: ProgressCallback | None = None,
) -> BLTResult:
    """The BLT minimising ‖A C⁻¹‖_F²·sens²(C) under ``participation`` (b-min-sep with ≤ k
    participations; fixed-epoch (k, n/k) has the same worst case), MXZ24 §4's multi-participation
    objective with the total squared error.

    ``buffers`` caps B: B' = 1, 2, …, B are optimised in turn, each warm-started from the best
    fewer-buffer optimum, and the fewest buffers whose loss is within the factor 1 + ``MERGE_RTOL``
    of the best are returned (a buffer duplicating another's pole or with ω ≈ 0 is merged away; an
    optimum with a dead buffer, ω ≤ ``DEAD_SCALE``, is never returned). None tries B = 1, 2, … ≤
    ``max_buffers`` and keeps B + 1 only while it lowers the loss by more than the factor ``rtol``
    (the rule of MXZ24's reference implementation). Each B runs L-BFGS on log L from a few
    deterministic starts and the warm starts (``_starts``). A cooldown workload is first optimised
    through its Toeplitz part, then refined on the exact loss when rounds × cooldown rounds ≤
    ``EXACT_COOLDOWN_LIMIT``.

    Returns:
        `BLTResult` with θ, ω (C) and θ̂, ω̂ (C⁻¹), un-normalised (c₀ = 1).

    Raises:
        InvalidArgumentError: when no buffer stays alive (independent noise is optimal for this
            participation).
    """
    n = participation.rounds
    require(n >= 2, "rounds", "at least 2 for a BLT", n)
    if buffers is not None:
        require(
            isinstance(buffers, int | np.integer) and 1 <= buffers <= MAX_BUFFERS,
            "buffers",
            f"an integer between 1 and {MAX_BUFFERS}",
            buffers,
        )
    toeplitz = workload.toeplitz_part()
    exact = workload.is_toeplitz or workload.cooldown_rounds(n) * n <= EXACT_COOLDOWN_LIMIT
    target = workload if exact else toeplitz
    fast = BLTLoss.build(toeplitz, participation)
    final = BLTLoss.build(target, participation) if target is not toeplitz else None
    solver = _BufferSolver(fast, final, max_iterations, callback)
    if buffers is not None:
        chosen = _fewest_buffers_near_best(solver, int(buffers))
    else:
        chosen = _buffers_while_improving(solver, max_buffers, rtol)
    results, its = solver.results, solver.iterations
    if chosen is None:
        raise InvalidArgumentError(
            "kind",
            "a participation for which a BLT helps: here the optimiser drives every "
            "buffer's output scale to 0, so independent noise (kind dpsgd) does as well",
            participation.describe(),
        )
    theta, theta_hat = _from_x(results[chosen][0])
    omega, omega_hat = pole_weights(theta, theta_hat), pole_weights(theta_hat, theta)
    err, sens2 = (final or fast).parts(theta, theta_hat)
    return BLTResult(
        theta,
        omega,
        theta_hat,
        omega_hat,
        err * sens2,
        its,
        target,
        {b: v for b, (_, v) in results.items()},
    )


class _BufferSolver:
    """Optimises a BLT at a given number of buffers B (fast loss, then the exact loss when
    ``final`` is given), keeping every usable optimum in ``results`` (B → (x, loss)) and the
    L-BFGS iterations spent."""

    def __init__(self, fast, final, max_iterations: int, callback: ProgressCallback | None):
        self.fast, self.final = fast, final
        self.max_iterations, self.callback = max_iterations, callback
        self.results: dict[int, tuple[np.ndarray, float]] = {}
        self.iterations = 0

    def solve(self, B: int, previous) -> tuple[np.ndarray, float] | None:
        """The optimum with B buffers, or None when one of its buffers is dead (the B − 1 optimum is
        as good)."""
        x, val, k = _optimize_fixed(
            self.fast, B, previous, self.max_iterations, self.callback, self.iterations
        )
        self.iterations += k
        if self.final is not None:
            res = lbfgs(
                _x_objective(self.final),
                x,
                max_iterations=self.max_iterations,
                memory=20,
                rel_improvement=1e-12,
                window=10,
            )
            self.iterations += res.iterations
            x, val = res.x, float(np.exp(res.f))
        if not _usable(*_from_x(x)):
            return None
        self.results[B] = (x, val)
        return x, val


def _fewest_buffers_near_best(solver: _BufferSolver, buffers: int) -> int | None:
    """B = 1, 2, …, ``buffers``, each warm-started from the best fewer-buffer optimum (and the
    preset starts); then the fewest buffers within MERGE_RTOL of the best loss: a buffer that
    duplicates another's pole or is (nearly) dead is memory for nothing. None: none usable."""
    previous = None
    for B in range(1, buffers + 1):
        got = solver.solve(B, previous)
        if got is not None:
            previous = _from_x(got[0])
    results = solver.results
    if not results:
        return None
    best = min(v for _, v in results.values())
    return min(b for b, (_, v) in results.items() if v <= (1 + MERGE_RTOL) * best)


def _buffers_while_improving(solver: _BufferSolver, max_buffers: int, rtol: float) -> int | None:
    """Add buffers while each lowers the loss by more than the factor ``rtol``; None: none
    usable."""
    chosen, previous = None, None
    for B in range(1, max_buffers + 1):
        got = solver.solve(B, previous)
        if got is None or (chosen is not None and not rtol * got[1] < solver.results[chosen][1]):
            break
        chosen, previous = B, _from_x(got[0])
    return chosen


def _usable(theta: np.ndarray, theta_hat: np.ndarray) -> bool:
    """Whether the pole pairs form a BLT corrflow accepts with every buffer alive: strictly
    interlaced in (0, 1) in float64, ω > DEAD_SCALE, and the checks of `validate_blt`."""
    p = np.empty(2 * theta.size)
    p[0::2], p[1::2] = theta, theta_hat
    if not (p[0] < 1 and p[-1] > 0 and np.all(np.diff(p) < 0)):
        return False
    omega = pole_weights(theta, theta_hat)
    if not (np.all(np.isfinite(omega)) and np.all(omega > DEAD_SCALE)):
        return False
    try:
        validate_blt(theta, omega)
    except InvalidArgumentError:
        return False
    return True


__all__ = [
    "AUTO_MAX_BUFFERS",
    "MAX_BUFFERS",
    "MERGE_RTOL",
    "BLTLoss",
    "BLTResult",
    "blt_coefs",
    "inverse_decays",
    "min_sep_sensitivity_squared",
    "optimize_blt",
    "pole_weights",
    "validate_blt",
    "workload_row_errors",
]
