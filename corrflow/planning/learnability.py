"""Before training: will the model drown in its noise? A pre-flight estimate from the factorization
alone.

The server's model is θ_t = θ_0 + η·(A x̂)_t with x̂_t = (Σ clipped updates + σ·clip·(C⁻¹Z)_t) /
cohort, so the noise it carries at round t has per-coordinate standard deviation η·σ·clip·‖B_t‖ /
cohort (B = A C⁻¹; ‖B_t‖² is the factorization's per-iterate error) and norm ≈ that × √d over d
parameters, while the clipped signal moves it at most η·clip·(A·1)_t. Their ratio at the last round,

    ρ = σ · √d · ‖B_{n−1}‖ / (cohort · (A·1)_{n−1}),

does not depend on η or clip. Measured at ε = 8, δ = 1e-5: runs that learn had ρ ≤ 0.2 (numpy
regression, ``corrflow simulate --users 100 --rounds 20 --epochs 2 --target-epsilon 8``: 0.04;
nextword ``compare --preset quick``, banded Toeplitz: 0.06; the arXiv cross-silo example of the
participation how-to, docs/how-to/participation.md: 0.2; DP-SGD on the quick preset, 0.17, gains
accuracy while its held-out loss rises); runs at ρ ≥ 0.39 ended worse than the initial model
(``--preset tiny``: 0.39 Toeplitz, 0.71 DP-SGD; the Keras LSTM with 5 users per round: 2.4).
Real-format runs (``--data`` on TFF-format SQLite, ε = 8) tolerate more: the Keras LSTM on 727 real
StackOverflow authors with a 2,000-word vocabulary learned at ρ = 0.49 (94% of the non-private loss
drop); ``compare --preset tiny --data`` with the nextword client and 2,000 words on a 300-user
generated file learned at ρ = 0.82 (Toeplitz, loss 7.60 → 5.69, non-private 4.91) and not at 1.47
(DP-SGD, 7.60 → 10.18); the Keras LSTM with 10,004 tokens and cohorts of 250
(``benchmarks/text_memory.py``) learned at 1.29 over 2 rounds (9.21 → 8.38); a cohort of 7 on arXiv
at 5.3 diverged (6.2 → 26.4); but the loopback text drill (``deploy/loopback.sh --client nextword``:
3 devices, every device in every round, a 54-word vocabulary, ε = 32, clip 0.25, 2–3 rounds) learned
at ρ = 3.02 in 160 of 160 in-process runs (loss 3.99 → 3.09–3.32). So ρ is a heuristic ranking, not
a sharp boundary: most runs measured below ``THRESHOLD`` learned, but not all — DP-SGD on the quick
preset (``compare --preset quick --epsilons 8 --seeds 1``) did not at ρ = 0.17 (held-out loss 6.68,
not below its initial loss; accuracy 0.137); above it runs went both ways (larger models with more
rounds fared better; above 1.5 only that tiny drill learned). Above ``THRESHOLD``
corrflow warns before training starts, saying so.

After training, `learning_section` puts the verdict on the record (``privacy_report.json``'s
``learning``): ρ, whether it warned, the held-out loss (and accuracy) of the initial and final
models, and ``learned`` — whether the final model's held-out loss is finite and below the initial
model's (``None`` without a held-out evaluation). Loss, not accuracy, decides: a noisy model can
rank the right word first more often while its probabilities are worse than the untrained model's
(DP-SGD in ``compare --preset quick``: accuracy 0 → 0.125, loss 5.3 → 6.6); the verdict then names
both. It also looks at the best held-out loss of the run: a final loss more than ``DRIFT_TOLERANCE``
(10%) above the best is flagged (``drifted``; a real-format Keras run went 7.60 → 5.94 at its best
and back to 6.94 — below the initial loss, yet a regression the final number alone hides), and the
verdict says at which round the best model was. The user-facing account is docs/how-to/compare.md,
"Will my configuration learn?".
"""

from __future__ import annotations

import logging
import math

import numpy as np

log = logging.getLogger("corrflow")
#: ρ above which corrflow warns before training that the configuration may not learn.
THRESHOLD = 0.3
#: A final held-out loss more than this fraction above the run's best is flagged as drift.
DRIFT_TOLERANCE = 0.10


def noise_to_signal(fac, sigma: float, dim: int, cohort: float) -> float:
    """The pre-flight noise-to-signal ratio ρ = σ·√d·‖B_{n−1}‖ / (cohort·(A·1)_{n−1}) (module
    docstring).

    Args:
        fac: a `Factorization` normalised to sensitivity 1 (its per-query error gives ‖B_t‖², its
            workload A).
        sigma: the noise multiplier σ.
        dim: d, the number of model parameters.
        cohort: the number the summed update is divided by.

    Returns:
        ρ (0 without noise).
    """
    if sigma <= 0:
        return 0.0
    n = fac.rounds
    b_last = float(np.sqrt(fac.per_query_error()[-1]))
    signal = float(fac.workload.apply(np.ones((n, 1)))[-1, 0])
    return float(sigma * np.sqrt(dim) * b_last / (cohort * signal))


