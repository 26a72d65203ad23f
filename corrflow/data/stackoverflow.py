"""Federated StackOverflow in TensorFlow Federated's SQLite format: reader, writer and a seeded
generator.

The file TFF's ``stackoverflow.load_data`` uses has two tables (000 §5.3 trains on its ``train``
split)::

    examples(split_name TEXT, client_id TEXT, serialized_example_proto BLOB)     -- one post per row
    client_metadata(client_id TEXT, split_name TEXT, num_examples INTEGER)

and every example is a ``tf.train.Example`` with bytes features ``tokens`` (space-separated
lower-case words), ``title``, ``tags`` ('|'-separated), ``type``, ``creation_date`` and the int64
``score``. TFF's splits are by date, not by client: ``train`` holds the posts before 2018-01-01,
``heldout`` and ``test`` later posts (TFF's ``stackoverflow.load_data`` documentation), so one
client may appear in several splits — ``client_metadata`` has one row per (client, split). One
client id is one user (one account) whatever the split; ``corrflow data stats`` counts distinct ids.
Evaluation on ``heldout`` measures later posts, partly of users seen in training.

The generator below assigns each synthetic user to one split (a simplification; held-out users are
then unseen).

The generator writes the very same format with a realistic shape: power-law posts per user (Pareto
tail), Zipfian words with per-user topic mixtures, log-normal post lengths; it streams user by user
so memory stays bounded at 340k users, and writes to a temporary file renamed into place at the end.
"""

from __future__ import annotations

import logging
import os
import sqlite3
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from corrflow.data.lexicon import Lexicon
from corrflow.data.tfexample import ProtoError, decode_example, encode_example
from corrflow.errors import DataFormatError, require

log = logging.getLogger(__name__)

SPLITS = ("train", "heldout", "test")
_COLUMNS = {
    "examples": {"split_name", "client_id", "serialized_example_proto"},
    "client_metadata": {"client_id", "split_name", "num_examples"},
}
_SCHEMA = """
CREATE TABLE examples (split_name TEXT NOT NULL, client_id TEXT NOT NULL,
    serialized_example_proto BLOB NOT NULL);
CREATE TABLE client_metadata (client_id TEXT NOT NULL, split_name TEXT NOT NULL,
    num_examples INTEGER NOT NULL);
"""
_INDEXES = """
CREATE INDEX idx_examples_client_id ON examples (client_id);
CREATE INDEX idx_examples_client_id_split ON examples (split_name, client_id);
CREATE INDEX idx_metadata_client_id ON client_metadata (client_id);
"""


@dataclass(frozen=True)
class Post:
    tokens: str
    title: str = ""
    tags: tuple[str, ...] = ()
    type: str = "answer"
    score: int = 0
    creation_date: str = ""

    def to_proto(self) -> bytes:
        return encode_example(
            {
                "tokens": self.tokens,
                "title": self.title,
                "tags": "|".join(self.tags),
                "type": self.type,
                "creation_date": self.creation_date,
                "score": np.array([self.score], np.int64),
            }
        )

    @classmethod
    def from_proto(cls, data: bytes) -> Post:
        f = decode_example(data)
        if "tokens" not in f or not isinstance(f["tokens"], list) or len(f["tokens"]) != 1:
            raise ProtoError("a bytes feature 'tokens' with one value")

        def text(name):
            v = f.get(name, [])
            if not isinstance(v, list):
                raise ProtoError(f"feature {name!r} to hold bytes")
            return v[0].decode("utf-8") if v else ""

        score = f.get("score")
        tags = text("tags")
        return cls(
            tokens=text("tokens"),
            title=text("title"),
            tags=tuple(t for t in tags.split("|") if t),
            type=text("type"),
            creation_date=text("creation_date"),
            score=int(score[0]) if isinstance(score, np.ndarray) and score.size else 0,
        )


