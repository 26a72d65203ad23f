"""Reading a checkpoint of the previous layout: a directory ``state/round-NNNNNN/`` published
through the pointer file ``state/CURRENT``, every file listed with its SHA-256 in the directory's
``MANIFEST.json`` (an HMAC keyed by the directory's ``server_secret``), the secrets inside it, the
momentum in ``model.npz`` (or, before that, in ``optimizer.npz``). It is verified as it was written
and read into a `corrflow.run.checkpoint.Checkpoint`; the first checkpoint a resumed run writes
replaces it (`corrflow.run.checkpoint.remove_previous_layout`)."""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path

import numpy as np

from corrflow.errors import IntegrityError
from corrflow.hashing import canonical_hmac
from corrflow.noise.engine import SECRET_FILE, SEGMENTS_FILE
from corrflow.run.checkpoint import (
    MANIFEST,
    POINTER,
    PUBLIC,
    SALT,
    SAMPLER_KEY,
    SECRET,
    Checkpoint,
)


def load_legacy(state_dir: Path) -> Checkpoint:
    """The checkpoint ``state_dir/CURRENT`` names, verified against its manifest.

    Args:
        state_dir: the run's ``state/`` directory.

    Returns:
        The checkpoint (its ``path`` the directory).

    Raises:
        IntegrityError: a pointer to no checkpoint directory, or a file missing, extra or changed.
    """
    ptr = state_dir / POINTER
    name = ptr.read_text().strip()
    path = state_dir / name
    if not name.startswith("round-") or "/" in name or not path.is_dir():
        raise IntegrityError(f"{ptr}: points to {name!r}, which is not a checkpoint directory")
    digest = _verify(path)
    secrets = {
        n: (path / n).read_bytes() for n in (SALT, SECRET, SAMPLER_KEY) if (path / n).is_file()
    }
    noise = {}
    if (path / "noise").is_dir():
        for p in (path / "noise").iterdir():
            if p.name in (SECRET_FILE, SEGMENTS_FILE):
                secrets[p.name] = p.read_bytes()
            elif p.is_file():
                noise[p.name] = p.read_bytes()
    # The momentum is in model.npz; a checkpoint before that has optimizer.npz.
    momentum = _group(path, "model", "momentum") or _group(path, "optimizer", "arr")
    return Checkpoint(
        path,
        name,
        digest,
        json.loads((path / PUBLIC).read_text()),
        noise,
        secrets,
        {},
        {"model": _group(path, "model", "arr"), "momentum": momentum},
    )


def _group(path: Path, key: str, group: str) -> list[np.ndarray]:
    """The arrays ``group_i`` of ``key.npz`` (group "arr": NumPy's unnamed arrays)."""
    if not (path / f"{key}.npz").is_file():
        return []
    with np.load(path / f"{key}.npz", allow_pickle=False) as d:
        count = sum(1 for f in d.files if f.rpartition("_")[0] == group)
        return [d[f"{group}_{i}"] for i in range(count)]


def _digests(directory: Path) -> dict[str, str]:
    out = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            out[p.relative_to(directory).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _verify(path: Path) -> str:
    """Check every file of the directory against its HMAC-authenticated manifest; returns the
    manifest's SHA-256."""
    manifest_path, secret_path = path / MANIFEST, path / SECRET
    for p in (manifest_path, secret_path):
        if not p.is_file():
            raise IntegrityError(f"{p}: missing (an incomplete or foreign checkpoint)")
    secret = secret_path.read_bytes()
    if len(secret) < 32:
        raise IntegrityError(f"{secret_path}: the server secret is shorter than 32 bytes")
    raw = manifest_path.read_bytes()
    try:
        manifest = json.loads(raw)
        body = {"checkpoint": manifest["checkpoint"], "files": dict(manifest["files"])}
        mac = str(manifest["hmac"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise IntegrityError(f"{manifest_path}: unreadable manifest ({exc})") from None
    if not hmac.compare_digest(mac, canonical_hmac(secret, body)):
        raise IntegrityError(
            f"{manifest_path}: the HMAC does not match the server secret (edited manifest)"
        )
    if body["checkpoint"] != path.name:
        raise IntegrityError(
            f"{manifest_path}: the manifest belongs to {body['checkpoint']}, not {path.name}"
        )
    actual = _digests(path)
    for rel in sorted(set(body["files"]) | set(actual)):
        if rel not in actual:
            raise IntegrityError(f"{path / rel}: missing from the checkpoint")
        if rel not in body["files"]:
            raise IntegrityError(f"{path / rel}: not listed in the checkpoint's manifest")
        if actual[rel] != body["files"][rel]:
            raise IntegrityError(
                f"{path / rel}: changed since the checkpoint was written (SHA-256 mismatch)"
            )
    return hashlib.sha256(raw).hexdigest()
