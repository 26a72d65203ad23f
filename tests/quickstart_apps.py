"""ClientApps written the way Flower's quickstarts are — full weights back, `num-examples`, the
user's own config keys — plus the one line corrflow asks of a user's app (`app =
register_identity(ClientApp())`). Three apps share one ClientApp object only so that one Ray start
serves every wrapper test; each handler is what a user would write.

* numpy: linear regression with float64 weights (`lr` from the train config);
* torch-style: a named state dict (emulated with numpy) with an integer buffer
  `bn.num_batches_tracked`, FedProx's `proximal-mu` used in the local objective;
* keras: a small Dense model, `set_weights` / `fit` / `get_weights`.

Federated evaluation (`@app.evaluate()`, `eval_loss` / `eval_acc`) and the server's
`central_evaluate(server_round, arrays)` (`loss` / `accuracy` on server-held data) are
quickstart-pytorch's, for the numpy model.
"""

from collections import OrderedDict

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from corrflow import register_identity

DIM = 8
TRUE_W = np.linspace(-1.0, 1.0, DIM)


def regression_data(partition: int, n: int = 32):
    rng = np.random.default_rng(1000 + partition)
    X = rng.standard_normal((n, DIM))
    return X, X @ TRUE_W + 0.1 * rng.standard_normal(n)


def loss_of(w: np.ndarray, b: float, X: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean((X @ w + b - y) ** 2))


def held_out():
    return regression_data(10_000, 512)


app = register_identity(ClientApp())


@app.train()
def train(msg: Message, context: Context) -> Message:
    return {"numpy": numpy_train, "torch": torch_style_train, "keras": keras_train}[
        str(msg.content["config"]["app"])
    ](msg, context)


def numpy_train(msg: Message, context: Context) -> Message:
    w, b = msg.content["arrays"].to_numpy_ndarrays()
    assert w.dtype == np.float64, w.dtype  # the dtype the app sent comes back
    lr = float(msg.content["config"]["lr"])
    X, y = regression_data(int(context.node_config["partition-id"]))
    for _ in range(5):
        r = X @ w + b - y
        w, b = w - lr * 2 * X.T @ r / len(y), b - lr * 2 * r.mean()
    return Message(
        RecordDict(
            {
                "arrays": ArrayRecord([w, b]),
                "metrics": MetricRecord(
                    {"train_loss": loss_of(w, float(b[0]), X, y), "num-examples": len(y)}
                ),
            }
        ),
        reply_to=msg,
    )


def torch_style_train(msg: Message, context: Context) -> Message:
    state = OrderedDict((k, v.numpy()) for k, v in msg.content["arrays"].items())
    w, b = state["fc.weight"], state["fc.bias"]  # a KeyError here: the names were lost
    mu = float(msg.content["config"]["proximal-mu"])
    lr = float(msg.content["config"]["lr"])
    X, y = regression_data(int(context.node_config["partition-id"]))
    w0, b0 = w.copy(), b.copy()
    for _ in range(5):
        r = X @ w[0] + b[0] - y
        w = w - lr * (2 * (X.T @ r)[None, :] / len(y) + mu * (w - w0))
        b = b - lr * (2 * r.mean() + mu * (b - b0))
    state["fc.weight"], state["fc.bias"] = w.astype(np.float32), b.astype(np.float32)
    # the server keeps its own
    state["bn.num_batches_tracked"] = np.asarray(state["bn.num_batches_tracked"] + 5)
    return Message(
        RecordDict(
            {
                "arrays": ArrayRecord(OrderedDict((k, Array(v)) for k, v in state.items())),
                "metrics": MetricRecord(
                    {"train_loss": loss_of(w[0], float(b[0]), X, y), "num-examples": len(y)}
                ),
            }
        ),
        reply_to=msg,
    )


def keras_model():
    import tensorflow as tf

    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.Input((DIM,)), tf.keras.layers.Dense(1)])
    model.compile(optimizer=tf.keras.optimizers.SGD(0.05), loss="mse")
    return model


def keras_train(msg: Message, context: Context) -> Message:
    model = keras_model()
    model.set_weights(msg.content["arrays"].to_numpy_ndarrays())
    X, y = regression_data(int(context.node_config["partition-id"]))
    history = model.fit(
        X, y, epochs=int(msg.content["config"]["local-epochs"]), batch_size=8, verbose=0
    )
    return Message(
        RecordDict(
            {
                "arrays": ArrayRecord(model.get_weights()),
                "metrics": MetricRecord(
                    {"train_loss": float(history.history["loss"][-1]), "num-examples": len(y)}
                ),
            }
        ),
        reply_to=msg,
    )


def _accuracy(w: np.ndarray, b: float, X: np.ndarray, y: np.ndarray) -> float:
    """A classification view of the regression (quickstart-pytorch reports an accuracy): the share
    of examples whose sign is predicted right."""
    return float(np.mean(np.sign(X @ w + b) == np.sign(y)))


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """quickstart-pytorch's client evaluation: the received model on the node's data."""
    w, b = msg.content["arrays"].to_numpy_ndarrays()
    X, y = regression_data(int(context.node_config["partition-id"]) + 500)
    metrics = {
        "eval_loss": loss_of(w, float(b[0]), X, y),
        "eval_acc": _accuracy(w, float(b[0]), X, y),
        "num-examples": len(y),
    }
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)


def central_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    """quickstart-pytorch's ``global_evaluate``: the global model on server-held data."""
    w, b = arrays.to_numpy_ndarrays()
    X, y = held_out()
    return MetricRecord(
        {"accuracy": _accuracy(w, float(b[0]), X, y), "loss": loss_of(w, float(b[0]), X, y)}
    )
