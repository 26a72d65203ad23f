"""One user's next-word sequences, from a real-format dataset file or from the on-the-fly generator,
behind one interface: after loading, clients and server-side evaluation take the same path whatever
the source.

Real formats (``corrflow data`` reads both):

* **TFF StackOverflow SQLite.** Partition i is the i-th client of the ``train`` split in client-id
  order; the held-out evaluation reads the ``heldout`` split (else ``test``). TFF's split is by date
  — train holds posts before 2018-01-01, heldout and test later ones — so a client may appear in
  several splits; evaluation is on later posts, not on unseen users.
* **arXiv metadata JSON lines.** The privacy unit is the author. A fixed 10% of authors, chosen by a
  hash of their id (`held_out_author`), is held out: papers with a held-out author are the
  evaluation set, the other papers are the training items — partition i is the i-th of them in file
  order — and a paper trains with all its authors' attribution (multi-attribution participation, 004
  §6). No held-out author's text is ever trained on.

Memory: a source keeps only ids (int32, ``seq_len + 1`` per sequence — 84 bytes at the papers' 20
tokens), never model outputs; evaluation streams them in batches (see the clients'
``evaluate_weights``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np

from corrflow.data.arxiv import ArxivReader
from corrflow.data.stackoverflow import StackOverflowSQLite
from corrflow.data.stats import detect_format
from corrflow.data.text_synth import SPECIAL, TextTask, user_sentences
from corrflow.data.vocab import Vocabulary
from corrflow.errors import require
from corrflow.participation.attribution import AttributionGraph

#: Fraction of arXiv authors held out for evaluation (by hashed id, so the split is fixed by the
# file alone).
HELD_OUT_AUTHORS = 0.10


def held_out_author(author: str) -> bool:
    """Whether an arXiv author id is in the fixed held-out 10%: SHA-256 of the id, first 8 bytes,
    below 10%."""
    h = int.from_bytes(hashlib.sha256(f"corrflow-heldout:{author}".encode()).digest()[:8], "big")
    return h < HELD_OUT_AUTHORS * 2.0**64


def data_format(path: str) -> str:
    """``stackoverflow-sqlite`` or ``arxiv-jsonl`` (`corrflow.data.stats.detect_format`)."""

    return detect_format(path)


@dataclass(frozen=True)
class TextSource:
    """``data_path=""``: the synthetic task of `corrflow.data.text_synth`. Otherwise a TFF
    StackOverflow SQLite file or arXiv JSON lines, and its vocabulary (``corrflow data vocab``); see
    the module docstring for which partition is which user."""

    data_path: str = ""
    vocab_path: str = ""
    seq_len: int = 20
    max_sentences: int = 256
    seed: int = 0  # the synthetic task's seed (data_path="")

    def __post_init__(self) -> None:
        require(
            not self.data_path or bool(self.vocab_path),
            "vocab-path",
            "a vocabulary file (corrflow data vocab) when data-path is set",
        )
        require(self.seq_len >= 2, "seq-len", "at least 2", self.seq_len)

    @property
    def synthetic_task(self):
        """The generator behind ``data_path=""``: 200 words (the vocabulary the nextword client uses
        too)."""

        return TextTask(vocab=200, seed=self.seed)

    @cached_property
    def vocab(self):

        return Vocabulary.load(self.vocab_path)

    @cached_property
    def format(self) -> str:
        return data_format(self.data_path) if self.data_path else "synthetic"

    @cached_property
    def _db(self):

        return StackOverflowSQLite(self.data_path)

    @cached_property
    def _arxiv(self) -> tuple[list, list]:
        """(training papers, held-out papers) of an arXiv file (texts kept: a paper is a few hundred
        bytes)."""

        train, held = [], []
        for paper in ArxivReader(self.data_path):
            (held if any(held_out_author(a) for a in paper.authors) else train).append(paper)
        return train, held

    def training_papers(self) -> list:
        """arXiv: the training papers (no held-out author), partition i being the i-th."""
        return self._arxiv[0]

    @cached_property
    def train_clients(self) -> list[str]:
        """The training partitions' ids: StackOverflow client ids, or arXiv paper ids."""
        if self.format == "arxiv-jsonl":
            return [p.id for p in self._arxiv[0]]
        return self._db.client_ids("train")

    def attribution(self):
        """arXiv: the training papers → authors graph with items named ``partition-<i>`` (the
        simulated nodes)."""

        require(
            self.format == "arxiv-jsonl",
            "data-path",
            "an arXiv JSON-lines file for an attribution graph",
            self.format,
        )
        return AttributionGraph.from_pairs(
            (f"partition-{i}", a) for i, p in enumerate(self._arxiv[0]) for a in p.authors
        )

    @property
    def num_tokens(self) -> int:
        if not self.data_path:
            return self.synthetic_task.num_tokens
        return self.vocab.num_tokens

    @property
    def first_word(self) -> int:
        """The first id of a real word: ids below it are PAD, BOS, EOS and the OOV buckets (accuracy
        skips them)."""
        if not self.data_path:
            return SPECIAL
        return self.vocab.first_word

    @property
    def input_len(self) -> int:
        if not self.data_path:
            return self.synthetic_task.seq_len
        return self.seq_len

    def _encode(self, texts) -> np.ndarray:
        return self.vocab.sequences(texts, self.seq_len, self.max_sentences)

    def user_sentences(self, partition: int) -> np.ndarray:
        """int32 (sentences, input_len + 1) of the partition's user (arXiv: of the partition's
        paper)."""
        if not self.data_path:
            return user_sentences(self.synthetic_task, partition)
        clients = self.train_clients
        require(
            0 <= partition < len(clients),
            "partition-id",
            f"0 ≤ id < {len(clients)} train clients",
            partition,
        )
        if self.format == "arxiv-jsonl":
            return self._encode(_sentences(self._arxiv[0][partition].text))
        posts = self._db.client_posts(clients[partition], "train")
        return self._encode(p.tokens for p in posts)

    def held_out(self, users: int | None = None, max_sequences: int = 0) -> np.ndarray:
        """Evaluation sequences (int32, n × (input_len + 1)): synthetic — ``users`` (default 100)
        users never trained on; StackOverflow — the first ``users`` (default: all) clients of the
        ``heldout`` split (else ``test``); arXiv — the papers of held-out authors. ``max_sequences``
        > 0 stops after that many (files only)."""
        if not self.data_path:
            return np.concatenate(
                [
                    user_sentences(self.synthetic_task, 1_000_000 + i)
                    for i in range(100 if users is None else users)
                ]
            )
        if self.format == "arxiv-jsonl":
            papers = self._arxiv[1][:users]
            require(
                bool(papers),
                "data-path",
                "an arXiv file with papers by held-out authors (10% of authors, by "
                "hashed id) for evaluation",
                len(self._arxiv[0]),
            )
            return _capped((self._encode(_sentences(p.text)) for p in papers), max_sequences)
        split = "heldout" if "heldout" in self._db.splits() else "test"
        rows = _capped(
            (
                self._encode(p.tokens for p in self._db.client_posts(c, split))
                for c in self._db.client_ids(split)[:users]
            ),
            max_sequences,
        )
        require(len(rows) > 0, "data-path", f"a non-empty {split!r} split for evaluation")
        return rows


