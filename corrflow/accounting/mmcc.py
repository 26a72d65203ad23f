"""MMCC: amplification by sampling for any non-negative lower-triangular matrix mechanism (002).

002 = Choquette-Choo, Ganesh, Steinke, Thakurta, "Privacy Amplification for Matrix Mechanisms", ICLR
2024 (arXiv:2310.15526). The released rows y_i = (C x)_i + N(0, σ²) are composed *conditionally*
(Thm 3.1 / C.2): off a bad event of probability ≤ δ1, row i (or block i of ``cycle`` rows) given the
earlier outputs is dominated by a product mixture of Gaussians PMoG({p̃_ij}, {C_ij}) with noise σ,
whose random sensitivity is Σ_j Bern(p̃_ij)·C_ij.

* p̃_ij (Alg. 2 / Alg. 4): the posterior probability that the example took part in round j given the
  outputs before the row, bounded with probability 1 − δ' by p̃ = q·e^ε/(q·e^ε + 1 − q), ε =
  z·‖h_j‖/σ + (2·s_ij − ‖h_j‖²)/(2σ²), where h_j is column j's history, z = Φ⁻¹(1 − δ') and s_ij the
  sum of the t largest entries of the history Gram column G[:, j] with t the (1 − δ') quantile of
  Binom(m_i, q), m_i the number of columns with history (App. F.3). The union bound counts exactly
  the (row, column) pairs that use a tail bound: δ' = δ1 / (2·pairs).
* Each row's PMoG becomes a MoG on the grid Δ2·ℕ by rounding every C_ij *up* (Lemma B.2 / Cor. B.3:
  only ever pessimistic); mass below 1e-14 is moved to the largest sensitivity (again pessimistic).
  p̃ is rounded up to a relative grid of 1e-4 so that near-identical rows share one PLD.
* The row PLDs (dp-accounting's ``from_mixture_gaussian_mechanism``, pessimistic estimate, both
  adjacency directions) are composed; identical rows are computed once and self-composed (banded
  Toeplitz encoders have few distinct rows). ε is read at δ2 and the guarantee is (ε, δ1 + δ2).

Poisson sampling with probability p in every round is MMCC (Alg. 1). Cyclic Poisson with ``cycle`` b
(002 App. D, which calls it "b-min-sep"; not 004's sampler) is Generalized-MMCC (Alg. 3): for the
examples of the group training in round k, keep columns k, k + b, …, treat blocks of b rows from
round k on as one vector release whose per-column sensitivity is the block's column norm (Cor. B.6),
sampling probability q = b·p, and take the worst group (for a Toeplitz encoder the first group is
the worst: the others see a shorter Toeplitz mechanism).
"""

from __future__ import annotations

import hashlib
import math
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np

from corrflow.accounting.mechanisms import check_pld_size
from corrflow.errors import InvalidArgumentError, require

#: Relative grid p̃ is rounded up to (pessimistic), so that rows differing by float noise share a
# PLD.
P_GRID = 1e-4
#: PMF mass below this is moved to the row's largest sensitivity (pessimistic, Cor. B.3).
MASS_FLOOR = 1e-14
#: Value discretisation of the row PLDs; 1e-3 moves ε by < 0.05% against dp-accounting's 1e-4 at 002
# App. F.5 and makes each mixture PLD ~8× faster.
MMCC_DISCRETIZATION = 1e-3
#: The grid Δ2 must resolve the largest sensitivity entry into at least this many steps.
MIN_GRID_STEPS = 10