class StackOverflowSQLite:
    """Read-only access to a TFF-format SQLite file; checks the schema on open.

    ``on_error="raise"`` (default) stops at a row whose proto does not parse, naming the file, the
    row id and the client; ``"skip"`` drops such rows, counts them in ``skipped`` and logs one
    warning per file.
    """

    def __init__(self, path: str | os.PathLike, on_error: str = "raise"):
        self.path = Path(path)
        require(on_error in ("raise", "skip"), "on_error", "'raise' or 'skip'", on_error)
        if not self.path.is_file():
            raise DataFormatError(self.path, None, "an existing TFF SQLite file")
        self.on_error = on_error
        self.skipped = 0
        self._warned = False
        try:
            self._db = sqlite3.connect(
                f"file:{self.path}?mode=ro", uri=True, check_same_thread=False
            )
            tables = {
                r[0] for r in self._db.execute("SELECT name FROM sqlite_master WHERE type='table'")
            }
        except sqlite3.DatabaseError as exc:
            raise DataFormatError(self.path, None, "an SQLite database", str(exc)) from exc
        for table, needed in _COLUMNS.items():
            if table not in tables:
                raise DataFormatError(
                    self.path,
                    f"table {table}",
                    f"a table {table!r} with columns {sorted(needed)}",
                    sorted(tables),
                )
        for table, needed in _COLUMNS.items():
            have = {r[1] for r in self._db.execute(f"PRAGMA table_info({table})")}
            if not needed <= have:
                raise DataFormatError(
                    self.path,
                    f"table {table}",
                    f"columns {sorted(needed)}",
                    f"missing {sorted(needed - have)}",
                )

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> StackOverflowSQLite:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def splits(self) -> list[str]:
        return [
            r[0]
            for r in self._db.execute("SELECT DISTINCT split_name FROM client_metadata ORDER BY 1")
        ]

    def _check_split(self, split: str) -> None:
        known = self.splits()
        if split not in known:
            raise DataFormatError(self.path, "client_metadata", f"split one of {known}", split)

    def client_ids(self, split: str = "train") -> list[str]:
        self._check_split(split)
        return [
            r[0]
            for r in self._db.execute(
                "SELECT client_id FROM client_metadata WHERE split_name = ? ORDER BY client_id",
                (split,),
            )
        ]

    def has_examples(self, split: str) -> bool:
        """Whether ``split`` holds at least one example (a split listed in the metadata may have
        none)."""
        row = self._db.execute(
            "SELECT 1 FROM examples WHERE split_name = ? LIMIT 1", (split,)
        ).fetchone()
        return row is not None

    def num_examples(self, split: str = "train") -> dict[str, int]:
        self._check_split(split)
        return dict(
            self._db.execute(
                "SELECT client_id, num_examples FROM client_metadata WHERE split_name = ?", (split,)
            )
        )

    def _parse(self, rowid: int, client: str, blob) -> Post | None:
        try:
            return Post.from_proto(blob)
        except (ProtoError, UnicodeDecodeError, TypeError) as exc:
            if self.on_error == "raise":
                raise DataFormatError(
                    self.path,
                    f"examples row {rowid} (client {client})",
                    "a serialized tf.train.Example with a 'tokens' feature",
                    str(exc),
                ) from exc
            self.skipped += 1
            if not self._warned:
                log.warning(
                    "%s: skipping malformed examples (first at row %d, client %s: %s); the count "
                    "is in 'skipped'",
                    self.path,
                    rowid,
                    client,
                    exc,
                )
                self._warned = True
            return None

    def client_posts(self, client_id: str, split: str = "train") -> list[Post]:
        """One client's posts of one split, in stored order."""
        self._check_split(split)
        rows = self._db.execute(
            "SELECT rowid, serialized_example_proto FROM examples WHERE split_name = ? AND "
            "client_id = ? ORDER BY rowid",
            (split, client_id),
        )
        return [p for rowid, blob in rows if (p := self._parse(rowid, client_id, blob)) is not None]

    def iter_posts(self, split: str = "train") -> Iterator[tuple[str, Post]]:
        """Stream (client id, post) over a whole split without loading it."""
        self._check_split(split)
        rows = self._db.execute(
            "SELECT rowid, client_id, serialized_example_proto FROM examples "
            "WHERE split_name = ? ORDER BY rowid",
            (split,),
        )
        for rowid, client, blob in rows:
            post = self._parse(rowid, client, blob)
            if post is not None:
                yield client, post


class StackOverflowWriter:
    """Writes the TFF schema to ``path`` (atomically: a temporary file renamed into place on
    ``close``)."""

    def __init__(self, path: str | os.PathLike, batch: int = 20_000):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = self.path.with_name(self.path.name + ".partial")
        self._tmp.unlink(missing_ok=True)
        self._db = sqlite3.connect(self._tmp)
        self._db.executescript("PRAGMA journal_mode = OFF; PRAGMA synchronous = OFF;" + _SCHEMA)
        self._rows: list[tuple[str, str, bytes]] = []
        self._meta: list[tuple[str, str, int]] = []
        self._batch = batch

    def add_client(self, client_id: str, split: str, posts) -> None:
        require(split in SPLITS, "split", f"one of {SPLITS}", split)
        count = 0
        for post in posts:
            self._rows.append((split, client_id, post.to_proto()))
            count += 1
        self._meta.append((client_id, split, count))
        if len(self._rows) >= self._batch:
            self._flush()

    def _flush(self) -> None:
        self._db.executemany("INSERT INTO examples VALUES (?, ?, ?)", self._rows)
        self._db.executemany("INSERT INTO client_metadata VALUES (?, ?, ?)", self._meta)
        self._db.commit()
        self._rows.clear()
        self._meta.clear()

    def close(self) -> Path:
        self._flush()
        self._db.executescript(_INDEXES)
        self._db.commit()
        self._db.close()
        os.replace(self._tmp, self.path)
        return self.path


