"""``factorize``: build a normalised `Factorization` of any supported kind (the CLI's
engine)."""

from __future__ import annotations

import time

import numpy as np

from corrflow.errors import require
from corrflow.factorization.base import Factorization, normalized
from corrflow.factorization.baselines import stamp_encoder
from corrflow.factorization.blt import MAX_BUFFERS
from corrflow.factorization.participation import Participation
from corrflow.factorization.registry import (
    BANDED_KINDS,
    BUFFER_KINDS,
    GAMMA_KINDS,
    KINDS,
    BuildRequest,
    kind_spec,
)
from corrflow.factorization.workloads import Workload
from corrflow.progress import ProgressCallback


def participation_for(
    rounds: int, epochs: int = 1, min_sep: int | None = None, kind: str | None = None
) -> Participation:
    """The participation pattern for ``rounds`` rounds (000 §2; b-min-sep as in 004).

    Args:
        rounds: n.
        epochs: k, the most participations of one user.
        min_sep: b, the fewest rounds between two participations (default n/k: fixed-epoch).
        kind: ``"fixed-epoch"`` or ``"min-sep"`` to force one; default inferred (fixed-epoch when
            b·k = n).

    Returns:
        Fixed-epoch (k, n/k) participation unless a different min-sep is given, then
        b-min-separation with at most k participations.
    """
    if kind == "fixed-epoch" or (kind is None and (min_sep is None or min_sep * epochs == rounds)):
        p = Participation.fixed_epoch(rounds, epochs)
        require(
            min_sep is None or min_sep == p.min_sep,
            "min-sep",
            f"rounds/epochs = {p.min_sep} for fixed-epoch participation",
            min_sep,
        )
        return p
    require(min_sep is not None, "min-sep", "a value for min-sep participation")
    return Participation.min_separation(rounds, min_sep, epochs)


def factorize(
    kind: str,
    participation: Participation,
    workload: Workload | None = None,
    *,
    bands: int | None = None,
    stamps: int = 1,
    gamma: float | None = None,
    taper: int | None = None,
    search_gamma: bool = False,
    tol: float = 5e-4,
    time_budget: float | None = None,
    buffers: int | None = None,
    callback: ProgressCallback | None = None,
    max_iterations: int | None = None,
) -> Factorization:
    """Build and normalise (sensitivity 1 under ``participation``) a factorization of ``kind``.

    Args:
        kind: one of `KINDS` (the registry, `corrflow.factorization.registry`).
        participation: the (k, b) pattern the sensitivity is computed for (`participation_for`).
        workload: A (default: prefix sums).
        bands: bands of C (banded, toeplitz, bsr) or of C⁻¹ (bisr, bifr); default the kind's own.
        stamps: repeat a rounds/stamps mechanism along the diagonal (see below).
        gamma: γ for bifr, bsr and lambda-cgd (see below).
        taper: b₀ of the 001 App. H taper (toeplitz only).
        search_gamma: bsr: search γ (the γ-BFR family of 003).
        tol: the optimizers' relative tolerance.
        time_budget: dense only: seconds after which the optimizer stops.
        buffers: blt only: B, the BLT's buffers.
        callback: progress callback of the iterative optimizers.

    Returns:
        A `Factorization` whose encoder C (n × n) has sensitivity 1, exact or an upper bound as
        labelled.

    ``taper`` = b₀ (toeplitz only) applies the 001 App. H taper for a min-sep known only to lie in
    [b₀, bands]; the encoder is then left column-unnormalised, as in 001 App. H. ``stamps`` > 1
    builds the mechanism for rounds/stamps rounds (epochs/stamps participations) and repeats it
    along the diagonal (000 App. D.4). ``gamma`` fixes γ for bifr/bsr/lambda-cgd; by default γ is
    searched for bifr and lambda-cgd and is 1/2 for bsr unless ``search_gamma`` (then bsr is the
    γ-BFR family of 003). ``time_budget`` (dense only): seconds after which the optimizer stops
    (``converged`` false, the duality gap in the metadata; load-dependent); ``max_iterations``
    (dense only): the deterministic budget instead. ``buffers`` (blt only): B, the BLT's buffers; by
    default the optimiser adds buffers while each lowers the loss by more than 1%. How each kind
    builds lives in `corrflow.factorization.registry`.
    """
    require(kind in KINDS, "kind", f"one of {KINDS}", kind)
    workload = workload or Workload.prefix()
    _check_options(kind, participation.rounds, bands, stamps, taper, buffers, gamma)
    inner = _inner_participation(participation, stamps)
    spec = kind_spec(kind)
    m = inner.rounds
    p = bands if bands is not None else min(inner.min_sep, m)
    start = time.perf_counter()
    enc, built = spec.build(
        BuildRequest(
            workload,
            inner,
            p,
            buffers=buffers,
            gamma=gamma,
            search_gamma=search_gamma,
            taper=taper,
            tol=tol,
            time_budget=time_budget,
            callback=callback,
            max_iterations=max_iterations,
        )
    )
    meta: dict = {"stamps": stamps, **built}
    if stamps != 1 and "lower_bound" in meta:
        meta["lower_bound"] = None  # the dual bound bounds the unstamped problem only
    enc = stamp_encoder(enc, stamps)
    meta["seconds"] = time.perf_counter() - start
    return normalized(kind, workload, participation, enc, meta)


def _check_options(
    kind: str,
    n: int,
    bands: int | None,
    stamps: int,
    taper: int | None,
    buffers: int | None,
    gamma: float | None,
) -> None:
    """Refuse, naming the option, a ``factorize`` option that ``kind`` does not take or a value out
    of its range."""
    require(
        isinstance(stamps, int | np.integer) and stamps >= 1 and n % stamps == 0,
        "stamps",
        f"a positive divisor of rounds={n}",
        stamps,
    )
    if bands is not None:
        require(kind in BANDED_KINDS, "bands", f"only with kinds {BANDED_KINDS}", bands)
        require(
            isinstance(bands, int | np.integer) and 1 <= bands <= n // stamps,
            "bands",
            f"an integer between 1 and rounds/stamps = {n // stamps}",
            bands,
        )
    require(
        taper is None or (kind == "toeplitz" and stamps == 1),
        "taper",
        "only with kind toeplitz (no stamps)",
        taper,
    )
    if buffers is not None:
        require(kind in BUFFER_KINDS, "buffers", f"only with kinds {BUFFER_KINDS}", buffers)
        require(
            isinstance(buffers, int | np.integer)
            and not isinstance(buffers, bool)
            and 1 <= buffers <= MAX_BUFFERS,
            "buffers",
            f"an integer between 1 and {MAX_BUFFERS}",
            buffers,
        )
    if gamma is not None:
        require(kind in GAMMA_KINDS, "gamma", f"only with kinds {', '.join(GAMMA_KINDS)}", gamma)
        require(0.0 <= gamma <= 1.0, "gamma", "a number in [0, 1]", gamma)


def _inner_participation(participation: Participation, stamps: int) -> Participation:
    if stamps == 1:
        return participation
    m = participation.rounds // stamps
    if participation.kind == "fixed-epoch":
        require(
            participation.epochs % stamps == 0 or participation.epochs < stamps,
            "stamps",
            f"a divisor of epochs={participation.epochs} (each stamp covers whole epochs)",
            stamps,
        )
        return Participation.fixed_epoch(m, max(1, participation.epochs // stamps))
    return Participation.min_separation(m, min(participation.min_sep, m))


__all__ = ["BANDED_KINDS", "KINDS", "factorize", "participation_for", "Factorization"]