def check_encoder(C: np.ndarray) -> None:
    """Refuse an encoder MMCC cannot analyse: it needs a lower-triangular C (adaptive inputs, 002
    §1.2) with non-negative entries (002 Lemma C.3).

    Args:
        C: the encoder, shape (n, n).

    Raises:
        InvalidArgumentError: (field ``factorization``) C is not square, has a negative entry or an
            entry above the diagonal (beyond 1e-12 of its largest).
    """
    require(
        C.ndim == 2 and C.shape[0] == C.shape[1], "factorization", "a square encoder C", C.shape
    )
    scale = max(float(np.abs(C).max()), 1e-300)
    i, j = np.unravel_index(int(np.argmin(C)), C.shape)
    if C[i, j] < -1e-12 * scale:
        raise InvalidArgumentError(
            "factorization",
            "an encoder with non-negative entries for MMCC (002 Lemma C.3 assumes C ≥ 0); its "
            f"most negative entry is C[{i}, {j}] = {C[i, j]:.4g} — use a non-negative kind such as "
            "dpsgd, banded Toeplitz with non-negative coefficients, or a single-epoch (k = 1) "
            "factorization",
        )
    upper = np.triu(np.abs(C), 1)
    if upper.max() > 1e-12 * scale:
        i, j = np.unravel_index(int(np.argmax(upper)), C.shape)
        raise InvalidArgumentError(
            "factorization",
            "a lower-triangular encoder for MMCC (rows are released in "
            f"round order); C[{i}, {j}] = {C[i, j]:.4g} lies above the diagonal",
        )


def block_problem(C: np.ndarray, start: int, cycle: int) -> tuple[np.ndarray, np.ndarray]:
    """Generalized-MMCC's reduction (002 Alg. 3 steps 1 and 4) for the group training in rounds
    start, start + b, ….

    Args:
        C: the encoder, shape (n, n), non-negative, lower-triangular.
        start: the group's first round k (0 ≤ k < b).
        cycle: b.

    Returns:
        (H, Cb): H = C[start:, start::b] clipped at 0, shape (n − start, columns) (rows in release
        order, the kept columns), and Cb[i, j] = ‖H[ib:(i+1)b, j]‖₂, the block sensitivities, shape
        (⌈(n − start)/b⌉, columns).
    """
    H = np.clip(C[start:, start::cycle], 0.0, None)
    m = H.shape[0]
    blocks = math.ceil(m / cycle)
    pad = np.zeros((blocks * cycle, H.shape[1]))
    pad[:m] = H
    Cb = np.sqrt((pad.reshape(blocks, cycle, -1) ** 2).sum(axis=1))
    return H, Cb


def tail_bounds(
    H: np.ndarray, Cb: np.ndarray, cycle: int, q: float, sigma: float, delta1: float
) -> tuple[np.ndarray, int]:
    """p̃ for every (block, column) with a non-zero block sensitivity (002 Alg. 2; Alg. 4 for cycle
    > 1).

    Block i conditions on the rows before i·cycle.

    Args:
        H: the kept columns in release order, shape (rows, columns) (`block_problem`).
        Cb: the block sensitivities, shape (blocks, columns).
        cycle: b (1: MMCC).
        q: the sampling probability.
        sigma: σ.
        delta1: the δ share of the tail bounds, split evenly over the pairs that use one.

    Returns:
        (p̃ of Cb's shape, number of pairs that used a tail bound); entries where Cb is 0 are
        irrelevant and left at q.

    Raises:
        InvalidArgumentError: (field ``delta_split``) ``delta1`` is 0 while some pair needs a tail
            bound.
    """
    from scipy.stats import binom, norm  # lazy: scipy's import slows every CLI start

    blocks, cols = Cb.shape
    hist_sq = np.zeros(cols)
    pt = np.full(Cb.shape, q)
    # A pair needs a tail bound when the column has history before the block and the block sees it.
    starts = np.arange(blocks) * cycle
    csum = np.vstack([np.zeros(cols), np.cumsum(H**2, axis=0)])
    hist_at = csum[np.minimum(starts, H.shape[0])]  # ‖h_j‖² at each block start
    need = (Cb > 0) & (hist_at > 0)
    pairs = int(need.sum())
    if pairs == 0:
        return pt, 0
    require(
        delta1 > 0,
        "delta_split",
        "a positive share of δ for the tail bounds when C has non-trivial pairs",
        delta1,
    )
    dprime = delta1 / (2 * pairs)
    z = float(norm.isf(dprime))
    G = np.zeros((cols, cols))
    done = 0
    for i in range(blocks):
        while done < min(starts[i], H.shape[0]):
            row = H[done]
            nz = np.flatnonzero(row)
            if nz.size:
                lo, hi = nz[0], nz[-1] + 1
                G[lo:hi, lo:hi] += np.outer(row[lo:hi], row[lo:hi])
            done += 1
        J = np.flatnonzero(need[i])
        if not J.size:
            continue
        hist_sq = hist_at[i]
        # Participations among the columns with history are Binom(m_i, q): t is its (1 − δ')
        # quantile (App. F.3). (Taking m = all columns would make Toeplitz rows identical sooner but
        # cost ~5% in ε at n = 128.)
        m_i = int(np.count_nonzero(hist_sq))
        t = int(binom.isf(dprime, m_i, q))
        while t < m_i and binom.sf(t, m_i, q) > dprime:
            t += 1
        t = max(t, 1)
        sub = G[:, J]
        rows = np.flatnonzero(sub.any(axis=1))
        sub = sub[rows]
        s = (
            -np.partition(-sub, t - 1, axis=0)[:t].sum(axis=0)
            if t < sub.shape[0]
            else sub.sum(axis=0)
        )
        h = np.sqrt(hist_sq[J])
        eps = z * h / sigma + (2.0 * s - h * h) / (2.0 * sigma * sigma)
        pt[i, J] = 1.0 / (1.0 + (1.0 - q) / q * np.exp(-eps))
    return pt, pairs


