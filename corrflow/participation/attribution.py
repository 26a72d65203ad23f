"""Attribution graphs (items → the users they belong to) and user-level contribution bounding (004
§6).

An item is a SuperNode (cross-device) or an example (cross-silo); a user is a person: an arXiv paper
belongs to all its authors. The graph is public (004 §3.1: fixed-graph adjacency), so bounding it
costs no privacy.

Contribution bounding keeps at most ``k_u`` items per user by the greedy rule of the
multi-attribution setting (004 §6, following "It's my data too"): visit items in a seeded random
order and keep an item iff every one of its users still has room; report how many items were dropped
and why.
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from corrflow.errors import DataFormatError, InvalidArgumentError, require
from corrflow.fileio import read_jsonl


@dataclass
class AttributionGraph:
    """Items (devices, examples, papers) → the users behind them, for user-level accounting (004
    §6).

    Attributes:
        item_ids: the items' ids, in index order.
        user_ids: the users' ids, in index order.
        item_users: for each item index, the sorted unique indices of its users (at least one).
    """

    item_ids: list[str]
    user_ids: list[str]
    item_users: list[list[int]]  # item index -> user indices (sorted, unique)

    def __post_init__(self) -> None:
        require(len(self.item_ids) == len(self.item_users), "item_users", "one user list per item")
        for i, users in enumerate(self.item_users):
            if not users:
                raise InvalidArgumentError(
                    "item_users", f"at least one user for item {self.item_ids[i]!r}"
                )

    @property
    def num_items(self) -> int:
        return len(self.item_ids)

    @property
    def num_users(self) -> int:
        return len(self.user_ids)

    def items_per_user(self) -> np.ndarray:
        """Returns:
        How many items each user is behind: int64 of shape (num_users,).
        """
        counts = np.zeros(self.num_users, dtype=np.int64)
        for users in self.item_users:
            counts[users] += 1
        return counts

    @classmethod
    def from_pairs(cls, pairs: Iterable[tuple[object, object]]) -> AttributionGraph:
        """Build a graph from links.

        Args:
            pairs: iterable of (item id, user id); ids are converted to strings and repeated pairs
                merged.

        Returns:
            The graph, items and users indexed in order of first appearance.
        """
        items: dict[str, int] = {}
        users: dict[str, int] = {}
        links: dict[int, set[int]] = {}
        for item, user in pairs:
            i = items.setdefault(str(item), len(items))
            u = users.setdefault(str(user), len(users))
            links.setdefault(i, set()).add(u)
        return cls(list(items), list(users), [sorted(links[i]) for i in range(len(items))])


def load_attribution(path: str | os.PathLike) -> AttributionGraph:
    """Read an attribution file (``--attribution``).

    Args:
        path: ``.csv`` with header ``item,user`` (one row per link), or ``.jsonl`` with ``{"item":
            id, "users": [ids]}`` per line.

    Returns:
        The attribution graph.

    Raises:
        InvalidArgumentError: a missing file, another format, or a malformed row (naming the file
            and line).
    """
    path = Path(path)
    require(path.is_file(), "attribution", "an existing .csv or .jsonl file", str(path))
    pairs = []
    if path.suffix == ".csv":
        with open(path, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            line = raw[: exc.start].count(b"\n") + 1
            raise InvalidArgumentError(
                "attribution", f"{path}:{line}: UTF-8 text (byte {raw[exc.start]:#04x} is not)"
            ) from None
        reader = csv.DictReader(io.StringIO(text, newline=""))
        if reader.fieldnames is None or not {"item", "user"} <= set(reader.fieldnames):
            raise InvalidArgumentError(
                "attribution", f"{path}: a header with columns item,user", reader.fieldnames
            )
        for line, row in enumerate(reader, start=2):
            item, user = (row.get("item") or "").strip(), (row.get("user") or "").strip()
            if not item or not user:
                raise InvalidArgumentError(
                    "attribution", f"{path}:{line}: non-empty item and user", row
                )
            pairs.append((item, user))
    elif path.suffix == ".jsonl":
        try:
            for line, obj in read_jsonl(path):
                users = obj.get("users") if isinstance(obj, dict) else None
                if (
                    not isinstance(obj, dict)
                    or "item" not in obj
                    or not isinstance(users, list)
                    or not users
                ):
                    raise InvalidArgumentError(
                        "attribution",
                        f'{path}:{line}: {{"item": id, "users": [at least one id]}}',
                        obj,
                    )
                pairs.extend((obj["item"], u) for u in users)
        except DataFormatError as exc:
            raise InvalidArgumentError(
                "attribution", f"{exc.path}:{exc.where}: {exc.expected}"
            ) from None
    else:
        raise InvalidArgumentError("attribution", "a .csv or .jsonl file", str(path))
    require(pairs, "attribution", f"{path}: at least one item")
    return AttributionGraph.from_pairs(pairs)


@dataclass
class BoundingReport:
    """What `bound_contributions` kept: item indices kept, how many dropped, and per user at
    the cap the items refused for it."""

    kept: list[int]  # item indices kept
    dropped: int
    # user id -> items refused for it
    dropped_by_full_user: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "kept": len(self.kept),
            "dropped": self.dropped,
            "users_at_cap": len(self.dropped_by_full_user),
        }


def bound_contributions(
    graph: AttributionGraph, max_items_per_user: int, seed: int = 0
) -> BoundingReport:
    """Greedy contribution bounding (004 §6, arXiv 2602.09338): visit items in a seeded random order
    and keep an item iff all its users hold fewer than ``max_items_per_user`` kept items.

    Args:
        graph: items → users.
        max_items_per_user: k_u ≥ 1; after bounding each user is behind at most k_u kept items,
            which is the planned sensitivity of a multi-attribution run.
        seed: seeds the visiting order (public).

    Returns:
        The kept item indices (sorted), the number dropped, and per user at the cap the items
        refused for it.
    """
    require(
        isinstance(max_items_per_user, int) and max_items_per_user >= 1,
        "k_u",
        "a positive integer",
        max_items_per_user,
    )
    counts = np.zeros(graph.num_users, dtype=np.int64)
    kept, refused = [], {}
    for i in np.random.default_rng([seed, 7]).permutation(graph.num_items):
        users = graph.item_users[i]
        full = [u for u in users if counts[u] >= max_items_per_user]
        if full:
            for u in full:
                refused[graph.user_ids[u]] = refused.get(graph.user_ids[u], 0) + 1
            continue
        counts[users] += 1
        kept.append(int(i))
    kept.sort()
    return BoundingReport(kept, graph.num_items - len(kept), refused)
