"""Atomic server checkpoints: one file, ``state/checkpoint.zip``, rewritten after every round and
published by ``os.replace`` of a fsync-ed temporary file in the same directory, then a fsync of the
directory; the fixed name is its own pointer. A kill leaves either the old or the new checkpoint,
never a mix.

The file is an uncompressed zip (``ZIP_STORED``; `zipfile`, readable with any unzip tool, nothing
pickled): the model and the optimizer's momentum as ``.npy`` members (``model/<i>.npy``,
``momentum/<i>.npy``), the run's state (``state.json``), the noise stream's state (``noise/…``:
`corrflow.noise.engine.state_parts` — a BLT run's noise buffer among them, so the file is as
private as the secrets and written 0600 —, a sharded stream's ``shards.json``, a noise node's
receipts) and, last, ``MANIFEST.json``: the SHA-256 of every member and of every secret file the
checkpoint depends on, authenticated by an HMAC keyed by the run's server secret. An edited,
truncated or swapped checkpoint, an edited or missing secret is refused on load with an
`IntegrityError` naming the file (and the member); so is a zip this module does not write (a
compressed or repeated member, members larger than the file), before any member is read. The HMAC
detects corruption, mistaken edits and another run's files, not a writer of ``state/``, who could
replace the secrets too (docs "Threat model").

The run's secrets — report salt, server secret, an amplified run's sampler key, the noise key and
its key segments — live apart in ``state/secrets/`` (0700, each file 0600, written atomically),
written once per process start and not again while their bytes stay the same (`SecretFiles`).
The key-segment table changes at every resumed start (a new segment from its next round on): it is
written under the name the published checkpoint does not use (``noise_segments.key`` or
``noise_segments.key.1``), so that checkpoint keeps verifying until the new one replaces it; the
file no checkpoint names any more is removed after that.

One file lives beside the checkpoint rather than in it: a banded noise buffer's rows
(``noise_ring.bin``, `corrflow.noise.engine.state_parts`), rewritten in place one row per round so
that the checkpoint's I/O stays O(d) rather than O(bands·d). The ring has a spare slot, so a round
never overwrites a row the published checkpoint needs; each row the checkpoint needs is named in its
``noise/noise_state.json`` (covered by the manifest) with its own HMAC, and a row that does not
match is refused on load.

The layout before this one (a checkpoint directory ``state/round-NNNNNN/`` published through a
``state/CURRENT`` pointer, every file listed in its own HMAC-authenticated ``MANIFEST.json``, the
secrets inside it) is still read (`load_checkpoint`), verified as it was written; the first
checkpoint a resumed run writes replaces it, and the old directories are removed after that.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import os
import shutil
import tempfile
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from corrflow.errors import IntegrityError
from corrflow.fileio import TEMP_PREFIX, fsync_dir, write_bytes
from corrflow.hashing import canonical_hmac

CHECKPOINT = "checkpoint.zip"
FORMAT = "corrflow.checkpoint/1"
MANIFEST = "MANIFEST.json"
PUBLIC = "state.json"
#: The run's secrets, beside the checkpoint (``state/secrets/``).
SECRETS_DIR = "secrets"
SALT, SECRET = "report_salt", "server_secret"
# Amplified runs only: the private key their cohorts are drawn from.
SAMPLER_KEY = "sampler_secret.key"
#: The previous layout's pointer to its checkpoint directory (read, converted, removed).
POINTER = "CURRENT"
#: The array groups a checkpoint holds (the model, the optimizer's momentum).
GROUPS = ("model", "momentum")


@dataclass(frozen=True)
class Published:
    """What the release journal records of a checkpoint: its round name (``round-NNNNNN``, the
    next round) and the SHA-256 of its manifest."""

    name: str
    digest: str


@dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint, read back (`load_checkpoint`).

    Attributes:
        path: the file (or, in the previous layout, the directory) it was read from.
        name: ``round-NNNNNN``, its next round.
        digest: the SHA-256 of its manifest (what the release journal records).
        public: its ``state.json``.
        noise: the noise stream's public files, name → bytes.
        secrets: the run's secrets, logical name → bytes.
        secret_files: logical name → ``{"file", "sha256"}`` as the manifest lists them (empty in
            the previous layout).
    """

    path: Path
    name: str
    digest: str
    public: dict = field(repr=False)
    noise: dict[str, bytes] = field(repr=False)
    secrets: dict[str, bytes] = field(repr=False)  # never shown: not in repr, str or errors
    secret_files: dict[str, dict] = field(default_factory=dict, repr=False)
    _arrays: dict[str, list[np.ndarray]] = field(default_factory=dict, repr=False)

    def __str__(self) -> str:
        return str(self.path)

    @property
    def state_dir(self) -> Path:
        """The run's ``state/`` directory."""
        return self.path.parent

    @property
    def legacy(self) -> bool:
        """Read from the previous layout (a directory published through ``CURRENT``)."""
        return self.path.is_dir()

    def arrays(self, group: str) -> list[np.ndarray]:
        """The arrays of one group (`GROUPS`), in order.

        Args:
            group: "model" or "momentum".

        Returns:
            The arrays (empty when the checkpoint holds none of that group).
        """
        return self._arrays.get(group, [])