def _round_up_probability(p: np.ndarray) -> np.ndarray:
    """p rounded up to the relative grid (1 + P_GRID)^k, capped at 1 (larger p̃ only dominates, Cor.
    B.3)."""
    k = np.ceil(np.log(p) / math.log1p(P_GRID) - 1e-9)
    return np.minimum(np.exp(k * math.log1p(P_GRID)), 1.0)


def row_pmf(idx: np.ndarray, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Law of Σ_j Bern(probs_j)·idx_j (grid units) by two-point convolutions (002 App. F.2).

    Args:
        idx: the sensitivities in grid units, int, shape (m,).
        probs: the Bernoulli probabilities p̃_j, shape (m,).

    Returns:
        (support, masses): the support points in grid units and their probabilities (summing to 1),
        with masses below `MASS_FLOOR` moved to the largest support point.
    """
    total = int(idx.sum())
    pmf = np.zeros(total + 1)
    pmf[0] = 1.0
    top = 0
    for g, q in zip(idx.tolist(), probs.tolist(), strict=True):
        shifted = pmf[: top + 1] * q
        pmf[: top + 1] *= 1.0 - q
        pmf[g : g + top + 1] += shifted
        top += g
    pmf = pmf[: top + 1]
    small = pmf < MASS_FLOOR
    small[top] = False
    pmf[top] += pmf[small].sum()
    pmf[small] = 0.0
    keep = np.flatnonzero(pmf)
    return keep, pmf[keep] / pmf[keep].sum()


def _row_pld(args):
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    from corrflow.accounting import pld_speed

    pld_speed.install()  # in the worker process too (a process pool runs this)
    sigma, grid, support, masses, vdi = args
    sens = support * grid
    if support.size == 1:
        return pld_lib.from_gaussian_mechanism(
            sigma, sensitivity=float(sens[0]), value_discretization_interval=vdi
        )
    # a Poisson-subsampled Gaussian: closed-form inverse, much faster
    if support.size == 2 and support[0] == 0:
        return pld_lib.from_gaussian_mechanism(
            sigma,
            sensitivity=float(sens[1]),
            sampling_prob=float(masses[1]),
            value_discretization_interval=vdi,
        )
    return pld_lib.from_mixture_gaussian_mechanism(
        sigma, sens.tolist(), masses.tolist(), value_discretization_interval=vdi
    )


@dataclass(frozen=True)
class MMCCRun:
    """One MMCC evaluation: ε at δ2 and what it used."""

    epsilon: float
    delta1: float
    delta2: float
    grid: float
    rows: int
    distinct_rows: int
    tail_bound_pairs: int
    max_p_tilde: float
    groups_analysed: int


def _compose(plds: list, counts: list[int]):
    parts = [p.self_compose(c) if c > 1 else p for p, c in zip(plds, counts, strict=True)]
    while len(parts) > 1:  # pairwise tree: keeps intermediate supports balanced
        parts = [
            parts[k].compose(parts[k + 1]) if k + 1 < len(parts) else parts[k]
            for k in range(0, len(parts), 2)
        ]
    return parts[0]


def mmcc_epsilon(
    C: np.ndarray,
    q: float,
    sigma: float,
    delta: float,
    *,
    cycle: int = 1,
    groups: list[int] | None = None,
    delta_split: float = 0.5,
    grid: float | None = None,
    discretization: float = MMCC_DISCRETIZATION,
    workers: int | None = None,
    progress: bool = False,
) -> MMCCRun:
    """ε of an amplified matrix mechanism by MMCC (002 Alg. 1) or Generalized-MMCC (002 Alg. 3).

    Args:
        C: the encoder, shape (n, n), non-negative, lower-triangular.
        q: the sampling probability: every round (cycle = 1) or of a group when its turn comes.
        sigma: the noise multiplier σ, per unit clip norm.
        delta: δ in (0, 1).
        cycle: b, the cyclic Poisson groups (1: Poisson sampling in every round).
        groups: the groups (0..cycle−1) to analyse, the worst taken (default all).
        delta_split: the share of δ spent on the tail bounds (δ1); all of δ goes to δ2 when no tail
            bound is needed.
        grid: Δ2 (default: the largest block sensitivity / 256; at most 1/`MIN_GRID_STEPS` of it).
        discretization: the row PLDs' value discretisation.
        workers: processes for the row PLDs (default: the CPU count).
        progress: progress lines on stderr.

    Returns:
        The `MMCCRun` of the worst group: ε at δ2, with the guarantee (ε, δ1 + δ2).

    Raises:
        InvalidArgumentError: an encoder MMCC cannot analyse (`check_encoder`), or a parameter out
            of range (the error names it).
    """
    C = np.asarray(C, dtype=np.float64)
    check_encoder(C)
    key = (
        hashlib.sha256(np.ascontiguousarray(C).tobytes()).hexdigest(),
        C.shape,
        *map(float, (q, sigma, delta, delta_split, discretization)),
        int(cycle),
        None if groups is None else tuple(groups),
        None if grid is None else float(grid),
    )
    if key in _RUNS:
        return _RUNS[key]
    run = _worst_group(
        C, q, sigma, delta, cycle, groups, delta_split, grid, discretization, workers, progress
    )
    if len(_RUNS) >= _RUNS_KEPT:
        _RUNS.pop(next(iter(_RUNS)))
    _RUNS[key] = run
    return run


# MMCC is a pure function of its inputs and costs seconds to minutes: a run that asks twice (every
# bound that applies, then the one selected; a report rebuilt with the same parameters) computes
# once per process. Bounded, oldest first out.
_RUNS: dict[tuple, MMCCRun] = {}
_RUNS_KEPT = 64


def _worst_group(
    C, q, sigma, delta, cycle, groups, delta_split, grid, discretization, workers, progress
):
    """`mmcc_epsilon` uncached: the worst group's `MMCCRun`."""
    groups, problems, grid = _block_problems(C, q, delta, delta_split, cycle, groups, grid)
    best = None
    for k, (H, Cb) in zip(groups, problems, strict=True):
        run = _group_epsilon(
            H,
            Cb,
            cycle,
            q,
            sigma,
            delta,
            delta_split,
            grid,
            discretization,
            workers,
            progress,
            groups,
        )
        if best is None or run.epsilon > best.epsilon:
            best = run
        if progress:
            print(
                f"MMCC group {k}: ε = {run.epsilon:.6g} ({run.distinct_rows} distinct of "
                f"{run.rows} rows)",
                file=sys.stderr,
            )
    return best


def _block_problems(C, q, delta, delta_split, cycle, groups, grid):
    """Check `mmcc_epsilon`'s parameters; return the groups, their block problems
    (`block_problem`) and the grid Δ2 (default: the largest block entry / 256)."""
    n = C.shape[0]
    require(
        isinstance(cycle, int) and 1 <= cycle <= n,
        "cycle",
        f"an integer in [1, rounds = {n}]",
        cycle,
    )
    require(np.isfinite(q) and 0 < q <= 1, "sampling_probability", "a probability in (0, 1]", q)
    require(0 < delta < 1, "delta", "a number in (0, 1)", delta)
    require(0 < delta_split < 1, "delta_split", "a fraction in (0, 1)", delta_split)
    groups = list(range(cycle)) if groups is None else groups
    problems = [block_problem(C, k, cycle) for k in groups]
    top = max(float(Cb.max()) for _, Cb in problems)
    require(top > 0, "factorization", "an encoder with a non-zero entry")
    grid = top / 256 if grid is None else grid
    require(np.isfinite(grid) and grid > 0, "mmcc_grid", "a positive number", grid)
    require(
        grid <= top / MIN_GRID_STEPS,
        "mmcc_grid",
        f"at most {top / MIN_GRID_STEPS:.4g} (the largest sensitivity "
        f"entry {top:.4g} in ≥ {MIN_GRID_STEPS} steps; a coarser grid rounds C up too far)",
        grid,
    )
    return groups, problems, grid


def _group_epsilon(
    H, Cb, cycle, q, sigma, delta, delta_split, grid, discretization, workers, progress, groups
) -> MMCCRun:
    """ε of one cyclic Poisson group's block problem (``block_problem``): tail bounds where a
    column has history, then the composition of its distinct rows' PLDs (002 Alg. 3); ``groups``
    are the groups analysed in all."""
    check_pld_size(sigma, float(Cb.sum(axis=1).max()), discretization=discretization)
    # δ1 is needed only when some block sees a column with history (never for cycle-banded C).
    hist = np.vstack([np.zeros(H.shape[1]), np.cumsum(H**2, axis=0)])[
        np.minimum(np.arange(Cb.shape[0]) * cycle, H.shape[0])
    ]
    trivial = not bool(((Cb > 0) & (hist > 0)).any())
    delta1 = 0.0 if trivial else delta * delta_split
    pt, pairs = tail_bounds(H, Cb, cycle, q, sigma, delta1)
    pt = _round_up_probability(pt)
    idx = np.ceil(Cb / grid - 1e-12).astype(np.int64)  # round up: pessimistic (Lemma B.2)
    rows, counts = _distinct_rows(idx, pt)
    jobs = [(sigma, grid, *row_pmf(a, b), discretization) for a, b in rows]
    plds = _build_plds(jobs, workers, progress)
    eps = float(_compose(plds, counts).get_epsilon_for_delta(delta - delta1))
    return MMCCRun(
        eps,
        delta1,
        delta - delta1,
        grid,
        int(sum(counts)),
        len(rows),
        pairs,
        float(pt[Cb > 0].max()),
        len(groups),
    )


def _distinct_rows(idx: np.ndarray, pt: np.ndarray) -> tuple[list, list[int]]:
    """The distinct non-empty rows of the rounded block (grid indices and tail probabilities,
    in a canonical order) and how many times each occurs: equal rows have equal PLDs."""
    keys: dict[bytes, int] = {}
    rows, counts = [], []
    for i in range(idx.shape[0]):
        J = np.flatnonzero(idx[i])
        if not J.size:
            continue
        order = np.lexsort((pt[i, J], idx[i, J]))
        key = idx[i, J][order].tobytes() + pt[i, J][order].tobytes()
        if key in keys:
            counts[keys[key]] += 1
        else:
            keys[key] = len(rows)
            rows.append((idx[i, J][order], pt[i, J][order]))
            counts.append(1)
    return rows, counts


def _build_plds(jobs: list, workers: int | None, progress: bool) -> list:
    workers = min(os.cpu_count() or 1, len(jobs)) if workers is None else workers
    out = []
    if workers > 1 and len(jobs) > 1:
        ctx = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            for k, p in enumerate(pool.map(_row_pld, jobs)):
                out.append(p)
                _tick(progress, k + 1, len(jobs))
    else:
        for k, job in enumerate(jobs):
            out.append(_row_pld(job))
            _tick(progress, k + 1, len(jobs))
    return out


def _tick(progress: bool, k: int, total: int) -> None:
    if progress:
        print(
            f"\rMMCC row PLDs {k}/{total}",
            end="\n" if k == total else "",
            file=sys.stderr,
            flush=True,
        )
