"""Partitioning a dataset over Flower nodes: simulation partitions (``partition-id`` ↔ data) and the
node-config string each SuperNode is started with in deployment (``flower-supernode --node-config
"..."``).

Cross-device (one user per node; StackOverflow): partition i holds the i-th user of the split in
client-id order, so ``num-partitions`` equals the number of users. Cross-silo (several users'
examples per node; arXiv): examples are spread over ``partitions`` silos by a seeded hash of the
example id — stable when the file grows — and the attribution graph stays global (a user's papers
may sit in several silos; the server bounds the user, not the silo).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from corrflow.data.arxiv import ArxivReader
from corrflow.data.stackoverflow import StackOverflowSQLite
from corrflow.data.stats import detect_format
from corrflow.errors import DataFormatError, require
from corrflow.fileio import write_json


def silo_of(item_id: str, partitions: int, seed: int = 0) -> int:
    digest = hashlib.sha256(f"{seed}:{item_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % partitions


def node_config(partition_id: int, num_partitions: int, data_path: str | os.PathLike) -> str:
    """The ``--node-config`` value for one SuperNode: Flower's space-separated key=value pairs with
    TOML values. Flower splits the line with a regex that knows no escapes, so the path is a TOML
    literal string ('...') or, if it contains a single quote, a basic string ("...")."""
    text = str(Path(data_path).resolve())
    if "'" not in text:
        quoted = f"'{text}'"
    else:
        require(
            '"' not in text and "\\" not in text,
            "data-path",
            "a path without both quote kinds",
            text,
        )
        quoted = f'"{text}"'
    return f"partition-id={partition_id} num-partitions={num_partitions} data-path={quoted}"


def make_manifest(
    path: str | os.PathLike,
    partitions: int | None = None,
    split: str = "train",
    seed: int = 0,
    on_error: str = "raise",
) -> dict:
    """Partition manifest: for each partition its users (cross-device) or its example ids
    (cross-silo) and the node-config line. ``partitions=None`` means one partition per user
    (StackOverflow) — required for arXiv."""
    fmt = detect_format(path)
    if fmt == "stackoverflow-sqlite":
        with StackOverflowSQLite(path, on_error=on_error) as db:
            users = db.client_ids(split)
        n = partitions or len(users)
        require(
            1 <= n <= len(users),
            "partitions",
            f"between 1 and the {len(users)} users of split {split!r}",
            n,
        )
        groups: list[list[str]] = [users[i::n] for i in range(n)]
        key = "users"
    else:
        require(
            partitions is not None and partitions >= 1,
            "partitions",
            "a number of silos ≥ 1 for arXiv data",
            partitions,
        )
        groups = [[] for _ in range(partitions)]
        for paper in ArxivReader(path, on_error=on_error):
            groups[silo_of(paper.id, partitions, seed)].append(paper.id)
        n, key = partitions, "items"
    return {
        "format": fmt,
        "path": str(Path(path).resolve()),
        "split": split,
        "seed": seed,
        "num_partitions": n,
        "partitions": [
            {"partition_id": i, key: g, "node_config": node_config(i, n, path)}
            for i, g in enumerate(groups)
        ],
    }


def write_manifest(manifest: dict, out: str | os.PathLike) -> Path:
    return write_json(out, manifest, indent=1)


def load_manifest(path: str | os.PathLike) -> dict:
    path = Path(path)
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (
        OSError,
        ValueError,
    ) as exc:  # ValueError: JSON that does not parse, bytes that are not UTF-8
        raise DataFormatError(path, None, "a partition manifest (JSON)", str(exc)) from exc
    for field in ("format", "path", "num_partitions", "partitions"):
        if field not in manifest:
            raise DataFormatError(path, None, f"a manifest field {field!r}")
    return manifest
