"""Adopting a run directory: register a moved or restored run with the release registry on purpose
(``corrflow runs adopt DIR``, `corrflow.cli.runs`).

A server refuses a run directory whose journal the registry does not confirm (a moved run, a copy, a
restored backup, a run under another ``$CORRFLOW_HOME``, or a registry lost): resuming two copies
would release the same rounds twice. When the directory is the only copy that will go on, the
operator adopts it: the registry binds the run to this directory and takes the journal's releases as
its own. Releases the registry holds beyond the journal (a backup older than what was released) are
kept aside as the other lineage's; the adopted run releases those rounds again, and their noise is
new, since every process start draws the rows after its checkpoint with a fresh key
(`corrflow.noise.segments`). The privacy report lists each adoption.
"""

from __future__ import annotations

from pathlib import Path

from corrflow.errors import InvalidArgumentError
from corrflow.run.registry import ReleaseRegistry
from corrflow.run.resume import STATE, RunLock, RunLockedError, check_resume


def adopt_run(run_dir: str | Path, registry: str | Path | None = None) -> dict:
    """Bind the run in ``run_dir`` to that directory in the release registry (module docstring).

    Args:
        run_dir: the run directory (its checkpoint and release journal are verified first).
        registry: the registry file (default: ``$CORRFLOW_HOME/release_registry.sqlite``).

    Returns:
        The adoption: run id, registry, directory, the directory the registry had (None when it
        did not know the run), the journal's and the registry's release counts, and the rounds the
        run will release again with fresh noise.

    Raises:
        InvalidArgumentError: not a run directory with a checkpoint.
        IntegrityError: the directory does not agree with its journal, or the registry is damaged,
            locked or emptied.
        RunLockedError: a server is running on it.
    """
    out = Path(run_dir)
    if not (out / STATE).is_dir():
        raise InvalidArgumentError(
            "DIR", "a corrflow run directory (with a state/ checkpoint)", str(out)
        )
    with RunLock(out):
        resume = check_resume(out)
        if resume.checkpoint is None:
            raise InvalidArgumentError(
                "DIR", "a run directory with a checkpoint (nothing to adopt)", str(out)
            )
        run_id = resume.checkpoint.public["run_id"]
        reg = ReleaseRegistry(registry or None)
        _refuse_live_original(reg.run_dir(run_id), out)
        record = reg.adopt(run_id, out, [(e.round, e.noise_round, e.hash) for e in resume.journal])
    return {"run_id": run_id, "registry": str(reg.path), **record}


def _refuse_live_original(registered: str | None, out: Path) -> None:
    """A server running on the directory the registry names: adopting a copy now would let both
    release the same rounds (RunLockedError naming the holder)."""
    if registered is None or Path(registered) == out.resolve() or not Path(registered).is_dir():
        return
    try:
        with RunLock(registered):
            pass
    except RunLockedError as exc:
        raise RunLockedError(
            f"the run is live in {registered}, which the registry names: stop that server before "
            f"adopting a copy of it ({exc})"
        ) from None
