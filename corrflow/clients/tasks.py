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


def get_task(name: str, model_dim: int = 20) -> Task:
    require(name in ("numpy", "keras"), "client", "numpy or keras", name)
    if name == "numpy":
        from corrflow.clients import numpy_client as c
        from corrflow.data.synthetic import regression_loss, regression_test_set

        X, y = regression_test_set(model_dim)
        return Task("numpy", c.app, {"train": c.train, "query": c.identity},
                    lambda: [np.zeros(model_dim, np.float32), np.zeros(1, np.float32)],
                    lambda w: {"test_loss": regression_loss(w, X, y)})
    from corrflow.clients import keras_client as k
    from corrflow.data.text_synth import user_sentences

    held_out = np.concatenate([user_sentences(k.TASK, 1_000_000 + i) for i in range(100)])  # users never trained

    def evaluate(w):
        loss, acc = k.evaluate_weights(w, held_out)
        return {"test_loss": loss, "test_accuracy": acc}

    return Task("keras", k.app, {"train": k.train, "query": k.identity},
                lambda: [w.astype(np.float32) for w in k.build_model().get_weights()], evaluate)
