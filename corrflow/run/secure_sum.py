"""The numbers behind a secure sum (SecAgg+), free of Flower: the protocol's parameters for a
cohort, the client's clipping that keeps a quantized update within the accountant's sensitivity,
and the server's plausibility check of an unmasked sum.

SecAgg+ (Bell, Bonawitz, Gascón, Lepoint, Raykova, "Secure Single-Server Aggregation with
(Poly)Logarithmic Overhead", CCS 2020) sums integers modulo M. Each client maps every coordinate of
its update from [−r, r] onto [0, T] by stochastic rounding (step Δ = 2r/T), so the cohort's sum of
m quantized vectors lies in [0, m·T]; choosing T per round with m·T < M means the modular sum never
wraps. Stochastic rounding moves each coordinate by less than one step, so a quantized update of an
update with ‖u‖₂ ≤ c − Δ√d has ‖·‖₂ ≤ c: the sensitivity the accountant uses holds for what is
summed, and the secure sum differs from the plain sum by less than m·Δ per coordinate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from corrflow.errors import require

#: M: the modulus of the masked sum (Flower's default; masks are drawn in [0, M − 1)).
MODULUS = 1 << 32
#: Flower's client rounds into int32 (``quantization._stochastic_round``): T must stay below 2³¹.
MAX_QUANTIZATION_RANGE = (1 << 31) - 2
#: Up to this cohort every member shares its secrets with all others (SecAgg); above it each
# shares with 2·⌈2·log₂ m⌉ + 1 neighbours (SecAgg+'s logarithmic graph).
FULL_GRAPH_COHORT = 32
#: The fraction of a member's neighbourhood (itself included) whose shares reconstruct its secrets:
# a neighbourhood tolerates losing a third of its members.
THRESHOLD_FRACTION = 2 / 3
#: Attempts of a round whose secure sum failed before anything was unmasked (too many dropouts, a
# malformed message): the same scheduled cohort and the same, never released, noise each time.
MAX_ATTEMPTS = 3
#: The key under which a receiver reports, in the collect stage, the nodes whose share
# ciphertexts it could not authenticate or decrypt (instead of its masked vector): the driver
# names those senders.
UNDECRYPTABLE_KEY = "corrflow-undecryptable"
#: The order of the per-client action counts summed inside the masked vector (no per-client metric
# travels in the clear).
ACTIONS = ("kept", "clipped", "zeroed")


@dataclass(frozen=True)
class SecureSumParams:
    """One round's SecAgg+ parameters: cohort m, shares per member and reconstruction threshold,
    clipping range r (= clip c: an ℓ2-clipped update never exceeds it per coordinate), quantization
    range T and modulus M."""

    cohort: int
    num_shares: int
    threshold: int
    clipping_range: float
    quantization_range: int
    modulus: int = MODULUS
    #: σ_max = σ·max_t ‖row t of C⁻¹‖ when a noise node joins the sum (one more participant whose
    # input is centred Gaussian noise on the grid); None without one.
    noise_sigma: float | None = None

    @property
    def participants(self) -> int:
        """The members of the secure sum: the cohort's clients, and the noise node if any."""
        return self.cohort + (self.noise_sigma is not None)

    @property
    def step(self) -> float:
        """Δ = 2r/T: the quantization step, the most stochastic rounding moves one coordinate."""
        return 2 * self.clipping_range / self.quantization_range

    def client_bound(self, dim: int, clip: float | None = None) -> float:
        """min(c, r) − Δ√d: the ℓ2 norm a client clips its update of ``dim`` coordinates to, so
        that its quantized update has norm ≤ min(c, r) ≤ c whatever clipping range r the server
        sent (corrflow's server sends r = c; ``clip`` None means c = r).

        Args:
            dim: d, the update's number of coordinates.
            clip: c, the clip norm the accountant's sensitivity assumes.

        Returns:
            The bound; ≤ 0 when the quantization slack Δ√d leaves no room.
        """
        c = self.clipping_range if clip is None else min(float(clip), self.clipping_range)
        return c - self.step * math.sqrt(dim)

    def sum_bound(self, active: int) -> float:
        """‖Σ‖₂ of ``active`` honest clients: m·c, plus the quantization's m·Δ√d slack only as
        float rounding (each quantized update is already ≤ c)."""
        return active * self.clipping_range * (1 + 1e-6)

    def dishonest_bound(self, dim: int) -> float:
        """The most one client that skips the clipping can move the sum in ℓ2: r per coordinate
        (Flower's quantization clips each coordinate to [−r, r]), r·√d in all."""
        return self.clipping_range * math.sqrt(dim)

    def to_dict(self) -> dict:
        """The parameters as the report shows them."""
        return {
            "cohort": self.cohort,
            "num_shares": self.num_shares,
            "threshold": self.threshold,
            "clipping_range": self.clipping_range,
            "quantization_range": self.quantization_range,
            "modulus": self.modulus,
            "step": self.step,
            **({"noise_sigma_max": self.noise_sigma} if self.noise_sigma is not None else {}),
        }


