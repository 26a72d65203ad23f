"""Atomic writes: the one helper behind every file corrflow saves (reports, factorizations, plan caches, noise
state, checkpoint pointers, vocabularies, manifests, generated data).

A file is written to a temporary name in its own directory, flushed and fsync-ed, then renamed over the target
(``os.replace``, atomic on POSIX): a reader, or a server restarted after a kill, sees the old file or the new one,
never half of one. A failed write removes its temporary file and leaves the target as it was."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

TEMP_PREFIX = ".tmp-"
# mkstemp creates files 0600; shared files (reports, vocabularies, manifests) get the mode open() would give them.
_UMASK = os.umask(0o022)
os.umask(_UMASK)


@contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "wb", *, private: bool = False,
                suffix: str = "") -> Iterator[IO]:
    """Open a temporary file beside ``path`` (``mode`` "w" or "wb"); when the block ends without an exception it is
    fsync-ed and renamed onto ``path``. ``private``: mode 0600 (secrets, noise state)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=TEMP_PREFIX, suffix=suffix)
    try:
        os.fchmod(fd, 0o600 if private else 0o666 & ~_UMASK)
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_bytes(path: str | os.PathLike, data: bytes, *, private: bool = False) -> Path:
    with atomic_file(path, "wb", private=private) as f:
        f.write(data)
    return Path(path)


def write_text(path: str | os.PathLike, text: str, *, private: bool = False) -> Path:
    with atomic_file(path, "w", private=private) as f:
        f.write(text)
    return Path(path)


def copy_file(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Copy ``src`` onto ``dst`` atomically (a reader of ``dst`` never sees part of the copy)."""
    with open(src, "rb") as f, atomic_file(dst, "wb", suffix=Path(dst).suffix) as g:
        shutil.copyfileobj(f, g)
    return Path(dst)


def write_json(path: str | os.PathLike, obj, **dumps) -> Path:
    """``json.dumps(obj, **dumps)`` written atomically."""
    return write_text(path, json.dumps(obj, **dumps))