@dataclass(frozen=True)
class StackOverflowSpec:
    """Parameters of the synthetic StackOverflow generator (defaults give a laptop-sized but
    realistically shaped dataset; the real one has 342,477 train clients with a median of tens and a
    tail of thousands of posts)."""

    users: int = 1000
    seed: int = 0
    posts_min: int = 2  # Pareto(posts_alpha) tail: P(posts ≥ x) = (posts_min / x)^posts_alpha
    posts_alpha: float = 1.2
    posts_max: int = 1000
    tokens_median: float = 12.0  # log-normal post length
    tokens_sigma: float = 0.6
    tokens_max: int = 80
    # Dirichlet α of each user's topic mixture (small = strong skew)
    topic_concentration: float = 0.2
    split_fractions: tuple[float, float, float] = (0.8, 0.1, 0.1)
    lexicon: Lexicon = field(default_factory=Lexicon)

    def __post_init__(self) -> None:
        require(self.users >= 1, "users", "at least 1", self.users)
        require(1 <= self.posts_min <= self.posts_max, "posts_min", "1 ≤ posts_min ≤ posts_max")
        require(self.posts_alpha > 0, "posts_alpha", "> 0", self.posts_alpha)
        require(
            abs(sum(self.split_fractions) - 1) < 1e-9 and min(self.split_fractions) >= 0,
            "split_fractions",
            "three non-negative fractions summing to 1",
            self.split_fractions,
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["lexicon"] = asdict(self.lexicon)
        return d


def client_id(index: int) -> str:
    return f"{index:08d}"


def posts_count(rng: np.random.Generator, spec: StackOverflowSpec) -> int:
    return int(
        min(
            spec.posts_max,
            np.floor(spec.posts_min * (1.0 - rng.random()) ** (-1.0 / spec.posts_alpha)),
        )
    )


def synthetic_user(spec: StackOverflowSpec, index: int) -> tuple[str, list[Post]]:
    """User ``index``'s split and posts: a pure function of (seed, index), so any subset can be
    regenerated."""
    rng = np.random.default_rng([spec.seed, 12, index])
    split = SPLITS[
        min(2, int(np.searchsorted(np.cumsum(spec.split_fractions), rng.random(), side="right")))
    ]
    lex = spec.lexicon
    count = posts_count(rng, spec)
    mix = rng.dirichlet(np.full(lex.topics, spec.topic_concentration))
    topics = rng.choice(lex.topics, size=count, p=mix)
    lengths = np.clip(
        np.round(spec.tokens_median * np.exp(spec.tokens_sigma * rng.standard_normal(count))),
        1,
        spec.tokens_max,
    ).astype(np.int64)
    title_len = 6
    ends = np.cumsum(lengths + title_len)
    draws = np.empty(int(ends[-1]), dtype=np.int64)
    owner = np.repeat(topics, lengths + title_len)
    for t in np.unique(topics):  # one CDF search per topic, not per post
        sel = owner == t
        draws[sel] = lex.sample(rng, int(t), int(sel.sum()))
    segments = np.column_stack(
        [lengths, np.full(count, title_len)]
    ).ravel()  # body, title, body, title…
    draws = lex.chain(rng, draws, np.repeat(topics, 2), segments)
    question = rng.random(count) < 0.35
    ntags = rng.integers(1, 4, size=count)
    tag_ids = rng.permuted(np.tile(np.arange(12), (count, 1)), axis=1)
    days = 14_000 + int(rng.integers(0, 3000)) + np.cumsum(rng.integers(0, 30, size=count))
    scores = rng.geometric(0.4, size=count) - 1
    words = lex.word_array[draws]
    posts = []
    for j in range(count):
        body = words[ends[j] - lengths[j] - title_len : ends[j]]
        q = bool(question[j])
        t = int(topics[j])
        posts.append(
            Post(
                tokens=" ".join(body[: lengths[j]]),
                title=" ".join(body[lengths[j] :]) if q else "",
                tags=tuple(f"topic{t}-tag{int(i)}" for i in tag_ids[j, : ntags[j]]) if q else (),
                type="question" if q else "answer",
                score=int(scores[j]),
                creation_date=str(np.datetime64(int(days[j]), "D")) + " 12:00:00.000000 UTC",
            )
        )
    return split, posts


def generate_stackoverflow(path: str | os.PathLike, spec: StackOverflowSpec, progress=None) -> dict:
    """Write ``spec.users`` synthetic users to ``path`` in TFF's SQLite format, streaming (bounded
    memory). Returns counts per split."""
    writer = StackOverflowWriter(path)
    counts = {s: {"clients": 0, "examples": 0} for s in SPLITS}
    for i in range(spec.users):
        split, posts = synthetic_user(spec, i)
        writer.add_client(client_id(i), split, posts)
        counts[split]["clients"] += 1
        counts[split]["examples"] += len(posts)
        if progress is not None:
            progress(i + 1)
    writer.close()
    return counts
