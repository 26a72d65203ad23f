"""Atomic writes: the one helper behind every file corrflow saves (reports, factorizations, plan
caches, noise state, secrets, vocabularies, manifests, generated data; the server checkpoint,
`corrflow.run.checkpoint`, follows the same steps for its one file).

A file is written to a temporary name in its own directory, flushed and fsync-ed, then renamed over
the target (``os.replace``, atomic on POSIX): a reader, or a server restarted after a kill, sees the
old file or the new one, never half of one. A failed write removes its temporary file and leaves the
target as it was."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from corrflow.errors import DataFormatError

TEMP_PREFIX = ".tmp-"
# mkstemp creates files 0600; shared files (reports, vocabularies, manifests) get the mode open()
# would give them.
_UMASK = os.umask(0o022)
os.umask(_UMASK)


@contextmanager
def atomic_file(
    path: str | os.PathLike, mode: str = "wb", *, private: bool = False, suffix: str = ""
) -> Iterator[IO]:
    """Open a temporary file beside ``path`` (``mode`` "w" or "wb"); when the block ends without an
    exception it is fsync-ed and renamed onto ``path``. ``private``: mode 0600 (secrets, noise
    state)."""
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


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or creation inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: str | os.PathLike, data: bytes, *, private: bool = False) -> Path:
    """Write ``data`` to ``path`` atomically.

    Args:
        path: the file.
        data: its bytes.
        private: mode 0600 (secrets, noise state).

    Returns:
        ``path`` as a `Path`.
    """
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


def write_json(path: str | os.PathLike, obj, *, private: bool = False, **dumps) -> Path:
    """``json.dumps(obj, **dumps)`` written atomically (``private``: mode 0600), streamed to the
    file as it is encoded: a report listing every user is never held as one string as well."""
    with atomic_file(path, "w", private=private) as f:
        json.dump(obj, f, **dumps)
    return Path(path)


def write_json_rows(path: str | os.PathLike, rows: Iterable, *, private: bool = False) -> Path:
    """A JSON array written atomically with one element per line: as readable as an indented
    array of flat records, and encoded by json's C encoder (an ``indent`` falls back to the
    pure-Python one, which dominated a 2,052-round run's metrics rewrites)."""
    with atomic_file(path, "w", private=private) as f:
        f.write("[")
        for i, row in enumerate(rows):
            f.write(("\n" if i == 0 else ",\n") + json.dumps(row))
        f.write("\n]\n")
    return Path(path)


def read_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, object]]:
    """(line number, value) of every non-blank line of a JSON-lines file (UTF-8; invalid bytes
    replaced so that the JSON parser names the line). A line that is not JSON raises
    `DataFormatError` naming ``file:line``."""

    with open(path, encoding="utf-8", errors="replace") as f:
        for line_no, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                yield line_no, json.loads(text)
            except json.JSONDecodeError as exc:
                raise DataFormatError(
                    path, line_no, f"a JSON value ({exc.msg})", text.strip()[:80]
                ) from None


def save_figure(fig, path: str | os.PathLike, **savefig_kwargs) -> Path:
    """Write a matplotlib figure to ``path`` atomically (format from the suffix, PNG by default);
    ``savefig_kwargs``: ``Figure.savefig``'s (``dpi``)."""
    path = Path(path)
    fmt = path.suffix.lstrip(".").lower() or "png"
    with atomic_file(path, "wb", suffix=path.suffix) as f:
        fig.savefig(f, format=fmt, **savefig_kwargs)
    return path
