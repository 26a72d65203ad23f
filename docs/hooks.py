"""mkdocs hooks: the generated reference. Pages hold a marker (an HTML comment such as ``<!--
corrflow:cli -->``) that is replaced at build time by text generated from the code — the typer app
(CLI), the settings model (run-config keys), the shipped JSON Schemas, the factorization registry
and the README's References — so the reference cannot drift from what corrflow does."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


# -- the command line ------------------------------------------------------------------------------
def cli_reference() -> str:
    import click
    import typer

    from corrflow.cli import app

    root = typer.main.get_command(app)
    out: list[str] = []

    def walk(cmd: click.Command, path: list[str]) -> None:
        if isinstance(cmd, click.Group):
            for name in sorted(cmd.commands):
                walk(cmd.commands[name], [*path, name])
            return
        name = " ".join(path)
        ctx = click.Context(cmd, info_name=name)
        out.append(f"## `corrflow {name}`\n")
        out.append(
            "```text\n" + "corrflow " + " ".join([name, *cmd.collect_usage_pieces(ctx)]) + "\n```\n"
        )
        if cmd.help:
            out.append(cmd.help.strip() + "\n")
        rows = []
        for param in cmd.params:
            if isinstance(param, click.Argument):
                rows.append(
                    (f"`{param.human_readable_name}` (argument)", param.type.name, "required", "")
                )
                continue
            if param.hidden:
                continue
            names = ", ".join(f"`{n}`" for n in [*param.opts, *param.secondary_opts])
            default = (
                ""
                if param.default in (None, "") or callable(param.default)
                else f"`{param.default}`"
            )
            if param.required:
                default = "required"
            kind = "flag" if param.is_flag else param.type.name
            rows.append((names, kind, default, getattr(param, "help", "") or ""))
        if rows:
            out.append("| option | type | default | meaning |\n|---|---|---|---|")
            out.extend("| " + " | ".join(_cell(c) for c in row) + " |" for row in rows)
            out.append("")

    walk(root, [])
    return "\n".join(out)


# -- run-config keys -------------------------------------------------------------------------------
def run_config_reference() -> str:
    from corrflow.config import RunConfig, help_text, settings_on, surface_default, surface_name

    rows = [
        "| run-config key | `corrflow simulate` flag | wrapper keyword | default | expected | "
        "meaning |",
        "|---|---|---|---|---|---|",
    ]
    exposed = settings_on("run_config")
    for name in RunConfig.model_fields:
        info = RunConfig.model_fields[name]
        meta = info.json_schema_extra or {}
        surfaces = meta.get("surfaces", [])
        key = f"`{surface_name(name, 'run_config')}`" if name in exposed else "—"
        flag = f"`{surface_name(name, 'cli')}`" if "cli" in surfaces else "—"
        kw = f"`{surface_name(name, 'wrapper')}`" if "wrapper" in surfaces else "—"
        default = surface_default(name, "run_config")
        default = "unset" if default is None else f"`{getattr(default, 'value', default)}`"
        rows.append(
            "| "
            + " | ".join(
                [key, flag, kw, default, _cell(meta.get("expected", "")), _cell(help_text(name))]
            )
            + " |"
        )
    return "\n".join(rows)


# -- JSON Schemas ----------------------------------------------------------------------------------
def schemas_reference() -> str:
    from corrflow.schemas import SCHEMAS, load_schema

    out = []
    for name, file in SCHEMAS.items():
        schema = load_schema(name)
        out.append(f"## `{file}` — `corrflow schema {name}`\n")
        out.append(schema.get("description", "") + "\n")
        body = schema if schema.get("type") == "object" else schema.get("items", {})
        required = set(body.get("required", []))
        if body.get("properties"):
            out.append("| field | type | required | meaning |\n|---|---|---|---|")
            for field, spec in body["properties"].items():
                kind = spec.get(
                    "type",
                    "const " + json.dumps(spec["const"])
                    if "const" in spec
                    else "one of " + ", ".join(map(str, spec.get("enum", [])))
                    if "enum" in spec
                    else "object",
                )
                if isinstance(kind, list):
                    kind = " or ".join(kind)
                out.append(
                    "| "
                    + " | ".join(
                        [
                            f"`{field}`",
                            _cell(kind),
                            "yes" if field in required else "",
                            _cell(spec.get("description", "")),
                        ]
                    )
                    + " |"
                )
            out.append("")
        out.append(
            f'??? note "The whole schema ({file})"\n\n    ```json\n'
            + "\n".join(
                "    " + line
                for line in json.dumps(schema, indent=2, ensure_ascii=False).splitlines()
            )
            + "\n    ```\n"
        )
    return "\n".join(out)


# -- factorization kinds ---------------------------------------------------------------------------
def kinds_reference() -> str:
    from corrflow.factorization.registry import REGISTRY

    rows = [
        "| kind | what | encoder structure | noise mode | accountants |",
        "|---|---|---|---|---|",
    ]
    for kind, spec in REGISTRY.items():
        rows.append(
            "| "
            + " | ".join(
                [
                    f"`{kind}`",
                    _cell(spec.description),
                    _cell(spec.structure),
                    _cell(spec.noise_mode),
                    _cell(", ".join(spec.accountants)),
                ]
            )
            + " |"
        )
    return "\n".join(rows)


# -- references ------------------------------------------------------------------------------------
def references() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(r"^## References\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    if not match:
        raise RuntimeError("README.md has no '## References' section")
    return match.group(1).strip()


GENERATORS = {
    "cli": cli_reference,
    "run-config": run_config_reference,
    "schemas": schemas_reference,
    "kinds": kinds_reference,
    "references": references,
}
MARKER = re.compile(r"<!-- corrflow:([a-z-]+) -->")


def on_page_markdown(markdown: str, page, config, files) -> str:
    def replace(m: re.Match) -> str:
        name = m.group(1)
        if name not in GENERATORS:
            raise ValueError(
                f"{page.file.src_path}: unknown generated section {name!r} (known: "
                f"{sorted(GENERATORS)})"
            )
        return GENERATORS[name]()

    return MARKER.sub(replace, markdown)
