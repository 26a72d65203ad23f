"""Word vocabulary and fixed-length sequences for next-word prediction (000 §5.3 / App. F: the
10,000 most frequent training words, out-of-vocabulary buckets, BOS/EOS/PAD, sequences of 20 tokens,
at most 256 sentences per user).

Ids: PAD = 0, BOS = 1, EOS = 2, OOV buckets 3 … 2 + oov_buckets, then the words by decreasing
training count (ties by the word itself, so the vocabulary is a pure function of the counts). With
one OOV bucket this is the id layout of `corrflow.data.text_synth`, so the Keras model works on
either source. An OOV word goes to bucket ``crc32(word) mod oov_buckets`` (stable across processes,
unlike Python's ``hash``).

Provenance. The vocabulary ships with the model, so it is part of what a run publishes. The file's
header line records how it was built — ``source=dp`` with its (ε, δ)
(`corrflow.data.dp_vocab`), ``source=public`` (a word list from public data), or
``source=non-private`` (counted from the private data without privacy, only with ``corrflow data
vocab --no-privacy``) — so a run reports it truthfully. A file without a header (TFF's own
vocabulary layout: one word per line) is a list the user supplies, taken as public; a corrflow
header without a ``source`` (files written before provenance was recorded) reads as ``unrecorded``,
outside the guarantee.
"""

from __future__ import annotations

import os
import zlib
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from corrflow.errors import DataFormatError, require
from corrflow.fileio import write_text

PAD, BOS, EOS = 0, 1, 2
HEADER = "#corrflow-vocab"
#: How a vocabulary was built (the header's ``source``); only ``dp`` and ``public`` are inside a
# run's guarantee.
SOURCES = ("dp", "public", "non-private", "unrecorded")


