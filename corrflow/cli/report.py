"""``corrflow report DIR``: re-print a finished or stopped run's summary from its files."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from corrflow.cli.common import emit, fail
from corrflow.cli.summary import run_summary
from corrflow.errors import CorrflowError
from corrflow.planning.learnability import held_out_summary
from corrflow.planning.plots import try_write_run_plot
from corrflow.run.journal import JOURNAL
from corrflow.run.reading import participation_users, read_run


def report_command(
    run_dir: Annotated[Path, typer.Argument(help="a run's directory (simulate's --out)")],
    plot: Annotated[
        bool, typer.Option(help="write DIR/run.png (held-out loss and ε spent per round)")
    ] = True,
    as_json: Annotated[
        bool, typer.Option("--json", help="print the privacy report as one JSON object")
    ] = False,
) -> None:
    """Re-print a run's summary, the one `corrflow simulate` printed, from its files (read only,
    nothing trained), and write its loss/ε-per-round plot (skipped with a note where DIR cannot be
    written). Exit 2 when DIR holds no run (a compare folder: its runs are listed) or its files
    are not a run's."""
    try:
        report, metrics = read_run(run_dir)
        held_out = held_out_summary(metrics)
        # each user's entry, from the per-user store (checked against the report's digest)
        users = participation_users(report, run_dir)
        if as_json:
            emit({**_with_users(report, users), "held_out": held_out}, True)
        else:
            typer.echo(run_summary(report, run_dir, held_out))
        if not _note_report_behind_journal(report, run_dir):
            _note_stopped(report)
        if plot:
            written, note = try_write_run_plot(metrics, report, run_dir / "run.png")
            typer.echo(f"plot: {written}" if written else note, err=True)
    except CorrflowError as exc:
        fail(exc)
    except OSError as exc:
        typer.echo(f"error: {run_dir}: {exc.strerror or exc}", err=True)
        raise typer.Exit(code=1) from None


def _with_users(report: dict, users: dict | None) -> dict:
    """The report with each user's entry listed under ``realized.participation.users`` (as a
    report listed them before the per-user store; None or an amplified run's: as published)."""
    part = report.get("realized", {}).get("participation", {})
    if users is None or "per_user" not in part:
        return report
    realized = {**report["realized"], "participation": {**part, "users": users}}
    return {**report, "realized": realized}


def _note_stopped(report: dict) -> None:
    """Say so when the run released fewer rounds than planned, and why it stopped."""
    planned = report.get("mechanism", {}).get("rounds", 0)
    if report.get("rounds_completed", 0) >= planned:
        return
    why = f"; it stopped: {report['stopped_reason']}" if report.get("stopped_reason") else ""
    typer.echo(
        f"note: the run released {report['rounds_completed']} of {planned} rounds{why}", err=True
    )


def _note_report_behind_journal(report: dict, run_dir: Path) -> bool:
    """Say so when the release journal records more rounds than the report covers (and return
    True): the report is complete every ``report_every`` rounds, and a server killed in between
    leaves it behind until the run resumes."""
    journal = run_dir / JOURNAL
    if not journal.is_file():
        return False
    with open(journal, "rb") as f:
        released = sum(1 for line in f if line.endswith(b"\n"))
    covered = int(report.get("rounds_completed", 0))
    if released > covered:
        typer.echo(
            f"note: the release journal records {released} released rounds, this report covers "
            f"{covered}: the server stopped between two of its complete reports (every "
            f"{report.get('report_every', 1)} rounds); rerun the run's command to resume it — it "
            "completes the report first",
            err=True,
        )
    return released > covered
