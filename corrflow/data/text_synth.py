"""StackOverflow-style federated text generated on the fly (seeded; no downloads), for next-word
prediction.

Shape of the data (000 §5.3, scaled to the machine): a Zipfian vocabulary, per-user topic skew
(Dirichlet topic mixtures), a power-law number of sentences per user, fixed-length sequences with
BOS/EOS/PAD and an OOV bucket. Word order follows a sparse first-order Markov chain per topic: after
word w, with probability ``follow`` the next word is one of w's ``successors`` (Zipf-weighted),
otherwise a fresh draw from the topic's unigram distribution. The successor table is shared by all
topics except for a ``topic_specific`` fraction of rows each topic redraws, so the previous word
predicts most of the next one and the context (the topic) the rest: a bigram model learns well above
the unigram baseline, an LSTM a little more. `bigram_ceiling` gives the structure's expected
accuracy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

PAD, BOS, EOS, OOV = 0, 1, 2, 3
SPECIAL = 4


@dataclass(frozen=True)
class TextTask:
    vocab: int = 500  # in-vocabulary words (ids SPECIAL .. SPECIAL+vocab−1)
    seq_len: int = 12
    topics: int = 8
    seed: int = 0
    follow: float = 0.7  # P(next word comes from the successor table)
    successors: int = 2  # successors per word (sparse Markov rows)
    successor_zipf: float = 1.5  # weights of the successors: 1/rank^s
    topic_specific: float = 0.25  # fraction of successor rows each topic redraws
    oov_rate: float = 0.05

    @property
    def num_tokens(self) -> int:
        return self.vocab + SPECIAL

    @property
    def successor_weights(self) -> np.ndarray:
        w = 1.0 / np.arange(1, self.successors + 1) ** self.successor_zipf
        return w / w.sum()


@lru_cache(maxsize=8)
def _topic_tables(task: TextTask) -> tuple[np.ndarray, np.ndarray]:
    """(unigram (topics, vocab), successor (topics, vocab, successors)) word indices, seeded by
    ``task.seed``."""
    rng = np.random.default_rng([task.seed, 100])
    zipf = 1.0 / np.arange(1, task.vocab + 1) ** 1.1
    unigram = np.stack([zipf[rng.permutation(task.vocab)] for _ in range(task.topics)])
    unigram /= unigram.sum(axis=1, keepdims=True)
    shared = rng.integers(0, task.vocab, size=(task.vocab, task.successors))
    successor = np.repeat(shared[None], task.topics, axis=0)
    for t in range(task.topics):
        rows = rng.random(task.vocab) < task.topic_specific
        successor[t, rows] = rng.integers(0, task.vocab, size=(int(rows.sum()), task.successors))
    return unigram, successor


def user_sentences(task: TextTask, user: int, max_sentences: int = 48) -> np.ndarray:
    """int32 array (sentences, seq_len + 1): BOS, words…, EOS, PAD…; ``oov_rate`` of words replaced
    by OOV."""
    return users_sentences(task, [user], max_sentences)[0]


def users_sentences(
    task: TextTask, users: Sequence[int], max_sentences: int = 48
) -> list[np.ndarray]:
    """`user_sentences` of each of ``users``: each user's draws come from its own generator, in the
    same order whatever the batch; the Markov chain then runs over all the users' sentences at
    once.

    Args:
        task: the text's generator parameters.
        users: user ids.
        max_sentences: the most sentences one user writes.

    Returns:
        Per user, its int32 array (sentences, seq_len + 1).
    """
    unigram, successor = _topic_tables(task)
    cdf = np.cumsum(unigram, axis=1)
    cdf[:, -1] = 1.0
    draws = [_user_draws(task, int(u), max_sentences) for u in users]
    topics, lengths, uniform, follow, pick, oov = (
        np.concatenate([d[k] for d in draws]) for k in range(6)
    )
    fresh = np.empty(uniform.shape, np.int64)  # each sentence's unigram draws, from its topic's
    for t in np.unique(topics):
        fresh[topics == t] = np.searchsorted(cdf[t], uniform[topics == t], side="right")
    words = fresh.copy()
    # the chain is sequential in position, vectorised over every user's sentences
    for i in range(1, task.seq_len):
        chained = successor[topics, words[:, i - 1], pick[:, i]]
        words[:, i] = np.where(follow[:, i], chained, fresh[:, i])
    tokens = np.where(oov, OOV, words + SPECIAL)
    out = np.full((len(topics), task.seq_len + 1), PAD, dtype=np.int32)
    out[:, 0] = BOS
    cols = np.arange(1, task.seq_len + 1)
    body = cols[None, :] < lengths[:, None]  # column j ≥ 1 holds token j − 1 before the EOS
    out[:, 1:][body] = tokens[body]
    out[np.arange(len(topics)), lengths] = EOS
    return np.split(out, np.cumsum([len(d[0]) for d in draws])[:-1])


def _user_draws(task: TextTask, user: int, max_sentences: int) -> tuple:
    """One user's random draws, from its generator ``(seed, 200, user)`` in a fixed order: its
    sentences' topics and lengths, the uniform draws of their fresh unigram words, whether each
    position follows the chain, which successor it picks, and which words become OOV."""
    rng = np.random.default_rng([task.seed, 200, int(user)])
    count = int(min(max_sentences, max(2, rng.pareto(1.5) * 6 + 2)))  # power-law posts per user
    mix = rng.dirichlet(np.full(task.topics, 0.3))
    topics = rng.choice(task.topics, size=count, p=mix)
    lengths = rng.integers(task.seq_len // 2, task.seq_len, size=count)
    uniform = rng.random((count, task.seq_len))  # row s: sentence s's, as one call per sentence
    follow = rng.random((count, task.seq_len)) < task.follow
    pick = np.searchsorted(
        np.cumsum(task.successor_weights), rng.random((count, task.seq_len)), side="right"
    )
    pick = np.minimum(pick, task.successors - 1)
    oov = rng.random((count, task.seq_len)) < task.oov_rate
    return topics, lengths, uniform, follow, pick, oov


def bigram_ceiling(task: TextTask) -> float:
    """Expected next-word accuracy (on words following a word) of a predictor that knows the
    previous word and the topic, from the generator's parameters: follow · w₁ · (1 − oov) — the
    chained top successor — ignoring the small chance that a fresh draw also hits it. A topic-blind
    bigram model loses part of the topic-specific rows."""
    return task.follow * float(task.successor_weights[0]) * (1 - task.oov_rate)


def xy(sentences: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inputs are tokens 0..L−1, targets tokens 1..L (next-word prediction)."""
    return sentences[:, :-1], sentences[:, 1:]


def accuracy_mask(targets: np.ndarray, first_word: int = SPECIAL) -> np.ndarray:
    """Accuracy counts real words only: no PAD, BOS, EOS or OOV bucket (000 §5.3's 'without OOV or
    EOS' variant). ``first_word``: the first real word's id — 3 + the OOV buckets
    (`corrflow.data.vocab.Vocabulary.first_word`; here one bucket, id 3)."""
    return targets >= first_word
