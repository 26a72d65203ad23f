"""Atomic server checkpoints: each round's state goes into a fresh directory that is fsynced and
then published by atomically replacing the ``CURRENT`` pointer file; older directories are removed
afterwards. A crash leaves either the old or the new checkpoint, never a mix. Each checkpoint
directory is created 0700 (its ledger holds raw user ids); the private parts (noise key and buffer,
report salt, server secret, and an amplified run's sampler key) are also 0600 files. Those fixed
for the run's life are written once and hard-linked into each later checkpoint.

Every file of a checkpoint is listed with its SHA-256 in ``MANIFEST.json``, authenticated by an HMAC
keyed by the server's private secret (the ``server_secret`` file): an edited ledger, a swapped noise
state or a missing file is refused on load, naming the file.

One file lives beside the checkpoint directories rather than in them: a banded noise buffer's rows
(``noise_ring.bin``, `corrflow.noise.engine.save_state`), rewritten in place one row per round
so that the checkpoint's I/O stays O(d) rather than O(bands·d). The ring has a spare slot, so a
round never overwrites a row the published checkpoint needs; each row the checkpoint needs is named
in its ``noise/noise_state.json`` (covered by the manifest) with its own HMAC, and a row that does
not match is refused on load."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import shutil
from pathlib import Path

import numpy as np

from corrflow.errors import IntegrityError
from corrflow.fileio import TEMP_PREFIX, atomic_directory, fsync_dir, write_bytes, write_text
from corrflow.hashing import canonical_hmac

POINTER = "CURRENT"
MANIFEST = "MANIFEST.json"
SECRET = "server_secret"
# Amplified runs only: the private key their cohorts are drawn from.
SAMPLER_KEY = "sampler_secret.key"


def write_checkpoint(
    state_dir: str | os.PathLike,
    name: str,
    arrays: dict[str, dict[str, list[np.ndarray]]],
    public: dict,
    private: dict[str, bytes],
    save_extra=None,
) -> Path:
    """Write ``arrays`` (one npz per key, holding groups of arrays: group ``g``'s i-th array is
    ``g_i``; group "arr" reads as NumPy's unnamed arrays), ``public`` (state.json) and ``private``
    (0600) files into
    ``state_dir/name`` as one atomic directory, publish it through ``CURRENT``, then remove older
    checkpoints.

    A private file whose bytes the published checkpoint already holds (the run's secrets, fixed for
    its life) is hard-linked from it, not written again: the secrets are written once per run (a
    file system without hard links gets a copy)."""
    root = Path(state_dir)
    previous = published_checkpoint(root)
    with atomic_directory(root / name) as tmp:
        for key, groups in arrays.items():
            named = {f"{g}_{i}": a for g, arrs in groups.items() for i, a in enumerate(arrs)}
            with open(tmp / f"{key}.npz", "wb") as f:  # inside the atomic directory: no rename
                np.savez(f, **named)
        write_text(tmp / "state.json", json.dumps(public, sort_keys=True))
        for fname, data in private.items():
            same_as = None if previous is None else previous / fname
            write_bytes(tmp / fname, data, private=True, same_as=same_as)
        if save_extra is not None:
            save_extra(tmp)
        _write_manifest(tmp, name)
    write_text(root / POINTER, name)
    fsync_dir(root)
    for old in root.iterdir():
        if old.is_dir() and old.name != name and not old.name.startswith(TEMP_PREFIX):
            shutil.rmtree(old, ignore_errors=True)
    return root / name


def published_checkpoint(state_dir: str | os.PathLike) -> Path | None:
    """The directory ``CURRENT`` names, unverified (None when there is none): where a checkpoint
    being written finds files it can link instead of writing (each compared byte for byte first).

    Args:
        state_dir: the checkpoints' directory.

    Returns:
        The published checkpoint's directory, or None.
    """
    root = Path(state_dir)
    try:
        name = (root / POINTER).read_text().strip()
    except OSError:
        return None
    path = root / name
    return path if name.startswith("round-") and "/" not in name and path.is_dir() else None


def current_checkpoint(state_dir: str | os.PathLike) -> Path | None:
    """The published checkpoint, its manifest and HMAC verified; None when ``CURRENT`` does not
    exist."""
    root = Path(state_dir)
    ptr = root / POINTER
    if not ptr.exists():
        return None
    name = ptr.read_text().strip()
    path = root / name
    if not name.startswith("round-") or "/" in name or not path.is_dir():
        raise IntegrityError(f"{ptr}: points to {name!r}, which is not a checkpoint directory")
    verify_checkpoint(path)
    return path


def _file_digests(directory: Path) -> dict[str, str]:
    out = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            out[p.relative_to(directory).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _manifest_mac(secret: bytes, body: dict) -> str:
    return canonical_hmac(secret, body)


def _write_manifest(directory: Path, name: str) -> None:
    secret = (directory / SECRET).read_bytes()
    body = {"checkpoint": name, "files": _file_digests(directory)}
    write_text(
        directory / MANIFEST,
        json.dumps({**body, "hmac": _manifest_mac(secret, body)}, sort_keys=True),
    )


def manifest_digest(path: Path) -> str:
    """SHA-256 of a checkpoint's manifest (what the release journal records for it)."""
    return hashlib.sha256((path / MANIFEST).read_bytes()).hexdigest()


def verify_checkpoint(path: Path) -> str:
    """Check every file of a checkpoint against its HMAC-authenticated manifest; returns the
    manifest's SHA-256. Raises IntegrityError naming the first file that is missing, extra or
    changed."""
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
    if not hmac.compare_digest(mac, _manifest_mac(secret, body)):
        raise IntegrityError(
            f"{manifest_path}: the HMAC does not match the server secret (edited manifest)"
        )
    if body["checkpoint"] != path.name:
        raise IntegrityError(
            f"{manifest_path}: the manifest belongs to {body['checkpoint']}, not {path.name}"
        )
    actual = _file_digests(path)
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


def remove_stale_temporaries(state_dir: str | os.PathLike) -> list[str]:
    """Remove the temporary directories and pointer files a killed server left (they may hold key
    copies)."""
    root = Path(state_dir)
    removed = []
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(TEMP_PREFIX):
                shutil.rmtree(p) if p.is_dir() else p.unlink()
                removed.append(p.name)
    return removed


def load_arrays(path: Path, key: str, group: str = "arr") -> list[np.ndarray]:
    """The arrays of one group of a checkpoint's npz file (see `write_checkpoint`).

    Args:
        path: the checkpoint directory.
        key: the file (``key``.npz).
        group: the group ("arr": the unnamed arrays, e.g. the model's).

    Returns:
        The group's arrays in order; empty when the file holds none of that group.
    """
    with np.load(path / f"{key}.npz", allow_pickle=False) as d:
        count = sum(1 for f in d.files if f.rpartition("_")[0] == group)
        return [d[f"{group}_{i}"] for i in range(count)]