class SecretFiles:
    """The run's secrets in ``state/secrets/``: each written (0600, atomically, fsync-ed) only
    when the published checkpoint does not already vouch for the same bytes (see the module
    docstring).

    Args:
        state_dir: the run's ``state/`` directory.
        published: the published checkpoint's ``secret_files`` (empty for a new run, or one of the
            previous layout, whose secrets are written here on its first checkpoint).
    """

    def __init__(self, state_dir: Path, published: Mapping[str, dict] | None = None):
        self.root = Path(state_dir) / SECRETS_DIR
        self.published = {k: dict(v) for k, v in (published or {}).items()}
        self._entries: dict[str, dict] = {}

    def put(self, name: str, data: bytes) -> None:
        """Make ``data`` the secret ``name`` of the checkpoint being written.

        Args:
            name: the secret's logical name (e.g. ``server_secret``).
            data: its bytes.
        """
        digest = hashlib.sha256(data).hexdigest()
        old = self.published.get(name)
        if old is not None and old["sha256"] == digest:
            self._entries[name] = old
            return
        used = {e["file"] for e in self.published.values()}
        fname = name if name not in used else f"{name}.1"
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_bytes(self.root / fname, data, private=True)
        fsync_dir(self.root)
        self._entries[name] = {"file": fname, "sha256": digest}

    def take(self) -> dict[str, dict]:
        """The secrets of the checkpoint being written (the names `put` since the last call)."""
        out, self._entries = self._entries, {}
        return out

    def publish(self, entries: Mapping[str, dict]) -> None:
        """``entries`` are now the published checkpoint's: remove the secret files no checkpoint
        names any more (only when the set changed: once per process start at most)."""
        if entries == self.published:
            return
        self.published = {k: dict(v) for k, v in entries.items()}
        keep = {e["file"] for e in entries.values()}
        for p in self.root.iterdir():
            if p.is_file() and p.name not in keep:
                p.unlink(missing_ok=True)


class _Hashing(io.RawIOBase):
    """A write-only stream that hashes what passes through into ``sink``."""

    def __init__(self, sink):
        super().__init__()
        self.sink, self.sha = sink, hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.sha.update(data)
        return self.sink.write(data)


def write_checkpoint(
    state_dir: str | os.PathLike,
    name: str,
    arrays: Mapping[str, list[np.ndarray]],
    public: dict,
    noise: Mapping[str, bytes],
    secrets: Mapping[str, dict],
    key: bytes,
) -> Published:
    """Write and publish the one checkpoint file (see the module docstring): every member hashed as
    it is written (one pass over the model), the manifest last, then fsync, ``os.replace`` onto
    ``state/checkpoint.zip`` and a fsync of the directory.

    Args:
        state_dir: the run's ``state/`` directory.
        name: ``round-NNNNNN`` (its next round).
        arrays: group (`GROUPS`) → arrays.
        public: the public state (``state.json``).
        noise: the noise stream's public files, name → bytes (``noise/<name>``).
        secrets: the secret files it depends on (`SecretFiles.take`), already on disk.
        key: the server secret, the manifest's HMAC key.

    Returns:
        Its name and manifest digest, as the release journal records them.
    """
    root = Path(state_dir)
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=root, prefix=TEMP_PREFIX, suffix=".zip")
    try:
        with os.fdopen(fd, "wb") as f:
            with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as z:
                members = _write_members(z, arrays, public, noise)
                body = {
                    "format": FORMAT,
                    "checkpoint": name,
                    "members": members,
                    "secrets": dict(secrets),
                }
                raw = json.dumps(
                    {**body, "hmac": canonical_hmac(key, body)}, sort_keys=True, indent=1
                ).encode()
                z.writestr(_member(MANIFEST), raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, root / CHECKPOINT)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(root)
    return Published(name, hashlib.sha256(raw).hexdigest())