def secure_sum_params(
    cohort: int, clip: float, dim: int, noise_sigma: float | None = None
) -> SecureSumParams:
    """The parameters of a round with ``cohort`` members, clip c and ``dim`` trainable coordinates.

    T is the largest even integer with m·T < M (the sum of m values in [0, T] never wraps modulo
    M; never a truncated cohort), capped where Flower's int32 rounding ends. With a noise node
    (``noise_sigma`` = σ_max, per unit clip) T also leaves the noise its headroom on both sides:
    m·T + 2·K·σ_max·T < M (`noise_headroom_range`). Raises `InvalidArgumentError` when
    c − Δ√d ≤ 0 (a model too large for the modulus)."""
    require(
        cohort >= 2,
        "cohort",
        "at least 2 members for a secure sum (one member's sum is its update)",
        cohort,
    )
    if noise_sigma is None:
        t = min(MAX_QUANTIZATION_RANGE, (MODULUS - 1) // cohort)
    else:
        t = noise_headroom_range(cohort, noise_sigma)
    t -= t % 2
    # the clients' graph; a noise node is a neighbour of every client (each client's guard must
    # see it in its round, and only its neighbours hold its shares), one more in each neighbourhood
    ring = (
        cohort
        if cohort <= FULL_GRAPH_COHORT
        else min(cohort, 2 * math.ceil(2 * math.log2(cohort)) + 1)
    )
    shares = ring + (noise_sigma is not None)
    threshold = max(2, math.ceil(THRESHOLD_FRACTION * shares))
    params = SecureSumParams(cohort, shares, threshold, float(clip), t, MODULUS, noise_sigma)
    require(
        params.client_bound(dim) > 0,
        "secure-aggregation",
        f"a model whose quantization slack Δ√d = {params.step * math.sqrt(dim):.3g} stays below "
        f"clip {clip:g} (cohort {cohort}, d = {dim})",
    )
    return params


#: K: the noise node's input may reach K·σ_max·T grid steps (K/2 standard deviations of σ_max·T/2)
# on either side of the clients' range before the modular sum wraps.
NOISE_HEADROOM_K = 20


def noise_headroom_range(cohort: int, noise_sigma: float) -> int:
    """T with room for the noise node's input: the largest integer with m·T + 2·K·σ_max·T < M.

    The clients' sum lies in [0, m·T]; the noise, σ_t·c/Δ = σ_t·T/2 grid steps per coordinate
    (σ_t ≤ σ_max), is centred at 0, so the headroom is needed on both sides.

    Args:
        cohort: m, the cohort's clients (the noise node not counted).
        noise_sigma: σ_max = σ·max_t ‖row t of C⁻¹‖ (per unit clip), ≥ 0.

    Returns:
        T, capped where Flower's int32 rounding ends.

    Raises:
        InvalidArgumentError: σ_max is not a finite, non-negative number.
    """
    require(
        math.isfinite(noise_sigma) and noise_sigma >= 0,
        "noise_sigma",
        "a finite, non-negative σ_max",
        noise_sigma,
    )
    t = int((MODULUS - 1) // (cohort + 2 * NOISE_HEADROOM_K * noise_sigma))
    while cohort * t + 2 * NOISE_HEADROOM_K * noise_sigma * t >= MODULUS:
        t -= 1  # float rounding of the division
    return min(MAX_QUANTIZATION_RANGE, t)


def wrap_probability(dim: int) -> float:
    """An upper bound on the probability that one round's noise node input wraps the modular sum
    in any of ``dim`` coordinates: |N| < K·σ_max·T unless one standard normal exceeds 2K − 1/std
    ≥ K (for std ≥ 1/K grid steps), so ≤ d·2·Φ(−K) with K = `NOISE_HEADROOM_K` (a wrap costs
    accuracy, never privacy: it is post-processing)."""
    return dim * math.erfc(NOISE_HEADROOM_K / math.sqrt(2))


def grid_noise(noise: np.ndarray, step: float, modulus: int = MODULUS) -> np.ndarray:
    """The noise node's input: round(n/Δ) with round(x) = ⌊x + ½⌋ (deterministic, ties up: the
    identity S + round(y) = round(S + y) for integer S needs the same tie rule everywhere;
    half-to-even breaks it), represented modulo M.

    Args:
        noise: n = σ·c·(C⁻¹Z)_t, one round's noise (any float array).
        step: Δ, the round's quantization step.
        modulus: M.

    Returns:
        int64 values in [0, M).
    """
    grid = np.floor(np.asarray(noise, np.float64) / step + 0.5).astype(np.int64)
    return np.mod(grid, modulus)


def centre(values: np.ndarray, params: SecureSumParams) -> np.ndarray:
    """A summed grid coordinate in [0, M) as the signed integer it stands for: the clients' sum
    lies in [0, m·T] and the noise adds less than the headroom H = (M − m·T)/2 on either side, so
    values from m·T + H on stand for negatives (value − M).

    Args:
        values: the unmasked sum modulo M (int64).
        params: the round's parameters (m = clients, T).

    Returns:
        int64 values in [−H, m·T + H).
    """
    top = params.cohort * params.quantization_range
    cut = top + (params.modulus - top) // 2
    v = np.asarray(values, np.int64)
    return np.where(v >= cut, v - params.modulus, v)


def bound_update(
    update: Sequence[np.ndarray], bound: float, zeroing: float
) -> tuple[list[np.ndarray], str]:
    """A client's update as it enters the secure sum (000 App. F.3 zeroing, then ℓ2 clipping):
    zeros when it is not finite or its ℓ∞ exceeds ``zeroing`` (> 0), else scaled to
    ‖u‖₂ ≤ ``bound``. Returns the float32 arrays and "kept", "clipped" or "zeroed"."""
    arrays = [np.asarray(a, dtype=np.float64) for a in update]
    zeros = [np.zeros(a.shape, np.float32) for a in arrays]
    if bound <= 0 or not all(np.isfinite(a).all() for a in arrays):
        return zeros, "zeroed"  # no room left by the quantization slack, or not finite
    linf = max((float(np.abs(a).max()) for a in arrays if a.size), default=0.0)
    if zeroing > 0 and linf > zeroing:
        return zeros, "zeroed"
    norm = math.sqrt(sum(float(np.sum(a * a)) for a in arrays))
    if norm <= bound:
        out = [a.astype(np.float32) for a in arrays]
        # float32 rounding can push a norm at the bound over it: scale inside it
        if math.sqrt(sum(float(np.sum(np.square(a, dtype=np.float64))) for a in out)) <= bound:
            return out, "kept"
    scale = bound / norm * (1 - 1e-6)
    return [(a * scale).astype(np.float32) for a in arrays], "clipped"


def action_vector(action: str, clipping_range: float) -> np.ndarray:
    """The one-hot of ``action`` (`ACTIONS`) scaled to r, summed inside the masked vector: its sum
    decodes to the cohort's counts (`decode_counts`) and no client's action is seen alone."""
    out = np.zeros(len(ACTIONS), np.float32)
    out[ACTIONS.index(action)] = clipping_range
    return out


def decode_counts(total: np.ndarray, params: SecureSumParams) -> dict[str, int]:
    """The cohort's action counts from the dequantized sum of `action_vector` s (each entry within
    m·Δ ≪ r/2 of count·r)."""
    counts = np.rint(np.asarray(total, np.float64) / params.clipping_range).astype(np.int64)
    return dict(zip(ACTIONS, (int(c) for c in counts), strict=True))


def implausible(
    total: Sequence[np.ndarray], counts: dict[str, int], active: int, params: SecureSumParams
) -> str | None:
    """Why an unmasked sum of ``active`` contributions cannot be what honest clients sent (a
    well-formed but wrong share cannot be attributed to anyone), or None: non-finite values, a norm
    above m·c, or action counts that do not add up to m."""
    if not all(np.isfinite(a).all() for a in total):
        return "the unmasked sum is not finite"
    norm = math.sqrt(sum(float(np.sum(np.square(a, dtype=np.float64))) for a in total))
    bound = params.sum_bound(active) + noise_norm_bound(params, total)
    if norm > bound:
        return (
            f"the unmasked sum has ℓ2 norm {norm:.6g} > m·c = {active}·{params.clipping_range:g}"
            + (" plus the noise's bound" if params.noise_sigma is not None else "")
            + " (a wrong share or a client that did not clip)"
        )
    if any(v < 0 for v in counts.values()) or sum(counts.values()) != active:
        return f"the action counts {counts} do not add up to the {active} contributions"
    return None


def noise_norm_bound(params: SecureSumParams, total: Sequence[np.ndarray]) -> float:
    """What the noise node's input may add to the sum's ℓ2 norm: c·σ_max·(√d + K) (a standard
    Gaussian vector exceeds √d + K with probability ≤ exp(−K²/2)) plus the rounding's Δ√d/2; 0
    without a noise node."""
    if params.noise_sigma is None:
        return 0.0
    dim = sum(int(np.size(a)) for a in total)
    root = math.sqrt(dim)
    c = params.clipping_range
    return c * params.noise_sigma * (root + NOISE_HEADROOM_K) + params.step * root / 2


#: The kinds of reply (`corrflow.strategies.wire.reply_kinds`) that carry nothing of one client's
# data in the clear: the protocol's own messages, failures, and the identity probe's answers.
PROTOCOL_KINDS = (
    "public keys",
    "encrypted shares",
    "masked vectors",
    "secret shares",
    "undecryptable-sender reports",
)


def server_saw(received: dict[str, dict[str, int]]) -> str:
    """What the server saw, derived from what it received (message type → kind → count): "only
    masked vectors …; never one user's update or per-user metric" only when every reply was a
    protocol message, an error or an identity answer; otherwise the per-user data that arrived in
    the clear, named first.

    Args:
        received: the record of every reply the server received during the run.

    Returns:
        The statement the privacy report makes.
    """
    kinds = {k: n for by_type in received.values() for k, n in by_type.items()}
    quiet = {*PROTOCOL_KINDS, "identity replies", "error replies"}
    clear = sorted(
        f"{t} {k} ×{n}"
        for t, by_type in received.items()
        for k, n in by_type.items()
        if k not in quiet
    )
    base = (
        "only masked vectors and each round's unmasked sum of the cohort's clipped updates "
        "(with the SecAgg+ public keys, encrypted shares and secret shares that unmask the sum)"
    )
    if clear:
        return f"per-user data in the clear: {', '.join(clear)}; besides that, {base}"
    if not kinds:
        return "nothing yet: no reply has reached the server"
    also = (
        f"; and each node's declared identity ({kinds['identity replies']} identity replies)"
        if kinds.get("identity replies")
        else ""
    )
    return f"{base}; never one user's update or per-user metric{also}"


def trust_section(clip: float, dim: int, cohort: float, received: dict | None = None) -> dict:
    """The privacy report's ``secure_aggregation`` section: what the server saw (derived from
    ``received``, the record of every reply it received), whom SecAgg+ protects against, what DP
    protects, what a client that skips the clipping can do, and the reconstruction threshold and
    dropout tolerance at the planned ``cohort`` (m ≥ 2; the quantization range is chosen again each
    round from the cohort it sends to)."""
    m = max(2, int(round(cohort)))
    p = secure_sum_params(m, clip, dim)
    received = received or {}
    return {
        "protocol": "SecAgg+ (Bell et al., CCS 2020): Flower's secaggplus_mod, corrflow's driver",
        "server_saw": server_saw(received),
        "received": received,
        "threat_model": "honest-but-curious server: Flower's SecAgg+ has no consistency round, so "
        "a server that lies about dropouts can unmask a client; clients are trusted to run "
        "corrflow's mod (clipping) unchanged",
        "noiseless_sum": "the server itself holds each round's noiseless cohort sum; DP protects "
        "the released models, not the sum, from the server",
        "client_clipping": f"each client clips its update to c − Δ√d = "
        f"{p.client_bound(dim):.9g} so that its quantized update has ℓ2 norm ≤ c = {clip:g}",
        "dishonest_client_bound": f"a client that skips the clipping moves each coordinate of the "
        f"sum by at most the clipping range r = {p.clipping_range:g}: ℓ2 ≤ r·√d = "
        f"{p.dishonest_bound(dim):.6g}, √d = {math.sqrt(dim):.4g} times the sensitivity the "
        "accountant assumes",
        "reconstruction_threshold": p.threshold,
        "neighbours": p.num_shares,
        "dropout_tolerance": f"each member's neighbourhood of {p.num_shares} may lose "
        f"{p.num_shares - p.threshold} (at the planned cohort {m}); a round with more dropouts is "
        f"not released and is redone (at most {MAX_ATTEMPTS} attempts, same cohort and noise) "
        "unless its sum was already unmasked",
        "dropouts": "a scheduled user who drops out counts as participating in the accounting",
        "quantization": {
            **p.to_dict(),
            "rule": "T = the largest even integer with m·T < M for the round's cohort m (the "
            "modular sum never wraps); the secure sum is within m·Δ per coordinate of the plain "
            "sum (stochastic rounding: unbiased, not counted toward ε)",
        },
    }
