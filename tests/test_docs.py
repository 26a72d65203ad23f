"""Docs that cannot rot: the documentation site builds with `mkdocs build --strict` (broken links,
anchors and references fail; the CLI, run-config, schema and API reference pages are generated from
the code), and every example in it runs.

Snippet markers — an HTML comment on the line right before a fenced block (invisible in the rendered
page):

* Python blocks run unless marked ``<!-- doctest: skip REASON -->``; the blocks of one page run in
  order in one namespace and one fresh working directory. ``<!-- doctest: run wrapper -->`` also
  drives the snippet's ServerApp ``main`` over an in-process grid of 10 nodes answered by its
  ClientApp's ``train``, as a Flower engine would.
* Shell blocks are syntax-checked (``bash -n``); ``<!-- doctest: run -->`` runs them (bash -euo
  pipefail, in the page's directory, with ``corrflow`` on PATH); ``<!-- doctest: loopback -->``
  checks them against ``deploy/loopback.sh``, the deployment the suite really runs (same programs,
  same flags, node-config keys, run-config keys that Flower parses and corrflow accepts) — a real
  deployment per snippet would take minutes.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
LOOPBACK = ROOT / "deploy" / "loopback.sh"
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
MARKER = re.compile(r"^<!-- doctest: (run|skip|loopback)(?: (.*?))? -->$")
MIN_RUNNABLE = 15


@dataclass(frozen=True)
class Snippet:
    page: Path
    line: int
    lang: str
    code: str
    mode: str  # run | skip | loopback | check (shell: syntax only)
    arg: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def snippets(page: Path) -> list[Snippet]:
    text = page.read_text(encoding="utf-8")
    out = []
    for m in FENCE.finditer(text):
        lang = m.group(1).lower()
        line = text.count("\n", 0, m.start()) + 1
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.match(before.strip())
        mode, arg = (marker.group(1), marker.group(2) or "") if marker else ("", "")
        if lang in ("python", "py"):
            mode = mode or "run"
        elif lang in ("bash", "sh", "shell"):
            mode = mode or "check"
        out.append(Snippet(page, line, lang, m.group(2), mode, arg))
    return out


PAGES = sorted(DOCS.rglob("*.md"))
ALL = [s for page in [*PAGES, README] for s in snippets(page)]
RUN_PAGES = sorted({s.page for s in ALL if s.mode == "run" and s.page != README})


def test_readme_is_a_short_guide_that_starts_with_the_setup_commands():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 150, len(lines)
    assert lines[2] == "```bash" and "corrflow simulate" in lines[3] and "pytest" in lines[4], (
        lines[:6]
    )
    assert "## References" in lines and all(f"**00{i}**" in "\n".join(lines) for i in range(5))


def test_docs_build_strictly_with_generated_reference(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-f",
            str(ROOT / "mkdocs.yml"),
            "-d",
            str(site),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    pages = list(site.rglob("index.html"))
    assert len(pages) >= 10, pages
    from corrflow.server.cli import app

    cli = (site / "reference" / "cli" / "index.html").read_text(encoding="utf-8")
    for command in [c.name or c.callback.__name__ for c in app.registered_commands]:
        assert f"corrflow {command}" in cli, command
    assert "corrflow noise sample" in cli and "corrflow data generate" in cli
    keys = (site / "reference" / "run-config" / "index.html").read_text(encoding="utf-8")
    from corrflow.config import settings_on, surface_name

    for name in settings_on("run_config"):
        assert surface_name(name, "run_config") in keys, name
    api = (site / "reference" / "api" / "corrflow" / "index.html").read_text(encoding="utf-8")
    assert "DifferentialPrivacyCorrelatedNoise" in api and "register_identity" in api
    assert (
        "Factorization" in (site / "reference" / "api" / "factorization" / "index.html").read_text()
    )
    assert "arXiv:2211.06530" in (site / "reference" / "papers" / "index.html").read_text()
    assert (site / "compare_quick_accuracy.png").exists() and (
        site / "compare_quick_keras_accuracy.png"
    ).exists()


def test_every_snippet_is_valid_and_enough_of_them_run(tmp_path):
    runnable = [s for s in ALL if s.mode == "run"]
    assert len(runnable) >= MIN_RUNNABLE, [s.where for s in runnable]
    assert any(s.arg == "wrapper" for s in runnable), "the wrapper example must run"
    assert sum(s.mode == "loopback" for s in ALL) >= 5, "the deployment steps must be checked"
    for s in ALL:
        if s.mode == "skip":
            assert s.arg, f"{s.where}: a skipped snippet says why"
        if s.lang in ("python", "py"):
            compile(s.code, s.where, "exec")
        elif s.lang in ("bash", "sh", "shell"):
            res = subprocess.run(["bash", "-n"], input=s.code, capture_output=True, text=True)
            assert res.returncode == 0, f"{s.where}: {res.stderr}"
        elif s.lang == "toml":
            tomllib.loads(s.code)
        elif s.lang == "json":
            json.loads(s.code)


@pytest.fixture(scope="module")
def shared_home(tmp_path_factory):
    """One CORRFLOW_HOME for every page, so `corrflow plan`'s measurements are cached once."""
    return tmp_path_factory.mktemp("corrflow_home")


