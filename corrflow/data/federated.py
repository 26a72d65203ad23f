"""One user's next-word sequences, from a TFF StackOverflow SQLite file or from the on-the-fly generator, behind
one interface: after loading, clients and server-side evaluation take the same path whatever the source."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np

from corrflow.errors import require


@dataclass(frozen=True)
class TextSource:
    """``data_path=""``: the synthetic task of :mod:`corrflow.data.text_synth`. Otherwise a TFF-format SQLite file
    and its vocabulary (``corrflow data vocab``); partition i is the i-th ``train`` client in client-id order."""

    data_path: str = ""
    vocab_path: str = ""
    seq_len: int = 20
    max_sentences: int = 256
    seed: int = 0                   # the synthetic task's seed (data_path="")

    def __post_init__(self) -> None:
        require(not self.data_path or bool(self.vocab_path), "vocab-path",
                "a vocabulary file (corrflow data vocab) when data-path is set")
        require(self.seq_len >= 2, "seq-len", "at least 2", self.seq_len)

    @property
    def synthetic_task(self):
        """The generator behind ``data_path=""``: 200 words (the vocabulary the nextword client uses too)."""
        from corrflow.data.text_synth import TextTask

        return TextTask(vocab=200, seed=self.seed)

    @cached_property
    def vocab(self):
        from corrflow.data.vocab import Vocabulary

        return Vocabulary.load(self.vocab_path)

    @cached_property
    def _db(self):
        from corrflow.data.stackoverflow import StackOverflowSQLite

        return StackOverflowSQLite(self.data_path)

    @cached_property
    def train_clients(self) -> list[str]:
        return self._db.client_ids("train")

    @property
    def num_tokens(self) -> int:
        if not self.data_path:
            return self.synthetic_task.num_tokens
        return self.vocab.num_tokens

    @property
    def input_len(self) -> int:
        if not self.data_path:
            return self.synthetic_task.seq_len
        return self.seq_len

    def user_sentences(self, partition: int) -> np.ndarray:
        """int32 (sentences, input_len + 1) of the partition's user."""
        if not self.data_path:
            from corrflow.data.text_synth import user_sentences

            return user_sentences(self.synthetic_task, partition)
        clients = self.train_clients
        require(0 <= partition < len(clients), "partition-id", f"0 ≤ id < {len(clients)} train clients", partition)
        posts = self._db.client_posts(clients[partition], "train")
        return self.vocab.sequences((p.tokens for p in posts), self.seq_len, self.max_sentences)

    def held_out(self, users: int = 100) -> np.ndarray:
        """Evaluation sequences from users never trained on (the ``heldout`` split, else ``test``)."""
        if not self.data_path:
            from corrflow.data.text_synth import user_sentences

            return np.concatenate([user_sentences(self.synthetic_task, 1_000_000 + i) for i in range(users)])
        split = "heldout" if "heldout" in self._db.splits() else "test"
        rows = [self.vocab.sequences((p.tokens for p in self._db.client_posts(c, split)), self.seq_len,
                                     self.max_sentences) for c in self._db.client_ids(split)[:users]]
        rows = [r for r in rows if len(r)]
        require(bool(rows), "data-path", f"a non-empty {split!r} split for evaluation")
        return np.concatenate(rows)


@lru_cache(maxsize=4)
def text_source(data_path: str = "", vocab_path: str = "", seq_len: int = 20, seed: int = 0) -> TextSource:
    """Process-wide cache, so a simulated client opens the file once, not once per round."""
    return TextSource(data_path, vocab_path, seq_len, seed=seed)
