"""The planner's score: the error a mechanism leaves in the *trained* model, not in the workload's
open-loop iterates.

Every error of the decoder B = A C⁻¹ (RMSE, max error, the last row) assumes that noise adds up in
the model untouched. Training feeds it back: a model displaced by noise gets a gradient that pulls
it back. On a quadratic whose round-update map has curvature h, with the server optimizer of the
workload (m_t = β m_{t−1} + u_t, x_t = x_{t−1} + η_t m_t, u_t = −κ x_{t−1} + noise_t, κ = server
lr × h), noise w_s injected in round s reaches the final model through the closed-loop response
r_κ (r_0 is the last row of A), so the final model's error per unit σ is sens · ‖C⁻ᵀ r_κ‖ — the
linear-regression analysis of Choquette-Choo, Dvijotham, Pillutla, Ganesh, Steinke, Thakurta,
"Correlated Noise Provably Beats Independent Noise for Differentially Private Learning" (arXiv
2310.06771), applied to a finite factorization. κ = 0 is the open-loop error of the final iterate.

κ is a property of the task. `estimate_damping` measures it on *public proxy data* (never the
private training data): a short non-private run with the same optimizer, probing the round-update
map's Jacobian K = −server_lr·∂U/∂x along random directions z by finite differences. Noise is
isotropic, but the excess loss it causes weights each direction by its curvature: Σᵢ κᵢ e(κᵢ)² for
the spectrum κᵢ of K, with e(κ) the closed-loop error. Its first-order (one-point) approximation
evaluates e at the mean of the loss-weighted spectrum, κ_w = E‖Kz‖² / E[zᵀKz] (Hutchinson's
estimator for tr K² / tr K), which is what the planner ranks by. Shapes: flat float64 model
vectors of d entries; the response r of n entries.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
from scipy.linalg import solve_triangular

from corrflow.errors import InvalidArgumentError, require
from corrflow.factorization.base import Factorization
from corrflow.factorization.encoders import DENSE_LIMIT
from corrflow.factorization.workloads import Workload

#: κ assumed when the plan is given neither ``--kappa`` nor proxy data: the loss-weighted damping
# measured (`estimate_damping`) on the quick preset's synthetic proxy (0.10–0.12 for generator
# seeds 1000–1002; 0.24 on real-format StackOverflow-style text, docs/explanation/evidence.md, "A
# score that predicts training"). It is a property of the task: a plan that assumes it says so.
DEFAULT_KAPPA = 0.1
#: Rounds of the proxy run probed (fractions of its length): the second half, where the noise that
# survives to the final model is injected (earlier noise is damped by the later rounds).
PROBE_AT = (0.5, 0.75, 1.0)
#: Random directions per probed round (each costs two evaluations of the round-update map).
PROBE_DIRECTIONS = 3
#: The finite-difference step, relative to the model's norm (float32 weights round at ~1e-7).
PROBE_STEP = 1e-2
#: Columns per block when C⁻ᵀr is computed without the dense C (above its DENSE_LIMIT).
SOLVE_BLOCK = 256


@dataclass(frozen=True)
class Damping:
    """κ, the per-round pull-back of the trained model towards its optimum (server lr × curvature),
    and where it came from.

    Attributes:
        kappa: κ ≥ 0 (0: open loop, the noise is never damped).
        source: ``declared`` (the user's --kappa), ``proxy`` (measured on public proxy data by
            `estimate_damping`) or ``default`` (`DEFAULT_KAPPA`, an assumption).
        details: how it was measured (proxy data, rounds probed, the per-probe κ, CPU seconds).
    """

    kappa: float
    source: str
    details: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        require(
            isinstance(self.kappa, int | float) and math.isfinite(self.kappa) and self.kappa >= 0,
            "kappa",
            "a finite number ≥ 0 (server learning rate × curvature per round)",
            self.kappa,
        )
        require(
            self.source in ("declared", "proxy", "default"),
            "kappa",
            "a source among declared, proxy, default",
            self.source,
        )

    def describe(self) -> str:
        """κ in words.

        Returns:
            One line saying κ and where it came from (``ASSUMED`` for the default).
        """
        if self.source == "declared":
            return f"κ = {self.kappa:.3g}, declared (--kappa)"
        if self.source == "proxy":
            what = self.details.get("proxy", "public proxy data")
            secs = self.details.get("cpu_seconds")
            spent = "" if secs is None else f", {secs:.1f} CPU s"
            return f"κ = {self.kappa:.3g}, measured on {what}{spent}"
        return (
            f"κ = {self.kappa:.3g}, ASSUMED (the quick preset's measured κ, not your task's; "
            "--proxy-data measures yours, --kappa declares it)"
        )

    def warnings(self) -> list[str]:
        """Why a measured κ may be a weak basis for the ranking.

        Returns:
            What makes it so (empty when nothing does): κ ≥ `OVERSHOOT_KAPPA`, or per-round values
            along the proxy run more than `SPREAD_FACTOR` apart.
        """
        if self.source != "proxy":
            return []
        out = []
        if self.kappa >= OVERSHOOT_KAPPA:
            out.append(
                f"κ = {self.kappa:.3g} ≥ {OVERSHOOT_KAPPA:g}: on the proxy data one round pulls "
                "the model back by more than its distance from the optimum (the loop overshoots), "
                "where the score's one-quadratic model of training fits poorly; a small proxy (a "
                "few users' text) overfits and measures a large κ — use a proxy the size of a "
                "cohort or more, or declare --kappa"
            )
        per_round = [v for v in self.details.get("kappa_per_round", {}).values() if v > 0]
        if per_round and max(per_round) > SPREAD_FACTOR * min(per_round):
            out.append(
                f"κ changes along the proxy run ({min(per_round):.3g} to {max(per_round):.3g} "
                f"over the probed rounds, more than {SPREAD_FACTOR:g}× apart): one κ describes "
                "this task poorly, and neighbouring candidates may swap"
            )
        return out

    def to_dict(self) -> dict:
        """The damping as JSON.

        Returns:
            The fields as a JSON-serialisable dict.
        """
        return asdict(self)


#: A measured κ at or above this makes the plan say the score's linear model is a poor fit: the
# proxy's loss pulls the model back by more than its own distance in one round (an over-damped,
# overshooting loop the one-quadratic model of training describes badly).
OVERSHOOT_KAPPA = 1.0
#: A measured κ whose per-round values along the proxy run differ by more than this factor makes
# the plan say κ is not one number for this task.
SPREAD_FACTOR = 2.0


def stable_kappa_limit(workload: Workload, n: int) -> float:
    """The κ at and above which training's linear feedback diverges: heavy-ball momentum on a
    quadratic, x ← x + η_t·m, m ← β·m − κ·x (+ noise), is stable iff 0 ≤ η_t·κ < 2(1 + β) (the
    2×2 transition's spectral radius < 1; Polyak 1964), so κ < 2(1 + β) / max_t η_t.

    Args:
        workload: the server optimizer (momentum β, learning-rate multipliers η).
        n: rounds.

    Returns:
        2(1 + β) / max η, the supremum of the κ `closed_loop_response` can score.
    """
    return 2.0 * (1.0 + workload.momentum) / float(np.max(workload.learning_rates(n)))


def check_kappa(damping: Damping, workload: Workload, n: int) -> None:
    """Refuse a κ at which the closed loop diverges (`stable_kappa_limit`): every candidate's score
    would grow without bound and their order would say nothing.

    Raises:
        InvalidArgumentError: naming ``kappa`` for a declared κ, ``proxy-data`` for a measured one.
    """
    limit = stable_kappa_limit(workload, n)
    if damping.kappa < limit:
        return
    bound = (
        f"κ < {limit:.3g} = 2(1 + momentum {workload.momentum:g}) / max learning-rate multiplier "
        f"{float(np.max(workload.learning_rates(n))):g}"
    )
    if damping.source == "proxy":
        raise InvalidArgumentError(
            "proxy-data",
            f"public proxy data on which non-private training is stable: {bound} (above it, "
            "training's feedback diverges and the score ranks nothing); check the proxy data and "
            "its vocabulary, or declare --kappa",
            f"κ = {damping.kappa:g} measured on {damping.details.get('proxy', 'the proxy data')}",
        )
    raise InvalidArgumentError(
        "kappa",
        f"{bound} (at or above it, training's feedback diverges and the score ranks nothing)",
        damping.kappa,
    )


def closed_loop_response(workload: Workload, n: int, kappa: float) -> np.ndarray:
    """The final model's response to unit noise in each round under training's feedback (arXiv
    2310.06771, linear regression; κ = 0 gives the last row of the workload A, 000 §5.3).

    Args:
        workload: the server optimizer (momentum β, learning-rate schedule η).
        n: rounds.
        kappa: κ ≥ 0, server lr × curvature.

    Returns:
        r_κ, float64 of shape (n,): x_n = Σ_s r_κ[s]·w_s for noise w_s added to round s's update.
    """
    eta, beta = workload.learning_rates(n), workload.momentum
    # Column s of the state holds the response to an impulse in round s; all n at once: O(n²).
    x, m = np.zeros(n), np.zeros(n)
    for t in range(n):
        u = -kappa * x
        u[t] += 1.0
        m = beta * m + u
        x = x + eta[t] * m
    return x


def closed_loop_error(fac: Factorization, response: np.ndarray) -> float:
    """The final model's noise standard deviation per coordinate at unit σ: sens · ‖C⁻ᵀ r‖ (the
    noise of round t is (C⁻¹Z)_t, so x_n = rᵀ C⁻¹ Z).

    Args:
        fac: a factorization of n rounds.
        response: r of shape (n,) (`closed_loop_response`).

    Returns:
        sens · ‖C⁻ᵀ r‖₂.
    """
    enc = fac.encoder
    if hasattr(enc, "solve_transposed"):  # Toeplitz: the time-reversed recursion, O(n·bands)
        v = enc.solve_transposed(response)
    elif enc.n <= DENSE_LIMIT:  # O(n²) on the dense C
        v = solve_triangular(enc.matrix(), response, lower=True, trans="T", check_finite=False)
    else:  # (rᵀC⁻¹)_i block by block of identity columns: O(n·block) memory, never the dense C
        v = np.empty(enc.n)
        for start in range(0, enc.n, SOLVE_BLOCK):
            cols = np.eye(enc.n, min(SOLVE_BLOCK, enc.n - start), -start)
            v[start : start + cols.shape[1]] = response @ enc.solve(cols)
    return float(fac.sensitivity.value * np.linalg.norm(v))


@dataclass(frozen=True)
class Probe:
    """One finite-difference probe of the round-update map: the proxy round it was taken at and
    zᵀKz, ‖Kz‖² for a unit direction z (K = −server_lr·∂U/∂x)."""

    round: int
    quadratic: float
    squared_norm: float


def loss_weighted_kappa(probes: list[Probe]) -> float:
    """κ_w = Σ‖Kz‖² / Σ zᵀKz over the probes: the mean of K's spectrum weighted by curvature
    (Hutchinson estimates of tr K² and tr K), i.e. the damping seen by the excess loss. 0 when the
    probes measure no damping (Σ zᵀKz ≤ 0): the open loop.

    Args:
        probes: the probes (`estimate_damping`).

    Returns:
        κ_w ≥ 0.
    """
    q = sum(p.quadratic for p in probes)
    if not probes or q <= 0:
        return 0.0
    return float(sum(p.squared_norm for p in probes) / q)


def estimate_damping(
    update: Callable[[np.ndarray, int], np.ndarray],
    x0: np.ndarray,
    workload: Workload,
    rounds: int,
    server_lr: float,
    *,
    seed: int = 0,
    directions: int = PROBE_DIRECTIONS,
    probe_at: tuple[float, ...] = PROBE_AT,
    proxy: str = "public proxy data",
) -> Damping:
    """κ measured on public proxy data: a non-private run of ``rounds`` rounds with the server
    optimizer of ``workload`` (the model the update map's Jacobian is probed at), probed in the
    rounds ``probe_at`` (fractions of the run) along ``directions`` random unit directions each.

    Args:
        update: (flat model, round) → the round's mean clipped client update U (flat, float64), on
            the proxy data; deterministic for a given round.
        x0: the initial model, flat (d,).
        workload: the server optimizer (momentum, learning-rate schedule).
        rounds: the proxy run's rounds.
        server_lr: the server learning rate (κ = server_lr × curvature).
        seed: the probe directions' seed (public: nothing private is drawn).
        directions: random directions per probed round.
        probe_at: the probed rounds as fractions of ``rounds``.
        proxy: what the proxy data is, for the report.

    Returns:
        `Damping` with source ``proxy``: κ = `loss_weighted_kappa` of the probes; details: the
        probes, κ per probed round, the isotropic mean κ (Σ zᵀKz / probes) and the CPU seconds.
    """
    require(rounds >= 1, "proxy-rounds", "a positive integer", rounds)
    cpu0 = time.process_time()
    rng = np.random.default_rng([int(seed), 36])
    eta, beta = workload.learning_rates(rounds), workload.momentum
    at = sorted({min(rounds - 1, max(0, math.ceil(f * rounds) - 1)) for f in probe_at})
    x = np.asarray(x0, np.float64).copy()
    m = np.zeros_like(x)
    probes: list[Probe] = []
    for t in range(rounds):
        base = update(x, t)
        if t in at:
            h = PROBE_STEP * max(1.0, float(np.linalg.norm(x)))
            for _ in range(directions):
                z = rng.normal(size=x.shape)
                z /= np.linalg.norm(z)
                kz = -server_lr * (update(x + h * z, t) - base) / h
                probes.append(Probe(t, float(z @ kz), float(kz @ kz)))
        m = beta * m + base
        x = x + server_lr * eta[t] * m
    per_round = {str(t): loss_weighted_kappa([p for p in probes if p.round == t]) for t in at}
    measured = loss_weighted_kappa(probes)
    # Two significant digits: the float rounding of another machine's proxy run cannot change the
    # plan (the plan depends on the request alone).
    kappa = float(f"{measured:.2g}")
    return Damping(
        kappa,
        "proxy",
        {
            "proxy": proxy,
            "measured_kappa": measured,
            "rounds": rounds,
            "probed_rounds": at,
            "directions": directions,
            "kappa_per_round": per_round,
            "isotropic_mean_kappa": float(np.mean([p.quadratic for p in probes])),
            "probes": [asdict(p) for p in probes],
            "cpu_seconds": time.process_time() - cpu0,
        },
    )
