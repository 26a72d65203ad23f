"""A numpy ClientApp: local gradient descent on the user's synthetic regression data; replies with
the new weights (the server subtracts the model it sent) and the example count, as Flower's
quickstarts do."""

from __future__ import annotations

import hashlib

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from corrflow.clients.identity import register_identity
from corrflow.data.synthetic import regression_loss, regression_partition

app = register_identity(ClientApp())  # answers the server's identity probe


def partition_id(context: Context) -> int:
    return int(context.node_config.get("partition-id", context.node_id % (1 << 31)))


def local_update(
    params: list[np.ndarray], X: np.ndarray, y: np.ndarray, lr: float, steps: int
) -> list[np.ndarray]:
    w, b = (p.astype(np.float64) for p in params)
    for _ in range(steps):
        r = X @ w + b[0] - y
        w = w - lr * 2 * X.T @ r / len(y)
        b = b - lr * 2 * np.array([r.mean()])
    return [(w - params[0]).astype(np.float32), (b - params[1]).astype(np.float32)]


def item_seed(item_id: str) -> int:
    """A stable integer per example id (cross-silo examples carry string ids such as arXiv paper
    ids)."""
    return int.from_bytes(hashlib.sha256(str(item_id).encode()).digest()[:4], "big")


def clip_l2(update: list[np.ndarray], clip: float) -> list[np.ndarray]:
    norm = float(np.sqrt(sum(float(np.sum(np.square(a, dtype=np.float64))) for a in update)))
    if norm <= clip:
        return update
    s = np.float32(clip / norm * (1 - 1e-6))
    return [a * s for a in update]


def train_items(params: list[np.ndarray], items: list[str], cfg) -> list[np.ndarray]:
    """Cross-silo: one local update per example id sent, each clipped to clip-norm here (the server
    re-checks that the sum's norm is at most items × clip-norm), returned summed."""
    clip = float(cfg["clip-norm"])
    total = [np.zeros_like(p) for p in params]
    for item in items:
        X, y = regression_partition(
            item_seed(item), params[0].shape[0], seed=int(cfg.get("seed", 0)), examples=8
        )
        delta = clip_l2(
            local_update(
                params, X, y, float(cfg.get("local-lr", 0.1)), int(cfg.get("local-steps", 5))
            ),
            clip,
        )
        for acc, d in zip(total, delta, strict=True):
            acc += d
    return total


@app.train()
def train(msg: Message, context: Context) -> Message:
    params = msg.content["arrays"].to_numpy_ndarrays()
    cfg = msg.content["config"]
    if "item-ids" in cfg:
        items = [str(i) for i in cfg["item-ids"]]
        # Cross-silo replies are deltas (replies = "delta"): the server checks their norm against
        # items × clip.
        return Message(
            content=RecordDict(
                {
                    "arrays": ArrayRecord(train_items(params, items, cfg)),
                    "metrics": MetricRecord({"num-items": len(items)}),
                }
            ),
            reply_to=msg,
        )
    X, y = regression_partition(
        partition_id(context), params[0].shape[0], seed=int(cfg.get("seed", 0))
    )
    delta = local_update(
        params, X, y, float(cfg.get("local-lr", 0.1)), int(cfg.get("local-steps", 5))
    )
    new = [p + d for p, d in zip(params, delta, strict=True)]
    loss = regression_loss(new, X, y)
    return Message(
        content=RecordDict(
            {
                "arrays": ArrayRecord(new),
                "metrics": MetricRecord({"num-examples": len(y), "train-loss": loss}),
            }
        ),
        reply_to=msg,
    )
