"""Reaching into a run's published checkpoint (``state/checkpoint.zip`` and ``state/secrets/``):
read it, or edit one of its members or secrets as a tampering test does."""

import zipfile
from pathlib import Path

from corrflow.run.checkpoint import CHECKPOINT, SECRETS_DIR, Checkpoint, load_checkpoint


def checkpoint(run_dir) -> Checkpoint:
    """The run's published checkpoint, verified."""
    return load_checkpoint(Path(run_dir) / "state")


def checkpoint_file(run_dir) -> Path:
    return Path(run_dir) / "state" / CHECKPOINT


def secret_file(run_dir, name: str) -> Path:
    """The file of the secret ``name`` (e.g. ``report_salt``) the published checkpoint names."""
    return Path(run_dir) / "state" / SECRETS_DIR / checkpoint(run_dir).secret_files[name]["file"]


def read_member(run_dir, member: str) -> bytes:
    with zipfile.ZipFile(checkpoint_file(run_dir)) as z:
        return z.read(member)


def replace_member(run_dir, member: str, data: bytes) -> None:
    """Rewrite the checkpoint with ``member``'s bytes replaced, its manifest left as it was (an
    edit by hand)."""
    path = checkpoint_file(run_dir)
    with zipfile.ZipFile(path) as z:
        parts = [(i.filename, z.read(i.filename)) for i in z.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, old in parts:
            z.writestr(name, data if name == member else old)
