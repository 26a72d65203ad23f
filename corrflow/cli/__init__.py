"""The ``corrflow`` command (docs "Conventions"): one subcommand per job, one module per command.

``--json`` prints exactly one JSON object as the last stdout line; progress goes to stderr; bad
arguments exit with code 2 and name the argument. Each command's shared options come from the
settings model (`corrflow.cli.options`); the spellings an earlier release published still work,
with a warning naming the new flag (`corrflow.cli.aliases`).
"""

from __future__ import annotations

import sys

import typer

from corrflow.cli.account import account
from corrflow.cli.aliases import AliasedCommand
from corrflow.cli.audit import audit
from corrflow.cli.compare import compare_command
from corrflow.cli.data import data_app
from corrflow.cli.factorize import factorize
from corrflow.cli.noise import noise_app
from corrflow.cli.noise_node import noise_node
from corrflow.cli.options import with_settings
from corrflow.cli.plan import plan
from corrflow.cli.report import report_command
from corrflow.cli.runs import runs_app
from corrflow.cli.schema import schema_command
from corrflow.cli.simulate import simulate
from corrflow.errors import InvalidArgumentError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="corrflow: federated learning with differential privacy through correlated noise.",
)


@app.callback()
def _root() -> None:
    """corrflow: federated learning with differential privacy through correlated noise."""


for _name, _command in (
    ("factorize", factorize),
    ("account", account),
    ("plan", plan),
    ("simulate", simulate),
    ("audit", audit),
    ("compare", compare_command),
):
    app.command(_name, cls=AliasedCommand)(with_settings(_command, _name))
app.command("report")(report_command)
app.command("schema")(schema_command)
app.command("noise-node")(noise_node)
app.add_typer(noise_app, name="noise")
app.add_typer(data_app, name="data")
app.add_typer(runs_app, name="runs")


def main() -> None:
    """The ``corrflow`` console script."""
    try:
        app()
    except InvalidArgumentError as exc:  # raised before a command could catch it
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)


__all__ = ["app", "main"]
