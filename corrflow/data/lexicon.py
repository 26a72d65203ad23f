"""Synthetic vocabulary shared by the on-disk generators: deterministic word strings, a Zipfian rank
distribution and per-topic skew, sampled through precomputed CDFs so one user's text costs O(tokens
· log V), not O(V)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

# Frequent English function words first, so generated text has a realistic head; then made-up words.
_COMMON = (
    "the",
    "to",
    "i",
    "a",
    "is",
    "and",
    "of",
    "it",
    "in",
    "you",
    "that",
    "this",
    "for",
    "be",
    "have",
    "on",
    "with",
    "not",
    "can",
    "are",
    "if",
    "but",
    "as",
    "or",
    "do",
    "my",
    "what",
    "so",
    "an",
    "at",
    "from",
    "use",
    "which",
    "there",
    "get",
    "how",
    "would",
    "will",
    "your",
    "was",
    "when",
    "just",
    "code",
    "like",
    "one",
    "all",
    "need",
    "any",
    "should",
    "there's",
    "it's",
    "don't",
    "i'm",
    "has",
    "using",
    "then",
    "file",
    "by",
    "value",
    "way",
    "also",
    "here",
)
_SYLLABLES = (
    "ka",
    "lo",
    "mi",
    "nu",
    "pe",
    "ra",
    "si",
    "to",
    "vu",
    "we",
    "xa",
    "yo",
    "zi",
    "be",
    "da",
    "fe",
    "go",
    "hu",
    "jo",
    "ke",
    "la",
    "mo",
    "ne",
    "po",
    "qu",
    "re",
    "sa",
    "ti",
    "ul",
    "va",
    "wi",
    "ze",
    "bo",
    "ci",
    "du",
    "ga",
    "he",
    "ja",
    "ki",
)


def synthetic_word(index: int) -> str:
    """The index-th word: a common word, else a bijective base-40 string of syllables (unique, lower
    case)."""
    if index < len(_COMMON):
        return _COMMON[index]
    n = index - len(_COMMON) + 1
    parts = []
    while n > 0:
        n, r = divmod(n - 1, len(_SYLLABLES))
        parts.append(_SYLLABLES[r])
    return "".join(reversed(parts)) + ("" if len(parts) > 1 else "x")


@dataclass(frozen=True)
class Lexicon:
    """``size`` word types with global Zipf(``zipf``) frequencies; topic t multiplies ``boost`` onto
    a seeded ``topic_share`` fraction of the words (per-user topic skew comes from each user's topic
    mixture)."""

    size: int = 20_000
    topics: int = 20
    zipf: float = 1.07
    boost: float = 20.0
    topic_share: float = 0.02
    seed: int = 0
    # Word order: a sparse first-order Markov chain per topic (see `chain`).
    follow: float = 0.6  # P(a word is a successor of the previous word rather than a fresh draw)
    successors: int = 3  # successors per word, Zipf(successor_zipf)-weighted
    successor_zipf: float = 1.5
    # fraction of successor rows each topic redraws from its own distribution
    topic_specific: float = 0.25

    @property
    def successor_weights(self) -> np.ndarray:
        w = 1.0 / np.arange(1, self.successors + 1) ** self.successor_zipf
        return w / w.sum()

    def bigram_ceiling(self) -> float:
        """Expected accuracy of predicting the top successor of the previous word, on a topic-blind
        predictor's rows (the shared ones): follow · w₁ · (1 − topic_specific). A lower bound on
        what bigram counts reach with enough data (fresh draws that hit the successor only add)."""
        return self.follow * float(self.successor_weights[0]) * (1 - self.topic_specific)

    @cached_property
    def words(self) -> list[str]:
        return [synthetic_word(i) for i in range(self.size)]

    @cached_property
    def word_array(self) -> np.ndarray:
        return np.asarray(self.words, dtype=object)

    @cached_property
    def topic_words(self) -> list[np.ndarray]:
        """Word indices boosted in each topic. The head (function words) stays shared; topic words
        come from the rest."""
        rng = np.random.default_rng([self.seed, 7])
        return [
            np.sort(
                rng.choice(
                    np.arange(len(_COMMON), self.size), int(self.topic_share * self.size), False
                )
            )
            for _ in range(self.topics)
        ]

    @cached_property
    def _cdf(self) -> np.ndarray:
        base = 1.0 / np.arange(1, self.size + 1) ** self.zipf
        cdf = np.empty((self.topics, self.size))
        for t, boosted in enumerate(self.topic_words):
            p = base.copy()
            p[boosted] *= self.boost
            cdf[t] = np.cumsum(p / p.sum())
        cdf[:, -1] = 1.0
        return cdf

    def sample(self, rng: np.random.Generator, topic: int, count: int) -> np.ndarray:
        """``count`` word indices drawn from topic ``topic``'s distribution."""
        return np.searchsorted(self._cdf[topic], rng.random(count), side="right")

    @cached_property
    def successor_table(self) -> np.ndarray:
        """int32 (topics, size, successors), shared by all topics: successors of a topic's own words
        come from that topic's distribution, of the other words from the global Zipf distribution;
        then each topic redraws a ``topic_specific`` fraction of rows from its own distribution."""
        rng = np.random.default_rng([self.seed, 8])
        base = np.cumsum(1.0 / np.arange(1, self.size + 1) ** self.zipf)
        base /= base[-1]
        shared = np.searchsorted(base, rng.random((self.size, self.successors)), side="right")
        # a topic word leads on to its topic: chains keep the skew
        for t, own in enumerate(self.topic_words):
            shared[own] = self.sample(rng, t, own.size * self.successors).reshape(
                own.size, self.successors
            )
        table = np.repeat(shared[None].astype(np.int32), self.topics, axis=0)
        for t in range(self.topics):
            rows = np.flatnonzero(rng.random(self.size) < self.topic_specific)
            table[t, rows] = self.sample(rng, t, rows.size * self.successors).reshape(
                rows.size, self.successors
            )
        return np.minimum(table, self.size - 1)

    def chain(
        self, rng: np.random.Generator, fresh: np.ndarray, topics: np.ndarray, lengths: np.ndarray
    ) -> np.ndarray:
        """Impose the Markov order on ``fresh`` topic draws: ``fresh`` is the concatenation of
        segments (posts) of ``lengths`` words with topics ``topics``; within a segment, word i is,
        with probability ``follow``, a successor of word i − 1 (weights ``successor_weights``), else
        its fresh draw. Vectorised over segments."""
        out = fresh.copy()
        if len(lengths) == 0 or self.follow <= 0:
            return out
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        table = self.successor_table
        cdf = np.cumsum(self.successor_weights)
        for i in range(1, int(lengths.max())):
            live = np.flatnonzero(lengths > i)
            pos = starts[live] + i
            follow = rng.random(live.size) < self.follow
            pick = np.minimum(
                np.searchsorted(cdf, rng.random(live.size), side="right"), self.successors - 1
            )
            chained = table[topics[live], out[pos - 1], pick]
            out[pos] = np.where(follow, chained, out[pos])
        return out
