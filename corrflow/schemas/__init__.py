"""JSON Schemas (draft 2020-12) of the files a corrflow run publishes: ``privacy_report.json``
(``privacy-report``), ``recipe.json`` (``recipe``, written by ``corrflow plan``) and
``metrics.json`` (``metrics``). ``corrflow schema NAME`` prints one; `validate` checks a
document against one with the ``jsonschema`` library."""

from __future__ import annotations

import json
from functools import cache
from importlib import resources

from corrflow.errors import InvalidArgumentError

#: Schema name → the file it describes.
SCHEMAS: dict[str, str] = {
    "privacy-report": "privacy_report.json",
    "recipe": "recipe.json",
    "metrics": "metrics.json",
}


@cache
def _text(name: str) -> str:
    if name not in SCHEMAS:
        raise InvalidArgumentError("name", f"a schema name ({', '.join(SCHEMAS)})", name)
    return resources.files(__name__).joinpath(f"{name}.json").read_text(encoding="utf-8")


def load_schema(name: str) -> dict:
    """The JSON Schema called ``name``.

    Args:
        name: one of `SCHEMAS` (``privacy-report``, ``recipe``, ``metrics``).

    Returns:
        The schema as a dict (a fresh copy).

    Raises:
        InvalidArgumentError: ``name`` is not a known schema.
    """
    return json.loads(_text(name))


def validate(name: str, document: object) -> None:
    """Check ``document`` (parsed JSON) against the schema ``name``.

    Args:
        name: one of `SCHEMAS`.
        document: the parsed file, e.g. ``json.load(open("privacy_report.json"))``.

    Raises:
        jsonschema.ValidationError: the document does not match; its message names the failing path.
    """
    import jsonschema

    schema = load_schema(name)
    jsonschema.validators.validator_for(schema).check_schema(schema)
    jsonschema.validate(document, schema, cls=jsonschema.Draft202012Validator)
