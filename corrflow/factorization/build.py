"""``factorize``: build a normalised :class:`Factorization` of any supported kind (the CLI's engine)."""

from __future__ import annotations

import time

import numpy as np

from corrflow.errors import require
from corrflow.factorization.banded import optimize_banded
from corrflow.factorization.base import Factorization, normalized
from corrflow.factorization.baselines import encoder_from_gram, fft_encoder, stamp_encoder, tree_encoder
from corrflow.factorization.closed_forms import best_gamma, bifr_encoder, bsr_encoder
from corrflow.factorization.dense import optimize_dense
from corrflow.factorization.encoders import BandedEncoder, Encoder, ToeplitzEncoder
from corrflow.factorization.participation import Participation
from corrflow.factorization.toeplitz import optimize_toeplitz, taper_coefficients
from corrflow.factorization.workloads import Workload
from corrflow.progress import ProgressCallback

KINDS = ("dpsgd", "tree", "dense", "banded", "toeplitz", "bisr", "bifr", "bsr", "lambda-cgd", "fft")
#: Kinds whose ``bands`` parameter is meaningful, and its default.
BANDED_KINDS = ("banded", "toeplitz", "bisr", "bifr", "bsr")


def participation_for(rounds: int, epochs: int = 1, min_sep: int | None = None,
                      kind: str | None = None) -> Participation:
    """Fixed-epoch (k, n/k) unless a different min-sep is given (then b-min-sep with ≤ k participations)."""
    if kind == "fixed-epoch" or (kind is None and (min_sep is None or min_sep * epochs == rounds)):
        p = Participation.fixed_epoch(rounds, epochs)
        require(min_sep is None or min_sep == p.min_sep, "min-sep", f"rounds/epochs = {p.min_sep} for fixed-epoch "
                "participation", min_sep)
        return p
    require(min_sep is not None, "min-sep", "a value for min-sep participation")
    return Participation.min_separation(rounds, min_sep, epochs)


def factorize(kind: str, participation: Participation, workload: Workload | None = None, *,
              bands: int | None = None, stamps: int = 1, gamma: float | None = None, taper: int | None = None,
              search_gamma: bool = False, tol: float = 5e-4, callback: ProgressCallback | None = None) -> Factorization:
    """Build and normalise (sensitivity 1 under ``participation``) a factorization of ``kind``.

    ``taper`` = b₀ (toeplitz only) applies the 001 App. H taper for a min-sep known only to lie in
    [b₀, bands]; the encoder is then left column-unnormalised, as in the digest's check values.
    ``stamps`` > 1 builds the mechanism for rounds/stamps rounds (epochs/stamps participations) and repeats it
    along the diagonal (000 App. D.4). ``gamma`` fixes γ for bifr/bsr/lambda-cgd; by default γ is searched for
    bifr and lambda-cgd and is 1/2 for bsr unless ``search_gamma`` (then bsr is the γ-BFR family of 003).
    """
    require(kind in KINDS, "kind", f"one of {KINDS}", kind)
    workload = workload or Workload.prefix()
    n = participation.rounds
    require(isinstance(stamps, int | np.integer) and stamps >= 1 and n % stamps == 0, "stamps",
            f"a positive divisor of rounds={n}", stamps)
    if bands is not None:
        require(kind in BANDED_KINDS, "bands", f"only with kinds {BANDED_KINDS}", bands)
        require(isinstance(bands, int | np.integer) and 1 <= bands <= n // stamps, "bands",
                f"an integer between 1 and rounds/stamps = {n // stamps}", bands)
    require(taper is None or (kind == "toeplitz" and stamps == 1), "taper", "only with kind toeplitz (no stamps)",
            taper)
    if gamma is not None:
        require(kind in ("bifr", "bsr", "lambda-cgd"), "gamma", "only with kinds bifr, bsr, lambda-cgd", gamma)
        require(0.0 <= gamma <= 1.0, "gamma", "a number in [0, 1]", gamma)
    inner = _inner_participation(participation, stamps)
    m = inner.rounds
    p = bands if bands is not None else min(inner.min_sep, m)
    meta: dict = {"stamps": stamps}
    start = time.perf_counter()
    enc: Encoder
    if kind == "dpsgd":
        enc = ToeplitzEncoder(np.ones(1), m)
    elif kind == "tree":
        enc = tree_encoder(m)
        meta["decoder"] = "optimal"
    elif kind == "fft":
        enc = fft_encoder(m)
        meta["decoder"] = "optimal"
    elif kind == "dense":
        res = optimize_dense(workload, inner, tol=tol, callback=callback)
        enc = encoder_from_gram(res.X)
        meta.update(iterations=res.iterations, converged=res.converged,
                    lower_bound=res.lower_bound if stamps == 1 else None,  # bounds the unstamped problem only
                    relative_gap=res.relative_gap)
    elif kind == "toeplitz":
        # A learning-rate schedule is not Toeplitz: optimise θ for the Toeplitz part (001 Prop. E.1 covers it).
        res = optimize_toeplitz(workload.toeplitz_part(), m, p, inner.min_sep, inner.max_participations,
                                callback=callback)
        # Column normalisation (001 §3.2) keeps the exact √k sensitivity only when bands ≤ min_sep.
        normalize = p <= inner.min_sep and taper is None
        coef = res.coef if taper is None else taper_coefficients(res.coef, taper)
        enc = ToeplitzEncoder(coef, m, column_normalize=normalize)
        meta.update(iterations=res.iterations, column_normalized=normalize,
                    optimized_for=workload.toeplitz_part().to_dict())
        if taper is not None:
            meta["taper_lower_min_sep"] = int(taper)
    elif kind == "banded":
        res = optimize_banded(workload, m, p, callback=callback)
        enc = BandedEncoder(res.band)
        meta["iterations"] = res.iterations
    elif kind in ("bisr", "bifr", "lambda-cgd"):
        if kind == "lambda-cgd":
            p = 2
        if kind == "bisr":
            g = 0.5
        elif gamma is not None:
            g = gamma
        else:
            g = best_gamma(lambda x: bifr_encoder(workload, m, p, x), workload, inner)[0]
        enc = bifr_encoder(workload, m, p, g)
        meta.update(gamma=g, noising_bands=p)
    else:  # bsr: γ = 1/2 (BSR) unless given; search_gamma turns it into γ-BFR (003)
        if gamma is not None:
            g = gamma
        elif search_gamma:
            g = best_gamma(lambda x: bsr_encoder(workload, m, p, x), workload, inner)[0]
        else:
            g = 0.5
        enc = bsr_encoder(workload, m, p, g)
        meta["gamma"] = g
    enc = stamp_encoder(enc, stamps)
    meta["seconds"] = time.perf_counter() - start
    return normalized(kind, workload, participation, enc, meta)


def _inner_participation(participation: Participation, stamps: int) -> Participation:
    if stamps == 1:
        return participation
    m = participation.rounds // stamps
    if participation.kind == "fixed-epoch":
        require(participation.epochs % stamps == 0 or participation.epochs < stamps, "stamps",
                f"a divisor of epochs={participation.epochs} (each stamp covers whole epochs)", stamps)
        return Participation.fixed_epoch(m, max(1, participation.epochs // stamps))
    return Participation.min_separation(m, min(participation.min_sep, m))


__all__ = ["KINDS", "factorize", "participation_for", "Factorization"]
