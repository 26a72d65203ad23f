"""Models that learn: the nextword client's gradients, per-client defaults that train (the README's
first command), metrics.json with the initial model, the simulate flags, the pre-flight
noise-to-signal estimate, and the learning verdict a run puts in its report and exit code."""

import json
import logging
import subprocess
import sys

import numpy as np
import pytest

from corrflow.clients import nextword_client as nw
from corrflow.clients.tasks import TRAINING_DEFAULTS, get_task, training_defaults
from corrflow.config import RunConfig
from corrflow.data.text_synth import user_sentences
from corrflow.factorization import Workload, factorize, participation_for
from corrflow.planning.learnability import THRESHOLD, check_learnable, noise_to_signal
from corrflow.server.app import run_server
from corrflow.server.inprocess import InProcessGrid


def _mean_loss(weights, prev, nxt):
    _, p = nw._forward([w.astype(np.float64) for w in weights], prev)
    return float(-np.log(p[np.arange(len(nxt)), nxt]).mean())


def test_nextword_step_is_minus_lr_times_the_numerical_gradient():
    """One full-batch SGD step with a tiny learning rate equals −lr × the finite-difference
    gradient."""
    rng = np.random.default_rng(0)
    w = nw.initial_weights(24, seed=1, embedding=4)
    w[1] = rng.normal(size=w[1].shape).astype(np.float32) * 0.3
    sentences = user_sentences(nw.task_for(0, vocab=20), 3)[:4]
    prev, nxt = nw._pairs(sentences)
    lr = 1e-3
    delta, _ = nw.local_train(w, sentences, lr, steps=1, batch=10_000)
    for k, idx in ((0, (int(prev[0]), 1)), (1, (2, int(nxt[0]))), (2, (int(nxt[1]),))):
        plus = [a.astype(np.float64).copy() for a in w]
        minus = [a.astype(np.float64).copy() for a in w]
        plus[k][idx] += 1e-5
        minus[k][idx] -= 1e-5
        grad = (_mean_loss(plus, prev, nxt) - _mean_loss(minus, prev, nxt)) / 2e-5
        assert delta[k][idx] == pytest.approx(-lr * grad, rel=1e-3, abs=1e-9)


def test_nextword_local_training_lowers_the_users_loss():
    text = nw.task_for(0)
    w = nw.initial_weights(text.num_tokens, 0)
    s = np.concatenate([user_sentences(text, u) for u in range(30)])
    delta, _ = nw.local_train(w, s, **{"lr": TRAINING_DEFAULTS["nextword"]["local_lr"], "steps": 2})
    assert all(d.dtype == np.float32 and d.shape == x.shape for d, x in zip(delta, w, strict=True))
    after = [a + d for a, d in zip(w, delta, strict=True)]
    assert nw.evaluate_weights(after, s)[0] < nw.evaluate_weights(w, s)[0] - 0.3


def test_readme_first_command_learns_at_its_defaults(tmp_path):
    """`corrflow simulate --users 100 --rounds 20 --epochs 2 --target-epsilon 8` (numpy client,
    in-process): every one of the last 5 rounds has held-out loss ≤ half the initial model's;
    metrics.json starts with round −1."""
    cfg = RunConfig(
        num_users=100,
        num_rounds=20,
        epochs=2,
        target_epsilon=8.0,
        client="numpy",
        state_dir=str(tmp_path),
        **training_defaults("numpy"),
    )
    task = get_task("numpy")
    run_server(InProcessGrid(task.handlers, 100), cfg, quiet=True)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert [m["round"] for m in metrics] == list(range(-1, 20))
    assert metrics[0]["test_loss"] == pytest.approx(
        task.evaluate(task.initial_weights())["test_loss"]
    )
    assert all(m["test_loss"] <= 0.5 * metrics[0]["test_loss"] for m in metrics[-5:]), [
        round(m["test_loss"], 3) for m in metrics
    ]


def test_dpsgd_noise_to_signal_matches_closed_form():
    """Identity encoder normalised to sensitivity √k (k participations): B = √k·A; with the prefix
    workload the last row of A is all ones, so ρ = σ·√d·√(k·n) / (cohort·n)."""
    for k in (1, 2):
        fac = factorize("dpsgd", participation_for(12, k), Workload.prefix())
        sigma, d, cohort = 0.7, 500, 40.0
        assert noise_to_signal(fac, sigma, d, cohort) == pytest.approx(
            sigma * np.sqrt(d) * np.sqrt(k * 12) / (cohort * 12), rel=1e-9
        )
    assert noise_to_signal(fac, 0.0, d, cohort) == 0.0


def test_unlearnable_configuration_warns(caplog):
    fac = factorize("toeplitz", participation_for(20, 2), Workload.sgd_momentum(0.9, 0.25))
    with caplog.at_level(logging.WARNING, logger="corrflow"):
        small = check_learnable(fac, 0.6, [np.zeros(21)], 10.0)
    assert small < THRESHOLD and not caplog.records
    with caplog.at_level(logging.WARNING, logger="corrflow"):
        big = check_learnable(fac, 0.6, [np.zeros(31_000)], 5.0)
    assert big > THRESHOLD and "unlikely to learn" in caplog.text


