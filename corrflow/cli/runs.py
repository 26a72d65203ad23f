"""``corrflow runs``: operate on run directories (``corrflow runs adopt DIR``, see
`corrflow.server.runs`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from corrflow.cli.common import AsJson
from corrflow.cli.options import cli_values, with_settings
from corrflow.config import validated_fields
from corrflow.errors import CorrflowError, IntegrityError, InvalidArgumentError
from corrflow.server.runs import adopt_run

runs_app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Operate on run directories."
)


def adopt_command(
    run_dir: Annotated[
        Path, typer.Argument(metavar="DIR", help="the run directory to adopt", show_default=False)
    ],
    as_json: AsJson = False,
    **settings,
) -> None:
    """Adopt a moved or restored run directory: the release registry binds the run to DIR, so that
    it resumes there. Rounds the registry saw released beyond DIR's journal are released again
    with fresh noise keys (listed in the privacy report). Adopt only the copy that goes on: two
    adopted copies of one run are two releases of its rounds."""
    try:
        registry = validated_fields(cli_values(settings), "cli").get("release_registry")
        rec = adopt_run(run_dir, registry or None)
    except InvalidArgumentError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from None
    except (CorrflowError, IntegrityError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=1) from None
    if as_json:
        print(json.dumps(rec, sort_keys=True))
        return
    moved = f" (was registered in {rec['previous_dir']})" if rec["previous_dir"] else ""
    print(f"adopted run {rec['run_id']} in {rec['run_dir']}{moved}; registry {rec['registry']}")
    again = rec["rounds_released_again"]
    if again:
        print(
            f"rounds {again[0] + 1}–{again[-1] + 1} were released before by another copy; this run "
            "releases them again with fresh noise keys (the privacy report lists the adoption)"
        )


# --release-registry comes from the settings model (`COMMAND_SETTINGS`), as in every command.
runs_app.command("adopt")(with_settings(adopt_command, "runs adopt"))
