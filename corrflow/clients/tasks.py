"""The two client tasks behind one interface: initial weights, server-side evaluation, and the ClientApp."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from corrflow.errors import require


@dataclass
class Task:
    name: str
    client_app: Any
    handlers: dict
    initial_weights: Any      # (config) -> list[np.ndarray]
    evaluate: Any             # (weights) -> dict of metrics


def get_task(name: str, model_dim: int = 20, data_path: str = "", vocab_path: str = "", seq_len: int = 20) -> Task:
    require(name in ("numpy", "keras"), "client", "numpy or keras", name)
    if name == "numpy":
        from corrflow.clients import numpy_client as c
        from corrflow.data.synthetic import regression_loss, regression_test_set

        X, y = regression_test_set(model_dim)
        return Task("numpy", c.app, {"train": c.train, "query": c.identity},
                    lambda: [np.zeros(model_dim, np.float32), np.zeros(1, np.float32)],
                    lambda w: {"test_loss": regression_loss(w, X, y)})
    from corrflow.clients import keras_client as k
    from corrflow.data.federated import text_source

    source = text_source(data_path, vocab_path, seq_len)
    held_out = source.held_out(100)  # users never trained on

    def evaluate(w):
        loss, acc = k.evaluate_weights(w, held_out)
        return {"test_loss": loss, "test_accuracy": acc}

    def initial():
        return [w.astype(np.float32) for w in k.build_model(source.num_tokens, source.input_len).get_weights()]

    return Task("keras", k.app, {"train": k.train, "query": k.identity}, initial, evaluate)
