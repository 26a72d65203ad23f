"""Where a run's files go. Everything a run writes lies inside its run directory; the only places
shared between runs are under ``$CORRFLOW_HOME`` (default ``~/corrflow``): the plan cache and the
release registry."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from corrflow.errors import InvalidArgumentError

log = logging.getLogger("corrflow")

#: How a relative run directory is resolved: against the working directory (the Python API and the
# CLI, as Python users expect), or against $CORRFLOW_HOME (the ServerApp, which `flwr run` starts
# in the SuperLink's directory).
RELATIVE_TO = ("cwd", "home")


def corrflow_home() -> Path:
    """``$CORRFLOW_HOME``, default ``~/corrflow``."""
    return Path(os.environ.get("CORRFLOW_HOME") or Path.home() / "corrflow").expanduser()


def run_directory(path: str | os.PathLike, relative_to: str = "cwd") -> Path:
    """The absolute run directory for ``path`` (``~`` expanded; a relative path under the working
    directory or under `corrflow_home`, per ``relative_to``), logged."""
    if relative_to not in RELATIVE_TO:
        raise ValueError(f"relative_to must be one of {RELATIVE_TO}")
    p = Path(path).expanduser()
    if not p.is_absolute():
        p = (Path.cwd() if relative_to == "cwd" else corrflow_home()) / p
    p = p.resolve()
    log.info("corrflow: run directory %s", p)
    return p


def _nearest_existing(path: Path) -> Path:
    p = path
    while not p.exists():
        p = p.parent
    return p


def _probe_writable(directory: Path) -> OSError | None:
    """Create and remove a temporary file in ``directory``: what an access check cannot tell
    (read-only mounts, /proc, permissions under root)."""
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        return exc
    return None


def writable_directory(path: str | os.PathLike, flag: str) -> Path:
    """``path`` as a directory corrflow may write (existing or creatable), checked without creating
    it; else `InvalidArgumentError` naming ``flag``."""

    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise InvalidArgumentError(flag, "a directory (this path is a file)", str(p))
    base = _nearest_existing(p.resolve())
    if not base.is_dir():
        raise InvalidArgumentError(flag, f"a directory path ({base} is a file)", str(p))
    if (exc := _probe_writable(base)) is not None:
        raise InvalidArgumentError(
            flag,
            f"a writable directory (creating a file in {base} failed: {exc.strerror or exc})",
            str(p),
        )
    return p


def writable_file(path: str | os.PathLike, flag: str) -> Path:
    """``path`` as a file corrflow may write (not a directory; its directory writable or
    creatable)."""

    p = Path(path).expanduser()
    if p.is_dir():
        raise InvalidArgumentError(flag, "a file path (this path is a directory)", str(p))
    writable_directory(p.parent if str(p.parent) else Path("."), flag)
    return p
