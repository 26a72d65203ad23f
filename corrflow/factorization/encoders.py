"""Encoders C (strategy matrices) with the structure that makes noise and error computations cheap.

Every encoder is lower-triangular and invertible, acts on the round axis (axis 0), and offers
``solve`` (C⁻¹ z, the gradient-space noise of 000 §4.4 / 001 Alg. 1), ``gram`` (X = CᵀC),
``column_norms`` and, where the structure allows it, an O(n·bands) sensitivity and error:

* `DenseEncoder`          any lower-triangular C (optimal multi-epoch, tree, FFT, stamped);
* `BandedEncoder`         C with ``bands`` non-zero diagonals (BandMF, 001 §2.2), column
  layout;
* `ToeplitzEncoder`       banded Toeplitz C, optionally column-normalised (001 §3.1–3.2);
* `InverseToeplitzEncoder` C whose inverse (the noising matrix) is banded Toeplitz (003:
  BISR, γ-BIFR, DP-λCGD);
* `BLTEncoder`            buffered linear Toeplitz C (arXiv 2404.16706, 2408.08868): C and
  C⁻¹ are both sums of B geometric sequences, applied in O(n·B) with B buffers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np
from scipy.linalg import solve_banded, solve_triangular

from corrflow.errors import InvalidArgumentError, require
from corrflow.factorization.blt import (
    blt_coefs,
    inverse_decays,
    pole_weights,
    validate_blt,
    workload_row_errors,
)
from corrflow.factorization.filters import lfilter
from corrflow.factorization.participation import Participation
from corrflow.factorization.sensitivity import (
    Sensitivity,
    is_nonneg_nonincreasing,
    sensitivity_from_gram,
    toeplitz_min_sep_sensitivity,
    vec_sens,
)
from corrflow.factorization.workloads import Workload

#: Above this many rounds the O(n²)-memory fallbacks (Gram matrix, dense C) are refused with a clear
# error.
DENSE_LIMIT = 8192


def _check_matrix_values(M: np.ndarray, field: str) -> None:
    require(bool(np.all(np.isfinite(M))), field, "finite entries (no NaN or Inf)")


class Encoder(ABC):
    """A lower-triangular, invertible n×n encoder C acting along axis 0."""

    structure: ClassVar[str]
    n: int

    @property
    def bands(self) -> int | None:
        """Non-zero diagonals of C (banded), of C⁻¹ (banded-inverse), or None (dense)."""
        return None

    @abstractmethod
    def solve(self, z: np.ndarray) -> np.ndarray:
        """C⁻¹ z along axis 0 (z has n rows)."""

    @abstractmethod
    def matrix(self) -> np.ndarray:
        """The dense n×n C (float64)."""

    @abstractmethod
    def scaled(self, factor: float) -> Encoder:
        """The encoder factor·C."""

    @abstractmethod
    def arrays(self) -> dict[str, np.ndarray]:
        """Arrays that define the encoder (saved in the factorization file)."""

    def params(self) -> dict:
        """JSON-able non-array parameters."""
        return {}

    def column_norms(self) -> np.ndarray:
        return np.linalg.norm(self.matrix(), axis=0)

    def columns(self, idx) -> np.ndarray:
        """C[:, idx] (n × len(idx)); structured encoders build only those columns."""
        require(self.n <= DENSE_LIMIT, "rounds", f"at most {DENSE_LIMIT} to materialise C", self.n)
        return self.matrix()[:, list(idx)]

    def _columns_from_band(self, band_rows: np.ndarray, idx) -> np.ndarray:
        """Columns whose non-zeros start on the diagonal: column j = band_rows[c] placed at rows j,
        j+1, …"""
        idx = list(idx)
        out = np.zeros((self.n, len(idx)))
        for c, j in enumerate(idx):
            m = min(band_rows.shape[1], self.n - j)
            out[j : j + m, c] = band_rows[c, :m]
        return out

    def gram(self) -> np.ndarray:
        require(
            self.n <= DENSE_LIMIT,
            "rounds",
            f"at most {DENSE_LIMIT} for a dense Gram matrix",
            self.n,
        )
        C = self.matrix()
        return C.T @ C

    def sensitivity(self, participation: Participation) -> Sensitivity:
        """Sensitivity under ``participation``: structural exact formula when one applies, else via
        X = CᵀC."""
        require(
            participation.rounds == self.n,
            "rounds",
            f"{self.n} (the encoder's size)",
            participation.rounds,
        )
        fast = self._structured_sensitivity(participation)
        if fast is not None:
            return fast
        require(
            self.n <= DENSE_LIMIT,
            "rounds",
            f"at most {DENSE_LIMIT} for the general sensitivity computation "
            f"of a {self.structure} encoder with this participation",
            self.n,
        )
        return sensitivity_from_gram(self.gram(), participation)

    def _structured_sensitivity(self, participation: Participation) -> Sensitivity | None:
        return None

    def per_query_error(self, workload: Workload) -> np.ndarray:
        """Squared row norms of B = A C⁻¹ (unit noise, unit sensitivity factor). Blockwise, O(n²)
        per block."""
        return _per_query_generic(self, workload)

    def noise_row_norms(self) -> np.ndarray:
        """‖(C⁻¹)_{t,:}‖₂ for t < n: the standard deviation of each coordinate of the noise w_t =
        (C⁻¹Z)_t of round t at unit σ and clip (Z i.i.d. N(0, 1); the diagonal of the noise
        covariance C⁻¹C⁻ᵀ). Blockwise solves of identity columns, O(n²) per block; Toeplitz-like
        encoders override it in O(n). Cached on the encoder (it is immutable).

        Returns:
            float64 array of shape (n,), read-only.
        """
        cached = getattr(self, "_noise_row_norms", None)
        if cached is None:
            cached = np.sqrt(self._noise_row_norms_squared())
            cached.setflags(write=False)
            self._noise_row_norms = cached
        return cached

    def _noise_row_norms_squared(self) -> np.ndarray:
        n = self.n
        m = int(max(1, min(n, (1 << 26) // (8 * n))))
        acc = np.zeros(n)
        for j0 in range(0, n, m):
            cols = min(m, n - j0)
            E = np.zeros((n, cols))
            E[j0 + np.arange(cols), np.arange(cols)] = 1.0
            acc += np.sum(self.solve(E) ** 2, axis=1)
        return acc

    def _disjoint_sensitivity(self, participation: Participation) -> Sensitivity:
        """Exact when X has bandwidth ≤ min_sep: contributions of one user hit disjoint rows (001
        §1.3)."""
        d = self.column_norms() ** 2
        if participation.kind == "fixed-epoch":
            k, b = participation.epochs, participation.min_sep
            s2 = float(d.reshape(k, b).sum(axis=0).max())
        else:
            s2 = float(vec_sens(d, participation.min_sep, participation.max_participations))
        return Sensitivity(float(np.sqrt(s2)), True, "banded-disjoint-columns")


def _per_query_generic(
    encoder: Encoder, workload: Workload, block_bytes: int = 1 << 26
) -> np.ndarray:
    n = encoder.n
    m = int(max(1, min(n, block_bytes // (8 * n))))
    acc = np.zeros(n)
    for j0 in range(0, n, m):
        cols = min(m, n - j0)
        E = np.zeros((n, cols))
        E[j0 + np.arange(cols), np.arange(cols)] = 1.0
        acc += np.sum(workload.apply(encoder.solve(E)) ** 2, axis=1)
    return acc


class DenseEncoder(Encoder):
    """Any lower-triangular n × n encoder C, stored in full (float64); the noise engine's ``dense``
    mode.

    Args:
        C: the square encoder matrix (lower-triangular, invertible), shape (n, n).
    """

    structure = "dense"

    def __init__(self, C: np.ndarray):
        C = np.array(C, dtype=np.float64)
        require(C.ndim == 2 and C.shape[0] == C.shape[1], "encoder", "a square matrix", C.shape)
        _check_matrix_values(C, "encoder")
        scale = max(float(np.abs(C).max()), 1e-300)
        require(
            bool(np.all(np.abs(np.triu(C, 1)) <= 1e-12 * scale)),
            "encoder",
            "a lower-triangular matrix (the noise must be streamable round by round)",
        )
        C = np.tril(C)
        diag = np.abs(np.diag(C))
        require(
            bool(diag.min() > 1e-12 * scale),
            "encoder",
            "a non-singular matrix (non-zero diagonal)",
            float(diag.min()),
        )
        self.C = C
        self.n = C.shape[0]

    def solve(self, z):
        return solve_triangular(
            self.C, np.asarray(z, dtype=np.float64), lower=True, check_finite=False
        )

    def matrix(self):
        return self.C.copy()

    def gram(self):
        return self.C.T @ self.C

    def columns(self, idx):
        return self.C[:, list(idx)]

    def column_norms(self):
        return np.linalg.norm(self.C, axis=0)

    def scaled(self, factor):
        return DenseEncoder(self.C * factor)

    def arrays(self):
        return {"C": self.C}

    def per_query_error(self, workload):
        require(
            self.n <= DENSE_LIMIT, "rounds", f"at most {DENSE_LIMIT} for a dense encoder", self.n
        )
        # B = A C⁻¹, i.e. Bᵀ = C⁻ᵀ Aᵀ: one triangular solve with all of Aᵀ.
        Bt = solve_triangular(
            self.C, workload.matrix(self.n).T, lower=True, trans="T", check_finite=False
        )
        return np.sum(Bt**2, axis=0)


class BandedEncoder(Encoder):
    """Banded C stored by columns: ``band[j, r] = C[j + r, j]`` (the n×bands layout of 001 §2.2)."""

    structure = "banded"

    def __init__(self, band: np.ndarray):
        band = np.array(band, dtype=np.float64)
        require(
            band.ndim == 2 and band.shape[1] >= 1, "encoder", "an (n, bands) band array", band.shape
        )
        _check_matrix_values(band, "encoder")
        n, p = band.shape
        require(p <= n, "bands", f"at most rounds={n}", p)
        out_of_range = np.arange(n)[:, None] + np.arange(p)[None, :] >= n
        band[out_of_range] = 0.0
        scale = max(float(np.abs(band).max()), 1e-300)
        require(
            bool(np.abs(band[:, 0]).min() > 1e-12 * scale),
            "encoder",
            "a non-singular matrix (non-zero diagonal)",
            float(np.abs(band[:, 0]).min()),
        )
        self.band = band
        self.n = n

    @property
    def bands(self):
        return self.band.shape[1]

    def solve(self, z):
        z = np.asarray(z, dtype=np.float64)
        return solve_banded((self.bands - 1, 0), self.band.T, z, check_finite=False)

    def row_band(self, t: int) -> np.ndarray:
        """C[t, t − r] for r = 0..bands−1 (0 where t − r < 0): the coefficients of 001 Alg. 1 at
        round t."""
        r = np.arange(self.bands)
        j = t - r
        return np.where(j >= 0, self.band[np.clip(j, 0, None), r], 0.0)

    def matrix(self):
        n, p = self.band.shape
        C = np.zeros((n, n))
        for r in range(p):
            idx = np.arange(n - r)
            C[idx + r, idx] = self.band[: n - r, r]
        return C

    def column_norms(self):
        return np.linalg.norm(self.band, axis=1)

    def columns(self, idx):
        return self._columns_from_band(self.band[list(idx)], idx)

    def scaled(self, factor):
        return BandedEncoder(self.band * factor)

    def arrays(self):
        return {"band": self.band}

    def _noise_row_norms_squared(self):
        if self.n > 4096:  # a dense C⁻¹ would be too large: blockwise banded solves
            return super()._noise_row_norms_squared()
        # one dense triangular solve (BLAS-3) is ten times faster than n banded ones even at 8 bands
        # (n = 2048: 0.3 against 3 CPU-s)
        inv = solve_triangular(self.matrix(), np.eye(self.n), lower=True, check_finite=False)
        return np.sum(inv * inv, axis=1)

    def _structured_sensitivity(self, participation):
        if self.bands <= participation.min_sep:
            return self._disjoint_sensitivity(participation)
        return None


def toeplitz_column_scale(coef: np.ndarray, n: int) -> np.ndarray:
    """Column scales that give a banded Toeplitz C equal column norms (001 §3.2, arXiv 2405.15913).

    Args:
        coef: θ, shape (p,).
        n: rounds.

    Returns:
        s, float64 of shape (n,): s_j = ‖θ‖ / ‖θ[:min(p, n−j)]‖, so column j times s_j has norm ‖θ‖.
    """
    sq = np.cumsum(np.asarray(coef, dtype=np.float64) ** 2)
    p = len(coef)
    lengths = np.minimum(p, n - np.arange(n))
    return np.sqrt(sq[-1] / sq[lengths - 1])


class ToeplitzEncoder(Encoder):
    """Banded Toeplitz C = T(θ)·diag(s): θ = first column (``bands`` entries); s = 1 or column
    normalisation."""

    structure = "toeplitz"

    def __init__(self, coef: np.ndarray, n: int, column_normalize: bool = False):
        coef = np.array(coef, dtype=np.float64).ravel()
        require(isinstance(n, int | np.integer) and n >= 1, "rounds", "a positive integer", n)
        require(1 <= len(coef) <= n, "bands", f"between 1 and rounds={n}", len(coef))
        _check_matrix_values(coef, "encoder")
        require(
            abs(coef[0]) > 1e-12 * max(float(np.abs(coef).max()), 1e-300),
            "encoder",
            "a non-zero leading Toeplitz coefficient (non-singular C)",
            float(coef[0]),
        )
        self.coef = coef
        self.n = int(n)
        self.column_normalize = bool(column_normalize)
        self.col_scale = (
            toeplitz_column_scale(coef, self.n) if column_normalize else np.ones(self.n)
        )

    @property
    def bands(self):
        return len(self.coef)

    def solve(self, z):
        z = np.asarray(z, dtype=np.float64)
        y = lfilter([1.0], self.coef, z, axis=0)
        if self.column_normalize:
            y = y / self.col_scale.reshape((-1,) + (1,) * (y.ndim - 1))
        return y

    def row_band(self, t: int) -> np.ndarray:
        """C[t, t − r] = θ_r·s_{t−r} for r = 0..bands−1 (0 where t − r < 0)."""
        r = np.arange(self.bands)
        j = t - r
        return np.where(j >= 0, self.coef * self.col_scale[np.clip(j, 0, None)], 0.0)

    def solve_transposed(self, v: np.ndarray) -> np.ndarray:
        """C⁻ᵀ v along axis 0: T⁻ᵀ is the time-reversed recursion."""
        v = np.asarray(v, dtype=np.float64)
        if self.column_normalize:
            v = v / self.col_scale.reshape((-1,) + (1,) * (v.ndim - 1))
        return lfilter([1.0], self.coef, v[::-1], axis=0)[::-1]

    def matrix(self):
        require(self.n <= DENSE_LIMIT, "rounds", f"at most {DENSE_LIMIT} to materialise C", self.n)
        return BandedEncoder(self.band_array()).matrix()

    def band_array(self) -> np.ndarray:
        """The (n, bands) column layout of `BandedEncoder`."""
        band = np.tile(self.coef, (self.n, 1)) * self.col_scale[:, None]
        return band

    def column_norms(self):
        sq = np.cumsum(self.coef**2)
        lengths = np.minimum(self.bands, self.n - np.arange(self.n))
        return np.sqrt(sq[lengths - 1]) * self.col_scale

    def columns(self, idx):
        idx = list(idx)
        return self._columns_from_band(np.outer(self.col_scale[idx], self.coef), idx)

    def scaled(self, factor):
        return ToeplitzEncoder(self.coef * factor, self.n, self.column_normalize)

    def arrays(self):
        return {"coef": self.coef}

    def params(self):
        return {"n": self.n, "column_normalize": self.column_normalize}

    def _structured_sensitivity(self, participation):
        if self.bands <= participation.min_sep:
            return self._disjoint_sensitivity(participation)
        if not is_nonneg_nonincreasing(self.coef):
            return None
        k = participation.max_participations
        formula = toeplitz_min_sep_sensitivity(self.coef, self.n, participation.min_sep, k)
        if not self.column_normalize:
            return Sensitivity(formula, True, "toeplitz-min-sep-closed-form")
        # Column normalisation only enlarges the last bands−1 columns, each by at most max(s):
        # entrywise bound.
        return Sensitivity(
            formula * float(self.col_scale.max()), False, "toeplitz-min-sep-scaled-bound"
        )

    def _noise_row_norms_squared(self):
        # C⁻¹ = diag(1/s)·T(θ)⁻¹ and T(θ)⁻¹ is Toeplitz with first column ĉ: row t has norm²
        # Σ_{j≤t} ĉ_j² / s_t².
        e0 = np.zeros(self.n)
        e0[0] = 1.0
        return np.cumsum(lfilter([1.0], self.coef, e0) ** 2) / self.col_scale**2

    def per_query_error(self, workload):
        if not workload.is_toeplitz:
            return _per_query_generic(self, workload)
        n, p = self.n, self.bands
        w = lfilter([1.0], self.coef, workload.toeplitz_coefs(n))
        err = np.cumsum(w**2)  # 001 Prop. D.1: query i has error Σ_{j≤i} w_j²
        if self.column_normalize and p > 1:
            lam = workload.toeplitz_coefs(n)
            tail = np.arange(max(0, n - p + 1), n)
            rows = np.zeros((n, len(tail)))  # column c = row tail[c] of A, transposed
            for c, i in enumerate(tail):
                rows[: i + 1, c] = lam[i::-1]
            err[tail] = np.sum(self.solve_transposed(rows) ** 2, axis=0)
        return err


class _ToeplitzByFirstColumn(Encoder):
    """An encoder C = T(c), lower-triangular Toeplitz, known by its first column c
    (`strategy_coefs`) and never stored dense: the banded-inverse and BLT encoders."""

    @abstractmethod
    def strategy_coefs(self) -> np.ndarray:
        """First column of C (length n)."""

    def matrix(self):
        require(self.n <= DENSE_LIMIT, "rounds", f"at most {DENSE_LIMIT} to materialise C", self.n)
        c = self.strategy_coefs()
        idx = np.arange(self.n)
        diff = idx[:, None] - idx[None, :]
        return np.where(diff >= 0, c[np.clip(diff, 0, None)], 0.0)

    def column_norms(self):
        c = self.strategy_coefs()
        return np.sqrt(np.cumsum(c**2)[::-1])

    def columns(self, idx):
        idx = list(idx)
        return self._columns_from_band(np.tile(self.strategy_coefs(), (len(idx), 1)), idx)


class InverseToeplitzEncoder(_ToeplitzByFirstColumn):
    """C with banded Toeplitz inverse: C⁻¹ = T(r), r = noising coefficients (``bands`` entries) (003
    Def. 2)."""

    structure = "banded-inverse"

    def __init__(self, noising: np.ndarray, n: int):
        r = np.array(noising, dtype=np.float64).ravel()
        require(isinstance(n, int | np.integer) and n >= 1, "rounds", "a positive integer", n)
        require(1 <= len(r) <= n, "bands", f"between 1 and rounds={n}", len(r))
        _check_matrix_values(r, "encoder")
        require(
            abs(r[0]) > 1e-12 * max(float(np.abs(r).max()), 1e-300),
            "encoder",
            "a non-zero leading noising coefficient (non-singular C)",
            float(r[0]),
        )
        self.noising = r
        self.n = int(n)

    @property
    def bands(self):
        return len(self.noising)

    def strategy_coefs(self) -> np.ndarray:
        """First column c of C = T(r)⁻¹ (length n): the impulse response of 1/r(x) (003 recursion
        (41))."""
        e0 = np.zeros(self.n)
        e0[0] = 1.0
        return lfilter([1.0], self.noising, e0)

    def solve(self, z):
        return lfilter(self.noising, [1.0], np.asarray(z, dtype=np.float64), axis=0)

    def scaled(self, factor):
        return InverseToeplitzEncoder(self.noising / factor, self.n)

    def arrays(self):
        return {"noising": self.noising}

    def params(self):
        return {"n": self.n}

    def _structured_sensitivity(self, participation):
        c = self.strategy_coefs()
        if not is_nonneg_nonincreasing(c):
            return None
        value = toeplitz_min_sep_sensitivity(
            c, self.n, participation.min_sep, participation.max_participations
        )
        return Sensitivity(value, True, "toeplitz-min-sep-closed-form")

    def _noise_row_norms_squared(self):
        r2 = np.zeros(self.n)
        r2[: self.bands] = self.noising**2
        return np.cumsum(r2)  # C⁻¹ = T(r): row t holds r_t, …, r_0

    def per_query_error(self, workload):
        if not workload.is_toeplitz:
            return _per_query_generic(self, workload)
        w = np.convolve(workload.toeplitz_coefs(self.n), self.noising)[: self.n]
        return np.cumsum(w**2)


class BLTEncoder(_ToeplitzByFirstColumn):
    """C = s·T(c) with c₀ = 1, c_k = Σ_j ω_j θ_j^(k−1): a buffered linear Toeplitz (BLT) encoder
    with B buffers (Dvijotham, McMahan, Pillutla, Steinke, Thakurta 2024, arXiv 2404.16706, Def.
    4.1; corrflow.factorization.blt).

    ``buf_decay`` θ and ``output_scale`` ω (B each) must satisfy 0 < θ < 1, ω > 0 and Σω/θ < 1, so
    that C is positive and non-increasing along its columns and C⁻¹ = T(ĉ)/s is the BLT with decays
    θ̂ ∈ (0, 1) and scales ω̂ < 0 (DMPST24 Lemma 5.2). ``scale`` s > 0 carries the sensitivity
    normalisation. ``inverse_decay`` θ̂, when given (the optimiser's pole pairs, the saved file),
    must interlace θ and reproduce ω by Lemma 5.2; otherwise it is found as the roots of the secular
    equation."""

    structure = "blt"

    def __init__(
        self,
        buf_decay: np.ndarray,
        output_scale: np.ndarray,
        n: int,
        scale: float = 1.0,
        inverse_decay: np.ndarray | None = None,
    ):
        require(isinstance(n, int | np.integer) and n >= 1, "rounds", "a positive integer", n)
        scale = (
            float(np.asarray(scale, dtype=np.float64).ravel()[0])
            if np.ndim(scale)
            else float(scale)
        )
        require(np.isfinite(scale) and scale > 0, "encoder", "a positive, finite BLT scale", scale)
        theta, omega = validate_blt(buf_decay, output_scale)
        order = np.argsort(-theta)
        self.buf_decay, self.output_scale = theta[order], omega[order]
        if inverse_decay is None:
            self.inverse_decay = inverse_decays(self.buf_decay, self.output_scale)
        else:
            th = np.sort(np.array(inverse_decay, dtype=np.float64).ravel())[::-1]
            require(
                th.shape == theta.shape and bool(np.all(np.isfinite(th))),
                "encoder",
                f"{theta.size} finite inverse decays",
                th.tolist(),
            )
            points = np.empty(2 * th.size)
            points[0::2], points[1::2] = self.buf_decay, th
            require(
                bool(points[-1] > 0 and np.all(np.diff(points) < 0)),
                "encoder",
                "inverse decays interlacing the decays: 1 > θ₁ > θ̂₁ > … > θ_B > θ̂_B > 0",
                th.tolist(),
            )
            require(
                bool(
                    np.allclose(
                        pole_weights(self.buf_decay, th), self.output_scale, rtol=1e-9, atol=0
                    )
                ),
                "encoder",
                "inverse decays consistent with the output scales (Lemma 5.2 of 2404.16706)",
            )
            self.inverse_decay = th
        self.inverse_scale = pole_weights(self.inverse_decay, self.buf_decay)
        self.scale = scale
        self.n = int(n)

    @property
    def buffers(self) -> int:
        """B: the model-sized vectors of noise state the streaming recursion keeps."""
        return int(self.buf_decay.size)

    def strategy_coefs(self) -> np.ndarray:
        """First column of C (length n): s·c."""
        return self.scale * blt_coefs(self.buf_decay, self.output_scale, self.n)

    def noising_coefs(self) -> np.ndarray:
        """First column of C⁻¹ (length n): ĉ/s, ĉ₀ = 1, ĉ_k = Σ_j ω̂_j θ̂_j^(k−1)."""
        return blt_coefs(self.inverse_decay, self.inverse_scale, self.n) / self.scale

    def _apply(self, decay: np.ndarray, weights: np.ndarray, x: np.ndarray) -> np.ndarray:
        """x + Σ_j w_j·S_j with S_j(t) = Σ_{s<t} d_j^(t−1−s) x_s: the BLT as B first-order
        recursions (MXZ24 Alg. 2), the parallel form, which stays accurate for decays near 1."""
        y = x.copy()
        for d, w in zip(decay, weights, strict=True):
            y += w * lfilter([0.0, 1.0], [1.0, -d], x, axis=0)
        return y

    def solve(self, z):
        z = np.asarray(z, dtype=np.float64)
        return self._apply(self.inverse_decay, self.inverse_scale, z) / self.scale

    def multiply(self, x: np.ndarray) -> np.ndarray:
        """C x along axis 0."""
        x = np.asarray(x, dtype=np.float64)
        return self.scale * self._apply(self.buf_decay, self.output_scale, x)

    def scaled(self, factor):
        return BLTEncoder(
            self.buf_decay,
            self.output_scale,
            self.n,
            self.scale * float(factor),
            self.inverse_decay,
        )

    def arrays(self):
        # The scale is an array so that the factorization's SHA-256 covers it.
        return {
            "buf_decay": self.buf_decay,
            "output_scale": self.output_scale,
            "inverse_decay": self.inverse_decay,
            "scale": np.array([self.scale]),
        }

    def params(self):
        return {"n": self.n}

    def _structured_sensitivity(self, participation):
        c = self.strategy_coefs()
        # cannot happen for a validated BLT; the general bound then applies
        if not is_nonneg_nonincreasing(c):
            return None
        value = toeplitz_min_sep_sensitivity(
            c, self.n, participation.min_sep, participation.max_participations
        )
        return Sensitivity(value, True, "toeplitz-min-sep-closed-form")

    def _noise_row_norms_squared(self):
        return np.cumsum(self.noising_coefs() ** 2)  # C⁻¹ Toeplitz with first column ĉ/s

    def per_query_error(self, workload):
        return workload_row_errors(self.noising_coefs(), workload)


ENCODER_TYPES: dict[str, type[Encoder]] = {
    cls.structure: cls
    for cls in (DenseEncoder, BandedEncoder, ToeplitzEncoder, InverseToeplitzEncoder, BLTEncoder)
}


def encoder_from_arrays(structure: str, arrays: dict[str, np.ndarray], params: dict) -> Encoder:
    """Rebuild an encoder saved with `Encoder.arrays` and `Encoder.params`.

    Args:
        structure: the saved encoder's structure name.
        arrays: its arrays.
        params: its JSON parameters.

    Returns:
        The encoder.
    """
    if structure == "dense":
        return DenseEncoder(arrays["C"])
    if structure == "banded":
        return BandedEncoder(arrays["band"])
    if structure == "toeplitz":
        return ToeplitzEncoder(arrays["coef"], int(params["n"]), bool(params["column_normalize"]))
    if structure == "banded-inverse":
        return InverseToeplitzEncoder(arrays["noising"], int(params["n"]))
    if structure == "blt":
        require(
            np.shape(arrays["scale"]) == (1,),
            "encoder",
            "a BLT scale array of shape (1,)",
            np.shape(arrays["scale"]),
        )
        return BLTEncoder(
            arrays["buf_decay"],
            arrays["output_scale"],
            int(params["n"]),
            arrays["scale"],
            arrays["inverse_decay"],
        )
    raise InvalidArgumentError("encoder", f"a structure in {sorted(ENCODER_TYPES)}", structure)
