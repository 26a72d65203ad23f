"""Reading a finished (or stopped) run's files back, read-only, for ``corrflow report``: its privacy
report and metrics, refused with the file named when they are not what a run writes, and the run
directories inside a folder that is not one run (a ``corrflow compare`` folder holds one per arm and
seed)."""

from __future__ import annotations

import json
from pathlib import Path

from corrflow.errors import DataFormatError, IntegrityError, InvalidArgumentError
from corrflow.run.user_store import check_entries, read_entries

REPORT, METRICS = "privacy_report.json", "metrics.json"
#: The sections of a privacy report every summary reads (objects).
REPORT_SECTIONS = ("mechanism", "planned", "realized", "accountant")
#: How many run directories a refusal lists (a large sweep holds hundreds).
LISTED = 12


def runs_inside(directory: Path, depth: int = 3) -> list[Path]:
    """The run directories (holding a privacy report and metrics) up to ``depth`` levels under
    ``directory``, sorted.

    Args:
        directory: a folder, e.g. a ``corrflow compare`` output.
        depth: how deep to look.

    Returns:
        Their paths.
    """
    found = []
    for level in range(1, depth + 1):
        pattern = "/".join(["*"] * level) + f"/{REPORT}"
        found += [p.parent for p in directory.glob(pattern) if (p.parent / METRICS).is_file()]
    return sorted(set(found))


def _not_a_run(run_dir: Path, missing: list[str]) -> InvalidArgumentError:
    inside = runs_inside(run_dir) if run_dir.is_dir() else []
    if not inside:
        return InvalidArgumentError(
            "DIR", f"a run directory holding {' and '.join(missing)}", str(run_dir)
        )
    shown = ", ".join(str(p) for p in inside[:LISTED])
    more = f" and {len(inside) - LISTED} more" if len(inside) > LISTED else ""
    return InvalidArgumentError(
        "DIR",
        f"one run's directory; {run_dir} holds {len(inside)} runs (a compare folder holds one per "
        f"arm and seed): {shown}{more}",
        str(run_dir),
    )


def read_run(run_dir: Path) -> tuple[dict, list[dict]]:
    """A run's privacy report and metrics, as written by the run.

    Args:
        run_dir: the run's directory (simulate's ``--out``).

    Returns:
        ``(report, metrics)``: the report object and the list of per-round metric objects.

    Raises:
        InvalidArgumentError: (``DIR``) not a run directory; the runs inside it listed.
        DataFormatError: a file that is not JSON, or not of the shape a run writes (the file
            named).
    """
    paths = {name: run_dir / name for name in (REPORT, METRICS)}
    missing = [name for name, p in paths.items() if not p.is_file()]
    if missing:
        raise _not_a_run(run_dir, missing)
    docs = {}
    for name, path in paths.items():
        try:
            docs[name] = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise DataFormatError(path, None, f"a run's JSON file ({exc})") from None
    report, metrics = docs[REPORT], docs[METRICS]
    if not isinstance(report, dict):
        raise DataFormatError(
            paths[REPORT], None, "a privacy report (a JSON object)", type(report).__name__
        )
    missing = [k for k in REPORT_SECTIONS if not isinstance(report.get(k), dict)]
    if missing:
        raise DataFormatError(
            paths[REPORT], None, f"a privacy report with its {', '.join(REPORT_SECTIONS)}", missing
        )
    if not isinstance(metrics, list) or not all(isinstance(m, dict) for m in metrics):
        raise DataFormatError(
            paths[METRICS], None, "a list of per-round metric objects", type(metrics).__name__
        )
    return report, metrics


def participation_users(report: dict, run_dir: Path) -> dict[str, dict] | None:
    """Each user's participation as of the report: hashed id → ``{"rounds", "min_gap"}`` — listed
    in a report of schema version 2 or before, read from the run's per-user store (and checked
    against the report's row count and digest) since version 3.

    Args:
        report: the privacy report (as published).
        run_dir: the run's directory.

    Returns:
        The users, or None where the report has none to read (an amplified run whose operator
        files are not there, a report from before the per-user record).

    Raises:
        IntegrityError: the store's rows do not match the report (edited, another run's), or the
            report names a store outside the run directory.
        DataFormatError: the store is missing or not readable.
    """
    part = report.get("realized", {}).get("participation", {})
    if "operator_only" in part:  # amplified: the operator's copy of the section
        copy = run_dir / part["operator_only"]
        if not copy.is_file():
            return None
        part = json.loads(copy.read_text())["realized"]["participation"]
    if isinstance(part.get("users"), dict):
        return part["users"]
    ref = part.get("per_user")
    if not isinstance(ref, dict):
        return None
    path = (run_dir / str(ref.get("store"))).resolve()
    if not path.is_relative_to(run_dir.resolve()):
        raise IntegrityError(
            f"{run_dir / REPORT}: names the per-user store {ref.get('store')!r}, outside the run"
        )
    entries = list(read_entries(path, below=int(report.get("rounds_completed", 0))))
    check_entries(entries, ref, path)
    return {e.user: {"rounds": list(e.rounds), "min_gap": e.min_gap} for e in entries}


__all__ = ["METRICS", "REPORT", "participation_users", "read_run", "runs_inside"]
