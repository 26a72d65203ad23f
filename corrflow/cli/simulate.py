"""``corrflow simulate``: run a federated simulation with correlated noise and print its privacy
report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from corrflow.cli.common import PerParticipation, emit, fail
from corrflow.cli.options import Verbosity, given_on_command_line, param_name
from corrflow.cli.run_settings import (
    apply_preset,
    check_first_round,
    refusal_leaves,
    simulate_config,
)
from corrflow.cli.summary import run_summary
from corrflow.config import RunConfig
from corrflow.errors import CorrflowError, IntegrityError, InvalidArgumentError
from corrflow.planning.learnability import held_out_summary
from corrflow.run.checkpoint import has_checkpoint
from corrflow.run.resume import preflight, settings_conflict, verify_finished_ledger

#: The engines a simulation runs on (`corrflow.server.simulation.simulate`'s ``backend``): a new
# one is a line here.
BACKENDS = {
    "flower": "Flower's simulation engine, Ray",
    "inprocess": "one process, Flower's messages without Ray",
    "cohort": "one process, a round's clients trained together (numpy and nextword tasks)",
}
Backend = Annotated[
    str,
    typer.Option(help="; ".join(f"{name}: {what}" for name, what in BACKENDS.items())),
]
Fresh = Annotated[
    bool,
    typer.Option(
        help="start a new run: move the previous run in --out aside (never deleted) instead of "
        "resuming it"
    ),
]
Plan = Annotated[
    Path | None,
    typer.Option(
        help="a recipe written by `corrflow plan` (OUT/recipe.json): its mechanism, "
        "participation, accountant, σ and population (--users); flags that differ are refused"
    ),
]
Preset = Annotated[
    str | None,
    typer.Option(
        help="a `corrflow compare` preset (quick, tiny, large, stackoverflow) for the task and "
        "schedule: users, rounds, epochs, ε, δ, client and optimizer; flags you type override it"
    ),
]


def simulate(
    ctx: typer.Context,
    backend: Backend = "flower",
    fresh: Fresh = False,
    verbose: Verbosity = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="print the privacy report as one JSON object")
    ] = False,
    plan: Plan = None,
    preset: Preset = None,
    noise_multiplier_per_participation: PerParticipation = None,
    **settings,
) -> None:
    """Run a federated simulation with correlated noise and print its privacy report. Rerunning the
    same command resumes from the checkpoint in --out. Exit codes: 0 done, 1 stopped before the
    planned rounds (the report says why) or refused, 2 bad arguments, 3 finished but did not learn
    (held-out loss not below the initial model's; the report's `learning` has the verdict), 130
    interrupted (state and report are complete; rerun to continue)."""
    try:
        if backend not in BACKENDS:
            raise InvalidArgumentError("--backend", f"one of {', '.join(BACKENDS)}", backend)
        if preset is not None and settings.get(param_name("mode")) == "cross-silo":
            raise InvalidArgumentError(
                "--preset",
                "no preset with --mode cross-silo (the manifest fixes the population)",
                preset,
            )
        apply_preset(preset, settings, given_on_command_line(ctx), plan)
        cfg = simulate_config(ctx, settings, plan, fresh, noise_multiplier_per_participation)
    except InvalidArgumentError as exc:
        fail(exc)
    except (CorrflowError, IntegrityError) as exc:
        fail(exc, settings)
    out = Path(cfg.state_dir)
    if fresh or not has_checkpoint(cfg.checkpoint_dir):  # before --out is locked
        try:
            check_first_round(cfg)
        except InvalidArgumentError as exc:
            fail(exc)
    with refusal_leaves(out):
        complete = _check_resume(cfg, out, fresh)
        _run_simulation(cfg, out, backend, fresh, verbose is True, as_json, complete)


def _check_resume(cfg: RunConfig, out: Path, fresh: bool) -> bool:
    """Refuse a directory holding another run (exit 2, naming what differs) or one that disagrees
    with its journal (exit 1); say whether the run resumes or is already complete. Returns whether
    it is complete."""
    try:
        if not fresh and (diff := settings_conflict(cfg.checkpoint_dir, cfg.run_settings())):
            raise InvalidArgumentError(
                "--out",
                "the directory of a run with the same settings, or --fresh to move that run aside "
                f"and start anew; {out} holds a run with other settings",
                diff,
            )
        resume = None if fresh else preflight(out)
    except CorrflowError as exc:
        fail(exc)
    if resume is None or resume.checkpoint is None:
        return False
    done = len(resume.journal)
    if done < cfg.num_rounds:
        typer.echo(f"resuming: {done} of {cfg.num_rounds} rounds already released", err=True)
    else:
        try:
            verify_finished_ledger(out)
        except CorrflowError as exc:
            fail(exc)
        typer.echo(
            f"already complete: all {cfg.num_rounds} rounds were released; nothing to train "
            "(--fresh starts a new run)",
            err=True,
        )
    return done >= cfg.num_rounds


def _run_simulation(
    cfg: RunConfig,
    out: Path,
    backend: str,
    fresh: bool,
    verbose: bool,
    as_json: bool,
    complete: bool,
) -> None:
    """Train (unless complete), print the summary or the report, and exit with the code the run
    earned."""
    # The simulation loads Flower (and Ray for --backend flower): only when a run starts.
    from corrflow.server.simulation import RunInterruptedError, RunStoppedEarlyError
    from corrflow.server.simulation import simulate as run_sim

    try:
        stopped = None
        try:
            report = (
                json.loads((out / "privacy_report.json").read_text())
                if complete
                else run_sim(cfg, backend=backend, fresh=fresh, verbose=verbose)
            )
        except RunStoppedEarlyError as exc:
            report, stopped = exc.report, exc
        _print_run(report, out, as_json)
        if stopped is not None:
            typer.echo(
                f"error: the run stopped after {report['rounds_completed']} of {cfg.num_rounds} "
                f"rounds: {stopped}",
                err=True,
            )
            raise typer.Exit(code=1)
        # the session logged the verdict; the summary's held-out line repeats it
        if report.get("learning", {}).get("learned") is False:
            raise typer.Exit(code=3)
    except RunInterruptedError as exc:
        kept = (
            f"State and report in {out} are complete; rerun the same command to continue."
            if (out / "privacy_report.json").exists()
            else "Nothing was trained or accounted; rerun the same command to start."
        )
        typer.echo(f"interrupted: {exc}. {kept}", err=True)
        raise typer.Exit(code=130) from None
    except (CorrflowError, IntegrityError) as exc:
        fail(exc, cfg.model_dump())
    # a full disk, a vanished mount: the last checkpoint and journal are consistent
    except OSError as exc:
        typer.echo(
            f"error: could not write the run's files in {out}: {exc.strerror or exc} "
            f"({exc.filename or out}). Everything released so far is checkpointed and journaled; "
            "fix the cause and rerun to resume.",
            err=True,
        )
        raise typer.Exit(code=1) from None


def _print_run(report: dict, out: Path, as_json: bool) -> None:
    """The run's summary, or its privacy report as one JSON object, with the held-out progress."""
    held_out = held_out_summary(json.loads((out / "metrics.json").read_text()))
    if as_json:
        emit({**report, "held_out": held_out}, True)
    else:
        typer.echo(run_summary(report, out, held_out))