def _simulate(tmp_path, *args):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "corrflow.server.cli",
            "simulate",
            "--users",
            "12",
            "--rounds",
            "4",
            "--epochs",
            "2",
            "--backend",
            "inprocess",
            "--out",
            str(tmp_path),
            "--json",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_simulate_flags_reach_the_run(tmp_path):
    proc = _simulate(
        tmp_path / "a",
        "--server-lr",
        "0.3",
        "--momentum",
        "0.7",
        "--local-lr",
        "0.05",
        "--local-steps",
        "3",
        "--seed",
        "5",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["held_out"]["rounds_evaluated"] == 4 and out["held_out"]["initial_test_loss"] > 0
    from corrflow.factorization.base import Factorization

    fac = Factorization.load(tmp_path / "a" / "factorization.npz")
    assert fac.workload.momentum == 0.7  # rebuilt for the optimizer's momentum
    metrics = json.loads((tmp_path / "a" / "metrics.json").read_text())
    other = _simulate(tmp_path / "b", "--seed", "6")
    assert other.returncode == 0
    # the seed picks the data: another seed, another initial held-out loss
    assert (
        json.loads((tmp_path / "b" / "metrics.json").read_text())[0]["test_loss"]
        != metrics[0]["test_loss"]
    )
    bad = _simulate(tmp_path / "c", "--momentum", "1.5")
    assert bad.returncode == 2 and "momentum" in bad.stderr


@pytest.mark.slow  # ~50 CPU-s; a cross-silo arXiv run: test_participation_strategy.py
def test_readme_arxiv_cross_silo_example_learns(tmp_path):
    """The docs' arXiv example (300 authors, 4 silos, multi-attribution, k_u = 2) at its defaults
    improves held-out loss by ≥ 20% over the run."""
    from corrflow.data.arxiv import ArxivSpec, generate_arxiv
    from corrflow.data.partition import make_manifest, write_manifest

    generate_arxiv(tmp_path / "arxiv.jsonl", ArxivSpec(users=300))
    write_manifest(make_manifest(tmp_path / "arxiv.jsonl", 4), tmp_path / "manifest.json")
    cfg = RunConfig(
        num_users=4,
        num_rounds=20,
        epochs=4,
        target_epsilon=8.0,
        mode="cross-silo",
        manifest_path=str(tmp_path / "manifest.json"),
        attribution_path=str(tmp_path / "arxiv.jsonl"),
        participation="multi-attribution",
        participation_rate=0.05,
        max_items_per_user=2,
        state_dir=str(tmp_path),
        **training_defaults("numpy"),
    )
    task = get_task("numpy")
    run_server(InProcessGrid(task.handlers, 4), cfg, quiet=True)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert len(metrics) == 21 and metrics[-1]["test_loss"] <= 0.8 * metrics[0]["test_loss"]


def test_learning_verdict_from_metrics():
    from corrflow.planning.learnability import learning_section

    hist = [
        {"round": -1, "test_loss": 5.0, "test_accuracy": 0.0},
        {"round": 0, "test_loss": 4.0, "test_accuracy": 0.2},
    ]
    ok = learning_section(hist, 0.1)
    assert (
        ok["learned"] is True and not ok["warned"] and ok["loss_improvement"] == pytest.approx(0.2)
    )
    assert ok["final_test_accuracy"] == 0.2
    worse = learning_section([hist[0], {"round": 0, "test_loss": 7.5}], 2.4)
    assert worse["learned"] is False and worse["warned"] and "did not learn" in worse["verdict"]
    assert f"2.40 > {THRESHOLD}" in worse["verdict"]
    nan = learning_section([hist[0], {"round": 0, "test_loss": float("nan")}], 0.0)
    assert nan["learned"] is False and nan["final_test_loss"] is None and "to nan" in nan["verdict"]
    json.dumps(nan, allow_nan=False)  # strict JSON: no NaN in the report
    numpy_floats = [
        {"round": -1, "test_loss": np.float32(5.0)},
        {"round": 0, "test_loss": np.float32(4.0)},
    ]
    # a plain bool, whatever evaluate returns
    assert learning_section(numpy_floats, 0.1)["learned"] is True
    json.dumps(learning_section(numpy_floats, 0.1))
    # accuracy rose but the loss did too (over-confident noisy logits): not learned, and the verdict
    # names both
    rose = learning_section([hist[0], {"round": 0, "test_loss": 6.0, "test_accuracy": 0.1}], 0.4)
    assert rose["learned"] is False and "accuracy from 0 to 0.1" in rose["verdict"]
    assert learning_section([hist[0]], 0.0)["learned"] is None  # no round trained
    # no held-out evaluation
    assert learning_section([{"round": -1}, {"round": 0}], 0.0)["learned"] is None


# what the screen shows is the point: a fresh interpreter, whose logging no earlier test configured
@pytest.mark.subprocess_cli
def test_a_run_that_does_not_learn_says_so_and_exits_3(tmp_path):
    """σ = 200 on 3 users a round: the noise swamps the model. The screen, the report and the exit
    code say so."""
    proc = _simulate(tmp_path, "--noise-multiplier", "200")
    assert proc.returncode == 3, proc.stderr
    assert "did not learn" in proc.stderr
    learning = json.loads((tmp_path / "privacy_report.json").read_text())["learning"]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["learning"] == learning
    assert (
        learning["learned"] is False
        and learning["warned"]
        and learning["noise_to_signal"] > THRESHOLD
    )
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert learning["final_test_loss"] == metrics[-1]["test_loss"] > metrics[0]["test_loss"]
    again = subprocess.run(
        [
            sys.executable,
            "-m",
            "corrflow.server.cli",
            "simulate",
            "--users",
            "12",
            "--rounds",
            "4",
            "--epochs",
            "2",
            "--backend",
            "inprocess",
            "--out",
            str(tmp_path),
            "--noise-multiplier",
            "200",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    # already complete: same verdict
    assert again.returncode == 3 and "did not learn (exit 3)" in again.stdout
