"""StackOverflow-style federated text generated on the fly (seeded; no downloads), for next-word prediction.

Shape of the data (000 §5.3, scaled to the machine): a Zipfian vocabulary, per-user topic skew (Dirichlet topic
mixtures), a power-law number of sentences per user, fixed-length sequences with BOS/EOS/PAD and an OOV bucket.
Sentences follow a per-topic first-order Markov chain (a Zipf-weighted successor table), so the next word is
predictable from context and a small LSTM learns it. The full real-format loaders and on-disk generators belong to
the data issue; this module is the in-memory generator both clients and the server share.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

PAD, BOS, EOS, OOV = 0, 1, 2, 3
SPECIAL = 4


@dataclass(frozen=True)
class TextTask:
    vocab: int = 500          # in-vocabulary words (ids SPECIAL .. SPECIAL+vocab−1)
    seq_len: int = 12
    topics: int = 8
    seed: int = 0

    @property
    def num_tokens(self) -> int:
        return self.vocab + SPECIAL


@lru_cache(maxsize=8)
def _topic_tables(task: TextTask) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([task.seed, 100])
    zipf = 1.0 / np.arange(1, task.vocab + 1) ** 1.1
    unigram = np.stack([zipf[rng.permutation(task.vocab)] for _ in range(task.topics)])
    unigram /= unigram.sum(axis=1, keepdims=True)
    successor = np.stack([rng.permutation(task.vocab) for _ in range(task.topics)])  # topic-specific next word
    return unigram, successor


def user_sentences(task: TextTask, user: int, max_sentences: int = 48) -> np.ndarray:
    """int32 array (sentences, seq_len + 1): BOS, words…, EOS, PAD…; 5% of words replaced by OOV."""
    unigram, successor = _topic_tables(task)
    rng = np.random.default_rng([task.seed, 200, int(user)])
    count = int(min(max_sentences, max(2, rng.pareto(1.5) * 6 + 2)))  # power-law posts per user
    mix = rng.dirichlet(np.full(task.topics, 0.3))
    out = np.full((count, task.seq_len + 1), PAD, dtype=np.int32)
    for s in range(count):
        topic = rng.choice(task.topics, p=mix)
        length = int(rng.integers(task.seq_len // 2, task.seq_len))
        w = rng.choice(task.vocab, p=unigram[topic])
        out[s, 0] = BOS
        for i in range(1, length):
            out[s, i] = OOV if rng.random() < 0.05 else w + SPECIAL
            w = successor[topic, w] if rng.random() < 0.7 else rng.choice(task.vocab, p=unigram[topic])
        out[s, length] = EOS
    return out


def xy(sentences: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inputs are tokens 0..L−1, targets tokens 1..L (next-word prediction)."""
    return sentences[:, :-1], sentences[:, 1:]


def accuracy_mask(targets: np.ndarray) -> np.ndarray:
    """Accuracy counts real words only: no PAD, EOS or OOV (000 §5.3's 'without OOV or EOS' variant)."""
    return targets >= SPECIAL
