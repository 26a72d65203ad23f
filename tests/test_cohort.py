"""The cohort engine (``--backend cohort``) against the per-client path: each client's update
matches what corrflow's ClientApp replies, within 1e-5 in ℓ2 relative to the update, and five DP
rounds release the same models; combinations it does not serve are refused with exit 2."""

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common import MessageType
from typer.testing import CliRunner

from corrflow.clients.tasks import task_for
from corrflow.config import RunConfig
from corrflow.planning.learnability import held_out_summary
from corrflow.planning.regime import matching_cohort, per_round_noise_to_signal
from corrflow.run.evaluation import evaluates
from corrflow.server.app import run_server
from corrflow.server.cli import app
from corrflow.server.cohort_backend import CohortTrainer, run_cohort
from corrflow.server.inprocess import InProcessGrid, enable_offline_messages

TOLERANCE = 1e-5
KEY = bytes(range(16))


def relative(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """‖a − b‖₂ / ‖b‖₂ over all arrays, in float64."""
    num = sum(
        float(np.sum((x.astype(np.float64) - y.astype(np.float64)) ** 2))
        for x, y in zip(a, b, strict=True)
    )
    den = sum(float(np.sum(y.astype(np.float64) ** 2)) for y in b)
    return float(np.sqrt(num / den))


def client_app_update(task, cfg: RunConfig, sent, user: int, server_round: int, extra=None):
    """What corrflow's per-client ClientApp replies for ``user``, minus the model it was sent."""
    enable_offline_messages()
    config = ConfigRecord(
        {
            "server-round": server_round,
            "local-lr": cfg.local_lr,
            "local-steps": cfg.local_steps,
            "clip-norm": cfg.clip_norm,
            "seed": cfg.seed,
            **(extra or {}),
        }
    )
    msg = Message(
        RecordDict({"arrays": ArrayRecord(sent), "config": config}),
        message_type=MessageType.TRAIN,
        dst_node_id=user + 1,
    )
    ctx = Context(1, user + 1, {"partition-id": user}, RecordDict(), {})
    reply = task.handlers["train"](msg, ctx)
    new = reply.content["arrays"].to_numpy_ndarrays()
    return [
        n.astype(np.float64) - s.astype(np.float64) for n, s in zip(new, sent, strict=True)
    ], dict(reply.content["metrics"])


@pytest.mark.parametrize("client", ["nextword", "numpy"])
def test_each_client_update_matches_the_client_app(client):
    cfg = RunConfig(client=client, num_users=60, local_steps=2, seed=3)
    task = task_for(cfg)
    rng = np.random.default_rng(7)
    # a model away from the initial one (nextword's W = 0 at the start would hide E's updates)
    sent = [(w + 0.2 * rng.normal(size=w.shape)).astype(np.float32) for w in task.initial_weights()]
    users = [0, 5, 11, 17, 23, 42, 59]  # ragged: nextword users have 2 to 48 sentences
    trainer = CohortTrainer(cfg, task, tuple(str(i) for i in range(len(sent))))
    result = trainer.train(sent, users, round_index=4)
    again = trainer.train(sent, users, round_index=4)  # deterministic: the same bits
    assert all(
        np.array_equal(a, b)
        for x, y in zip(result.deltas, again.deltas, strict=True)
        for a, b in zip(x, y, strict=True)
    )
    sizes = set()
    for user, delta, metrics in zip(users, result.deltas, result.metrics, strict=True):
        expected, expected_metrics = client_app_update(task, cfg, sent, user, server_round=5)
        assert relative(delta, expected) <= TOLERANCE
        assert float(np.linalg.norm(expected[0])) > 0  # a real update, not two zeros
        assert metrics["num-examples"] == expected_metrics["num-examples"]
        assert metrics["train-loss"] == pytest.approx(expected_metrics["train-loss"], rel=1e-4)
        sizes.add(metrics["num-examples"])
    if client == "nextword":
        assert len(sizes) > 1  # the cohort really was ragged


@pytest.mark.parametrize("shift", [800.0, -800.0])
def test_logits_past_exp_range_fall_back_to_the_shifted_softmax(shift):
    """Softmax ignores a constant added to every logit; exp does not (float64's overflows past
    709, and every term underflows below −745): the engine falls back to the max-shifted softmax
    and still matches the per-client path, which always shifts (its update itself: the reply's
    b near ±800 is rounded to float32's 6e-5 steps)."""
    from corrflow.clients.cohort import nextword_data, train_nextword
    from corrflow.clients.nextword_client import local_train

    cfg = RunConfig(client="nextword", num_users=20, local_steps=2, seed=3)
    task = task_for(cfg)
    rng = np.random.default_rng(7)
    sent = [(w + 0.2 * rng.normal(size=w.shape)).astype(np.float32) for w in task.initial_weights()]
    sent[2] = sent[2] + np.float32(shift)
    users, data = [0, 5, 11], nextword_data(task.user_data)
    shuffles = [(cfg.seed, u, 1) for u in users]
    result = train_nextword(
        sent, [data(u) for u in users], shuffles, cfg.local_lr, 2, dtype=np.float64
    )
    for user, shuffle, delta in zip(users, shuffles, result.deltas, strict=True):
        expected, _ = local_train(sent, task.user_data(user)[0], cfg.local_lr, 2, shuffle=shuffle)
        assert relative(delta, expected) <= TOLERANCE


def test_ragged_regression_data_is_padded_and_masked():
    from corrflow.clients.cohort import train_regression
    from corrflow.clients.numpy_client import local_update
    from corrflow.data.synthetic import regression_partition

    sent = [np.linspace(-1, 1, 10, dtype=np.float32), np.array([0.3], np.float32)]
    parts = [regression_partition(u, 10, seed=2, examples=n) for u, n in enumerate((3, 32, 9))]
    data = [(X.astype(np.float64), y.astype(np.float64), len(y)) for X, y in parts]
    result = train_regression(sent, data, lr=0.05, steps=4)
    for (X, y), delta in zip(parts, result.deltas, strict=True):
        assert relative(delta, local_update(sent, X, y, 0.05, 4)) <= TOLERANCE


@pytest.mark.parametrize("client", ["nextword", "numpy"])
def test_five_dp_rounds_release_the_same_models(client, tmp_path):
    settings = dict(client=client, num_users=40, num_rounds=5, epochs=1, target_epsilon=8.0, seed=1)
    per_client = run_server(
        InProcessGrid(task_for(RunConfig(**settings)).handlers, 40),
        RunConfig(**settings, state_dir=str(tmp_path / "inprocess")),
        noise_key=KEY,
        quiet=True,
    )
    cohort = run_cohort(RunConfig(**settings, state_dir=str(tmp_path / "cohort")), noise_key=KEY)
    initial = task_for(RunConfig(**settings)).initial_weights()
    assert cohort.state.next_round == per_client.next_round == 5
    moved = [p - i for p, i in zip(per_client.params, initial, strict=True)]
    assert (
        relative([c - i for c, i in zip(cohort.state.params, initial, strict=True)], moved)
        <= TOLERANCE
    )
    assert cohort.state.ledger.epsilon_history == per_client.ledger.epsilon_history
    assert cohort.state.ledger.selected == per_client.ledger.selected
    for a, b in zip(cohort.state.metrics_history, per_client.metrics_history, strict=True):
        assert a["accepted"] == b["accepted"] == 8
        assert a["test_loss"] == pytest.approx(b["test_loss"], rel=1e-5)


def test_eval_every_evaluates_every_nth_and_the_last_round(tmp_path):
    cfg = RunConfig(
        client="numpy", num_users=20, num_rounds=7, eval_every=3, state_dir=str(tmp_path / "o")
    )
    run = run_cohort(cfg, noise_key=KEY)
    evaluated = [m["round"] + 1 for m in run.state.metrics_history if "test_loss" in m]
    assert evaluated == [3, 6, 7]
    assert [t + 1 for t in range(7) if evaluates(t, 3, 7)] == [3, 6, 7]
    report = run.report()
    assert report["evaluation"]["every"] == 3
    assert report["learning"]["rounds_evaluated"] == 3
    summary = held_out_summary(
        [{"round": -1, "test_loss": 2.0}, {"round": 0}, {"round": 1, "test_loss": 1.0}]
    )
    assert summary["rounds_evaluated"] == 1 and summary["final_test_loss"] == 1.0


def test_regime_matches_the_papers_ratio():
    # 000 Table 3: σ = 0.600 at ε ≈ 8.84, d ≈ 4.05·10⁶, m = 1,000 → r ≈ 1.2
    assert per_round_noise_to_signal(0.600, 4_050_000, 1000) == pytest.approx(1.2075, rel=1e-3)
    # the stackoverflow preset's model: d = 33·204 = 6,732; at σ ≈ 0.65 the rule gives m ≈ 44
    assert matching_cohort(0.653, 6732) == 44
    assert per_round_noise_to_signal(0.653, 6732, 44) == pytest.approx(1.2176, rel=1e-3)


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--secagg"], "--secagg"),
        (["--noise-workers", "2"], "--noise-workers"),
        (["--client", "keras"], "--client"),
    ],
)
def test_unserved_combinations_are_refused(flags, named, tmp_path):
    out = tmp_path / "o"
    res = CliRunner().invoke(
        app,
        ["simulate", "--backend", "cohort", "--users", "20", "--rounds", "4", "--out", str(out)]
        + flags,
    )
    assert res.exit_code == 2, res.output
    assert named in res.output
    assert not out.exists() or not any(out.iterdir())


