"""``corrflow audit``: an empirical privacy audit of one run with canary users."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from corrflow.accounting.audit import candidates_for_ceiling
from corrflow.cli.common import as_flag, emit, fail
from corrflow.cli.options import Verbosity, given_on_command_line, param_name
from corrflow.cli.run_settings import (
    apply_preset,
    check_first_round,
    refusal_leaves,
    simulate_config,
)
from corrflow.config import RunConfig
from corrflow.errors import CorrflowError, IntegrityError, InvalidArgumentError
from corrflow.planning.resources import check_fits, estimate

#: ``corrflow audit``'s exit code when the whole interval of the estimate lies above the claim
# but the lower bound does not prove it.
AUDIT_SUSPECT_EXIT = 5

Canaries = Annotated[
    int,
    typer.Option(
        help="candidate canary users; each is inserted by a fair coin (about half), the rest are "
        "the held-out null"
    ),
]
Preset = Annotated[
    str | None,
    typer.Option(
        help="a `corrflow compare` preset (quick, tiny, large, stackoverflow) for the task and "
        "schedule; flags you type override it"
    ),
]
AuditSeed = Annotated[
    int | None,
    typer.Option(help="seed of the canaries' directions and coins (default: fresh; printed)"),
]
Plan = Annotated[
    Path | None,
    typer.Option(
        help="a recipe written by `corrflow plan` (OUT/recipe.json), as for `corrflow simulate`"
    ),
]
AuditBackend = Annotated[
    str,
    typer.Option(
        help="inprocess: one Flower message per client; cohort: a round's clients trained "
        "together (numpy and nextword tasks), as `corrflow simulate --backend cohort`"
    ),
]


def audit(
    ctx: typer.Context,
    canaries: Canaries = 200,
    preset: Preset = None,
    audit_seed: AuditSeed = None,
    plot: Annotated[bool, typer.Option(help="write OUT/audit.png (score histograms)")] = True,
    verbose: Verbosity = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="print the audit as one JSON object")
    ] = False,
    plan: Plan = None,
    backend: AuditBackend = "inprocess",
    **settings,
) -> None:
    """Empirical privacy audit: train once, in process, with canary users added to the population
    (scheduled, clipped, noised and accounted like real users; each returns a fixed random direction
    scaled to the clip norm), then report the run's claimed ε, the one-shot estimate ε̂ (Andrew et
    al., arXiv 2302.03098) and a 95% lower bound ε_lo (Steinke, Nasr, Jagielski, arXiv 2305.08846)
    from the released models. Always a new run in --out (default corrflow_audit; an earlier run
    there is moved aside). Exit codes: 0 consistent (nothing shown above the claim), 1 the run
    failed, 2 bad arguments, 4 VIOLATION (ε_lo exceeds the claimed ε at 95% confidence), 5 SUSPECT
    (ε_lo does not exceed the claim, but the whole 95% bootstrap interval of ε̂ lies above it — its
    lower end exceeds the claimed ε: rerun with more canaries).
    When the largest ε_lo this many canaries can show is below the claim, a note says so and how
    many would lift it."""
    try:
        typed = given_on_command_line(ctx)
        apply_preset(preset, settings, typed, plan)
        if "state_dir" not in typed:
            settings[param_name("state_dir")] = Path("corrflow_audit")
        _check_canaries(canaries, settings.get(param_name("mode")))
        cfg = simulate_config(ctx, settings, plan, fresh=True)
        check_first_round(cfg)
        _check_audit_fits(cfg, canaries)
        _check_backend(cfg, backend)
    except InvalidArgumentError as exc:
        fail(as_flag(exc))
    except (CorrflowError, IntegrityError) as exc:
        fail(exc, settings)
    with refusal_leaves(Path(cfg.state_dir)):
        _run_audit(cfg, canaries, audit_seed, plot, verbose is True, as_json, backend)


def _check_canaries(canaries: int, mode: str | None) -> None:
    """Enough candidate canaries, each a simulated cross-device SuperNode."""
    # The canaries are Flower ClientApps: their module loads Flower, only when an audit starts.
    from corrflow.strategies.canaries import MIN_CANARIES

    if canaries < MIN_CANARIES:
        raise InvalidArgumentError(
            "--canaries", f"at least {MIN_CANARIES} candidate canaries", canaries
        )
    if mode not in (None, "cross-device"):
        raise InvalidArgumentError(
            "--mode", "cross-device (a canary is a simulated SuperNode)", mode
        )


def _check_audit_fits(cfg: RunConfig, canaries: int) -> None:
    """Every candidate canary is a simulated SuperNode with its own draws: its memory counts too."""
    check_fits(
        estimate(
            cfg.num_users + canaries, cfg.num_rounds, cfg.kind, cfg.bands or cfg.b, cfg.model_dim
        ),
        {
            "users": "--canaries" if canaries > cfg.num_users else "--users",
            "factorization": "--rounds",
            "noise": ("--bands", "--model-dim"),
        },
    )


def _check_backend(cfg: RunConfig, backend: str) -> None:
    """An engine the audit trains on, serving these settings."""
    # The audit's module loads Flower: only when an audit starts.
    from corrflow.server.audit import check_audit_backend

    check_audit_backend(cfg, backend)


def _run_audit(
    cfg: RunConfig,
    canaries: int,
    audit_seed: int | None,
    plot: bool,
    verbose: bool,
    as_json: bool,
    backend: str = "inprocess",
) -> None:
    """Run the audit, print it, and exit with the code its verdict earned."""
    # The audit trains a run in process, with Flower's messages: only when an audit starts.
    from corrflow.server.audit import run_audit
    from corrflow.server.simulation import RunInterruptedError

    try:
        result = run_audit(cfg, canaries, audit_seed, backend=backend, verbose=verbose, plot=plot)
    except RunInterruptedError as exc:
        typer.echo(f"interrupted: {exc}; no audit was computed", err=True)
        raise typer.Exit(code=130) from None
    except InvalidArgumentError as exc:
        fail(as_flag(exc))
    except (CorrflowError, IntegrityError) as exc:
        fail(exc, cfg.model_dump())
    if as_json:
        emit(result, True)
    else:
        typer.echo(audit_summary(result))
    typer.echo(f"audit: {result['verdict']}", err=True)
    if result["run"]["stopped_reason"]:
        typer.echo(
            f"note: the run stopped early ({result['run']['stopped_reason']}); the audit covers "
            f"the {result['run']['rounds_completed']} rounds released",
            err=True,
        )
    _note_ceiling(result)
    claimed = result["epsilon_claimed"]
    if claimed is not None and result["epsilon_lower"] > claimed:
        raise typer.Exit(code=4)
    if result["verdict"].startswith("SUSPECT"):
        raise typer.Exit(code=AUDIT_SUSPECT_EXIT)


def _note_ceiling(result: dict) -> None:
    """Say so when this many canaries cannot prove a violation of the claim, and how many could."""
    claimed = result["epsilon_claimed"]
    ceiling = result["canaries"]["lower_bound_ceiling"]
    if claimed is None or ceiling > claimed:
        return
    need = candidates_for_ceiling(claimed, result["delta"])
    if need is not None:
        more = f"about {need} candidates (--canaries {need}) would lift the ceiling above the claim"
    else:
        more = (
            "no number of candidates up to a million lifts the ceiling above it at δ = "
            f"{result['delta']:g} (the bound's δ term grows with the count)"
        )
    typer.echo(
        f"note: with {result['canaries']['candidates']} candidates ε_lo can be at most "
        f"{ceiling:.3g}, below the claimed ε = {claimed:.3g}: this audit cannot prove a "
        f"violation, only estimate one; {more}",
        err=True,
    )


def audit_summary(r: dict) -> str:
    """The audit for people.

    Args:
        r: the audit (audit.json's content).

    Returns:
        Seven lines: claim, estimate, lower bound, final-model estimate, canaries, verdict and
        files.
    """
    st, c = r["statistics"], r["canaries"]
    lb = st["lower_bound"]
    lo, hi = r["epsilon_estimate_interval"]
    run = r["run"]
    return "\n".join(
        [
            f"claimed     ε = {r['epsilon_claimed']:.4g} at δ = {r['delta']:g} ({run['kind']}, "
            f"{run['participation']}, σ = {run['noise_multiplier']:.4g}, accountant "
            f"{run['accountant']})",
            f"estimate    ε̂ = {r['epsilon_estimate']:.4g} (95% bootstrap interval {lo:.3g} – "
            f"{hi:.3g}); all-iterates whitened scores: inserted mean "
            f"{st['whitened']['mean']:.3g} ± {st['whitened']['std']:.3g}, held-out "
            f"{st['whitened']['null_mean']:.3g} ± {st['whitened']['null_std']:.3g}",
            f"lower bnd   ε_lo = {r['epsilon_lower']:.4g} at {r['confidence']:.0%} confidence "
            f"({lb['correct']} of {lb['guesses_in'] + lb['guesses_out']} guesses correct; at most "
            f"{c['lower_bound_ceiling']:.3g} with {c['candidates']} candidates)",
            f"final model ε̂ = {st['final_model']['epsilon']:.4g} (cosine with θ_T − θ_0, Andrew "
            "et al.)",
            f"canaries    {c['inserted']} inserted, {c['held_out']} held out, audit seed "
            f"{c['audit_seed']}; {c['population_share']:.1%} of the population",
            f"verdict     {r['verdict']}",
            f"files       {run['dir']}/audit.json" + (f", {r['plot']}" if r.get("plot") else ""),
        ]
    )
