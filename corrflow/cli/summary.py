"""The few lines a run's summary prints (``corrflow simulate`` and ``corrflow report``)."""

from __future__ import annotations

import math
from pathlib import Path

from corrflow.accounting.noise_scale import describe as describe_noise
from corrflow.planning.regime import regime_lines
from corrflow.planning.run import selection_line
from corrflow.run.noise_trust import noise_worker_lines


def _loss(value: float | None) -> str:
    """A held-out loss for the summary: a non-finite one (None in the metrics) shows as such."""
    return "non-finite" if value is None else f"{value:.4f}"


def run_summary(report: dict, out: Path, held_out: dict) -> str:
    """The run for people (the whole report: OUT/privacy_report.json).

    Args:
        report: the privacy report.
        out: the run's directory.
        held_out: the held-out summary of its metrics.

    Returns:
        A few lines: held-out progress, mechanism, privacy, users, notes and files.
    """
    mech, planned, realized = report["mechanism"], report["planned"], report["realized"]
    part = planned["participation"]
    eps = realized["epsilon"]
    acc = (
        f", accuracy {held_out['initial_test_accuracy']:.4f} → "
        f"{held_out['final_test_accuracy']:.4f}"
        if "final_test_accuracy" in held_out
        else ""
    )
    failed = (
        " — did not learn (exit 3)" if report.get("learning", {}).get("learned") is False else ""
    )
    drift = held_out.get("drift_above_best")
    if drift is not None and drift > report.get("learning", {}).get("drift_tolerance", 0.1):
        at = (
            "the initial model"
            if held_out["best_round"] < 0
            else f"round {held_out['best_round'] + 1}"
        )
        failed += (
            f" — drifted: {drift:.0%} above the best loss {held_out['best_test_loss']:.4f} ({at})"
        )
    change = (
        f" ({-held_out['loss_improvement']:+.1%})"
        if math.isfinite(held_out.get("loss_improvement", math.nan))
        else ""
    )
    # None: a dense (unbanded) encoder
    bands = "" if mech["bands"] is None else f", bands={mech['bands']}"
    lines = [
        f"held-out    loss {_loss(held_out['initial_test_loss'])} → "
        f"{_loss(held_out['final_test_loss'])}{change}{acc} "
        f"{_evaluated(held_out['rounds_evaluated'], report['rounds_completed'])}{failed}",
        f"mechanism   {mech['kind']} ({mech['participation']}, k={mech['epochs']}, "
        f"b={mech['min_sep']}{bands}), {mech['rounds']} rounds; {part['kind']} ({part['mode']}) "
        f"participation, expected cohort {part['expected_cohort']:g}, k_u = "
        f"{part['items_per_user']}",
        f"privacy     ε = {'n/a (non-private)' if eps is None else f'{eps:.4f}'} realised (planned "
        f"{'n/a' if planned['epsilon'] is None else format(planned['epsilon'], '.4f')}), "
        f"δ = {report['delta']:g}, σ = {report['noise_multiplier']:.4g}, clip "
        f"{report['clip_norm']:g}, accountant {report['accountant']['name']}, sampling "
        f"{report['accountant'].get('sampling', 'none')}",
        *_sigma_lines(report, out),
        *(
            [f"noise       {describe_noise(report['noise_std_per_round'])}"]
            if report.get("noise_std_per_round")
            else []
        ),
        *(
            [f"accounting  {selection_line(report['accountant'])}"]
            if "bounds" in report["accountant"]
            else []
        ),
        _users_line(realized, out),
        *regime_lines(report),
        *_secure_aggregation_lines(report),
        *noise_worker_lines(report),
        *_vocabulary_lines(report),
        *(f"note        {note}" for note in mech.get("notes", [])),
        f"rounds      {report['rounds_completed']} completed"
        + (f"; stopped: {report['stopped_reason']}" if report.get("stopped_reason") else ""),
        f"report      {out / 'privacy_report.json'}",
    ]
    return "\n".join(lines)


