"""``corrflow plan``: choose the mechanism for a training run (how to use it: docs/how-to/plan.md).

From the population P, the cohort size B and the rounds n the participation follows: b = ⌊P/B⌋
rounds between a user's turns and k = ⌈n/b⌉ participations (fixed-epoch when b·k = n), or the
sampler an accountant implies (cyclic Poisson with q = b·B/P for the cyclic-Poisson reduction of 001
Prop. 2.1 and Generalized-MMCC, 002 App. D — and, for a p-banded C with p < ⌊P/B⌋, the cyclic
Poisson sampler with its own separation b = p, which amplifies; b-min-sep with p0 = B/P for the
Monte Carlo accountant, 004). For each kind of the registry and each band count (powers of two up to
b and the neighbourhood of the rule of thumb ε√n/k, whose optimum sits near twice it, 001 Fig. 2b:
McKenna, "Scaling up the Banded Matrix Factorization Mechanism for Differentially Private ML", arXiv
2405.15913) the factorization is built (cached), σ is calibrated with every applicable accountant
(cached), and the candidate is scored by its RMSE at the target ε (σ · RMSE at unit σ), its max
error, the noise engine's state memory and time per round for d parameters. The best candidate
within the memory and noise-time budgets is the recommendation.

The dense candidate (000) is built last, warm-started from the Toeplitz optimum with b bands (its
optimizer's own start), with a budget in iterations (`dense_iterations`, a function of n
alone), never in seconds: the same request gives the same recipe on any machine and under any load.
A stopped optimizer still yields a valid factorization whose (finite) duality gap is reported. It is
skipped without building when its noise state or its O(t·d) noise time per round breaks a budget.
The wall-clock ``time_budget`` (``--time-budget``) can only abort a plan —
`PlanStoppedError`, and no recipe is written — never change what it recommends.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from corrflow.accounting.accountant import AccountingOptions, SamplingSpec, accountant_for
from corrflow.accounting.mechanisms import check_epsilon
from corrflow.config import MAX_ROUNDS, MAX_USERS
from corrflow.errors import CorrflowError, require
from corrflow.factorization.base import Factorization, normalized
from corrflow.factorization.build import factorize
from corrflow.factorization.metrics import ErrorReport
from corrflow.factorization.participation import Participation
from corrflow.factorization.registry import KINDS, REGISTRY
from corrflow.factorization.workloads import Workload
from corrflow.fileio import write_text
from corrflow.noise.keys import VERSION as KEY_VERSION
from corrflow.noise.prng import make_source
from corrflow.participation.samplers import BMinSepSampler, clamp_probability
from corrflow.planning.cache import PlanCache
from corrflow.planning.recipe import Recipe
from corrflow.planning.run import workload_for
from corrflow.planning.score import (
    Damping,
    check_kappa,
    closed_loop_error,
    closed_loop_response,
)
from corrflow.progress import Progress

#: The largest --time-budget (a week): beyond it a deadline is no limit at all, and 1e308 s once
# planned without end.
MAX_TIME_BUDGET = 7 * 24 * 3600.0
#: Kinds planned by default (tree, fft, bsr, bisr, lambda-cgd and the non-Toeplitz banded optimum
# are opt-in).
DEFAULT_KINDS = ("dpsgd", "toeplitz", "bifr", "dense")
PLAN_ACCOUNTANTS = ("unamplified", "cyclic-poisson", "mmcc", "monte-carlo")
#: MMCC runs by default only up to this many rounds: every probe of its σ search is a full run
# (minutes at n ≈ 2000, see benchmarks/accounting.py); above it MMCC is opt-in (``accountants``)
# and listed as skipped.
MMCC_DEFAULT_MAX_ROUNDS = 512
#: The dense optimizer's work budget in units of n³ flops-per-iteration: ⌈DENSE_WORK / n³⌉
# iterations (at most `DENSE_MAX_ITERATIONS`) — about 120 L-BFGS iterations at n = 2052
# (minutes on 2 cores), thousands at n ≤ 512 (where it converges first). A count, not seconds, so
# that the plan does not depend on the machine.
DENSE_WORK = 1e12
DENSE_MAX_ITERATIONS = 10_000


def dense_iterations(rounds: int) -> int:
    """The plan's default iteration budget for the dense optimizer (see `DENSE_WORK`).

    Args:
        rounds: n.

    Returns:
        ⌈DENSE_WORK / n³⌉ iterations, within [50, `DENSE_MAX_ITERATIONS`].
    """
    return int(min(DENSE_MAX_ITERATIONS, max(50, math.ceil(DENSE_WORK / float(rounds) ** 3))))


class PlanStoppedError(CorrflowError):
    """The plan ran past its wall-clock ``--time-budget``: it stops and writes no recipe (a recipe
    must depend on the request alone, never on how fast this machine was)."""


@dataclass(frozen=True)
class PlanRequest:
    """What ``corrflow plan`` is asked: the run's size, its privacy target and the budgets a recipe
    must fit.

    Attributes:
        rounds: n.
        population: P, the users (≥ cohort_size).
        cohort_size: B, the users per round.
        target_epsilon: ε > 0.
        delta: δ in (0, 1).
        memory_budget: bytes of noise state (inf: none).
        noise_time_budget: seconds of noise generation per round (inf: none).
        model_params: d.
        kinds: the factorization kinds to plan (`DEFAULT_KINDS`).
        accountants: the accountants (None: the cheap defaults, `accountant_list`).
        momentum: the server optimizer's momentum β.
        cooldown_fraction: the fraction of rounds with a linear learning-rate cooldown.
        tol: the dense optimizer's duality-gap tolerance.
        time_budget: wall-clock seconds after which the plan aborts with no recipe (None: none).
        mc_samples: Monte Carlo samples per direction.
        dense_iterations: the dense optimizer's iteration budget (None: `dense_iterations` of n).
        damping: κ of the trained task (`corrflow.planning.score.Damping`): the candidates are
            ranked by the closed-loop error of the final model at κ; None: by RMSE at the target ε
            (the open-loop score of the workload's iterates).

    Raises:
        InvalidArgumentError: a field out of range, naming its CLI flag (without ``--``).
    """

    rounds: int
    population: int
    cohort_size: int
    target_epsilon: float
    delta: float
    memory_budget: float = math.inf  # bytes of noise state
    noise_time_budget: float = math.inf  # seconds of noise generation per round
    model_params: int = 1_000_000
    kinds: tuple[str, ...] = DEFAULT_KINDS
    accountants: tuple[str, ...] | None = None  # None: the cheap defaults
    momentum: float = 0.9
    cooldown_fraction: float = 0.25
    tol: float = 5e-4
    # wall-clock seconds after which the plan aborts (no recipe); None: none
    time_budget: float | None = None
    mc_samples: int = 100_000
    # the dense optimizer's iteration budget; None: dense_iterations(n)
    dense_iterations: int | None = None
    damping: Damping | None = None  # None: rank by RMSE at the target ε

    def __post_init__(self) -> None:
        require(
            isinstance(self.rounds, int) and 1 <= self.rounds <= MAX_ROUNDS,
            "rounds",
            f"a positive integer ≤ {MAX_ROUNDS}",
            self.rounds,
        )
        # Each flag's own range first (a cohort of 10³⁰ is the cohort's fault), then the pair: a
        # population smaller than a possible cohort is the population's.
        require(
            isinstance(self.cohort_size, int) and 1 <= self.cohort_size <= MAX_USERS,
            "cohort-size",
            f"an integer in [1, {MAX_USERS:.0e}]",
            self.cohort_size,
        )
        require(
            isinstance(self.population, int) and self.cohort_size <= self.population <= MAX_USERS,
            "population",
            f"an integer in [cohort-size = {self.cohort_size}, {MAX_USERS:.0e}]",
            self.population,
        )
        check_epsilon(self.target_epsilon, "target-epsilon")
        require(0 < self.delta < 1, "delta", "a number in (0, 1)", self.delta)
        require(self.memory_budget >= 0, "memory-budget", "bytes ≥ 0", self.memory_budget)
        require(
            self.noise_time_budget >= 0, "noise-time-budget", "seconds ≥ 0", self.noise_time_budget
        )
        require(
            isinstance(self.model_params, int) and self.model_params >= 1,
            "model-params",
            "a positive integer",
            self.model_params,
        )
        bad = [k for k in self.kinds if k not in KINDS]
        require(self.kinds and not bad, "kinds", f"kinds from {KINDS}", bad or self.kinds)
        bad = [a for a in (self.accountants or ()) if a not in PLAN_ACCOUNTANTS]
        require(
            self.accountants is None or (self.accountants and not bad),
            "accountants",
            f"accountants from {PLAN_ACCOUNTANTS}",
            bad or self.accountants,
        )
        require(0 <= self.momentum < 1, "momentum", "a number in [0, 1)", self.momentum)
        if self.damping is not None:
            check_kappa(self.damping, self.workload, self.rounds)
        require(
            self.time_budget is None or 0 < self.time_budget <= MAX_TIME_BUDGET,
            "time-budget",
            f"seconds in (0, {MAX_TIME_BUDGET:g}] (a week; leave it out for no limit)",
            self.time_budget,
        )
        require(
            self.dense_iterations is None
            or (isinstance(self.dense_iterations, int) and self.dense_iterations >= 1),
            "dense-iterations",
            "a positive integer",
            self.dense_iterations,
        )

    @property
    def dense_iteration_budget(self) -> int:
        """The dense optimizer's iteration budget: ``dense_iterations``, or its default for n."""
        return self.dense_iterations or dense_iterations(self.rounds)

    @property
    def min_sep(self) -> int:
        """b = ⌊P/B⌋ rounds between a user's turns (at most n)."""
        return min(self.population // self.cohort_size, self.rounds)

    @property
    def epochs(self) -> int:
        """k = ⌈n/b⌉ participations."""
        return -(-self.rounds // self.min_sep)

    @property
    def fixed_epoch(self) -> bool:
        """Whether b·k = n (fixed-epoch participation is possible)."""
        return self.min_sep * self.epochs == self.rounds

    @property
    def workload(self) -> Workload:
        """The server optimizer's workload, exactly as the strategy builds it
        (planning.run.workload_for)."""

        return workload_for(self.momentum, self.cooldown_fraction)

    def accountant_list(self) -> tuple[list[str], list[dict]]:
        """The accountants the plan runs.

        Returns:
            (accountants to run, skipped accountants as ``{"accountant", "reason"}``): the requested
            ones, or unamplified, cyclic-poisson and MMCC up to `MMCC_DEFAULT_MAX_ROUNDS` rounds.
        """
        if self.accountants is not None:
            return list(self.accountants), [
                {"accountant": a, "reason": "not requested (--accountants)"}
                for a in PLAN_ACCOUNTANTS
                if a not in self.accountants
            ]
        run = ["unamplified", "cyclic-poisson"]
        skipped = [
            {
                "accountant": "monte-carlo",
                "reason": "opt-in (--accountants monte-carlo): Monte Carlo "
                "verification draws ~10⁵ samples per candidate σ",
            }
        ]
        if self.rounds <= MMCC_DEFAULT_MAX_ROUNDS:
            run.append("mmcc")
        else:
            skipped.append(
                {
                    "accountant": "mmcc",
                    "reason": f"opt-in above {MMCC_DEFAULT_MAX_ROUNDS} rounds "
                    "(--accountants mmcc): each probe of its σ search is a full Generalized-MMCC "
                    "run",
                }
            )
        return run, skipped

    def rule_of_thumb(self) -> float:
        """The rule of thumb for the number of bands, b* ≈ ε√n/k (001 §4.2, Fig. 2b: McKenna,
        "Scaling up the Banded Matrix Factorization Mechanism for Differentially Private ML", arXiv
        2405.15913; the optimum sits near twice it).

        Returns:
            ε√n/k.
        """
        return self.target_epsilon * math.sqrt(self.rounds) / self.epochs

    def band_grid(self) -> list[int]:
        """The band counts the plan tries.

        Returns:
            Sorted: powers of two up to b, b itself, and ⌈r⌉, ⌈1.5r⌉, ⌈2r⌉, ⌈3r⌉ for the rule of
            thumb r (within [1, b]).
        """
        b = self.min_sep
        grid = {2**i for i in range(int(math.log2(b)) + 1)} | {b}
        r = self.rule_of_thumb()
        grid |= {min(b, max(1, math.ceil(f * r))) for f in (1.0, 1.5, 2.0, 3.0)}
        return sorted(grid)


@dataclass
class Candidate:
    """A complete recipe (kind, bands, participation, accountant, σ) with its scores; the fields are
    those of ``plan.json``'s ``candidates`` (RMSE and max error at the target ε, per unit clip norm
    and coordinate)."""

    kind: str
    bands: int | None
    accountant: str
    participation: str
    participation_rate: float
    min_sep: int  # the sampler's b (1: Poisson sampling in every round)
    noise_multiplier: float | None = None
    epsilon: float | None = None
    rmse: float | None = None  # at the target ε, per unit clip norm and coordinate
    max_error: float | None = None
    rmse_unit_sigma: float | None = None
    noise_state_bytes: int = 0
    noise_seconds_per_round: float = 0.0
    build_seconds: float = 0.0
    calibration_seconds: float = 0.0
    cached: bool = False
    fits: bool = False
    over_budget: list[str] = field(default_factory=list)
    factorization_sha256: str = ""
    rank: int | None = None
    rmse_ratio_vs_dpsgd: float | None = None
    # σ · sens · ‖C⁻ᵀ r_κ‖: the final model's noise under training's feedback (score module)
    closed_loop_error: float | None = None
    score: float | None = None  # what the plan ranks by: closed_loop_error, else rmse
    rmse_rank: int | None = None  # the rank the plain RMSE gives (within the budgets)
    notes: dict = field(default_factory=dict)

    def label(self) -> str:
        """Returns:
        ``kind[bands] / accountant``, with ``(Poisson, b=1)`` for a sampler in every round.
        """
        sampler = (
            " (Poisson, b=1)" if self.min_sep == 1 and self.participation != "fixed-epoch" else ""
        )
        return (
            f"{self.kind}"
            + (f"[{self.bands}]" if self.bands is not None else "")
            + f" / {self.accountant}"
            + sampler
        )

    def key(self) -> tuple:
        """The candidate's identity in `PlanResult.factorizations`.

        Returns:
            (kind, bands, accountant, min_sep).
        """
        return (self.kind, self.bands, self.accountant, self.min_sep)

    def to_dict(self) -> dict:
        """Returns:
        The fields as a JSON-serialisable dict.
        """
        return asdict(self)


@dataclass
class PlanResult:
    """A plan: the ranked candidates, the recommended one and what was skipped.

    Attributes:
        request: the `PlanRequest`.
        candidates: sorted by RMSE at the target ε; those within the budgets ranked.
        recommended: the best candidate within the budgets, or None.
        skipped: kinds and accountants not planned, each with the reason.
        seconds: the plan's wall-clock time.
        cache_hits: cache hits.
        cache_misses: cache misses.
        factorizations: `Candidate.key` → its normalised factorization.
        noise_cost: `noise_unit_costs` as measured.
    """

    request: PlanRequest
    candidates: list[Candidate]
    recommended: Candidate | None
    skipped: list[dict]
    seconds: float
    cache_hits: int
    cache_misses: int
    # (kind, bands, participation kind) → Factorization
    factorizations: dict = field(default_factory=dict)
    noise_cost: dict = field(default_factory=dict)


def noise_unit_costs(dim: int = 1 << 20, repeats: int = 3) -> dict:
    """Seconds per float32 Gaussian draw (the engine's Philox source) and per multiply-add, measured
    here.

    Args:
        dim: the vector length timed.
        repeats: the best of this many timings is kept.

    Returns:
        ``{"seconds_per_draw", "seconds_per_multiply_add", "measured_dim"}``.
    """

    src = make_source("philox", bytes(16), KEY_VERSION)  # a timing: any key
    x = np.ones(dim, dtype=np.float32)
    y = np.zeros(dim, dtype=np.float32)
    t_draw = t_madd = math.inf
    for r in range(repeats):
        t0 = time.perf_counter()
        src.normal(r, 0, dim)
        t_draw = min(t_draw, (time.perf_counter() - t0) / dim)
        t0 = time.perf_counter()
        y += np.float32(0.5) * x
        t_madd = min(t_madd, (time.perf_counter() - t0) / dim)
    return {"seconds_per_draw": t_draw, "seconds_per_multiply_add": t_madd, "measured_dim": dim}


def participation_of(
    req: PlanRequest, accountant: str, min_sep: int | None = None
) -> tuple[Participation, str, float]:
    """The participation an accountant analyses (module docstring).

    Args:
        req: the plan request.
        accountant: one of `PLAN_ACCOUNTANTS`.
        min_sep: the sampler's b for amplified accountants (default ⌊P/B⌋; 1 = Poisson sampling
            every round).

    Returns:
        (factorization participation, strategy participation name, participation rate p0 = B/P).
    """
    n, b, k = req.rounds, req.min_sep, req.epochs
    if min_sep is not None and accountant != "unamplified":
        b, k = min_sep, -(-n // min_sep)
    if accountant == "unamplified":
        if req.fixed_epoch:
            return Participation.fixed_epoch(n, k), "fixed-epoch", 0.0
        return Participation.min_separation(n, b, k), "bminsep", req.cohort_size / req.population
    strategy = "bminsep" if accountant == "monte-carlo" else "cyclic-poisson"
    return Participation.min_separation(n, b, k), strategy, req.cohort_size / req.population


def sampling_of(req: PlanRequest, accountant: str, min_sep: int | None = None) -> SamplingSpec:
    """The accountant's sampling description, with the strategy's sampler probability (the cohort
    planner's p).

    Args:
        req: the plan request.
        accountant: one of `PLAN_ACCOUNTANTS`.
        min_sep: the sampler's b (default ⌊P/B⌋).

    Returns:
        The `SamplingSpec` (b-min-sep for Monte Carlo, 004 §1.5; cyclic Poisson with q = b·B/P
        otherwise; none for unamplified).
    """
    if accountant == "unamplified":
        return SamplingSpec()
    p0 = req.cohort_size / req.population
    b = min_sep or req.min_sep
    if accountant == "monte-carlo":
        return SamplingSpec(
            "bminsep",
            req.population,
            req.population * p0,
            sampling_probability=BMinSepSampler.probability_for_rate(p0, b),
            accountant="monte-carlo",
        )

    return SamplingSpec(
        "cyclic-poisson",
        req.population,
        req.population * p0,
        sampling_probability=clamp_probability(b * p0),
        accountant=accountant,
    )


def applicable(req: PlanRequest, fac: Factorization, accountant: str) -> str | None:
    """Whether an accountant can analyse a factorization.

    Args:
        req: the plan request.
        fac: the candidate's factorization.
        accountant: one of `PLAN_ACCOUNTANTS`.

    Returns:
        None when it can, else the reason it cannot (the encoder's structure, more than b bands, or
        negative entries for MMCC).
    """
    spec = REGISTRY[fac.kind]
    if accountant not in spec.accountants:
        return f"{accountant} does not analyse {fac.kind} ({spec.structure} encoder)"
    bands = fac.bands or 1
    if accountant in ("cyclic-poisson", "monte-carlo") and bands > fac.participation.min_sep:
        return f"{accountant} needs at most b = {fac.participation.min_sep} bands"
    if accountant == "mmcc" and bool(np.any(fac.encoder.matrix() < -1e-12)):
        return "mmcc needs a non-negative encoder"
    return None


def _build_params(req: PlanRequest, kind: str, bands: int | None, part: Participation) -> dict:
    return {
        "kind": kind,
        "participation": part.to_dict(),
        "bands": bands,
        "workload": req.workload.to_dict(),
        "gamma": None,
        "taper": None,
        "stamps": 1,
        "tol": req.tol if kind == "dense" else None,
        "max_iterations": req.dense_iteration_budget if kind == "dense" else None,
    }


def _for_participation(fac: Factorization, part: Participation, cache: PlanCache) -> Factorization:
    """The same encoder normalised under another participation (the builder did not depend on its
    kind); cached, as a min-sep sensitivity can take seconds at n ≈ 2000."""
    if fac.participation == part:
        return fac
    return cache.factorization(
        {"normalized_from": fac.sha256(), "participation": part.to_dict()},
        lambda: normalized(fac.kind, fac.workload, part, fac.encoder, fac.metadata),
    )[0]


class _Deadline:
    """The plan's ``--time-budget``: called between steps, it stops the plan once spent."""

    def __init__(self, budget: float | None):
        self.start = time.perf_counter()
        self.budget = budget

    def spent(self) -> float:
        return time.perf_counter() - self.start

    def __call__(self, where: str) -> None:
        spent = self.spent()
        if self.budget is not None and spent > self.budget:
            raise PlanStoppedError(
                f"plan stopped by --time-budget {self.budget:g} s after {spent:.0f} s, "
                f"{where}; no recipe written (a plan's recipe depends on its inputs only, so it "
                "is never cut short: rerun without --time-budget or with a larger one — the "
                "cache keeps what was built)"
            )


def _build_jobs(req: PlanRequest) -> list[tuple[str, int | None]]:
    """Every (kind, bands) to build: each banded kind over the band grid, dense last (it gets what
    is left of the time budget)."""
    jobs: list[tuple[str, int | None]] = []
    for kind in req.kinds:
        if REGISTRY[kind].takes_bands:
            jobs += [(kind, p) for p in req.band_grid()]
        else:
            jobs.append((kind, None))
    jobs.sort(key=lambda j: j[0] == "dense")
    return jobs


def _noise_cost(req: PlanRequest, costs: dict, kind: str, bands: int | None) -> tuple[int, float]:
    """The noise state's bytes and seconds per round of ``kind`` at ``bands`` for the model."""
    spec = REGISTRY[kind]
    d = req.model_params
    mem = spec.noise_state_bytes(bands, d, req.rounds)
    secs = d * (
        spec.draws_per_round(bands, req.rounds) * costs["seconds_per_draw"]
        + max(spec.multiply_adds_per_round(bands, req.rounds), 0.0)
        * costs["seconds_per_multiply_add"]
    )
    return mem, secs


def _build(
    req: PlanRequest,
    cache: PlanCache,
    kind: str,
    bands: int | None,
    base_part: Participation,
    deadline: _Deadline,
    quiet: bool,
) -> tuple[Factorization, bool]:
    """Build (or load from the cache) the unamplified factorization of one job, checking the
    deadline at every optimizer iteration; returns it and whether it came from the cache."""
    with Progress(f"plan: build {kind}" + (f" bands={bands}" if bands else ""), quiet=quiet) as cb:

        def guarded(it, f):
            deadline(f"while building {kind} (iteration {it})")
            cb(it, f)

        return cache.factorization(
            _build_params(req, kind, bands, base_part),
            lambda: factorize(
                kind,
                base_part,
                req.workload,
                bands=bands,
                tol=req.tol,
                callback=guarded,
                max_iterations=req.dense_iteration_budget if kind == "dense" else None,
            ),
        )


def _variants(
    req: PlanRequest, accountants: list[str], kind: str, fac: Factorization
) -> list[tuple[str, int | None]]:
    """The (accountant, sampler separation) pairs to plan a built factorization under.

    With b = ⌊P/B⌋ the cyclic sampler's q = b·B/P is close to 1 and nothing is amplified, so a
    p-banded C (p < ⌊P/B⌋) is also planned under the cyclic Poisson sampler with its own separation
    b = p, the largest the reduction allows for p bands (001 Prop. 2.1), q = p·B/P. For p = 1
    (DP-SGD) that is Poisson sampling in every round (b = 1, q = B/P): the amplified DP-SGD
    baseline.
    """
    variants: list[tuple[str, int | None]] = [(acc, None) for acc in accountants]
    own_b = fac.bands or 1
    if (
        "cyclic-poisson" in accountants
        and "cyclic-poisson" in REGISTRY[kind].accountants
        and own_b < req.min_sep
    ):
        variants.append(("cyclic-poisson", own_b))
    return variants


def _candidate_notes(req: PlanRequest, kind: str, fac: Factorization) -> dict:
    """What the ranking table shows beside a candidate: dense's convergence, γ, BLT buffers."""
    notes: dict = {}
    if kind == "dense":
        notes = {k: fac.metadata.get(k) for k in ("converged", "relative_gap", "iterations")}
        notes["max_iterations"] = req.dense_iteration_budget
    if "gamma" in fac.metadata:
        notes["gamma"] = fac.metadata["gamma"]
    if "buffers" in fac.metadata:  # blt: B buffers of d float32 (noise_state_bytes)
        notes["buffers"] = fac.metadata["buffers"]
    return notes


@dataclass
class _Planning:
    """What every candidate of one plan shares: the request, cache, deadline, the closed-loop
    response the score uses (None: rank by RMSE) and the lists being filled."""

    req: PlanRequest
    cache: PlanCache
    deadline: _Deadline
    response: np.ndarray | None
    skipped: list[dict]
    cands: list[Candidate] = field(default_factory=list)
    facs: dict = field(default_factory=dict)

    def add(self, kind, bands, fac, cached, acc, sampler_b, mem, secs) -> None:
        """Plan ``fac`` under accountant ``acc`` (and sampler separation ``sampler_b``): adapt it to
        the participation, calibrate σ and score it; a failure is recorded in ``skipped``."""
        req = self.req
        part, strategy, p0 = participation_of(req, acc, sampler_b)
        try:
            fac_a = _for_participation(fac, part, self.cache)
        except CorrflowError as exc:
            self.skipped.append(
                {"kind": kind, "bands": bands, "accountant": acc, "reason": str(exc)}
            )
            return
        if applicable(req, fac_a, acc) is not None:
            return
        cand = Candidate(
            kind,
            fac.bands if REGISTRY[kind].takes_bands else None,
            acc,
            strategy,
            p0 if strategy != "fixed-epoch" else 0.0,
            part.min_sep,
            noise_state_bytes=mem,
            noise_seconds_per_round=secs,
            build_seconds=float(fac.metadata.get("seconds", 0.0)),
            cached=cached,
            factorization_sha256=fac_a.sha256(),
        )
        cand.notes = _candidate_notes(req, kind, fac)
        self.deadline(f"before calibrating {cand.label()}")
        try:
            _calibrate(req, self.cache, cand, fac_a)
        except CorrflowError as exc:
            self.skipped.append(
                {
                    "kind": kind,
                    "bands": bands,
                    "accountant": acc,
                    "reason": f"calibration failed: {exc}",
                }
            )
            return
        if self.response is not None:
            cand.closed_loop_error = cand.noise_multiplier * closed_loop_error(fac_a, self.response)
        cand.score = cand.rmse if self.response is None else cand.closed_loop_error
        cand.over_budget = _over_budget(req, mem, secs)
        cand.fits = not cand.over_budget
        self.facs[cand.key()] = fac_a
        self.cands.append(cand)


def _say(quiet: bool, line: str) -> None:
    """One plain progress line on stderr: a progress bar shows only on a terminal, and a plan
    takes minutes."""
    if not quiet:
        print(line, file=sys.stderr, flush=True)


def make_plan(req: PlanRequest, cache: PlanCache, *, quiet: bool = False) -> PlanResult:
    """Build, calibrate and rank every candidate (module docstring).

    Args:
        req: the plan request.
        cache: the plan cache (factorizations and calibrations are reused from it).
        quiet: no progress bars.

    Returns:
        The `PlanResult`.

    Raises:
        PlanStoppedError: the plan ran past ``req.time_budget``.
    """
    deadline = _Deadline(req.time_budget)
    accountants, skipped = req.accountant_list()
    costs = noise_unit_costs()
    base_part = participation_of(req, "unamplified")[0]
    jobs = _build_jobs(req)
    response = (
        None
        if req.damping is None
        else closed_loop_response(req.workload, req.rounds, req.damping.kappa)
    )
    planning = _Planning(req, cache, deadline, response, skipped)
    with Progress("plan: candidates", total=len(jobs), quiet=quiet, unit="candidates") as tick:
        for done, (kind, bands) in enumerate(jobs):
            tick(done)
            _say(
                quiet,
                f"plan: candidate {done + 1} of {len(jobs)}: {kind}"
                + (f"[{bands}]" if bands else "")
                + " (built once, then cached; σ calibrated for each accountant)",
            )
            _plan_job(planning, kind, bands, base_part, accountants, costs, quiet)
        tick(len(jobs))
    cands = planning.cands
    _rank(cands, req.rounds)
    best = next((c for c in cands if c.fits), None)
    return PlanResult(
        req,
        cands,
        best,
        skipped,
        deadline.spent(),
        cache.hits,
        cache.misses,
        planning.facs,
        costs,
    )


def _plan_job(
    planning: _Planning,
    kind: str,
    bands: int | None,
    base_part: Participation,
    accountants: list[str],
    costs: dict,
    quiet: bool,
) -> None:
    """Build one (kind, bands) job and plan it under every accountant variant that applies."""
    req, skipped = planning.req, planning.skipped
    spec = REGISTRY[kind]
    over = _over_budget(req, *_noise_cost(req, costs, kind, bands))
    if spec.fixed_epoch_only and not req.fixed_epoch:
        skipped.append(
            {
                "kind": kind,
                "reason": f"needs fixed-epoch participation (b·k = n); here "
                f"b = {req.min_sep}, k = {req.epochs}, n = {req.rounds}",
            }
        )
        return
    # the one build too slow to make only to report it over budget
    if kind == "dense" and over:
        skipped.append({"kind": kind, "reason": "not built: " + "; ".join(over)})
        return
    planning.deadline(f"before building {kind}" + (f"[{bands}]" if bands else ""))
    try:
        fac, cached = _build(req, planning.cache, kind, bands, base_part, planning.deadline, quiet)
    except CorrflowError as exc:
        skipped.append({"kind": kind, "bands": bands, "reason": f"build failed: {exc}"})
        return
    # the built encoder's own size (its bands, or a BLT's buffers) sets its noise cost
    sized = (
        spec.size_of(fac.encoder)
        if spec.noise_mode in ("banded", "banded-inverse", "blt")
        else bands
    )
    mem, secs = _noise_cost(req, costs, kind, sized)
    for acc, sampler_b in _variants(req, accountants, kind, fac):
        planning.add(kind, bands, fac, cached, acc, sampler_b, mem, secs)


def _over_budget(req: PlanRequest, mem: int, secs: float) -> list[str]:
    out = []
    if mem > req.memory_budget:
        out.append(f"noise state {mem:,} B > memory budget {req.memory_budget:,.0f} B")
    if secs > req.noise_time_budget:
        out.append(f"noise time {secs:.3g} s/round > budget {req.noise_time_budget:g} s")
    return out


def _calibrate(req: PlanRequest, cache: PlanCache, cand: Candidate, fac: Factorization) -> None:
    spec = sampling_of(req, cand.accountant, cand.min_sep)
    opts = AccountingOptions(mc_samples=req.mc_samples)
    params = {
        "accountant": cand.accountant,
        "sampling": asdict(spec),
        "target_epsilon": req.target_epsilon,
        "delta": req.delta,
        "mc_samples": req.mc_samples if cand.accountant == "monte-carlo" else None,
        **_accounting_inputs(fac, cand.accountant),
    }

    def compute() -> dict:
        t0 = time.perf_counter()
        res = accountant_for(spec, opts).noise_multiplier(fac, req.target_epsilon, req.delta)
        return {
            "noise_multiplier": res.noise_multiplier,
            "epsilon": res.epsilon,
            "delta": res.delta,
            "guarantee": res.guarantee,
            "seconds": time.perf_counter() - t0,
        }

    def valid(
        r: dict,
    ) -> bool:  # what a calibration can return: σ > 0, ε within the target, a verified δ
        ok = (
            isinstance(r["guarantee"], bool)
            and math.isfinite(r["noise_multiplier"])
            and r["noise_multiplier"] > 0
            and 0 <= r["epsilon"] <= req.target_epsilon * (1 + 1e-9)
            and 0 < r["delta"] <= 1
        )
        # exact and microseconds: re-derive ε from the cached σ
        if ok and cand.accountant == "unamplified":
            ok = (
                r["epsilon"]
                == accountant_for(spec, opts).epsilon(fac, r["noise_multiplier"], req.delta).epsilon
            )
        return ok

    res, _ = cache.calibration(params, compute, valid)
    require(
        res["guarantee"],
        "accountants",
        f"an accountant whose σ meets δ = {req.delta:g} "
        f"({cand.accountant} verified δ = {res['delta']:.3g}; Monte Carlo needs more samples)",
        cand.accountant,
    )
    err = ErrorReport(
        **cache.calibration(
            {"errors_of": fac.sha256(), "sensitivity": fac.sensitivity.value},
            lambda: fac.errors().to_dict(),
            _valid_errors,
        )[0]
    )
    cand.noise_multiplier = float(res["noise_multiplier"])
    cand.epsilon = float(res["epsilon"])
    cand.calibration_seconds = float(res["seconds"])
    cand.rmse_unit_sigma = err.rmse
    cand.rmse = cand.noise_multiplier * err.rmse
    cand.max_error = cand.noise_multiplier * err.max_error


def _valid_errors(r: dict) -> bool:
    try:
        err = ErrorReport(**r)
    except TypeError:
        return False
    return all(
        isinstance(v, int | float) and math.isfinite(v) and v >= 0 for v in asdict(err).values()
    )


def _accounting_inputs(fac: Factorization, accountant: str) -> dict:
    """What the accountant's answer depends on: the unamplified Gaussian sees only the sensitivity
    (000 App. D.2), the cyclic-Poisson reduction only n, b and the largest column norm (001 Prop.
    2.1); MMCC and Monte Carlo see the whole encoder. Keying calibrations by these lets candidates
    share them."""
    if accountant == "unamplified":
        return {"sensitivity": fac.sensitivity.value}
    if accountant == "cyclic-poisson":
        return {
            "rounds": fac.rounds,
            "min_sep": fac.participation.min_sep,
            "bands_at_most_min_sep": (fac.bands or 1) <= fac.participation.min_sep,
            "max_column_norm": float(fac.encoder.column_norms().max()),
        }
    return {"factorization_sha256": fac.sha256(), "participation": fac.participation.to_dict()}


def _rank(cands: list[Candidate], rounds: int) -> None:
    """Sort by the score (the closed-loop error at κ, or RMSE at the target ε without κ; ties: less
    memory, then less noise work per round — counted in draws and multiply-adds, not timed, so the
    order is the same on every machine); rank the ones within the budgets, and record the rank the
    plain RMSE would give them (``rmse_rank``)."""

    def work(c: Candidate) -> float:
        spec = REGISTRY[c.kind]
        size = c.notes.get("buffers", c.bands) if isinstance(c.notes, dict) else c.bands
        return spec.draws_per_round(size, rounds) + max(
            spec.multiply_adds_per_round(size, rounds), 0.0
        )

    by_rmse = sorted(cands, key=lambda c: (c.rmse, c.noise_state_bytes, work(c)))
    for i, c in enumerate([c for c in by_rmse if c.fits], start=1):
        c.rmse_rank = i
    cands.sort(key=lambda c: (c.score, c.noise_state_bytes, work(c)))
    dpsgd = min((c.rmse for c in cands if c.kind == "dpsgd"), default=None)
    rank = 0
    for c in cands:
        if dpsgd:
            c.rmse_ratio_vs_dpsgd = c.rmse / dpsgd
        if c.fits:
            rank += 1
            c.rank = rank


#: What the closed-loop score assumes, printed by ``corrflow plan`` and kept in ``plan.json``.
CLOSED_LOOP_ASSUMES = (
    "training pulls a noisy model back like a quadratic: each round by κ = server lr × curvature, "
    "the same κ in every round (the loss-weighted mean over directions)",
    "the candidates differ only in their noise: the same cohort size, clipping and optimizer "
    "(the Poisson samplers' varying cohort size is not modelled)",
    "it predicts the order of the final loss, not its value; lower is better",
)
RMSE_ASSUMES = (
    "the noise adds up in the model untouched (open loop: no feedback from training)",
    "it ranks the workload's iterates (RMSE over all n), not the final model",
)


def _mechanism(c: Candidate) -> tuple:
    """What noise a candidate adds, whatever bounds it: a one-band encoder is the identity, so
    every kind with one band is DP-SGD's mechanism; else the kind and its bands; and the sampler's
    separation."""
    if c.kind == "dpsgd" or c.bands == 1:
        return ("dpsgd", None, c.min_sep)
    return (c.kind, c.bands, c.min_sep)


def _same_mechanism(a: Candidate, b: Candidate) -> bool:
    """The same mechanism under another accountant (at the same b the accountants differ only in
    how tightly they bound the same noise), or under another name (`_mechanism`)."""
    return _mechanism(a) == _mechanism(b)


def score_summary(result: PlanResult, top: int = 5) -> dict:
    """What the plan ranked by and why its recommendation wins: the score (closed-loop error of
    the final model at κ, arXiv 2310.06771, or RMSE at the target ε without κ), κ and its source,
    what the score assumes, the recommendation against the runner-up (the best-ranked candidate
    of another kind, band count or sampler separation), and the ranking the plain RMSE gives
    beside it.

    Args:
        result: the plan.
        top: how many candidates of the plain-RMSE ranking to list.

    Returns:
        ``{"name", "formula", "kappa", "kappa_source", "kappa_details", "assumes", "warnings",
        "recommended", "runner_up", "margin", "rmse_ranking"}`` (``margin``: the runner-up's score
        over the pick's, minus 1).
    """
    req, best = result.request, result.recommended
    damping = req.damping
    closed = damping is not None

    def entry(c: Candidate | None) -> dict | None:
        if c is None:
            return None
        return {
            "candidate": c.label(),
            "min_sep": c.min_sep,
            "score": c.score,
            "rank": c.rank,
            "rmse": c.rmse,
            "rmse_rank": c.rmse_rank,
            "closed_loop_error": c.closed_loop_error,
        }

    ranked = [c for c in result.candidates if c.fits]
    runner = (
        None if best is None else next((c for c in ranked if not _same_mechanism(c, best)), None)
    )
    by_rmse = sorted(ranked, key=lambda c: c.rmse_rank)
    return {
        "name": "closed-loop final error" if closed else "rmse",
        "formula": (
            "σ · sens · ‖C⁻ᵀ r_κ‖: the final model's noise when training pulls it back by κ per "
            "round (Choquette-Choo et al., arXiv 2310.06771, linear regression)"
            if closed
            else "σ · RMSE of B = A C⁻¹ over the n iterates (000 Eq. 4)"
        ),
        "kappa": damping.kappa if closed else None,
        "kappa_source": damping.source if closed else None,
        "kappa_described": damping.describe() if closed else None,
        "kappa_details": damping.details if closed else None,
        "assumes": list(CLOSED_LOOP_ASSUMES if closed else RMSE_ASSUMES),
        "warnings": damping.warnings() if closed else [],
        "recommended": entry(best),
        "runner_up": entry(runner),
        "margin": None
        if best is None or runner is None or not best.score
        else runner.score / best.score - 1,
        "rmse_ranking": [entry(c) for c in by_rmse[:top]],
    }


def write_plan(
    result: PlanResult,
    out: Path,
    *,
    plots: bool = True,
    cache: PlanCache | None = None,
    quiet: bool = False,
) -> dict:
    """Write a plan to a directory.

    Args:
        result: the plan (`make_plan`).
        out: the directory (created).
        plots: also write the PNG plots (`corrflow.planning.plots.write_plots`).
        cache: the plan cache, for the plots.
        quiet: no progress bars.

    Returns:
        ``plan.json``'s content. ``recipe.json`` (the recommended recipe, ``corrflow schema
        recipe``) and ``factorization.npz`` are written when a candidate fits the budgets.
    """

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    recipe = _write_recipe(result, out)
    t0 = time.perf_counter()
    files = {}
    if plots and result.candidates:
        # Here, not at the top: plots imports this module (sampling_of), a cycle at import.
        from corrflow.planning.plots import write_plots

        files = write_plots(result, out, cache=cache, quiet=quiet)
    doc = _plan_document(result, recipe, files)
    doc["seconds"] = result.seconds + time.perf_counter() - t0
    write_text(
        out / "plan.json", json.dumps(doc, indent=2, sort_keys=True, default=_jsonable) + "\n"
    )
    return doc


def _write_recipe(result: PlanResult, out: Path) -> Recipe | None:
    """Write the recommended candidate's ``factorization.npz`` and ``recipe.json`` into ``out``;
    None (nothing written) when no candidate fits the budgets."""
    req, best = result.request, result.recommended
    if best is None:
        return None
    fac = result.factorizations[best.key()]
    fac.save(out / "factorization.npz")
    recipe = Recipe(
        kind=best.kind,
        bands=best.bands,
        rounds=req.rounds,
        epochs=fac.participation.epochs,
        min_sep=best.min_sep,
        participation=best.participation,
        participation_rate=best.participation_rate,
        accountant=best.accountant,
        noise_multiplier=best.noise_multiplier,
        epsilon=best.epsilon,
        delta=req.delta,
        target_epsilon=req.target_epsilon,
        population=req.population,
        cohort_size=req.cohort_size,
        momentum=req.momentum,
        cooldown_fraction=req.cooldown_fraction,
        factorization="factorization.npz",
        factorization_sha256=fac.sha256(),
        rmse=best.rmse,
        max_error=best.max_error,
        model_params=req.model_params,
        noise_state_bytes=best.noise_state_bytes,
        noise_seconds_per_round=best.noise_seconds_per_round,
        score=_recipe_score(result),
    )
    recipe.save(out / "recipe.json")
    return recipe


def _plan_document(result: PlanResult, recipe: Recipe | None, files: dict) -> dict:
    """``plan.json``'s content, less its ``seconds``."""
    req = result.request
    req_d = asdict(req)
    for key in ("memory_budget", "noise_time_budget"):
        if math.isinf(req_d[key]):
            req_d[key] = None
    doc = {
        "format": "corrflow.plan/1",
        "request": req_d,
        "participation": {
            "min_sep": req.min_sep,
            "epochs": req.epochs,
            "fixed_epoch": req.fixed_epoch,
            "rule_of_thumb_bands": req.rule_of_thumb(),
            "band_grid": req.band_grid(),
        },
        "recommended": recipe.to_dict() if recipe else None,
        "score": score_summary(result),
        "candidates": [c.to_dict() for c in result.candidates],
        "skipped": result.skipped,
        "noise_unit_costs": result.noise_cost,
        "cache": {"hits": result.cache_hits, "misses": result.cache_misses},
        "files": {
            "recipe": "recipe.json" if recipe else None,
            "factorization": "factorization.npz" if recipe else None,
            **files,
        },
    }
    if recipe is None:
        doc["error"] = "no candidate fits the memory and noise-time budgets"
    return doc


def _recipe_score(result: PlanResult) -> dict:
    """The recipe's record of the score it was chosen by and its inputs."""
    best, damping = result.recommended, result.request.damping
    return {
        "name": "closed-loop final error" if damping else "rmse",
        "value": best.score,
        "kappa": None if damping is None else damping.kappa,
        "kappa_source": None if damping is None else damping.source,
        "kappa_inputs": None
        if damping is None
        else {k: v for k, v in damping.details.items() if k != "probes"},
        "warnings": [] if damping is None else damping.warnings(),
        "closed_loop_error": best.closed_loop_error,
        "rmse_rank": best.rmse_rank,
    }


def _jsonable(x):
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"not JSON serialisable: {type(x)}")
