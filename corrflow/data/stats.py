"""Summary statistics of a federated dataset on disk (``corrflow data stats``): users, examples,
tokens, and the quantiles of examples per user and users per example — the numbers that set k_u,
cohort sizes and δ. A user is a distinct id across the file's splits (StackOverflow clients) or a
distinct author (arXiv)."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import numpy as np

from corrflow.data.arxiv import ArxivReader
from corrflow.data.stackoverflow import StackOverflowSQLite
from corrflow.errors import DataFormatError

QUANTILES = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)


def quantiles(values) -> dict[str, float]:
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return {}
    q = np.quantile(v, QUANTILES)
    out = {f"p{int(round(p * 100))}": float(x) for p, x in zip(QUANTILES, q, strict=True)}
    out["mean"] = float(v.mean())
    return out


def detect_format(path: str | os.PathLike) -> str:
    path = Path(path)
    if not path.is_file():
        raise DataFormatError(path, None, "an existing dataset file (.sqlite or .jsonl)")
    with open(path, "rb") as f:
        head = f.read(16)
    if head.startswith(b"SQLite format 3"):
        return "stackoverflow-sqlite"
    if head.lstrip()[:1] == b"{":
        return "arxiv-jsonl"
    raise DataFormatError(
        path, None, "an SQLite file (TFF StackOverflow) or JSON lines (arXiv metadata)", head[:16]
    )


def stackoverflow_stats(path: str | os.PathLike, on_error: str = "raise") -> dict:
    """Per split: clients, examples, tokens and examples per client; overall: distinct users (a TFF
    client may appear in several splits — the split is by date — and is one user), examples per user
    summed over splits, and how many users appear in more than one split."""

    with StackOverflowSQLite(path, on_error=on_error) as db:
        splits = {}
        per_user: Counter = Counter()
        in_splits: Counter = Counter()
        tokens = examples = 0
        for split in db.splits():
            counts = db.num_examples(split)
            n_tokens = n_examples = 0
            for _, post in db.iter_posts(split):
                n_tokens += len(post.tokens.split())
                n_examples += 1
            splits[split] = {
                "users": len(counts),
                "examples": n_examples,
                "tokens": n_tokens,
                "examples_per_user": quantiles(list(counts.values())),
            }
            per_user.update(counts)
            in_splits.update(counts.keys())
            tokens += n_tokens
            examples += n_examples
        return {
            "format": "stackoverflow-sqlite",
            "path": str(path),
            "users": len(per_user),
            "users_in_several_splits": sum(1 for n in in_splits.values() if n > 1),
            "train_users": splits.get("train", {}).get("users", 0),
            "examples": examples,
            "tokens": tokens,
            "examples_per_user": quantiles(list(per_user.values())),
            "users_per_example": quantiles([1]) if examples else {},
            "splits": splits,
            "skipped": db.skipped,
        }


def arxiv_stats(
    path: str | os.PathLike, on_error: str = "raise", min_authors: int = 1, key: str = "full"
) -> dict:

    reader = ArxivReader(path, on_error=on_error, min_authors=min_authors, key=key)
    per_user: Counter = Counter()
    per_example: list[int] = []
    pairs: set[tuple[str, str]] = set()
    repeat = multi = tokens = 0
    for paper in reader:
        per_example.append(len(paper.authors))
        per_user.update(paper.authors)
        tokens += len(paper.text.split())
        if len(paper.authors) > 1:
            multi += 1
            team = sorted(paper.authors)[:32]  # big collaborations: bounded pair count
            new = {(a, b) for i, a in enumerate(team) for b in team[i + 1 :]}
            repeat += bool(new & pairs)
            pairs |= new
    return {
        "format": "arxiv-jsonl",
        "path": str(path),
        "users": len(per_user),
        "examples": len(per_example),
        "tokens": tokens,
        "examples_per_user": quantiles(list(per_user.values())),
        "users_per_example": quantiles(per_example),
        "single_author_fraction": float(np.mean(np.asarray(per_example) == 1))
        if per_example
        else 0.0,
        "repeat_coauthorship_fraction": repeat / multi if multi else 0.0,
        "skipped": reader.skipped,
        "filtered": reader.filtered,
    }


def dataset_stats(path: str | os.PathLike, **kwargs) -> dict:
    fmt = detect_format(path)
    if fmt == "stackoverflow-sqlite":
        kwargs.pop("min_authors", None)
        kwargs.pop("key", None)
        return stackoverflow_stats(path, **kwargs)
    return arxiv_stats(path, **kwargs)
