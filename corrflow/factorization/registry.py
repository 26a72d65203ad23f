"""The one registry of factorization kinds: how each family builds, its encoder structure, the noise
engine's mode for it, its cost per round for d model parameters, and the accountants that apply to
it.

``factorize`` (build.py), the noise engine's default mode, the planner (``corrflow plan``) and the
CLI help read this table instead of branching on kind names. Costs follow the engine's modes (001
§4.3, 003 §8): a ``banded`` C with p bands keeps a float32 ring buffer of p − 1 model-sized vectors
and draws one fresh vector per round; a banded inverse (003) keeps no buffer and regenerates p draws
per round; ``dense`` keeps none and regenerates all t + 1 draws in round t (O(t·d) work); a BLT with
B buffers (arXiv 2404.16706, 2408.08868) keeps B·d float32 and draws one vector per round; DP-SGD
draws one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from corrflow.errors import require
from corrflow.factorization.banded import optimize_banded
from corrflow.factorization.baselines import encoder_from_gram, fft_encoder, tree_encoder
from corrflow.factorization.blt import optimize_blt
from corrflow.factorization.closed_forms import best_gamma, bifr_encoder, bsr_encoder
from corrflow.factorization.dense import optimize_dense
from corrflow.factorization.encoders import BandedEncoder, BLTEncoder, Encoder, ToeplitzEncoder
from corrflow.factorization.participation import Participation
from corrflow.factorization.toeplitz import optimize_toeplitz, taper_coefficients
from corrflow.factorization.workloads import Workload
from corrflow.progress import ProgressCallback


@dataclass(frozen=True)
class BuildRequest:
    """What a family's builder receives: the (inner, unstamped) participation, workload and its
    parameters."""

    workload: Workload
    participation: Participation
    bands: int  # p (the default min(min_sep, rounds) when not given)
    buffers: int | None = None  # B for a BLT (None: chosen by the optimiser)
    gamma: float | None = None
    search_gamma: bool = False
    taper: int | None = None
    tol: float = 5e-4
    # dense: stop the optimizer after this many seconds (gap reported)
    time_budget: float | None = None
    # dense: stop the optimizer after this many iterations (deterministic)
    max_iterations: int | None = None
    callback: ProgressCallback | None = None


Builder = Callable[[BuildRequest], tuple[Encoder, dict]]


@dataclass(frozen=True)
class KindSpec:
    """One factorization family.

    ``structure``: the encoder class it produces (toeplitz, banded, banded-inverse, blt, dense);
    ``noise_mode``: the engine's default mode for it; ``takes_bands`` / ``takes_gamma`` /
    ``takes_buffers``: which parameters are meaningful; ``accountants``: those that can analyse it
    (cyclic-poisson and monte-carlo need a banded C with at most min-sep bands; mmcc needs a
    non-negative C and is fast only for Toeplitz C, whose rows share privacy-loss distributions);
    ``fixed_epoch_only``: the builder needs (k, n/k) fixed-epoch participation."""

    name: str
    description: str
    structure: str
    noise_mode: str
    build: Builder
    takes_bands: bool = False
    takes_gamma: bool = False
    accountants: tuple[str, ...] = ("unamplified",)
    fixed_epoch_only: bool = False
    takes_buffers: bool = False

    def size_of(self, encoder: Encoder) -> int | None:
        """The size the cost methods take for a built encoder: its bands, or its buffers for a
        BLT."""
        return encoder.buffers if isinstance(encoder, BLTEncoder) else encoder.bands

    def noise_state_bytes(self, bands: int | None, dim: int, rounds: int) -> int:
        """Memory the noise engine keeps for ``dim`` parameters: the banded ring buffer of (p − 1)·d
        float32 (``CorrelatedNoise.buffer_bytes``), a BLT's B·d float32 buffers (``bands`` = B, see
        `size_of`), or dense mode's n×n float64 C⁻¹; O(d) modes keep no extra state."""
        if self.noise_mode == "banded":
            return 4 * dim * max((bands or 1) - 1, 0)
        if self.noise_mode == "blt":
            return 4 * dim * (bands or 1)
        if self.noise_mode == "dense":
            return 8 * rounds * rounds
        return 0

    def draws_per_round(self, bands: int | None, rounds: int) -> float:
        """Mean model-sized Gaussian vectors generated per round (the engine's dominant cost)."""
        if self.noise_mode == "banded-inverse":
            p = bands or 1
            return float(np.mean(np.minimum(np.arange(1, rounds + 1), p)))
        if self.noise_mode == "dense":
            return (rounds + 1) / 2.0
        return 1.0

    def multiply_adds_per_round(self, bands: int | None, rounds: int) -> float:
        """Mean model-sized multiply-adds per round beyond the draws (the banded recursion's p − 1
        terms; a BLT's B to combine its buffers and B to update them)."""
        if self.noise_mode == "banded":
            return float(max((bands or 1) - 1, 0))
        if self.noise_mode == "blt":
            return 2.0 * (bands or 1)
        return self.draws_per_round(bands, rounds) - 1.0


