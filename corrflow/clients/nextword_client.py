"""A numpy next-word ClientApp: a low-rank bigram softmax model (embedding E, output projection W,
bias b; logits(next | prev) = E[prev]·W + b) trained by local SGD on the user's sentences —
synthetic (the Markov-structured text of `corrflow.data.text_synth`), or a real-format dataset
file when the server sends ``data-path`` and ``vocab-path``. Small enough (about 17k parameters at
the synthetic 204 tokens, 2·16·V + V = 330k at the papers' 10,004) for DP comparisons on a CPU in
minutes. Replies with the new weights, as Flower's quickstarts do (the server subtracts the model it
sent).

Memory: training holds one minibatch's probabilities (64 × V float64: 5 MB at V = 10,004);
evaluation streams the (previous, next) pairs in chunks of ``EVAL_PAIRS`` (1,024 × V float64: 82
MB), never the whole held-out set's."""

from __future__ import annotations

from functools import lru_cache
from logging import INFO

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.logger import log

from corrflow.clients.identity import register_identity
from corrflow.clients.numpy_client import partition_id
from corrflow.data.federated import data_paths, text_source
from corrflow.data.text_synth import PAD, SPECIAL, TextTask, accuracy_mask, user_sentences, xy
from corrflow.errors import require

app = register_identity(ClientApp())  # answers the server's identity probe
EMBEDDING = 16
#: (previous word, next word) pairs per evaluation chunk (memory ∝ EVAL_PAIRS × vocabulary, see the
# module doc).
EVAL_PAIRS = 1024


def node_data_paths(cfg, context: Context) -> tuple[str, str]:
    """`data_paths`, saying once per process in the SuperNode's log
    when the node's own config names the data file (deployment: each device reads its own file, not
    the path the server sent). Paths and the partition id only: operator settings, never the user's
    data."""
    data, vocab = data_paths(cfg, context)
    if context.node_config.get("data-path"):
        _announce(partition_id(context), data, vocab)
    return data, vocab


def own_sentences(source, context: Context) -> np.ndarray:
    """The training sentences of this node's user: train partition ``partition-id`` of ``source`` (a
    `TextSource`).

    A node whose own config names the data file trains exactly one of the file's train partitions,
    so its ``num-partitions`` (when given) must equal their count, as ``corrflow data partition``
    writes it without ``--partitions``: a manifest with several users per node is a cross-silo
    layout, under which this node would silently train one user of its group.

    Raises:
        InvalidArgumentError: (field ``num-partitions``) the node config's count differs from the
            file's.
    """
    part = partition_id(context)
    node = context.node_config
    if node.get("data-path") and "num-partitions" in node:
        count = len(source.train_clients)
        require(
            int(node["num-partitions"]) == count,
            "num-partitions",
            f"{count} in the node config (one node per train partition of {node['data-path']}: "
            "write the node configs with `corrflow data partition` without --partitions; a node "
            "trains user partition-id only)",
            node["num-partitions"],
        )
    return source.user_sentences(part)


@lru_cache(maxsize=8)
def _announce(partition: int, data: str, vocab: str) -> None:
    log(
        INFO,
        "corrflow: partition-id %d trains on the SuperNode's own data file %s (node config "
        "data-path), vocabulary %s",
        partition,
        data,
        vocab,
    )


def task_for(seed: int, vocab: int = 200) -> TextTask:
    """The synthetic text the nextword client trains on (``seed`` fixes the data)."""
    return TextTask(vocab=vocab, seed=int(seed))


def initial_weights(num_tokens: int, seed: int, embedding: int = EMBEDDING) -> list[np.ndarray]:
    """[E (V, d) ~ N(0, 1/d), W (d, V) = 0, b (V) = 0] (float32): the first step moves W along the
    embeddings."""
    rng = np.random.default_rng([int(seed), 300])
    return [
        (rng.normal(size=(num_tokens, embedding)) / np.sqrt(embedding)).astype(np.float32),
        np.zeros((embedding, num_tokens), np.float32),
        np.zeros(num_tokens, np.float32),
    ]


