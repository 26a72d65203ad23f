"""The privacy report (``privacy_report.json``; its fields: docs/explanation/conventions.md,
"Privacy report", and the JSON Schema that ``corrflow schema privacy-report`` prints), with user ids
hashed by salted SHA-256."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from corrflow.accounting.noise_scale import noise_std_per_round
from corrflow.accounting.participation import ParticipationSummary
from corrflow.accounting.tracking import PrivacyPlan, RealizedPrivacy
from corrflow.factorization.base import Factorization
from corrflow.fileio import write_json

#: Version of privacy_report.json's layout. 3: the per-user participation is summarised, each
# user's entry in the run's per-user store the report names (``realized.participation.per_user``);
# 2: every user listed in the report, rewritten every ``report_every`` rounds, at the last round and
# at every stop, the per-round record an append-only ledger log; 1: rewritten after every round (no
# field).
SCHEMA_VERSION = 3


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
    summary: ParticipationSummary,
    store: dict,
    policy: str | None = None,
    overrides: Sequence[dict] = (),
) -> dict:
    """The report's realised participation: the per-user record summarised, and its store named.

    Args:
        summary: the per-user record's summary (`ParticipationSummary`).
        store: the reference to the per-user store (``{"store", "table", "rows", "digest"}``).
        policy: the separation policy, or None.
        overrides: the override records (user ids hashed).

    Returns:
        ``{"min_gap", "max_participations", "user_count", "participations",
        "min_gap_quantiles", "policy", "overrides", "per_user"}``.
    """
    return {**summary.to_dict(), "policy": policy, "overrides": list(overrides), "per_user": store}


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


@dataclass(frozen=True)
class ReportInputs:
    """Everything the privacy report states, as the run holds it (`build_report`).

    Attributes:
        factorization: the run's factorization.
        plan: σ, the planned ε and the accountant (`PrivacyPlan`).
        realized: ε of the participation so far (`RealizedPrivacy`).
        clip_norm: the clip norm.
        delta: the run's target δ.
        target_epsilon: the target ε, or None.
        planned_participation: the planner's description, with the run's ``mode``.
        planned_sensitivity: the planned sensitivity (k_u · the factorization's).
        planned_sensitivity_exact: whether it is exact.
        summary: the per-user record's summary.
        store: the reference to the per-user store.
        policy: the separation policy, or None.
        overrides: the override records (user ids hashed).
        rejections: how many replies were rejected.
        rounds_completed: rounds released so far.
        rounds_planned: rounds planned.
        stopped_reason: why the run stopped early, or None.
        run_id: the run's id.
        identity: where users' identities come from (``per-launch``: not stable over restarts).
        learning: the ``learning`` section.
        notes: the mechanism's notes.
        report_every: N: the report is complete every N rounds.
        regime: the ``regime`` section.
        eval_every: rounds between held-out evaluations.
        lineage: the ``lineage`` section (the noise key segments, adoptions).
        noise_workers: the noise workers' ``trust`` section, or None (noise drawn in process).
        secure_aggregation: the ``secure_aggregation`` section, or None.
        noise_node: the noise node's ``noise_node`` and ``trust_model`` sections (empty without).
        vocabulary: the ``vocabulary`` section of a run on a dataset file, or None.
        total: the ``total`` section from the training's (ε, δ) (basic composition with the
            vocabulary), or None.
    """

    factorization: Factorization
    plan: PrivacyPlan
    realized: RealizedPrivacy
    clip_norm: float
    delta: float
    target_epsilon: float | None
    planned_participation: dict
    planned_sensitivity: float
    planned_sensitivity_exact: bool
    summary: ParticipationSummary
    store: dict
    policy: str | None
    overrides: list[dict]
    rejections: int
    rounds_completed: int
    rounds_planned: int
    stopped_reason: str | None
    run_id: str
    identity: str
    learning: dict
    notes: tuple[str, ...] = ()
    report_every: int = 1
    regime: dict = field(default_factory=dict)
    eval_every: int = 1
    lineage: dict = field(default_factory=dict)
    noise_workers: dict | None = None
    secure_aggregation: dict | None = None
    noise_node: dict = field(default_factory=dict)
    vocabulary: dict | None = None
    total: Callable[[float | None, float], dict] | None = None


def build_report(x: ReportInputs) -> dict:
    """The privacy report of a run (docs "Conventions", Privacy report): the one place its
    sections are put together. Its size does not grow with the population: the per-user record is
    summarised (`participation_section`) and lives in the store the report names.

    Args:
        x: the run's facts (`ReportInputs`).

    Returns:
        The report dict (the ``privacy-report`` JSON Schema, `SCHEMA_VERSION`).
    """
    plan, real = x.plan, x.realized
    report = privacy_report(
        factorization=x.factorization,
        noise_multiplier=plan.noise_multiplier,
        clip_norm=x.clip_norm,
        delta=plan.delta if plan.delta is not None else x.delta,
        target_epsilon=x.target_epsilon,
        accountant=plan.accountant,
        planned={
            "sensitivity": x.planned_sensitivity,
            "sensitivity_exact": x.planned_sensitivity_exact,
            "epsilon": plan.epsilon,
            "participation": x.planned_participation,
        },
        realized={
            "sensitivity": real.sensitivity,
            "sensitivity_exact": real.sensitivity_exact,
            "epsilon": real.epsilon,
            "accounting": real.accounting,
            "delta": real.delta,
            "guarantee": real.delta is not None and real.delta <= x.delta * (1 + 1e-12),
            "participation": participation_section(x.summary, x.store, x.policy, x.overrides),
            "rejections": x.rejections,
        },
        rounds_completed=x.rounds_completed,
        rounds_planned=x.rounds_planned,
        stopped_reason=x.stopped_reason,
        run_id=x.run_id,
        identity={"source": x.identity, "stable_across_restarts": x.identity != "per-launch"},
        learning=x.learning,
    )
    report["mechanism"]["notes"] = list(x.notes)
    report["report_every"] = x.report_every
    report["regime"] = x.regime
    report["evaluation"] = {"every": x.eval_every, "final_round_always": True}
    report["lineage"] = x.lineage
    if x.noise_workers:
        report["trust"] = x.noise_workers
    if x.secure_aggregation is not None:
        report["secure_aggregation"] = x.secure_aggregation
    report.update(x.noise_node)
    if x.vocabulary is not None:
        report["vocabulary"] = x.vocabulary
        if x.total is not None:
            report["total"] = x.total(real.epsilon, report["delta"])
    return report


def write_report(report: dict, path: str | os.PathLike) -> Path:
    """Write a report as indented, sorted JSON, atomically (`corrflow.fileio`).

    Args:
        report: the report (`privacy_report`).
        path: the file.

    Returns:
        The path written.
    """
    return write_json(path, report, indent=1, sort_keys=True)