@dataclass
class Vocabulary:
    words: list[str]
    oov_buckets: int = 1
    #: How it was built: ``{"source": one of SOURCES, "epsilon", "delta", ...}`` (the header's
    # key=value pairs).
    provenance: dict[str, Any] = field(default_factory=lambda: {"source": "public"})
    _index: dict[str, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        require(self.oov_buckets >= 1, "oov_buckets", "at least 1", self.oov_buckets)
        require(
            self.provenance.get("source") in SOURCES,
            "source",
            f"one of {SOURCES}",
            self.provenance.get("source"),
        )
        self._index = {w: i + self.first_word for i, w in enumerate(self.words)}
        require(len(self._index) == len(self.words), "words", "distinct words")

    @property
    def first_word(self) -> int:
        return 3 + self.oov_buckets

    @property
    def num_tokens(self) -> int:
        """Size of the model's input/output layer: specials + OOV buckets + words."""
        return self.first_word + len(self.words)

    def lookup(self, word: str) -> int:
        i = self._index.get(word)
        return i if i is not None else 3 + zlib.crc32(word.encode()) % self.oov_buckets

    def encode(self, sentence: str, seq_len: int) -> np.ndarray:
        """``seq_len + 1`` ids: BOS, the first ``seq_len`` words, EOS when the sentence was shorter,
        then PAD (TFF's StackOverflow preprocessing). Inputs are ids[:-1], targets ids[1:]."""
        out = np.zeros(seq_len + 1, dtype=np.int32)
        ids = [self.lookup(w) for w in sentence.split()[:seq_len]]
        out[0] = BOS
        out[1 : 1 + len(ids)] = ids
        if len(ids) < seq_len:
            out[1 + len(ids)] = EOS
        return out

    def sequences(
        self, sentences: Iterable[str], seq_len: int = 20, max_sentences: int = 256
    ) -> np.ndarray:
        """int32 (n, seq_len + 1) for one user's first ``max_sentences`` sentences."""
        rows = [
            self.encode(s, seq_len) for _, s in zip(range(max_sentences), sentences, strict=False)
        ]
        return np.stack(rows) if rows else np.zeros((0, seq_len + 1), np.int32)

    def header(self) -> str:
        """``#corrflow-vocab oov_buckets=N source=S [epsilon=E delta=D …]`` (values without
        spaces)."""
        extra = " ".join(f"{k}={v}" for k, v in self.provenance.items() if k != "source")
        return f"{HEADER} oov_buckets={self.oov_buckets} source={self.provenance['source']}" + (
            f" {extra}" if extra else ""
        )

    def save(self, path: str | os.PathLike) -> None:
        """One word per line, most frequent first (TFF's vocabulary file layout) after the
        provenance header."""
        for k, v in self.provenance.items():
            require(
                k.isidentifier() and not any(c.isspace() or c == "=" for c in str(v)),
                "provenance",
                "key=value pairs without spaces",
                f"{k}={v}",
            )
        write_text(path, self.header() + "\n" + "".join(w + "\n" for w in self.words))

    @classmethod
    def load(cls, path: str | os.PathLike) -> Vocabulary:
        path = Path(path)
        if not path.is_file():
            raise DataFormatError(path, None, "an existing vocabulary file")
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as exc:
            line = path.read_bytes()[: exc.start].count(b"\n") + 1
            raise DataFormatError(
                path, line, f"UTF-8 text ({exc.reason} at byte {exc.start})"
            ) from None
        buckets, provenance, offset = 1, {"source": "public"}, 1
        if lines and lines[0].startswith(HEADER):
            buckets, provenance = _parse_header(path, lines[0])
            lines, offset = lines[1:], 2
        for n, w in enumerate(lines):
            if not w or any(c.isspace() for c in w):
                raise DataFormatError(path, n + offset, "one word (no spaces) per line", w)
        seen = set()
        for n, w in enumerate(lines):
            if w in seen:
                raise DataFormatError(path, n + offset, "distinct words", w)
            seen.add(w)
        return cls(lines, buckets, provenance)


def _parse_header(path: Path, line: str) -> tuple[int, dict[str, Any]]:
    """(OOV buckets, provenance) from a header line; a header without ``source`` is
    ``unrecorded``."""
    fields: dict[str, Any] = {}
    for part in line[len(HEADER) :].split():
        key, sep, value = part.partition("=")
        if not sep:
            raise DataFormatError(path, 1, f"'{HEADER} key=value …'", line)
        fields[key] = value
    try:
        buckets = int(fields.pop("oov_buckets", 1))
        for key in ("epsilon", "delta"):
            if key in fields:
                fields[key] = float(fields[key])
    except ValueError as exc:
        raise DataFormatError(
            path, 1, "numeric oov_buckets, epsilon and delta in the header", line
        ) from exc
    provenance = {"source": fields.pop("source", "unrecorded"), **fields}
    if provenance["source"] not in SOURCES:
        raise DataFormatError(path, 1, f"source one of {SOURCES}", provenance["source"])
    if provenance["source"] == "dp" and not ("epsilon" in provenance and "delta" in provenance):
        raise DataFormatError(path, 1, "epsilon= and delta= for source=dp", line)
    return buckets, provenance


def read_provenance(path: str | os.PathLike) -> dict[str, Any]:
    """The provenance of a vocabulary file (its header only), with the file's SHA-256 and word
    count."""
    import hashlib

    v = Vocabulary.load(path)
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return {**v.provenance, "words": len(v.words), "oov_buckets": v.oov_buckets, "sha256": digest}


def count_words(sentences: Iterable[str]) -> Counter:
    counts: Counter = Counter()
    for s in sentences:
        counts.update(s.split())
    return counts


def build_vocabulary(
    counts: Counter, size: int = 10_000, oov_buckets: int = 1, source: str = "non-private"
) -> Vocabulary:
    """The ``size`` most frequent words (000 App. F: 10,000), ties broken by the word. Counted from
    private data this is ``non-private`` (outside any guarantee:
    `corrflow.data.dp_vocab.dp_vocabulary` is the private route); from public text, pass
    ``source="public"``. No words counted (a file without training examples) is refused: the
    vocabulary would be empty and every run on it would fail later.

    Args:
        counts: word → count.
        size: words kept.
        oov_buckets: out-of-vocabulary buckets.
        source: ``non-private`` or ``public``.

    Returns:
        The `Vocabulary`.

    Raises:
        InvalidArgumentError: (``vocab_size``) size < 1, or (``data``) no word counted.
    """
    require(size >= 1, "vocab_size", "at least 1", size)
    require(bool(counts), "data", "a file with training examples to count words from", "no words")
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]
    return Vocabulary([w for w, _ in ranked], oov_buckets, {"source": source})
