"""Reading a finished (or stopped) run's files back, read-only, for ``corrflow report``: its privacy
report and metrics, refused with the file named when they are not what a run writes, and the run
directories inside a folder that is not one run (a ``corrflow compare`` folder holds one per arm and
seed)."""

from __future__ import annotations

import json
from pathlib import Path

from corrflow.errors import DataFormatError, InvalidArgumentError

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


__all__ = ["METRICS", "REPORT", "read_run", "runs_inside"]
