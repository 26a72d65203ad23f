"""Optimal multi-epoch dense factorizations under (k, b) fixed-epoch participation.

000 §3 (Choquette-Choo, McMahan, Rush, Thakurta, "Multi-Epoch Matrix Factorization Mechanisms for
Private Machine Learning", arXiv 2211.06530): minimise ``tr(AᵀA X⁻¹)`` over X = CᵀC ≻ 0 with ``max_π
1ᵀX[π,π]1 ≤ 1`` (Eq. 6).

* `optimize_dense` (default, any n): the primal restricted to X[i, j] = 0 on the pairs one
  user can share (Π̂, i ≠ j) — the structure of the optimum (000 Fig. 2) — and every pattern's
  diagonal summing to 1. The sensitivity is then exact for vector contributions (000 Cor. 2.1 and
  App. I.3, Eq. 36 with X = 0 ≥ 0 on Π̂). Solved by L-BFGS in that affine subspace (Cholesky-based,
  3.3 n³ flops an iteration), stopping on the relative duality gap against the Lagrange dual bound
  of 000 Thm. 3.1 evaluated at the KKT multipliers read off the primal (U = G = X⁻¹AᵀAX⁻¹ on the
  pattern blocks; Λ ≥ 0 on Π̂).
* `solve_dual` (small n): maximise the dual g(v, Λ) = 2 tr((U^½ T U^½)^½) − Σ v (000 Eq. 7,
  with non-negativity multipliers) by L-BFGS-B, for the constraint sets of 000 App. I.3: ``"sign"``
  (Eq. 34, all sign vectors), ``"pattern-nonneg"`` (Eq. 36) and ``"nonneg"`` (Eq. 35). Reproduces
  000 Table 6.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import numpy as np
from scipy.linalg import LinAlgError, cholesky, solve_triangular, svdvals
from threadpoolctl import threadpool_limits

from corrflow.errors import require
from corrflow.factorization.encoders import ToeplitzEncoder
from corrflow.factorization.optim import lbfgs
from corrflow.factorization.participation import Participation
from corrflow.factorization.toeplitz import optimize_toeplitz
from corrflow.factorization.workloads import Workload
from corrflow.progress import ProgressCallback


@dataclass(frozen=True)
class DenseResult:
    """The optimal multi-epoch Gram matrix X (n × n, sensitivity 1), its loss tr(AᵀA X⁻¹), the dual
    lower bound (000 Thm. 3.1), the iterations and whether the gap tolerance was met."""

    X: np.ndarray  # optimal Gram matrix, sensitivity 1 under the participation
    loss: float  # tr(AᵀA X⁻¹) = total squared error at sensitivity 1
    lower_bound: float  # dual lower bound (valid for every X ≥ 0 on Π̂ with sensitivity ≤ 1)
    iterations: int
    converged: bool

    @property
    def relative_gap(self) -> float:
        return (self.loss - self.lower_bound) / self.loss


def reversed_cholesky(X: np.ndarray) -> np.ndarray:
    """The lower-triangular factor of a Gram matrix (000 §3.4, arXiv 2211.06530).

    Args:
        X: symmetric positive definite, shape (n, n).

    Returns:
        C, lower-triangular (n, n), with CᵀC = X: C = J Lᵀ J where J X J = L Lᵀ.
    """
    L = cholesky(X[::-1, ::-1], lower=True)
    return np.ascontiguousarray(L.T[::-1, ::-1])


def optimal_decoder_loss(workload_matrix: np.ndarray, X: np.ndarray) -> float:
    """The total squared error with the optimal decoder (000 §1.5).

    Args:
        workload_matrix: A, shape (n, n).
        X: CᵀC, shape (n, n).

    Returns:
        tr(AᵀA X⁻¹) = ‖A C^†‖²_F for any C with CᵀC = X.
    """
    R = cholesky(X, lower=True)
    Y = solve_triangular(R, workload_matrix.T, lower=True, check_finite=False)
    return float(np.sum(Y**2))


def _pattern_index(participation: Participation) -> np.ndarray:
    return np.arange(participation.rounds) % participation.min_sep


def _dual_bound_from_primal(G: np.ndarray, A: np.ndarray, participation: Participation) -> float:
    """Dual value (000 Thm. 3.1) at multipliers read off the primal gradient G = X⁻¹TX⁻¹ (KKT: U =
    HvHᵀ − Λ ≈ G).

    Any v > 0 and Λ ≥ 0 on the same-pattern pairs with U ⪰ 0 bound the optimum from below. Λ =
    max(0, v_p − G_ij) is tried first; when that U is not positive definite (early iterates), Λ
    moves toward v_p on every same-pattern pair (U = diag(v_p), always positive definite) by the
    first of a fixed set of mixing weights that is. The bound is then maximised over the scale c of
    (v, Λ): g(cv, cΛ) = 2√c·S − c·Σv with S = Σ svd(A U^½) gives S²/Σv at c = (S/Σv)². Always
    finite."""
    pid = _pattern_index(participation)
    b = participation.min_sep
    v = np.bincount(pid, weights=np.diag(G), minlength=b) / participation.epochs
    v = np.maximum(v, 1e-12 * max(float(v.max()), 1e-300))
    same = pid[:, None] == pid[None, :]
    vp = v[pid]
    # Λ = max(0, v_p − G_ij) on same-pattern off-diagonal pairs; U = v_p − Λ there, v_p on the
    # diagonal.
    U = np.where(same, np.minimum(vp[:, None], G), 0.0)
    np.fill_diagonal(U, vp)
    LU = None
    for mix in (0.0, 1 / 64, 1 / 16, 1 / 4, 1 / 2, 1.0):
        try:
            LU = cholesky(U if mix == 0 else (1 - mix) * U + mix * np.diag(vp), lower=True)
            break
        except LinAlgError:
            continue
    if LU is None:  # diag(v_p) with v_p > 0 failed only through overflow
        return -np.inf
    S = float(np.sum(svdvals(A @ LU, check_finite=False)))
    return S * S / float(v.sum())


def _warm_start(workload: Workload, participation: Participation) -> np.ndarray:
    """Gram of the column-normalised banded Toeplitz optimum with bands = b, divided by k: feasible
    (zero on Π̂, every pattern's diagonal sums to 1) and within a few percent of the optimum (001
    §9.3)."""

    n, k, b = participation.rounds, participation.epochs, participation.min_sep
    if b == 1:
        return np.eye(n) / k
    coef = optimize_toeplitz(workload.toeplitz_part(), n, b).coef
    enc = ToeplitzEncoder(coef / np.linalg.norm(coef), n, column_normalize=True)
    return enc.gram() / k


def optimize_dense(
    workload: Workload,
    participation: Participation,
    *,
    tol: float = 5e-4,
    max_iterations: int = 10_000,
    memory: int = 8,
    X0: np.ndarray | None = None,
    callback: ProgressCallback | None = None,
    time_budget: float | None = None,
) -> DenseResult:
    """Optimal multi-epoch X for ``workload`` under fixed-epoch ``participation`` (see module
    docstring).

    Stops when (loss − dual bound)/loss ≤ ``tol``, when the loss stops improving, after
    ``max_iterations`` (the deterministic budget: the same inputs give the same X on any machine) or
    after ``time_budget`` seconds (a wall-clock stop, load-dependent; every iterate is feasible, so
    a stopped X is a valid factorization). The lower bound is the best dual value over the iterates
    whose dual point is positive definite (the start included), so the gap stays finite when the
    optimizer stops early.

    Args:
        workload: A.
        participation: fixed-epoch (k, b).
        tol: the relative duality-gap tolerance.
        max_iterations: L-BFGS iterations (the deterministic budget).
        memory: L-BFGS history.
        X0: a starting Gram matrix, shape (n, n) (default: the banded Toeplitz optimum with b bands,
            divided by k).
        callback: progress callback.
        time_budget: seconds, or None.

    Returns:
        X (n × n, sensitivity 1 under ``participation``), its loss, the dual lower bound and the
        iterations.
    """
    require(
        participation.kind == "fixed-epoch",
        "participation",
        "fixed-epoch (k, b) for the dense multi-epoch optimizer (use banded/toeplitz for min-sep)",
        participation.kind,
    )
    n = participation.rounds
    A = workload.matrix(n)
    objective = _Objective(A, participation)
    # A dual bound costs about as much as a few iterations at small n and ~25 at n = 2000 (an SVD):
    # checks every ``every`` iterations, a function of n alone, keep them near 20% of the time and
    # the result a function of the inputs (no clock). Until one iterate gives a positive-definite
    # dual point (a finite bound), every iterate is tried, so a stopped run still reports a finite
    # gap from the best such iterate.
    every = max(10, min(125, n // 16))
    deadline = None if time_budget is None else time.perf_counter() + time_budget
    stop = _DualGapStop(objective, participation, every, tol, deadline, callback)
    X = _warm_start(workload, participation) if X0 is None else np.array(X0, dtype=np.float64)
    f0, G0 = objective.evaluate(X, True)
    require(np.isfinite(f0), "X0", "a positive definite starting point")
    # Small matrices: BLAS thread wake-ups cost more than they save (measured 3× at n = 256 on 2
    # cores).
    with threadpool_limits(limits=1 if n < 768 else None):
        # the starting point's dual point: a finite gap however early the optimizer stops
        stop.check(G0)
        res = lbfgs(
            objective,
            X,
            max_iterations=max_iterations,
            memory=memory,
            rel_improvement=1e-9,
            window=25,
            on_iteration=stop,
        )
        f, G = objective.evaluate(res.x, True)
        stop.check(G)
    bound = stop.bound
    return DenseResult(res.x, f, bound, res.iterations, (f - bound) / f <= tol)


class _Objective:
    """The loss tr(AᵀA X⁻¹) for L-BFGS: its value and its gradient projected onto the constraints
    (zero off the free entries, each pattern's diagonal summing to a constant); keeps the last
    unprojected gradient −X⁻¹AᵀAX⁻¹ for the dual bound."""

    def __init__(self, A: np.ndarray, participation: Participation):
        self.A = A
        self.At = np.ascontiguousarray(A.T)
        self.pid = _pattern_index(participation)
        self.free = ~participation.same_pattern_mask()
        self.b, self.k = participation.min_sep, participation.epochs
        self.G: np.ndarray | None = None

    def project(self, D: np.ndarray) -> np.ndarray:
        D = np.where(self.free, D, 0.0)
        d = np.diag(D)
        pid = self.pid
        np.fill_diagonal(D, d - (np.bincount(pid, weights=d, minlength=self.b) / self.k)[pid])
        return D

    def evaluate(self, X: np.ndarray, need_grad: bool):
        try:
            R = cholesky(X, lower=True, check_finite=False)
        except LinAlgError:
            return np.inf, None
        Y = solve_triangular(R, self.At, lower=True, check_finite=False)  # R⁻¹Aᵀ
        f = float(np.einsum("ij,ij->", Y, Y))
        if not need_grad:
            return f, None
        Z = solve_triangular(R, Y, lower=True, trans="T", check_finite=False)  # X⁻¹Aᵀ
        return f, Z @ Z.T  # X⁻¹AᵀAX⁻¹

    def __call__(self, X: np.ndarray, need_grad: bool):
        f, G = self.evaluate(X, need_grad)
        if G is None:
            return f, None
        self.G = G
        return f, self.project(-G)


class _DualGapStop:
    """L-BFGS's per-iteration hook: reports progress, stops at the deadline, and every ``every``
    iterations raises the best dual bound and stops once the relative gap is within ``tol``."""

    def __init__(self, objective, participation, every, tol, deadline, callback):
        self.objective, self.participation = objective, participation
        self.every, self.tol, self.deadline, self.callback = every, tol, deadline, callback
        self.bound = -np.inf
        self.next_check = every

    def check(self, G: np.ndarray) -> None:
        bound = _dual_bound_from_primal(G, self.objective.A, self.participation)
        self.bound = max(self.bound, bound)

    def __call__(self, it: int, X: np.ndarray, f: float, g: np.ndarray) -> bool:
        if self.callback is not None:
            self.callback(it, f)
        if self.deadline is not None and time.perf_counter() > self.deadline:
            return True
        if it < self.next_check and np.isfinite(self.bound):
            return False
        self.check(self.objective.G)
        self.next_check = it + self.every
        return (f - self.bound) / f <= self.tol


# --------------------------------------------------------------------------------------------------
# Exact small-n solver for the constraint variants of 000 App. I.3.

CONSTRAINTS = ("sign", "pattern-nonneg", "nonneg")


@dataclass(frozen=True)
class ConstrainedResult:
    """The optimum of 000 Eq. 6 under one constraint set: its ``loss``, ``X`` (n × n) and
    ``constraints``."""

    loss: float  # optimal tr(AᵀA X⁻¹) under the constraint set (to ~1e-9 relative)
    X: np.ndarray
    constraints: str


def _constraint_vectors(participation: Participation, constraints: str) -> np.ndarray:
    n = participation.rounds
    vecs = []
    for pat in participation.patterns():
        sign_sets = (
            itertools.product((1.0, -1.0), repeat=len(pat) - 1)
            if constraints == "sign"
            else [(1.0,) * (len(pat) - 1)]
        )
        for signs in sign_sets:
            u = np.zeros(n)
            u[pat] = (1.0, *signs)
            vecs.append(u)
    return np.array(vecs)


def solve_constrained(
    workload: Workload,
    participation: Participation,
    constraints: str = "pattern-nonneg",
) -> ConstrainedResult:
    """Optimal X of 000 Eq. 6 under ``constraints`` by a primal log-barrier Newton method (n ≤ 16).

    ``"sign"``: uᵀXu ≤ 1 for all sign vectors on every pattern (Eq. 34; exact only for d = 1 when X
    has negative entries); ``"pattern-nonneg"``: all-ones pattern vectors plus X ≥ 0 on Π̂ (Eq. 36);
    ``"nonneg"``: pattern vectors plus X ≥ 0 everywhere (Eq. 35). Reproduces 000 Table 6.

    Args:
        workload: A.
        participation: fixed-epoch (k, b), n ≤ 16.
        constraints: ``"sign"``, ``"pattern-nonneg"`` or ``"nonneg"``.

    Returns:
        The optimal loss and X (n × n).
    """
    require(constraints in CONSTRAINTS, "constraints", f"one of {CONSTRAINTS}", constraints)
    require(participation.kind == "fixed-epoch", "participation", "fixed-epoch", participation.kind)
    n = participation.rounds
    require(
        n <= 16, "rounds", "at most 16 for the exact constrained solver (use optimize_dense)", n
    )
    A = workload.matrix(n)
    barrier = _Barrier(A.T @ A, participation, constraints)
    # strictly feasible: slack ≥ 1/2, entries > 0
    X0 = np.eye(n) / (2.0 * participation.epochs) + 1e-3 / n
    X = barrier.to_mat(_central_path(barrier, X0[barrier.li, barrier.lj]))
    return ConstrainedResult(optimal_decoder_loss(A, X), X, constraints)


class _Barrier:
    """The log-barrier problem of 000 Eq. 6 under one constraint set, in the lower-triangular
    coordinates x of X: tr(AᵀA X⁻¹) − μ(Σ log slack + Σ log x_nonneg + log det X)."""

    def __init__(self, T: np.ndarray, participation: Participation, constraints: str):
        n = participation.rounds
        self.n, self.T = n, T
        self.U = U = _constraint_vectors(participation, constraints)
        self.li, self.lj = li, lj = np.tril_indices(n)
        if constraints == "sign":
            self.nonneg = np.zeros(len(li), dtype=bool)
        elif constraints == "pattern-nonneg":
            self.nonneg = participation.same_pattern_mask()[li, lj]
        else:
            self.nonneg = li != lj
        basis = np.zeros((len(li), n, n))
        basis[np.arange(len(li)), li, lj] = 1.0
        basis[np.arange(len(li)), lj, li] = 1.0
        self.basis = basis
        self.cu = np.einsum("ui,aij,uj->ua", U, basis, U)  # d(uᵀXu)/dx_a

    def to_mat(self, x: np.ndarray) -> np.ndarray:
        X = np.zeros((self.n, self.n))
        X[self.li, self.lj] = x
        X[self.lj, self.li] = x
        return X

    def __call__(self, x, mu, need):
        """Barrier objective, gradient and Hessian at x (inf outside the feasible set)."""
        n, T, U, nonneg, basis, cu = self.n, self.T, self.U, self.nonneg, self.basis, self.cu
        X = self.to_mat(x)
        slack = 1.0 - np.einsum("ui,ij,uj->u", U, X, U)
        if np.any(slack <= 0) or np.any(x[nonneg] <= 0):
            return np.inf, None, None
        try:
            R = cholesky(X, lower=True)
        except LinAlgError:
            return np.inf, None, None
        Xi = solve_triangular(R, solve_triangular(R, np.eye(n), lower=True), lower=True, trans="T")
        f = np.trace(T @ Xi) - mu * (
            np.log(slack).sum() + np.log(x[nonneg]).sum() + 2 * np.log(np.diag(R)).sum()
        )
        if not need:
            return f, None, None
        P = Xi @ T @ Xi
        g = -np.einsum("ij,aji->a", P, basis) + mu * (
            cu.T @ (1.0 / slack) - np.einsum("ij,aji->a", Xi, basis)
        )
        g[nonneg] -= mu / x[nonneg]
        PE, XE = P @ basis, Xi @ basis
        H = np.einsum("aij,bji->ab", PE, XE)
        H = H + H.T + mu * ((cu.T / slack**2) @ cu + np.einsum("aij,bji->ab", XE, XE))
        H[nonneg, nonneg] += mu / x[nonneg] ** 2
        return f, g, H


def _central_path(barrier: _Barrier, x: np.ndarray) -> np.ndarray:
    """Follow the central path from a strictly feasible x: damped Newton on each barrier problem,
    μ divided by 10 until the duality-gap bound is below 1e-11 of tr(AᵀA)."""
    n, U, nonneg, T = barrier.n, barrier.U, barrier.nonneg, barrier.T
    mu = 1.0
    for _ in range(60):
        for _ in range(100):  # damped Newton on the barrier problem
            f, g, H = barrier(x, mu, True)
            d = -np.linalg.solve(H, g)
            decrement = -float(g @ d)
            t = 1.0
            while barrier(x + t * d, mu, False)[0] > f - 0.25 * t * decrement and t > 1e-14:
                t *= 0.5
            x = x + t * d
            if decrement < 1e-14 * max(abs(f), 1.0):
                break
        if mu * (len(U) + nonneg.sum() + n) < 1e-11 * np.trace(T):
            break
        mu *= 0.1
    return x