def _write_members(
    z: zipfile.ZipFile,
    arrays: Mapping[str, list[np.ndarray]],
    public: dict,
    noise: Mapping[str, bytes],
) -> dict[str, str]:
    """Write the members before the manifest; returns member → SHA-256."""
    members = {}
    for group, arrs in arrays.items():
        for i, a in enumerate(arrs):
            member = f"{group}/{i}.npy"
            with z.open(member, "w", force_zip64=True) as out:
                h = _Hashing(out)
                np.lib.format.write_array(h, np.asarray(a), allow_pickle=False)
            members[member] = h.sha.hexdigest()
    parts = {PUBLIC: json.dumps(public, sort_keys=True).encode()}
    parts.update({f"noise/{n}": data for n, data in noise.items()})
    for member, data in parts.items():
        z.writestr(_member(member), data)
        members[member] = hashlib.sha256(data).hexdigest()
    return members


def _member(name: str) -> zipfile.ZipInfo:
    """A stored member with a fixed time stamp (the file's bytes depend on its content only)."""
    info = zipfile.ZipInfo(name)  # 1980-01-01, as zipfile gives the arrays' members
    info.compress_type = zipfile.ZIP_STORED
    return info


def load_checkpoint(state_dir: str | os.PathLike) -> Checkpoint | None:
    """The published checkpoint, verified: its manifest's HMAC, every member and every secret
    file against the manifest; one of the previous layout (``CURRENT`` → ``round-NNNNNN/``)
    against its own manifest. None when there is none.

    Args:
        state_dir: the run's ``state/`` directory.

    Returns:
        The checkpoint, or None.

    Raises:
        IntegrityError: naming the file (and member) that is missing, truncated, edited or not
            the run's.
    """
    root = Path(state_dir)
    path = root / CHECKPOINT
    if path.exists():
        return _load_file(path)
    if (root / POINTER).exists():
        from corrflow.run.checkpoint_legacy import load_legacy

        return load_legacy(root)
    return None


def _check_entries(path: Path, z: zipfile.ZipFile) -> None:
    """Refuse, before reading a member, a zip this module would not have written: a compressed or
    repeated member, or members whose sizes add up to more than the file (an overlapping-entry zip
    bomb)."""
    infos, names = z.infolist(), z.namelist()
    if len(set(names)) != len(names):
        raise IntegrityError(f"{path}: a member name appears twice (not a corrflow checkpoint)")
    if any(i.compress_type != zipfile.ZIP_STORED for i in infos):
        raise IntegrityError(f"{path}: a compressed member (corrflow checkpoints are stored)")
    if sum(i.file_size for i in infos) > path.stat().st_size:
        raise IntegrityError(f"{path}: its members are larger than the file (overlapping entries)")


def _load_file(path: Path) -> Checkpoint:
    try:
        with zipfile.ZipFile(path) as z:
            _check_entries(path, z)
            raw = z.read(MANIFEST)
            data = {n: z.read(n) for n in z.namelist() if n != MANIFEST}
    except KeyError:
        raise IntegrityError(f"{path}: no {MANIFEST} (a truncated or foreign checkpoint)") from None
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise IntegrityError(f"{path}: not a readable checkpoint (truncated? {exc})") from None
    try:
        manifest = json.loads(raw)
        body = {k: manifest[k] for k in ("format", "checkpoint", "members", "secrets")}
        members, secret_files = dict(body["members"]), dict(body["secrets"])
        mac = str(manifest["hmac"])
        int(mac, 16)  # a hex digest, or the comparison below could not run
        if len(mac) != 64 or SECRET not in secret_files or PUBLIC not in members:
            raise ValueError(f"no 64-hex-digit hmac, {SECRET} entry or {PUBLIC} member")
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise IntegrityError(f"{path}:{MANIFEST}: unreadable manifest ({exc})") from None
    if body["format"] != FORMAT:
        raise IntegrityError(f"{path}: format {body['format']!r}, expected {FORMAT!r}")
    root = path.parent / SECRETS_DIR
    key = _read_secrets(root, {SECRET: secret_files.get(SECRET)})[SECRET]
    if len(key) < 32:
        raise IntegrityError(f"{_secret_path(root, secret_files[SECRET])}: shorter than 32 bytes")
    if not hmac.compare_digest(mac, canonical_hmac(key, body)):
        raise IntegrityError(
            f"{path}:{MANIFEST}: the HMAC does not match the server secret "
            f"{_secret_path(root, secret_files[SECRET])} (an edited manifest or secret, or "
            "another run's checkpoint)"
        )
    secrets = _read_secrets(root, secret_files)
    _check_members(path, members, data)
    _check_secrets(root, secret_files, secrets)
    try:
        public = json.loads(data[PUBLIC])
        arrays = {g: _arrays(data, g) for g in GROUPS}
    except ValueError as exc:  # unreachable for a file that matches its manifest
        raise IntegrityError(f"{path}: unreadable member ({exc})") from None
    return Checkpoint(
        path,
        str(body["checkpoint"]),
        hashlib.sha256(raw).hexdigest(),
        public,
        {n.removeprefix("noise/"): b for n, b in data.items() if n.startswith("noise/")},
        secrets,
        secret_files,
        arrays,
    )