def _environment(workdir: Path, home: Path) -> dict:
    shim = workdir / ".bin"
    shim.mkdir(exist_ok=True)
    corrflow = shim / "corrflow"
    corrflow.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m corrflow.server.cli "$@"\n')
    corrflow.chmod(0o755)
    path = os.pathsep.join(
        [str(shim), str(Path(sys.executable).parent), os.environ.get("PATH", "")]
    )
    return {
        **os.environ,
        "PATH": path,
        "PYTHONPATH": str(ROOT),
        "CORRFLOW_HOME": str(home),
        "MPLBACKEND": "Agg",
    }


def _drive_wrapper_app(namespace: dict) -> None:
    """Run the snippet's ServerApp main over an in-process grid answered by its ClientApp's train
    handler."""
    from flwr.app import Context, RecordDict

    from corrflow.server.inprocess import InProcessGrid

    grid = InProcessGrid({"train": namespace["train"]}, 10)
    namespace["main"](
        grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
    )


@pytest.mark.parametrize("page", RUN_PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_runnable_snippets_of_a_page_run(page, tmp_path, shared_home, monkeypatch):
    env = _environment(tmp_path, shared_home)
    monkeypatch.chdir(tmp_path)
    for key in ("PYTHONPATH", "CORRFLOW_HOME", "MPLBACKEND"):
        monkeypatch.setenv(key, env[key])
    namespace: dict = {"__name__": "__doc_snippet__"}
    for s in snippets(page):
        if s.mode != "run":
            continue
        if s.lang in ("python", "py"):
            exec(compile(s.code, s.where, "exec"), namespace)  # noqa: S102 - the docs' own examples
            if s.arg == "wrapper":
                _drive_wrapper_app(namespace)
                run_dir = Path(env["CORRFLOW_HOME"]) / "my_run"  # the page's absolute state_dir
                report = json.loads((run_dir / "privacy_report.json").read_text())
                assert not (tmp_path / "my_run").exists()
                from corrflow.schemas import validate

                validate("privacy-report", report)
                assert report["rounds_completed"] == 10 and report["realized"]["epsilon"] <= 8.0
        else:
            res = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", s.code],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert res.returncode == 0, (
                f"{s.where} exited {res.returncode}:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
            )


# -- the deployment steps are the loopback test's --------------------------------------------------
def _logical_lines(code: str) -> list[str]:
    return [
        ln.strip()
        for ln in code.replace("\\\n", " ").splitlines()
        if ln.strip() and not ln.startswith("#")
    ]


def _loopback_invocation(program: str) -> str:
    """The loopback script's command line that starts ``program`` (continuation lines joined)."""
    text = LOOPBACK.read_text().replace("\\\n", " ")
    lines = [
        ln
        for ln in text.splitlines()
        if f'"$bin/{program}"' in ln and not ln.lstrip().startswith(("#", "[["))
    ]
    assert len(lines) == 1, (program, lines)
    return lines[0]