def _pairs(sentences: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    X, Y = xy(sentences)
    keep = Y != PAD
    return X[keep], Y[keep]


def _forward(weights, prev):
    E, W, b = weights
    h = E[prev]
    logits = h @ W + b
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    return h, p


def local_train(
    weights: list[np.ndarray],
    sentences: np.ndarray,
    lr: float,
    steps: int,
    batch: int = 64,
    shuffle: tuple[int, ...] = (0,),
) -> tuple[list[np.ndarray], float]:
    """``steps`` epochs of minibatch SGD on the mean cross-entropy; returns (delta = new − old, last
    batch loss)."""
    E, W, b = (w.astype(np.float64) for w in weights)
    prev, nxt = _pairs(sentences)
    rng = np.random.default_rng([*map(int, shuffle), 400])
    loss = float("nan")
    for _ in range(steps):
        order = rng.permutation(len(prev))
        for i in range(0, len(order), batch):
            idx = order[i : i + batch]
            h, p = _forward((E, W, b), prev[idx])
            n = len(idx)
            loss = float(-np.log(p[np.arange(n), nxt[idx]] + 1e-12).mean())
            g = p
            g[np.arange(n), nxt[idx]] -= 1.0
            g /= n
            dh = g @ W.T
            W -= lr * (h.T @ g)
            b -= lr * g.sum(axis=0)
            np.add.at(E, prev[idx], -lr * dh)
    new = (E, W, b)
    return [(n - o).astype(np.float32) for n, o in zip(new, weights, strict=True)], loss


def evaluate_weights(
    weights: list[np.ndarray],
    sentences: np.ndarray,
    first_word: int = SPECIAL,
    chunk: int = EVAL_PAIRS,
) -> tuple[float, float]:
    """(cross-entropy over non-PAD targets, next-word accuracy on real words — targets ≥
    ``first_word``, so neither specials nor OOV buckets count), accumulated over chunks of ``chunk``
    pairs (bounded memory)."""
    prev, nxt = _pairs(sentences)
    w64 = [w.astype(np.float64) for w in weights]
    ce = hits = real = 0.0
    for i in range(0, len(prev), chunk):
        _, p = _forward(w64, prev[i : i + chunk])
        y = nxt[i : i + chunk]
        ce -= float(np.log(p[np.arange(len(y)), y] + 1e-12).sum())
        m = accuracy_mask(y, first_word)
        hits += float((p.argmax(axis=1)[m] == y[m]).sum())
        real += float(m.sum())
    return (ce / len(nxt) if len(nxt) else float("nan")), (hits / real if real else 0.0)


@app.train()
def train(msg: Message, context: Context) -> Message:
    weights = msg.content["arrays"].to_numpy_ndarrays()
    cfg = msg.content["config"]
    seed, user = int(cfg.get("seed", 0)), partition_id(context)
    data, vocab = node_data_paths(cfg, context)
    # A real-format dataset file: the node's own (node config), else the one the server
    # evaluates on.
    if data:
        sentences = own_sentences(
            text_source(data, vocab, int(cfg.get("seq-len", 20)), seed), context
        )
    else:
        sentences = user_sentences(task_for(seed, weights[0].shape[0] - SPECIAL), user)
    delta, loss = local_train(
        weights,
        sentences,
        float(cfg.get("local-lr", 0.5)),
        int(cfg.get("local-steps", 1)),
        shuffle=(seed, user, int(cfg.get("server-round", 0))),
    )
    new = [w + d for w, d in zip(weights, delta, strict=True)]
    return Message(
        content=RecordDict(
            {
                "arrays": ArrayRecord(new),
                "metrics": MetricRecord({"num-examples": int(len(sentences)), "train-loss": loss}),
            }
        ),
        reply_to=msg,
    )