def _secret_path(root: Path, entry) -> Path:
    """The file a manifest's secret entry names (checked to lie in ``root``)."""
    fname = str(entry.get("file", "")) if isinstance(entry, dict) else ""
    if not fname or "/" in fname or fname.startswith("."):
        raise IntegrityError(f"{root}: the checkpoint names a secret file {fname!r}")
    return root / fname


def _read_secrets(root: Path, files: dict) -> dict[str, bytes]:
    """The secret files the manifest names, read (IntegrityError naming a missing one)."""
    out = {}
    for name, entry in files.items():
        p = root / name if entry is None else _secret_path(root, entry)
        if not p.is_file():
            raise IntegrityError(f"{p}: a secret the checkpoint vouches for is missing ({name})")
        out[name] = p.read_bytes()
    return out


def _check_members(path: Path, members: dict[str, str], data: dict[str, bytes]) -> None:
    for member in sorted(set(members) | set(data)):
        if member not in data:
            raise IntegrityError(f"{path}: member {member} is missing from the checkpoint")
        if member not in members:
            raise IntegrityError(f"{path}: member {member} is not listed in its manifest")
        if hashlib.sha256(data[member]).hexdigest() != members[member]:
            raise IntegrityError(
                f"{path}: member {member} changed since the checkpoint was written (SHA-256 "
                "mismatch)"
            )


def _check_secrets(root: Path, files: dict[str, dict], secrets: dict[str, bytes]) -> None:
    for name, entry in sorted(files.items()):
        if hashlib.sha256(secrets[name]).hexdigest() != entry.get("sha256"):
            raise IntegrityError(
                f"{root / entry['file']}: changed since the checkpoint was written (SHA-256 "
                "mismatch)"
            )


def _arrays(data: dict[str, bytes], group: str) -> list[np.ndarray]:
    out, i = [], 0
    while (member := f"{group}/{i}.npy") in data:
        out.append(np.load(io.BytesIO(data[member]), allow_pickle=False))
        i += 1
    return out


def has_checkpoint(state_dir: str | os.PathLike) -> bool:
    """Whether ``state_dir`` holds a published checkpoint (this layout or the previous one),
    unverified."""
    root = Path(state_dir)
    return (root / CHECKPOINT).exists() or (root / POINTER).exists()


def remove_stale_temporaries(state_dir: str | os.PathLike) -> list[str]:
    """Remove the temporary files and directories a killed server left (they may hold key
    copies)."""
    root = Path(state_dir)
    removed = []
    for d in (root, root / SECRETS_DIR):
        if d.is_dir():
            for p in d.iterdir():
                if p.name.startswith(TEMP_PREFIX):
                    shutil.rmtree(p) if p.is_dir() else p.unlink()
                    removed.append(p.name)
    return removed


def has_previous_layout(state_dir: str | os.PathLike) -> bool:
    """Whether the previous layout's pointer or any of its checkpoint directories is left."""
    root = Path(state_dir)
    return (root / POINTER).exists() or any(p.is_dir() for p in root.glob("round-*"))


def remove_previous_layout(state_dir: str | os.PathLike) -> None:
    """After this layout's checkpoint is published: remove the previous layout's checkpoint
    directories (they hold copies of the secrets), then its pointer — in that order, so that a kill
    in between leaves something `has_previous_layout` finds and the next start removes.

    Raises:
        OSError: a directory that could not be removed (its secrets would stay behind unnoticed).
    """
    root = Path(state_dir)
    for old in root.glob("round-*"):
        if old.is_dir():
            shutil.rmtree(old)
    (root / POINTER).unlink(missing_ok=True)
