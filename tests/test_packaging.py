"""What the README, its tour and the docs write into a checkout stays out of git and out of the
Flower app package (FAB) that `flwr run .` builds: Flower refuses a FAB over 10 MB, and the tour's
own outputs (a compare folder, `mkdocs build`'s site/) are larger than that."""

import io
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest
from flwr.cli.build import build_fab_from_disk
from flwr.common.constant import FAB_MAX_SIZE

ROOT = Path(__file__).parent.parent
# Directories a command writes when no --out is given, and mkdocs's default site_dir.
DEFAULT_OUTPUTS = ["corrflow_run", "corrflow_compare", "corrflow_plan", "corrflow_audit", "site"]
_WRITES = [
    re.compile(r"--out ([a-z][\w.\-]*)"),  # lower-case names only: DIR, PATH, RUN are placeholders
    re.compile(r"> ([a-z][\w\-]*\.[\w.]+)"),
    re.compile(r"state_dir=\"([\w\-]+)\""),
]


def _documented_outputs() -> set[str]:
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found = set(DEFAULT_OUTPUTS)
    for path in texts:
        for pattern in _WRITES:
            found.update(pattern.findall(path.read_text()))
    return found - {"dev"}  # `> /dev/null`


def test_every_documented_output_is_git_ignored():
    outputs = sorted(_documented_outputs())
    assert {"corrflow_compare", "site", "my_plan", "planned_run", "corrflow_run"} <= set(outputs)
    r = subprocess.run(
        ["git", "check-ignore", "--no-index", "--verbose", "--non-matching", "--stdin"],
        input="\n".join(f"{name}/inner" for name in outputs),
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode == 128:
        pytest.skip(f"not a git checkout: {r.stderr.strip()}")
    not_ignored = [line.split("\t")[1] for line in r.stdout.splitlines() if line.startswith("::")]
    assert not not_ignored, f"written by the README or docs but not git-ignored: {not_ignored}"


def _copy_app(dest: Path) -> None:
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("pyproject.toml", ".gitignore", "README.md", "mkdocs.yml"):
        shutil.copy2(ROOT / name, dest / name)
    for name in ("corrflow", "docs", "benchmarks", "deploy"):
        shutil.copytree(ROOT / name, dest / name, ignore=skip)


def test_the_app_package_leaves_out_the_tour_outputs(tmp_path):
    app = tmp_path / "corrflow"
    app.mkdir()
    _copy_app(app)
    # The tour's outputs, each 2 MiB of incompressible JSON-named bytes (together over Flower's
    # 10 MB limit), plus a folder no .gitignore line names: the include list must keep it out too.
    outputs = [*sorted(_documented_outputs()), "results_of_my_own"]
    rng = np.random.default_rng(0)
    for name in outputs:
        folder = app / name if "." not in name else app / f"{name}.d"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "privacy_report.json").write_bytes(rng.bytes(2 << 20))
        (folder / "notes.md").write_bytes(b"x" * 1024)
    fab = build_fab_from_disk(app)
    names = zipfile.ZipFile(io.BytesIO(fab)).namelist()
    assert len(fab) < FAB_MAX_SIZE / 4, len(fab)
    outside = sorted(
        n for n in names if n.split("/")[0] not in {"corrflow", "pyproject.toml", ".info"}
    )
    assert outside == [], outside
    # The app still holds everything the ServerApp and ClientApp import, and the JSON Schemas.
    assert "corrflow/server/app.py" in names and "corrflow/clients/dispatch.py" in names
    assert {"corrflow/schemas/privacy-report.json", "corrflow/schemas/recipe.json"} <= set(names)
    expected = {
        p.relative_to(app).as_posix()
        for p in (app / "corrflow").rglob("*")
        if p.suffix == ".py" or p.parent.name == "schemas" and p.suffix == ".json"
    }
    assert expected == set(names) - {"pyproject.toml", ".info/CONTENT"}