def _flags(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", text))


def _keys(assignments: str) -> set[str]:
    return set(re.findall(r"([a-z][a-z0-9.-]*)=", assignments))


LOOPBACK_SNIPPETS = [s for s in ALL if s.mode == "loopback"]


@pytest.mark.parametrize("snippet", LOOPBACK_SNIPPETS, ids=lambda s: s.where)
def test_deployment_steps_are_the_commands_the_loopback_test_runs(snippet):
    from flwr.common.config import parse_config_args

    from corrflow.config import from_run_config

    loopback = LOOPBACK.read_text()
    for line in _logical_lines(snippet.code):
        argv = shlex.split(line)
        program = Path(argv[0]).name
        if program in ("flower-superlink", "flower-supernode"):
            expected = _loopback_invocation(program)
            assert _flags(" ".join(a for a in argv if a.startswith("--"))) == _flags(expected), (
                line,
                expected,
            )
            if "--node-config" in argv:
                ours = argv[argv.index("--node-config") + 1]
                theirs = re.search(r'--node-config "(.*?)"\s*$', expected).group(1)
                assert _keys(ours) == _keys(theirs), (ours, theirs)
        elif program in ("pki.sh", "register.sh", "fingerprint.sh"):
            assert argv[0] == f"deploy/{program}" and (ROOT / "deploy" / program).exists()
            assert f'"$here/{program}"' in loopback or program == "fingerprint.sh", program
            script = (ROOT / "deploy" / program).read_text()
            for flag in _flags(" ".join(a for a in argv if a.startswith("--"))):
                assert flag in script, (program, flag)
        elif program == "flwr":
            sub = argv[1]
            assert re.search(rf"flwr_cli {sub}\b", loopback), f"loopback.sh never runs flwr {sub}"
            if sub == "run":
                assert (
                    argv[2] == "deploy/app"
                    and (ROOT / "deploy" / "app" / "pyproject.toml").exists()
                )
                theirs = re.search(r"flwr_cli run \. loopback (.*?)\)", loopback).group(1)
                assert _flags(" ".join(a for a in argv if a.startswith("--"))) <= _flags(theirs), (
                    line
                )
                if "--run-config" in argv:
                    parsed = parse_config_args([argv[argv.index("--run-config") + 1]])
                    assert parsed and all(k.startswith("corrflow.") for k in parsed), parsed
                    app = tomllib.loads((ROOT / "deploy" / "app" / "pyproject.toml").read_text())
                    base = {
                        f"corrflow.{k}": v
                        for k, v in app["tool"]["flwr"]["app"]["config"]["corrflow"].items()
                    }
                    # corrflow accepts them
                    from_run_config({**base, **parsed, "corrflow.state-dir": "run"})
        else:
            pytest.fail(f"{snippet.where}: {program} is not a step of deploy/loopback.sh")


# -- docstrings of the public API ------------------------------------------------------------------
def _public_api(package: str):
    import importlib
    import inspect

    pkg = importlib.import_module(package)
    for name in pkg.__all__:
        obj = getattr(pkg, name)
        if inspect.isfunction(obj):
            yield f"{package}.{name}", obj
        elif inspect.isclass(obj):
            for attr, member in vars(obj).items():
                func = member.__func__ if isinstance(member, classmethod | staticmethod) else member
                if (
                    not attr.startswith("_")
                    and inspect.isfunction(func)
                    and func.__module__.startswith("corrflow")
                ):
                    yield f"{package}.{name}.{attr}", func


@pytest.mark.parametrize(
    "package",
    [
        "corrflow.factorization",
        "corrflow.noise",
        "corrflow.participation",
        "corrflow.strategies",
        "corrflow.accounting",
        "corrflow.planning",
        "corrflow.run",
    ],
)
def test_public_functions_document_args_and_returns(package):
    """Every exported function and public method says what its parameters are (Args) and what it
    returns (Returns), as the API reference renders them."""
    import inspect

    missing = []
    for qualname, func in _public_api(package):
        doc = inspect.getdoc(func) or ""
        sig = inspect.signature(func)
        if [p for p in sig.parameters if p not in ("self", "cls")] and "Args:" not in doc:
            missing.append(f"{qualname}: Args")
        if (
            sig.return_annotation not in (inspect.Signature.empty, None, "None")
            and "Returns:" not in doc
        ):
            missing.append(f"{qualname}: Returns")
    assert not missing, missing


def test_register_identity_is_documented():
    import inspect

    from corrflow import register_identity

    doc = inspect.getdoc(register_identity)
    assert "Args:" in doc and "Returns:" in doc


def test_no_sphinx_roles_in_docstrings():
    """mkdocstrings renders docstrings as Markdown: a Sphinx role (:class:`X`) would show literally
    on the API pages. Code spans (`X`) or cross-references ([X][module.X]) instead."""
    role = re.compile(r":(?:class|func|mod|data|meth|attr|exc|obj|const):`")
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted((ROOT / "corrflow").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), start=1)
        if role.search(line)
    ]
    assert not found, found
