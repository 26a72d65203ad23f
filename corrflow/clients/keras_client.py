"""The TensorFlow/Keras ClientApp: next-word prediction with an embedding + LSTM (the StackOverflow
model of 000 §5.3, scaled to the machine), local SGD over the user's sentences; replies with the new
weights and the example count. TensorFlow uses a GPU when it sees one; simulated clients share it
through the engine's fractional GPUs.

The model has one change from 000's stack: the output layer reads the word embedding as well as the
LSTM state (a residual path), its kernel starts at zero and the embedding at N(0, 1/e). Federated
training takes a few dozen averaged steps, and with SGD the plain embedding → LSTM → dense stack
sits on the unigram plateau far longer than that (measured, no noise, 100 users a round: held-out
loss 5.32 → 4.90 in 20 rounds of FedAvg; with the residual path the same run reaches 3.93 —
docs/reference/benchmarks.md, "The Keras LSTM in ``corrflow simulate``"), because the LSTM's output
is too small at initialisation to carry a gradient to the embedding.

Memory: the model holds V·(2e + u) + LSTM parameters (10,004 tokens, e = 16, u = 32: about 0.5 M
floats, 2 MB); a training step materialises ``batch × seq_len × V`` float32 logits (16 × 20 ×
10,004: 13 MB) and evaluation ``EVAL_BATCH × seq_len × V`` per batch (64 × 20 × 10,004: 51 MB, a few
copies in the loss and argmax) — never the whole held-out set's predictions, so evaluation's peak
does not grow with the held-out size."""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from corrflow.clients.identity import register_identity
from corrflow.clients.nextword_client import node_data_paths, own_sentences
from corrflow.data.federated import TextSource, text_source
from corrflow.data.text_synth import SPECIAL, xy

app = register_identity(ClientApp())  # answers the server's identity probe
SYNTHETIC = TextSource()


def build_model(
    num_tokens: int = SYNTHETIC.num_tokens,
    input_len: int = SYNTHETIC.input_len,
    embedding: int = 16,
    units: int = 32,
    seed: int = 0,
):
    """Embedding (V, e) → LSTM(units) → Dense over [embedding, LSTM state] → V logits per position.
    ``seed`` seeds each initializer (no global RNG is touched)."""
    import tensorflow as tf

    init = tf.keras.initializers
    inputs = tf.keras.Input(shape=(input_len,), dtype="int32")
    e = tf.keras.layers.Embedding(
        num_tokens,
        embedding,
        mask_zero=True,
        embeddings_initializer=init.RandomNormal(stddev=embedding**-0.5, seed=seed),
    )(inputs)
    x = tf.keras.layers.LSTM(
        units,
        return_sequences=True,
        kernel_initializer=init.GlorotUniform(seed=seed + 1),
        recurrent_initializer=init.Orthogonal(seed=seed + 2),
    )(e)
    x = tf.keras.layers.Concatenate()([e, x])
    outputs = tf.keras.layers.Dense(num_tokens, kernel_initializer="zeros")(x)
    return tf.keras.Model(inputs, outputs)


_MODELS: dict = {}
#: Held-out sequences per evaluation batch (memory ∝ EVAL_BATCH × seq_len × vocabulary, see the
# module doc).
EVAL_BATCH = 64


def _model(sentences: np.ndarray, weights: list[np.ndarray]):
    """One Keras model and its compiled SGD step per (vocabulary size, sequence length), reused
    across rounds."""
    key = (weights[0].shape[0], sentences.shape[1] - 1)
    if key not in _MODELS:
        _MODELS[key] = _compiled(build_model(*key))
    return _MODELS[key]


def _compiled(model):
    """(model, step, score): ``step(x, y, lr)`` is one graph-compiled SGD step on the cross-entropy
    summed over real tokens (PAD weighs 0) and divided by the batch's positions — 10× faster than
    eager steps, which dominated simulation time; ``score(x, y, first_word)`` is one evaluation
    batch's sums (cross-entropy over non-PAD targets, their count, correct real-word predictions,
    real-word targets)."""
    import tensorflow as tf

    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(reduce_retracing=True)
    def step(xb, yb, lr):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True), sample_weight=tf.cast(yb != 0, tf.float32))
        for v, g in zip(
            model.trainable_variables, tape.gradient(loss, model.trainable_variables), strict=True
        ):
            v.assign_sub(lr * g)
        return loss

    @tf.function(reduce_retracing=True)
    def score(xb, yb, first_word):
        logits = model(xb, training=False)
        keep = tf.cast(yb != 0, tf.float64)
        ce = tf.cast(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels=yb, logits=logits), tf.float64
        )
        real = tf.cast(yb >= first_word, tf.float64)
        hit = (
            tf.cast(tf.equal(tf.argmax(logits, axis=-1, output_type=tf.int32), yb), tf.float64)
            * real
        )
        return (
            tf.reduce_sum(ce * keep),
            tf.reduce_sum(keep),
            tf.reduce_sum(hit),
            tf.reduce_sum(real),
        )

    return model, step, score


def local_train(
    weights: list[np.ndarray], sentences: np.ndarray, lr: float, epochs: int = 1, batch: int = 16
):
    """``epochs`` passes of minibatch SGD (in order) over the user's sentences; returns (new
    weights, last loss)."""
    import tensorflow as tf

    model, step, _ = _model(sentences, weights)
    model.set_weights(weights)
    X, Y = xy(sentences)
    rate = tf.constant(lr, tf.float32)
    loss = float("nan")
    for _ in range(epochs):
        for i in range(0, len(X), batch):
            loss = step(tf.constant(X[i : i + batch]), tf.constant(Y[i : i + batch]), rate)
    return [n.astype(np.float32) for n in model.get_weights()], float(loss)


def evaluate_weights(
    weights: list[np.ndarray],
    sentences: np.ndarray,
    first_word: int = SPECIAL,
    batch: int = EVAL_BATCH,
) -> tuple[float, float]:
    """(cross-entropy over non-PAD targets, next-word accuracy on real words — targets ≥
    ``first_word``, so neither specials nor OOV buckets count), accumulated over batches of
    ``batch`` sequences: peak memory is one batch's logits whatever the number of sequences."""
    import tensorflow as tf

    model, _, score = _model(sentences, weights)
    model.set_weights(weights)
    X, Y = xy(sentences)
    totals = np.zeros(4)
    fw = tf.constant(first_word, tf.int32)
    for i in range(0, len(X), batch):
        totals += [
            float(v)
            for v in score(tf.constant(X[i : i + batch]), tf.constant(Y[i : i + batch]), fw)
        ]
    ce, n, hits, real = totals
    return (ce / n if n else float("nan")), (hits / real if real else 0.0)


@app.train()
def train(msg: Message, context: Context) -> Message:
    weights = msg.content["arrays"].to_numpy_ndarrays()
    cfg = msg.content["config"]
    data, vocab = node_data_paths(cfg, context)
    source = text_source(data, vocab, int(cfg.get("seq-len", 20)), int(cfg.get("seed", 0)))
    sentences = own_sentences(source, context)
    new, loss = local_train(
        weights, sentences, float(cfg.get("local-lr", 0.5)), int(cfg.get("local-steps", 1))
    )
    return Message(
        content=RecordDict(
            {
                "arrays": ArrayRecord(new),
                "metrics": MetricRecord({"num-examples": int(len(sentences)), "train-loss": loss}),
            }
        ),
        reply_to=msg,
    )