def _dpsgd(req: BuildRequest):
    return ToeplitzEncoder(np.ones(1), req.participation.rounds), {}


def _tree(req: BuildRequest):
    return tree_encoder(req.participation.rounds), {"decoder": "optimal"}


def _fft(req: BuildRequest):
    return fft_encoder(req.participation.rounds), {"decoder": "optimal"}


def _dense(req: BuildRequest):

    extra = {} if req.max_iterations is None else {"max_iterations": req.max_iterations}
    res = optimize_dense(
        req.workload,
        req.participation,
        tol=req.tol,
        callback=req.callback,
        time_budget=req.time_budget,
        **extra,
    )
    return encoder_from_gram(res.X), {
        "iterations": res.iterations,
        "converged": res.converged,
        "lower_bound": res.lower_bound,
        "relative_gap": res.relative_gap,
    }


def _toeplitz(req: BuildRequest):

    inner, p, wl = req.participation, req.bands, req.workload
    # A learning-rate schedule is not Toeplitz: optimise θ for the Toeplitz part (001 Prop. E.1
    # covers it).
    res = optimize_toeplitz(
        wl.toeplitz_part(),
        inner.rounds,
        p,
        inner.min_sep,
        inner.max_participations,
        callback=req.callback,
    )
    # Column normalisation (001 §3.2) keeps the exact √k sensitivity only when bands ≤ min_sep.
    normalize = p <= inner.min_sep and req.taper is None
    coef = res.coef if req.taper is None else taper_coefficients(res.coef, req.taper)
    meta = {
        "iterations": res.iterations,
        "column_normalized": normalize,
        "optimized_for": wl.toeplitz_part().to_dict(),
    }
    if req.taper is not None:
        meta["taper_lower_min_sep"] = int(req.taper)
    return ToeplitzEncoder(coef, inner.rounds, column_normalize=normalize), meta


def _banded(req: BuildRequest):

    res = optimize_banded(req.workload, req.participation.rounds, req.bands, callback=req.callback)
    return BandedEncoder(res.band), {"iterations": res.iterations}


def _inverse_banded(kind: str) -> Builder:
    def build(req: BuildRequest):
        m, wl = req.participation.rounds, req.workload
        p = 2 if kind == "lambda-cgd" else req.bands
        if kind == "bisr":
            g = 0.5
        elif req.gamma is not None:
            g = req.gamma
        else:
            g = best_gamma(lambda x: bifr_encoder(wl, m, p, x), wl, req.participation)[0]
        return bifr_encoder(wl, m, p, g), {"gamma": g, "noising_bands": p}

    return build


def _bsr(req: BuildRequest):
    # γ = 1/2 (BSR) unless given; search_gamma turns it into γ-BFR (003)
    m, wl = req.participation.rounds, req.workload
    if req.gamma is not None:
        g = req.gamma
    elif req.search_gamma:
        g = best_gamma(lambda x: bsr_encoder(wl, m, req.bands, x), wl, req.participation)[0]
    else:
        g = 0.5
    return bsr_encoder(wl, m, req.bands, g), {"gamma": g}


def _blt(req: BuildRequest):

    res = optimize_blt(req.workload, req.participation, req.buffers, callback=req.callback)
    enc = BLTEncoder(
        res.buf_decay, res.output_scale, req.participation.rounds, inverse_decay=res.inverse_decay
    )
    # buffers_requested: a given B is a cap; buffers (the effective count) is fewer when the extra
    # ones would duplicate a pole or be dead (optimize_blt's MERGE_RTOL).
    return enc, {
        "buffers": enc.buffers,
        "buffers_requested": req.buffers,
        "iterations": res.iterations,
        "optimized_for": res.optimized_for.to_dict(),
        "loss_by_buffers": {str(b): v for b, v in res.losses_by_buffers.items()},
        "buf_decay": enc.buf_decay.tolist(),
        "output_scale": enc.output_scale.tolist(),
        "pillutla_score": float(np.sum(enc.output_scale / enc.buf_decay)),
    }


