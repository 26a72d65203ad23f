from importlib.util import find_spec

import numpy as np
import pytest

from corrflow.clients.keras_client import SYNTHETIC, build_model, local_train
from corrflow.clients.tasks import get_task
from corrflow.config import RunConfig
from corrflow.data.text_synth import BOS, EOS, PAD, SPECIAL, TextTask, user_sentences, xy
from corrflow.server.app import run_server
from corrflow.server.inprocess import InProcessGrid

# find_spec, not importorskip: TensorFlow loads (seconds) only in the process that runs these tests,
# not in every xdist worker that collects them
pytestmark = pytest.mark.skipif(
    find_spec("tensorflow") is None, reason="TensorFlow (the keras extra) is not installed"
)

TASK = TextTask()
KERAS_TASK = SYNTHETIC.synthetic_task  # the text the Keras client trains on


def test_synthetic_text_shape_and_determinism():
    a, b = user_sentences(TASK, 7), user_sentences(TASK, 7)
    np.testing.assert_array_equal(a, b)
    assert a.shape[1] == TASK.seq_len + 1 and np.all(a[:, 0] == BOS)
    assert np.all((a == EOS).sum(axis=1) == 1) and a.max() < TASK.num_tokens
    X, Y = xy(a)
    np.testing.assert_array_equal(X[:, 1:], Y[:, :-1])
    counts = [len(user_sentences(TASK, u)) for u in range(200)]
    assert np.percentile(counts, 90) > 2 * np.median(counts)  # long-tailed posts per user
    words = np.concatenate([user_sentences(TASK, u).ravel() for u in range(50)])
    words = words[words >= SPECIAL]
    top = np.bincount(words).max() / len(words)
    assert 0.005 < top < 0.2 and PAD == 0  # Zipf-like head, not degenerate


def test_local_training_learns_word_order_and_returns_new_weights():
    """125 SGD steps (40 users' sentences, 5 epochs) take the LSTM below the unigram cross-entropy:
    the residual path from the embedding lets SGD leave the unigram plateau within the steps
    federated training has (the plain embedding → LSTM → dense stack stays above it for
    thousands)."""
    model = build_model()
    w = model.get_weights()
    s = np.concatenate([user_sentences(KERAS_TASK, u) for u in range(40)])
    new, _ = local_train(w, s, lr=2.0, epochs=5)
    assert [d.shape for d in new] == [x.shape for x in w] and all(
        d.dtype == np.float32 for d in new
    )
    task = get_task("keras")
    _, y_train = xy(s)
    counts = np.bincount(y_train[y_train != PAD], minlength=KERAS_TASK.num_tokens) + 0.5
    _, y_held = xy(SYNTHETIC.held_out(100))
    unigram = float(-np.log((counts / counts.sum())[y_held[y_held != PAD]]).mean())
    before, after = task.evaluate(w), task.evaluate(new)
    # zero output kernel
    assert before["test_loss"] == pytest.approx(np.log(KERAS_TASK.num_tokens), abs=0.01)
    assert after["test_loss"] < unigram - 0.2 and after["test_accuracy"] > 0.02


def test_keras_strategy_round_trip(tmp_path):
    cfg = RunConfig(
        num_users=6,
        num_rounds=2,
        epochs=1,
        noise_multiplier=0.5,
        client="keras",
        local_lr=0.5,
        local_steps=1,
        state_dir=str(tmp_path),
    )
    task = get_task("keras")
    s = run_server(InProcessGrid(task.handlers, 6), cfg, quiet=True)
    assert s.next_round == 2 and "test_accuracy" in s.metrics_history[-1]
    assert any(
        np.abs(p - q).max() > 0 for p, q in zip(s.params, task.initial_weights(), strict=True)
    )


def test_keras_on_a_tff_sqlite_file(tmp_path):
    """The same client and evaluation path on a real-format file (generated here) and its
    vocabulary."""
    from corrflow.data.stackoverflow import (
        StackOverflowSpec,
        StackOverflowSQLite,
        generate_stackoverflow,
    )
    from corrflow.data.vocab import build_vocabulary, count_words

    path = tmp_path / "so.sqlite"
    generate_stackoverflow(path, StackOverflowSpec(users=40, seed=4))
    with StackOverflowSQLite(path) as db:
        build_vocabulary(count_words(p.tokens for _, p in db.iter_posts("train")), 300).save(
            tmp_path / "v.txt"
        )
    cfg = RunConfig(
        num_users=6,
        num_rounds=2,
        epochs=1,
        noise_multiplier=0.5,
        client="keras",
        local_lr=0.5,
        local_steps=1,
        state_dir=str(tmp_path),
        data_path=str(path),
        vocab_path=str(tmp_path / "v.txt"),
        seq_len=10,
    )
    task = get_task("keras", data_path=str(path), vocab_path=str(tmp_path / "v.txt"), seq_len=10)
    assert task.initial_weights()[0].shape[0] == 304  # embedding rows = specials + OOV + words
    s = run_server(InProcessGrid(task.handlers, 6), cfg, quiet=True)
    assert s.next_round == 2 and s.metrics_history[-1]["rejected"] == 0
    assert np.isfinite(s.metrics_history[-1]["test_loss"])


def test_keras_evaluation_streams_and_skips_oov_buckets():
    """Batched evaluation equals one pass; a constant predictor of an OOV bucket scores 0 with 8
    buckets (it scored ~2% when accuracy counted every id ≥ 4)."""
    from corrflow.clients.keras_client import evaluate_weights
    from corrflow.data.vocab import Vocabulary

    v = Vocabulary(["a", "b", "c"], oov_buckets=8)
    sents = v.sequences(["a b zz c yy a", "b a xx ww", "c c c qq", "a a b"] * 3, seq_len=8)
    w = build_model(v.num_tokens, 8).get_weights()
    rng = np.random.default_rng(0)
    w = [x + rng.normal(0, 0.2, x.shape).astype(np.float32) for x in w]
    assert evaluate_weights(w, sents, v.first_word, batch=5) == pytest.approx(
        evaluate_weights(w, sents, v.first_word, batch=1000), rel=1e-6
    )
    bucket = v.lookup("zz")
    w[-2][:] = 0  # output kernel 0, bias one-hot: always predict the bucket
    w[-1][:] = 0
    w[-1][bucket] = 10.0
    assert (sents[:, 1:] == bucket).any() and evaluate_weights(w, sents, v.first_word)[1] == 0.0
