"""A numpy ClientApp: local gradient descent on the user's synthetic regression data; replies with the model delta
(new − received) and the example count. Also answers the identity query used in simulation."""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from corrflow.data.synthetic import regression_loss, regression_partition

app = ClientApp()


def partition_id(context: Context) -> int:
    return int(context.node_config.get("partition-id", context.node_id % (1 << 31)))


def local_update(params: list[np.ndarray], X: np.ndarray, y: np.ndarray, lr: float, steps: int) -> list[np.ndarray]:
    w, b = (p.astype(np.float64) for p in params)
    for _ in range(steps):
        r = X @ w + b[0] - y
        w = w - lr * 2 * X.T @ r / len(y)
        b = b - lr * 2 * np.array([r.mean()])
    return [(w - params[0]).astype(np.float32), (b - params[1]).astype(np.float32)]


@app.train()
def train(msg: Message, context: Context) -> Message:
    params = msg.content["arrays"].to_numpy_ndarrays()
    cfg = msg.content["config"]
    X, y = regression_partition(partition_id(context), params[0].shape[0])
    delta = local_update(params, X, y, float(cfg.get("local-lr", 0.1)), int(cfg.get("local-steps", 5)))
    loss = regression_loss([p + d for p, d in zip(params, delta, strict=True)], X, y)
    return Message(content=RecordDict({"arrays": ArrayRecord(delta),
                                       "metrics": MetricRecord({"num-examples": len(y), "train-loss": loss})}),
                   reply_to=msg)


@app.query()
def identity(msg: Message, context: Context) -> Message:
    """Simulation only: report the partition id (self-reported; deployments use the SuperNode's public key)."""
    return Message(content=RecordDict({"metrics": MetricRecord({"partition-id": partition_id(context)})}),
                   reply_to=msg)