_BANDED_ACCOUNTANTS = ("unamplified", "cyclic-poisson", "mmcc", "monte-carlo")

REGISTRY: dict[str, KindSpec] = {
    s.name: s
    for s in (
        KindSpec(
            "dpsgd",
            "DP-SGD: independent noise each round (C = I)",
            "toeplitz",
            "identity",
            _dpsgd,
            accountants=_BANDED_ACCOUNTANTS,
        ),
        KindSpec(
            "tree", "binary-tree aggregation with the optimal decoder", "dense", "dense", _tree
        ),
        KindSpec(
            "dense",
            "optimal multi-epoch dense factorization (000)",
            "dense",
            "dense",
            _dense,
            fixed_epoch_only=True,
        ),
        KindSpec(
            "banded",
            "optimal p-banded C (001, BandMF)",
            "banded",
            "banded",
            _banded,
            takes_bands=True,
            accountants=_BANDED_ACCOUNTANTS,
        ),
        KindSpec(
            "toeplitz",
            "optimal p-banded Toeplitz C (001 App. E)",
            "toeplitz",
            "banded",
            _toeplitz,
            takes_bands=True,
            accountants=_BANDED_ACCOUNTANTS,
        ),
        KindSpec(
            "bisr",
            "banded inverse square root (003, γ = 1/2)",
            "banded-inverse",
            "banded-inverse",
            _inverse_banded("bisr"),
            takes_bands=True,
        ),
        KindSpec(
            "bifr",
            "γ-BIFR: banded inverse, γ searched (003)",
            "banded-inverse",
            "banded-inverse",
            _inverse_banded("bifr"),
            takes_bands=True,
            takes_gamma=True,
        ),
        KindSpec(
            "bsr",
            "banded square root (BSR; γ-BFR with --search-gamma)",
            "toeplitz",
            "banded",
            _bsr,
            takes_bands=True,
            takes_gamma=True,
            accountants=_BANDED_ACCOUNTANTS,
        ),
        KindSpec(
            "lambda-cgd",
            "λ-CGD: 2-banded inverse, γ searched (003)",
            "banded-inverse",
            "banded-inverse",
            _inverse_banded("lambda-cgd"),
            takes_gamma=True,
        ),
        KindSpec(
            "fft", "FFT (circulant) mechanism with the optimal decoder", "dense", "dense", _fft
        ),
        # A BLT's C is Toeplitz, positive and non-increasing but not banded: MMCC applies, the
        # banded reductions do not.
        KindSpec(
            "blt",
            "buffered linear Toeplitz (BLT): B buffers, one draw per round (2404.16706, "
            "2408.08868)",
            "blt",
            "blt",
            _blt,
            takes_buffers=True,
            accountants=("unamplified", "mmcc"),
        ),
    )
}

KINDS = tuple(REGISTRY)
#: Kinds whose ``bands`` parameter is meaningful.
BANDED_KINDS = tuple(k for k, s in REGISTRY.items() if s.takes_bands)
GAMMA_KINDS = tuple(k for k, s in REGISTRY.items() if s.takes_gamma)
BUFFER_KINDS = tuple(k for k, s in REGISTRY.items() if s.takes_buffers)


def kind_spec(kind: str) -> KindSpec:
    """The registry entry of a factorization kind.

    Args:
        kind: one of `KINDS`.

    Returns:
        Its `KindSpec`.

    Raises:
        InvalidArgumentError: an unknown kind (the message lists the kinds).
    """
    require(kind in REGISTRY, "kind", f"one of {KINDS}", kind)
    return REGISTRY[kind]


def noise_mode_for(structure: str) -> str:
    """The noise engine's mode for an encoder structure: the mode the registry's families of that
    structure declare (banded and Toeplitz C → the banded recursion; banded inverse → regenerated
    draws; dense → dense).

    Args:
        structure: an encoder structure (``toeplitz``, ``banded``, ``banded-inverse``, ``blt``,
            ``dense``).

    Returns:
        The mode of `corrflow.noise.CorrelatedNoise`.
    """
    modes = {s.noise_mode for s in REGISTRY.values() if s.structure == structure} - {"identity"}
    require(
        len(modes) == 1,
        "structure",
        f"one of {sorted({s.structure for s in REGISTRY.values()})}",
        structure,
    )
    return modes.pop()


__all__ = [
    "BANDED_KINDS",
    "BUFFER_KINDS",
    "GAMMA_KINDS",
    "KINDS",
    "REGISTRY",
    "BuildRequest",
    "KindSpec",
    "kind_spec",
    "noise_mode_for",
]