def _sigma_lines(report: dict, out: Path) -> list[str]:
    """σ in both conventions, through the run's own factorization (none when its file is missing
    or is not the one the report names)."""
    from corrflow.accounting.noise_scale import both_conventions
    from corrflow.errors import CorrflowError, IntegrityError
    from corrflow.factorization.base import Factorization

    sigma = report.get("noise_multiplier")
    if not sigma:
        return []
    try:
        fac = Factorization.load(out / "factorization.npz")
    except (OSError, CorrflowError, IntegrityError, ValueError):
        return []
    if fac.sha256() != report["mechanism"].get("factorization_sha256", fac.sha256()):
        return []
    return [f"σ           {both_conventions(fac, sigma)}"]


def noise_node_lines(report: dict) -> list[str]:
    """The noise node's trust lines (none for a run without one)."""
    node = report.get("noise_node")
    if not node:
        return []
    head = node.get("journal_head") or "none yet"
    return [
        f"trust       a noise node (id {node['node_id']}, key {node['public_key'][:16]}…) adds "
        "the noise inside the secure sum: the server never sees an un-noised sum; private "
        "against the server unless it colludes with the noise node (privacy_report.json: "
        "trust_model)",
        f"noise node  {node['rounds_contributed']} rounds contributed; its journal head "
        f"{head[:16]}… (compare with the noise node's report)",
    ]


def _secure_aggregation_lines(report: dict) -> list[str]:
    """The trust model of a ``--secagg`` run, in two summary lines."""
    sa = report.get("secure_aggregation")
    if not sa:
        return []
    return [
        f"secagg      SecAgg+: the server saw {sa['server_saw'].split(';')[0]}; threshold "
        f"{sa['reconstruction_threshold']} of {sa['neighbours']} neighbours",
        *(
            noise_node_lines(report)
            or [
                "trust       honest-but-curious server (no consistency round); it holds each "
                "noiseless sum — DP protects the released models; clients must run the clipping "
                "(privacy_report.json: secure_aggregation)",
            ]
        ),
    ]


def _vocabulary_lines(report: dict) -> list[str]:
    """The vocabulary's provenance and the total (ε, δ) with it, for a run on a dataset file."""
    vocab, total = report.get("vocabulary"), report.get("total")
    if vocab is None:
        return []
    spent = (
        f" (ε = {vocab['epsilon']:g}, δ = {vocab['delta']:g})" if vocab["source"] == "dp" else ""
    )
    lines = [f"vocabulary  {vocab['words']} words, {vocab['source']}{spent}: {vocab['note']}"]
    if total and vocab["source"] == "dp":
        eps = "n/a" if total["epsilon"] is None else f"{total['epsilon']:.4f}"
        lines.append(
            f"total       ε = {eps}, δ = {total['delta']:g} (vocabulary + training, basic "
            "composition)"
        )
    return lines


def _users_line(realized: dict, out: Path) -> str:
    """Who trained, and how often (a public run), or where the operator finds it (amplified)."""
    users = realized["participation"]
    if "operator_only" in users:  # an amplified run: nothing public depends on the secret cohorts
        return (
            "users       secret cohorts (amplified ε): who trained, and the per-round reply "
            f"counts, are in {out / users['operator_only']} and {out / 'operator'} (owner-only); "
            f"policy {users['policy']}"
        )
    count = users["max_participations"]
    gap = (
        "no user trained twice" if users["min_gap"] is None else f"smallest gap {users['min_gap']}"
    )
    # schema 3: a count, each user's entry in the per-user store; before, every user inline
    number = users["user_count"] if "user_count" in users else len(users["users"])
    store = f" (each in {users['per_user']['store']})" if "per_user" in users else ""
    return (
        f"users       {number}{store}, at most {count} round{'' if count == 1 else 's'} "
        f"each, {gap}; {realized['rejections']} rejection(s), {len(users['overrides'])} "
        f"override(s), policy {users['policy']}"
    )


def _evaluated(evaluated: int, completed: int) -> str:
    """How many of the completed rounds were evaluated on held-out data (``--eval-every``)."""
    if evaluated == completed:
        return f"over {completed} rounds"
    return f"over {completed} rounds ({evaluated} evaluated)"