def _capped(blocks, max_rows: int = 0) -> np.ndarray:
    """Concatenate arrays of rows until ``max_rows`` (0: all), reading no further blocks than
    needed."""
    out, n = [], 0
    for b in blocks:
        if len(b):
            out.append(b)
            n += len(b)
        if max_rows and n >= max_rows:
            break
    return np.concatenate(out)[: max_rows or None] if out else np.zeros((0, 1), np.int32)


def _sentences(text: str) -> list[str]:
    """An arXiv paper's title and abstract as lower-case sentences (split at full stops)."""
    return [s for s in (" ".join(part.split()) for part in text.lower().split(". ")) if s]


@lru_cache(maxsize=4)
def text_source(
    data_path: str = "", vocab_path: str = "", seq_len: int = 20, seed: int = 0
) -> TextSource:
    """Process-wide cache, so a simulated client opens the file once, not once per round."""
    return TextSource(data_path, vocab_path, seq_len, seed=seed)


def data_paths(config, node_config) -> tuple[str, str]:
    """(data file, vocabulary file) a client trains on: the SuperNode's node config (``data-path``,
    ``vocab-path``) when it names a data file, else what the server's message config sends ("" :
    synthetic). ``node_config``: a Flower Context (its ``node_config``) or a mapping."""
    node = getattr(node_config, "node_config", node_config) or {}
    if node.get("data-path"):
        return str(node["data-path"]), str(node.get("vocab-path") or config.get("vocab-path", ""))
    return str(config.get("data-path", "")), str(config.get("vocab-path", ""))


def train_clients_count(data_path: str) -> int:
    """How many training partitions (StackOverflow train clients, arXiv training papers) a dataset
    file has."""
    return len(TextSource(data_path, "-").train_clients)


def check_dataset(data_path: str, vocab_path: str) -> None:
    """Refuse, before anything is written or trained, a dataset file without training examples or
    without a held-out split to evaluate on, and a vocabulary that does not load or holds no word
    (`DataFormatError` naming the file)."""
    from corrflow.errors import DataFormatError

    src = TextSource(data_path, vocab_path)
    if not src.vocab.words:
        raise DataFormatError(vocab_path, None, "a vocabulary with at least one word")
    if src.format == "arxiv-jsonl":
        train, held = src._arxiv
        if not train or not held:
            raise DataFormatError(
                data_path,
                None,
                "arXiv JSON lines with training papers and papers by held-out authors "
                "(10% of authors, by hashed id) for evaluation",
                f"{len(train)} training and {len(held)} held-out papers",
            )
        return
    db = src._db
    split = "heldout" if "heldout" in db.splits() else "test"
    for name, what in (("train", "training"), (split, "evaluation")):
        if name not in db.splits() or not db.has_examples(name):
            raise DataFormatError(
                data_path, "examples", f"a {name!r} split with examples ({what})", "none"
            )
