"""Real text in the real format: a git repository's commit history as arXiv metadata JSON lines
(the format ``corrflow compare --data`` and ``simulate --data`` read; corrflow.data.arxiv).

Each commit is one "paper": its subject is the title, its message body the abstract, and its author
plus every ``Co-authored-by:`` trailer are its authors — so a commit written by two people counts
against both, the multi-attribution setting of 004 §6–7.3 (corrflow's attribution graph bounds
each author's contributions). Commits without a message body keep their title as their text;
bots are kept as authors.

With ``--format stackoverflow`` it writes TFF's StackOverflow SQLite instead (what ``corrflow
compare --data`` trains on): one client per author, one post per commit (subject and body, lower
case, punctuation split off as tokens); commits with several authors are left out (a post has one
client), and each author's split — train 80%, heldout 10%, test 10% — is drawn from a hash of
the name, so no held-out author ever trains.

Usage: python benchmarks/commit_text.py REPO OUT [--format arxiv|stackoverflow] [--min-words N]

Prints one JSON object: commits written, distinct authors, commits with several authors, words.
No network: REPO is a local clone (or a bare mirror).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

from corrflow.data.stackoverflow import Post, StackOverflowWriter
from corrflow.fileio import atomic_file

_TRAILER = re.compile(r"^co-authored-by:\s*(.+?)\s*(<[^>]*>)?\s*$", re.IGNORECASE | re.MULTILINE)
_FIELD, _RECORD = "\x1f", "\x1e"
_TOKEN = re.compile(r"[a-z0-9_']+|[^\sa-z0-9_']")


def parsed_name(name: str) -> list[str]:
    """``"Ada B. Lovelace"`` → ``["Lovelace", "Ada B.", ""]`` (arXiv's ``authors_parsed``); tokens
    without a letter or digit (an emoji after a name) are left out."""
    parts = [p for p in name.split() if any(c.isalnum() for c in p)]
    if not parts:
        return ["unknown", "", ""]
    return [parts[-1], " ".join(parts[:-1]), ""]


def commits(repo: Path) -> list[dict]:
    """Every commit reachable from HEAD as an arXiv-style record (module docstring)."""
    text = subprocess.run(
        ["git", "-C", str(repo), "log", f"--format=%H{_FIELD}%an{_FIELD}%s{_FIELD}%b{_RECORD}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    records = []
    for raw in text.split(_RECORD):
        if not raw.strip():
            continue
        sha, author, subject, body = (raw.strip("\n").split(_FIELD) + ["", "", "", ""])[:4]
        names = [author] + [m.group(1) for m in _TRAILER.finditer(body)]
        distinct = list(dict.fromkeys(n.strip() for n in names if n.strip()))
        abstract = _TRAILER.sub("", body).strip()
        records.append(
            {
                "id": sha[:12],
                "authors": " and ".join(distinct),
                "authors_parsed": [parsed_name(n) for n in distinct],
                "title": subject.strip(),
                "abstract": abstract,
                "categories": "cs.LG",
            }
        )
    return records


def split_of(author: str) -> str:
    """An author's split from a hash of the name: train 80%, heldout 10%, test 10%."""
    bucket = int.from_bytes(hashlib.sha256(author.encode()).digest()[:8], "little") % 10
    return "train" if bucket < 8 else ("heldout" if bucket == 8 else "test")


def write_stackoverflow(records: list[dict], out: Path) -> int:
    """Single-author commits as TFF StackOverflow clients (module docstring); how many were
    left out for having several authors."""
    per_author: dict[str, list[Post]] = {}
    several = 0
    for r in records:
        if len(r["authors_parsed"]) > 1:
            several += 1
            continue
        text = f"{r['title']} {r['abstract']}".lower()
        tokens = " ".join(_TOKEN.findall(text))
        per_author.setdefault(r["authors"], []).append(Post(tokens=tokens, title=r["title"]))
    writer = StackOverflowWriter(out)
    for i, (author, posts) in enumerate(sorted(per_author.items())):
        writer.add_client(f"{i:08d}", split_of(author), posts)
    writer.close()
    return several


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("repo", type=Path, help="a local git repository (a bare mirror works)")
    ap.add_argument("out", type=Path, help="the JSON-lines file to write")
    ap.add_argument(
        "--min-words", type=int, default=3, help="drop commits with fewer words (default 3)"
    )
    ap.add_argument(
        "--format",
        choices=("arxiv", "stackoverflow"),
        default="arxiv",
        help="arXiv JSON lines (every co-author) or TFF StackOverflow SQLite (single-author "
        "commits)",
    )
    args = ap.parse_args()
    try:
        records = commits(args.repo)
    except subprocess.CalledProcessError as exc:
        print(
            f"error: REPO: not a git repository with history: {exc.stderr.strip()}", file=sys.stderr
        )
        raise SystemExit(2) from None
    kept = [r for r in records if len(f"{r['title']} {r['abstract']}".split()) >= args.min_words]
    left_out = 0
    if args.format == "stackoverflow":
        left_out = write_stackoverflow(kept, args.out)
    else:
        with atomic_file(args.out, "w") as f:
            for r in kept:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    authors = {a for r in kept for a in r["authors"].split(" and ")}
    print(
        json.dumps(
            {
                "benchmark": "commit_text",
                "repo": str(args.repo),
                "commits": len(kept),
                "dropped_short": len(records) - len(kept),
                "authors": len(authors),
                "multi_author_commits": sum(len(r["authors_parsed"]) > 1 for r in kept),
                "format": args.format,
                "left_out_multi_author": left_out,
                "words": sum(len(f"{r['title']} {r['abstract']}".split()) for r in kept),
                "out": str(args.out),
            }
        )
    )


if __name__ == "__main__":
    main()
