"""The client tasks behind one interface: initial weights, server-side evaluation, and the
ClientApp.

``seed`` fixes the task's data and the model's initialisation (never the noise key): two runs with
one seed train on the same users from the same start."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from corrflow.config import TRAINING_DEFAULTS
from corrflow.data.federated import text_source
from corrflow.data.synthetic import regression_loss, regression_partition, regression_test_set
from corrflow.data.text_synth import SPECIAL, user_sentences, users_sentences
from corrflow.errors import require

CLIENTS = ("numpy", "nextword", "keras")


def training_defaults(client: str, **overrides) -> dict:
    """The client's ``TRAINING_DEFAULTS`` with the given non-None overrides (RunConfig keyword
    arguments)."""
    require(client in CLIENTS, "client", " or ".join(CLIENTS), client)
    return {**TRAINING_DEFAULTS[client], **{k: v for k, v in overrides.items() if v is not None}}


@dataclass
class Task:
    name: str
    client_app: Any
    handlers: dict
    initial_weights: Any  # () -> list[np.ndarray]
    evaluate: Any  # (weights) -> dict of metrics
    # (partition) -> the arrays that user trains on (fingerprints in comparisons)
    user_data: Any = None
    # (partitions) -> each one's `user_data`, built together (the synthetic text); None: one by one
    users_data: Any = None


def task_for(cfg, seed: int | None = None) -> Task:
    """The task a run's settings (`corrflow.config.RunConfig`) train: `get_task` with the settings'
    client, model size, data and vocabulary files, sequence length, seed (``seed`` overrides it)
    and evaluation size."""
    return get_task(
        cfg.client,
        cfg.model_dim,
        cfg.data_path,
        cfg.vocab_path,
        cfg.seq_len,
        cfg.seed if seed is None else seed,
        cfg.eval_sequences,
    )


def get_task(
    name: str,
    model_dim: int = 20,
    data_path: str = "",
    vocab_path: str = "",
    seq_len: int = 20,
    seed: int = 0,
    eval_sequences: int = 0,
) -> Task:
    require(name in CLIENTS, "client", " or ".join(CLIENTS), name)
    if name == "numpy":
        from corrflow.clients import numpy_client as c  # here: Flower loads only to train

        X, y = regression_test_set(model_dim, seed=seed)

        return Task(
            "numpy",
            c.app,
            {"train": c.train},
            lambda: [np.zeros(model_dim, np.float32), np.zeros(1, np.float32)],
            lambda w: {"test_loss": regression_loss(w, X, y)},
            lambda u: regression_partition(u, model_dim, seed=seed),
        )
    if name == "nextword":
        from corrflow.clients import nextword_client as nw  # here: Flower loads only to train

        if data_path:  # a real-format dataset file and its vocabulary
            source = text_source(data_path, vocab_path, seq_len, seed)
            held, first_word, tokens = (
                source.held_out(max_sequences=eval_sequences),
                source.first_word,
                source.num_tokens,
            )
            data = lambda u: (source.user_sentences(u),)  # noqa: E731
            many = None
        else:
            text = nw.task_for(seed)
            # never trained on
            held = np.concatenate(users_sentences(text, [1_000_000 + i for i in range(200)]))
            first_word, tokens = SPECIAL, text.num_tokens
            data = lambda u: (user_sentences(text, u),)  # noqa: E731
            many = lambda us: [(s,) for s in users_sentences(text, us)]  # noqa: E731

        def evaluate_nw(w):
            loss, acc = nw.evaluate_weights(w, held, first_word)
            return {"test_loss": loss, "test_accuracy": acc}

        return Task(
            "nextword",
            nw.app,
            {"train": nw.train},
            lambda: nw.initial_weights(tokens, seed),
            evaluate_nw,
            data,
            many,
        )
    from corrflow.clients import keras_client as k  # here: Flower, TensorFlow only to train

    source = text_source(data_path, vocab_path, seq_len, seed)
    # synthetic: 100 unseen users; a file: its held-out split
    held_out = source.held_out(max_sequences=eval_sequences)

    def evaluate(w):
        loss, acc = k.evaluate_weights(w, held_out, source.first_word)
        return {"test_loss": loss, "test_accuracy": acc}

    def initial():
        return [
            w.astype(np.float32)
            for w in k.build_model(source.num_tokens, source.input_len, seed=seed).get_weights()
        ]

    return Task(
        "keras", k.app, {"train": k.train}, initial, evaluate, lambda u: (source.user_sentences(u),)
    )