def test_a_real_format_file_trains_the_same_updates(tmp_path):
    """--data: the cohort engine reads each user's sentences from the file once, as the ClientApp
    reads them every round, and trains the same updates."""
    from corrflow.data.stackoverflow import Post, StackOverflowWriter
    from corrflow.data.vocab import build_vocabulary, count_words

    words = [f"word{i}" for i in range(30)]
    rng = np.random.default_rng(3)
    writer = StackOverflowWriter(tmp_path / "so.sqlite")
    for u in range(12):  # ragged: 1 to 4 posts per user
        posts = [Post(" ".join(rng.choice(words, 9))) for _ in range(1 + u % 4)]
        writer.add_client(f"u{u:04d}", "train", posts)
    writer.add_client("h0000", "heldout", [Post(" ".join(words[:9]))])
    writer.close()
    build_vocabulary(count_words(words), 30).save(tmp_path / "v.txt")
    cfg = RunConfig(
        client="nextword",
        num_users=12,
        num_rounds=4,
        data_path=str(tmp_path / "so.sqlite"),
        vocab_path=str(tmp_path / "v.txt"),
        seq_len=10,
    )
    task = task_for(cfg)
    sent = [(w + 0.2 * rng.normal(size=w.shape)).astype(np.float32) for w in task.initial_weights()]
    users = list(range(12))
    result = CohortTrainer(cfg, task, ("0", "1", "2")).train(sent, users, round_index=0)
    config_data = {"data-path": cfg.data_path, "vocab-path": cfg.vocab_path, "seq-len": 10}
    for user, delta in zip(users, result.deltas, strict=True):
        expected, _ = client_app_update(task, cfg, sent, user, 1, config_data)
        assert relative(delta, expected) <= TOLERANCE


def test_an_interrupted_cohort_run_resumes_to_its_planned_rounds(tmp_path):
    import threading

    cfg = RunConfig(
        client="numpy", num_users=20, num_rounds=6, epochs=2, state_dir=str(tmp_path / "o")
    )
    stop = threading.Event()

    def end(metrics):
        if metrics["round"] == 2:
            stop.set()  # as the first SIGINT does: the round in progress finishes

    first = run_cohort(cfg, noise_key=KEY, stop_event=stop, on_round_end=end)
    assert first.state.next_round == 3 and "interrupted" in first.state.stopped_reason
    # a stopped run's directory resumes: the stop is recorded, the rounds after it run
    again = run_cohort(cfg.replace(state_dir=str(tmp_path / "o")))
    report = again.report()
    assert report["rounds_completed"] == 6 and not report["stopped_reason"]
    assert report["lineage"]["key_segments"] == [0, 3]
