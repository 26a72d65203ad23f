"""The privacy report (``privacy_report.json``; its fields: docs/explanation/conventions.md,
"Privacy report", and the JSON Schema that ``corrflow schema privacy-report`` prints), with user ids
hashed by salted SHA-256."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from corrflow.accounting.noise_scale import noise_std_per_round
from corrflow.factorization.base import Factorization
from corrflow.fileio import write_json

#: Version of privacy_report.json's layout. 2: the run's per-round record is an
# append-only ledger log, and the report — complete, every user listed — is rewritten every
# ``report_every`` rounds, at the last round and at every stop (1: after every round; no field).
SCHEMA_VERSION = 2


def hash_user_id(user_id: str, salt: bytes) -> str:
    """Salted SHA-256 of a user id (reports never print raw ids).

    Args:
        user_id: the raw id (converted with ``str``).
        salt: the run's secret salt.

    Returns:
        The first 24 hex digits of SHA-256(salt ‖ id).
    """
    return hashlib.sha256(salt + str(user_id).encode()).hexdigest()[:24]


def mechanism_section(factorization: Factorization) -> dict:
    """The report's ``mechanism`` section.

    Args:
        factorization: the run's factorization.

    Returns:
        ``{"kind", "rounds", "epochs", "min_sep", "bands", "participation", "workload",
        "factorization_sha256"}``.
    """
    return {
        "kind": factorization.kind,
        "rounds": factorization.rounds,
        "epochs": factorization.participation.epochs,
        "min_sep": factorization.participation.min_sep,
        "bands": factorization.bands,
        "participation": factorization.participation.kind,
        "workload": factorization.workload.to_dict(),
        "factorization_sha256": factorization.sha256(),
    }


def participation_section(
    user_rounds: Mapping[str, Sequence[int]],
    salt: bytes,
    policy: str | None = None,
    overrides: Sequence[dict] = (),
    hashed: Callable[[str], str] | None = None,
) -> dict:
    """The report's participation section, with user ids hashed.

    Args:
        user_rounds: user id → the rounds the user contributed to.
        salt: the run's secret salt (`hash_user_id`).
        policy: the separation policy, or None.
        overrides: the override records.
        hashed: user id → its `hash_user_id` under ``salt`` (a run's cache; default: computed).

    Returns:
        ``{"min_gap", "max_participations", "policy", "overrides", "users": {hashed id: {"rounds",
        "min_gap"}}}``.
    """
    hashed = hashed or (lambda u: hash_user_id(u, salt))
    users = {hashed(u): _user_entry(rs) for u, rs in user_rounds.items()}
    gaps = [u["min_gap"] for u in users.values() if u["min_gap"] is not None]
    return {
        "min_gap": min(gaps) if gaps else None,
        "max_participations": max((len(u["rounds"]) for u in users.values()), default=0),
        "policy": policy,
        "overrides": list(overrides),
        "users": users,
    }


def _user_entry(rounds: Sequence[int]) -> dict:
    """A user's ``{"rounds", "min_gap"}`` (``min_gap`` as `corrflow.accounting.posthoc.min_gap`),
    in plain Python: a report lists every user, and numpy's per-call overhead would dominate."""
    r = sorted(int(x) for x in rounds)
    gaps = [b - a for a, b in zip(r, r[1:], strict=False) if b != a]
    return {"rounds": r, "min_gap": min(gaps) if gaps else None}


def privacy_report(
    *,
    factorization: Factorization,
    noise_multiplier: float,
    clip_norm: float,
    delta: float,
    target_epsilon: float | None,
    accountant: dict,
    planned: dict,
    realized: dict,
    rounds_completed: int,
    **extra,
) -> dict:
    """Assemble the privacy report.

    The report's ``delta`` is the δ that goes with the reported ε's: the target, or the larger δ the
    accountant actually verified (``accountant["delta"]``, Monte Carlo with too few samples) — never
    a target that was not verified; when ``realized`` carries the δ its ε holds at
    (``realized["delta"]``: the run's δ after post-hoc accounting), that one is used. A pair valid
    at the target δ stays valid at any larger δ, so one δ serves the planned and the realised ε.

    Args:
        factorization: the run's factorization (the ``mechanism`` section).
        noise_multiplier: σ.
        clip_norm: the clip norm.
        delta: the target δ.
        target_epsilon: the target ε, or None.
        accountant: the accountant section (`AccountingResult.to_dict`'s ``accountant``).
        planned: the planned sensitivity, ε and participation.
        realized: the realised sensitivity, ε, its δ and participation.
        rounds_completed: rounds completed so far.
        **extra: further top-level sections, as given.

    Returns:
        The report dict (the shape the ``privacy-report`` JSON Schema describes), with
        ``noise_std_per_round``: σ·‖(C⁻¹)_{t,:}‖ summarised (the DP-SGD z when it is the same every
        round; `corrflow.accounting.noise_scale`).
    """
    verified = float(accountant.get("delta", delta)) if isinstance(accountant, dict) else delta
    if isinstance(realized, dict) and realized.get("delta") is not None:
        # The run's ε is the realised one; after post-hoc accounting (an override) it holds at the
        # run's δ, whatever δ the plan's Monte Carlo verified.
        verified = float(realized["delta"])
    return {
        "schema_version": SCHEMA_VERSION,
        "mechanism": mechanism_section(factorization),
        "noise_multiplier": noise_multiplier,
        "noise_std_per_round": noise_std_per_round(factorization, noise_multiplier),
        "clip_norm": clip_norm,
        "delta": max(delta, verified),
        "target_delta": delta,
        "guarantee": verified <= delta,
        "target_epsilon": target_epsilon,
        "accountant": accountant,
        "planned": planned,
        "realized": realized,
        "rounds_completed": rounds_completed,
        **extra,
    }


def write_report(report: dict, path: str | os.PathLike) -> Path:
    """Write a report as indented, sorted JSON, atomically (`corrflow.fileio`).

    Args:
        report: the report (`privacy_report`).
        path: the file.

    Returns:
        The path written.
    """
    return write_json(path, report, indent=1, sort_keys=True)
