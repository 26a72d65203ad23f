"""The privacy report (README "Conventions", Privacy report (JSON)), with user ids hashed by salted SHA-256."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from corrflow.accounting.posthoc import min_gap
from corrflow.factorization.base import Factorization
from corrflow.fileio import write_json


def hash_user_id(user_id: str, salt: bytes) -> str:
    """Salted SHA-256 of a user id (reports never print raw ids)."""
    return hashlib.sha256(salt + str(user_id).encode()).hexdigest()[:24]


def mechanism_section(factorization: Factorization) -> dict:
    return {"kind": factorization.kind, "rounds": factorization.rounds, "epochs": factorization.participation.epochs,
            "min_sep": factorization.participation.min_sep, "bands": factorization.bands,
            "participation": factorization.participation.kind, "workload": factorization.workload.to_dict(),
            "factorization_sha256": factorization.sha256()}


def participation_section(user_rounds: Mapping[str, Sequence[int]], salt: bytes, policy: str | None = None,
                          overrides: Sequence[dict] = ()) -> dict:
    users = {hash_user_id(u, salt): {"rounds": sorted(int(r) for r in rs), "min_gap": min_gap(rs)}
             for u, rs in user_rounds.items()}
    gaps = [u["min_gap"] for u in users.values() if u["min_gap"] is not None]
    return {"min_gap": min(gaps) if gaps else None,
            "max_participations": max((len(u["rounds"]) for u in users.values()), default=0),
            "policy": policy, "overrides": list(overrides), "users": users}


def privacy_report(*, factorization: Factorization, noise_multiplier: float, clip_norm: float, delta: float,
                   target_epsilon: float | None, accountant: dict, planned: dict, realized: dict,
                   rounds_completed: int, **extra) -> dict:
    """Assemble the report; ``planned``/``realized`` hold sensitivity, epsilon and participation.

    ``delta`` is the δ that goes with the reported ε's: the target, or the larger δ the accountant actually verified
    (``accountant["delta"]``, Monte Carlo with too few samples) — never a target that was not verified. A pair valid at
    the target δ stays valid at any larger δ, so one δ serves the planned and the realised ε."""
    verified = float(accountant.get("delta", delta)) if isinstance(accountant, dict) else delta
    if isinstance(realized, dict) and realized.get("delta") is not None:
        # The run's ε is the realised one; after post-hoc accounting (an override) it holds at the run's δ,
        # whatever δ the plan's Monte Carlo verified (issue 21 item 6).
        verified = float(realized["delta"])
    return {"mechanism": mechanism_section(factorization), "noise_multiplier": noise_multiplier,
            "clip_norm": clip_norm, "delta": max(delta, verified), "target_delta": delta,
            "guarantee": verified <= delta, "target_epsilon": target_epsilon, "accountant": accountant,
            "planned": planned, "realized": realized, "rounds_completed": rounds_completed, **extra}


def write_report(report: dict, path: str | os.PathLike) -> Path:
    """Write JSON atomically (:mod:`corrflow.fileio`)."""
    return write_json(path, report, indent=1, sort_keys=True)
