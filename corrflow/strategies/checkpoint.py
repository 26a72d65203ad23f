"""Atomic server checkpoints: each round's state goes into a fresh directory that is fsynced and then published
by atomically replacing the ``CURRENT`` pointer file; older directories are removed afterwards. A crash leaves
either the old or the new checkpoint, never a mix. Each checkpoint directory is created 0700 (its ledger holds raw
user ids); the private parts (noise key and buffer, report salt) are also 0600 files."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from corrflow.errors import IntegrityError

POINTER = "CURRENT"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint(state_dir: str | os.PathLike, name: str, arrays: dict[str, list[np.ndarray]],
                     public: dict, private: dict[str, bytes], save_extra=None) -> Path:
    """Write ``arrays`` (npz per key), ``public`` (state.json) and ``private`` files into ``state_dir/name``."""
    root = Path(state_dir)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tmp-"))
    try:
        for key, arrs in arrays.items():
            with open(tmp / f"{key}.npz", "wb") as f:
                np.savez(f, *arrs)
        (tmp / "state.json").write_text(json.dumps(public, sort_keys=True))
        for fname, data in private.items():
            fd = os.open(tmp / fname, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        if save_extra is not None:
            save_extra(tmp)
        for p in tmp.rglob("*"):
            if p.is_file():
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
        final = root / name
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        ptr_fd, ptr_tmp = tempfile.mkstemp(dir=root, prefix=".tmp-ptr-")
        with os.fdopen(ptr_fd, "w") as f:
            f.write(name)
            f.flush()
            os.fsync(f.fileno())
        os.replace(ptr_tmp, root / POINTER)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in root.iterdir():
        if old.is_dir() and old.name != name and not old.name.startswith(".tmp-"):
            shutil.rmtree(old, ignore_errors=True)
    return root / name


def current_checkpoint(state_dir: str | os.PathLike) -> Path | None:
    root = Path(state_dir)
    ptr = root / POINTER
    if not ptr.exists():
        return None
    path = root / ptr.read_text().strip()
    if not (path / "state.json").exists():
        raise IntegrityError(f"{root}: CURRENT points to {path.name}, which is incomplete")
    return path


def load_arrays(path: Path, key: str) -> list[np.ndarray]:
    with np.load(path / f"{key}.npz", allow_pickle=False) as d:
        return [d[f"arr_{i}"] for i in range(len(d.files))]
