"""``corrflow schema NAME``: print the JSON Schema of a file corrflow writes (privacy-report,
recipe, metrics)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from corrflow.errors import InvalidArgumentError
from corrflow.schemas import SCHEMAS, load_schema


def schema_command(
    name: Annotated[
        str,
        typer.Argument(
            help=f"which schema: {', '.join(f'{k} ({v})' for k, v in SCHEMAS.items())}",
            show_default=False,
        ),
    ],
    as_json: Annotated[
        bool, typer.Option("--json", help="print the schema as one JSON object on one line")
    ] = False,
) -> None:
    """Print the JSON Schema (draft 2020-12) of privacy_report.json, recipe.json or metrics.json.
    Validate a file with any JSON Schema tool, e.g. `corrflow schema privacy-report > s.json &&
    check-jsonschema --schemafile s.json OUT/privacy_report.json`."""
    if name not in SCHEMAS:
        typer.echo(
            f"error: {InvalidArgumentError('NAME', 'one of ' + ', '.join(SCHEMAS), name)}", err=True
        )
        raise typer.Exit(code=2)
    schema = load_schema(name)
    print(
        json.dumps(schema, ensure_ascii=False)
        if as_json
        else json.dumps(schema, indent=2, ensure_ascii=False)
    )