def check_learnable(fac, sigma: float, weights, cohort: float) -> float:
    """Compute ρ (`noise_to_signal`) for a model and log a warning when it exceeds
    `THRESHOLD`.

    Args:
        fac: the run's normalised factorization.
        sigma: the noise multiplier σ.
        weights: the model's arrays (any shapes; d is their total size).
        cohort: the number the summed update is divided by.

    Returns:
        ρ.
    """
    dim = int(sum(np.size(w) for w in weights))
    rho = noise_to_signal(fac, sigma, dim, cohort)
    if rho > THRESHOLD:
        log.warning(
            "this configuration %s learn: the model will carry noise %.2f× the largest signal the "
            "clipped updates can give it (σ = %.3f, %d parameters, cohort %g; a heuristic: most "
            "measured runs at ≤ %.2f learned, though DP-SGD on the quick preset did not at 0.17; "
            "runs above went both ways, above 1.5 only a 54-word drill learned). Raise the cohort "
            "(users per round), lower ε's noise (higher target ε), use a smaller model or a "
            "correlated-noise kind with lower error.",
            "is unlikely to" if rho > 1.5 else "may not",
            rho,
            sigma,
            dim,
            cohort,
            THRESHOLD,
        )
    return rho


def held_out_summary(entries: list[dict]) -> dict:
    """Initial, final and best held-out loss (and accuracy) and the loss's relative improvement.

    Args:
        entries: ``metrics.json``'s entries, non-empty: the initial model as ``"round": -1``, then
            one entry per round, each with ``test_loss`` (and optionally ``test_accuracy``).

    Returns:
        ``{"initial_test_loss", "final_test_loss", "rounds_evaluated"}`` (non-finite losses as
        None), plus ``initial_test_accuracy``/``final_test_accuracy`` when both ends report
        accuracy, ``loss_improvement`` (1 − final/initial), ``best_test_loss``/``best_round`` and
        ``drift_above_best`` (final/best − 1) when they are defined.
    """
    entries = evaluated_entries(entries)
    first, last = entries[0], entries[-1]
    out = {
        "initial_test_loss": _finite(first["test_loss"]),
        "final_test_loss": _finite(last["test_loss"]),
        "rounds_evaluated": len(entries) - 1,
    }
    if "test_accuracy" in first and "test_accuracy" in last:
        out.update(
            initial_test_accuracy=_finite(first["test_accuracy"]),
            final_test_accuracy=_finite(last["test_accuracy"]),
        )
    if out["initial_test_loss"] and out["final_test_loss"] is not None:
        out["loss_improvement"] = 1.0 - out["final_test_loss"] / out["initial_test_loss"]
    losses = [
        (float(e["test_loss"]), int(e.get("round", i - 1)))
        for i, e in enumerate(entries)
        if "test_loss" in e and math.isfinite(float(e["test_loss"]))
    ]
    if losses:
        best, best_round = min(losses)
        out.update(best_test_loss=best, best_round=best_round)
        if out["final_test_loss"] is not None and best > 0:
            out["drift_above_best"] = out["final_test_loss"] / best - 1.0
    return out


def evaluated_entries(entries: list[dict]) -> list[dict]:
    """The initial entry and the rounds that were evaluated (with ``eval_every`` N > 1 the others
    carry no ``test_loss``; the last round is always evaluated when the run completes).

    Args:
        entries: ``metrics.json``'s entries.

    Returns:
        ``entries[0]`` and every later entry with a ``test_loss``.
    """
    return entries[:1] + [e for e in entries[1:] if "test_loss" in e]


def _finite(value) -> float | None:
    """A plain float, or None for NaN/±inf (strict JSON has neither; the verdict's text names
    them)."""
    value = float(value)
    return value if math.isfinite(value) else None


def learning_section(entries: list[dict], noise_to_signal: float) -> dict:
    """The privacy report's ``learning`` verdict (module docstring).

    Args:
        entries: ``metrics.json``'s entries (see `held_out_summary`); may be empty.
        noise_to_signal: the run's pre-flight ρ.

    Returns:
        ``{"noise_to_signal", "threshold", "warned", "learned", "verdict"}``, plus
        `held_out_summary`'s fields, ``drifted`` and ``drift_tolerance`` when the run evaluates a
        held-out set and has trained at least one round (else ``learned`` is None).
    """
    out = {
        "noise_to_signal": noise_to_signal,
        "threshold": THRESHOLD,
        "warned": noise_to_signal > THRESHOLD,
    }
    entries = evaluated_entries(entries)
    if len(entries) < 2 or "test_loss" not in entries[0]:
        return {
            **out,
            "learned": None,
            "verdict": "not evaluated (no held-out evaluation or no round trained)",
        }
    held = held_out_summary(entries)
    first, last = float(entries[0]["test_loss"]), float(entries[-1]["test_loss"])
    learned = bool(math.isfinite(last) and last < first)
    moved = f"held-out loss went from {first:.4g} to {last:.4g}"
    if "final_test_accuracy" in held:
        moved += (
            f", accuracy from {held['initial_test_accuracy']:.4g} to "
            f"{held['final_test_accuracy']:.4g}"
        )
    verdict = (
        moved
        if learned
        else f"the model did not learn: {moved} over {held['rounds_evaluated']} rounds"
    )
    drift = held.get("drift_above_best")
    drifted = bool(
        drift is None
        and held.get("best_test_loss") is not None
        or (drift is not None and drift > DRIFT_TOLERANCE)
    )
    if drifted:
        at = "the initial model" if held["best_round"] < 0 else f"round {held['best_round'] + 1}"
        verdict += (
            f"; the final loss is {drift:.0%} above the run's best {held['best_test_loss']:.4g} "
            f"({at}): it drifted"
            if drift is not None
            else f"; the run's best loss was {held['best_test_loss']:.4g} ({at})"
        )
    if not learned and out["warned"]:
        verdict += (
            f" (the pre-flight check warned: noise-to-signal {noise_to_signal:.2f} > {THRESHOLD})"
        )
    return {
        **out,
        **held,
        "learned": learned,
        "drifted": drifted,
        "drift_tolerance": DRIFT_TOLERANCE,
        "verdict": verdict,
    }
