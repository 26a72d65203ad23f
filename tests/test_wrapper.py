"""The drop-in wrapper around FedAvg / FedProx with ClientApps written as Flower's quickstarts are
(full float64 weights, a named state dict with an integer buffer, a Keras model). Messages reach
the user's ClientApp object itself (its mods, its handler dispatch, corrflow's identity handler
registered by ``register_identity``) through corrflow's in-process grid, so no Ray instance starts;
Flower's own simulation engine is exercised by tests/test_strategy.py and tests/test_flwr_run.py."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord
from flwr.serverapp.strategy import FedAdam, FedAvg, FedProx, Krum

sys.path.insert(0, str(Path(__file__).parent))
import quickstart_apps as qs  # noqa: E402
from independent import independent_epsilon  # noqa: E402

from corrflow import DifferentialPrivacyCorrelatedNoise  # noqa: E402
from corrflow.errors import InvalidArgumentError  # noqa: E402
from corrflow.factorization import Factorization  # noqa: E402
from corrflow.protocol import PROBE_ACTION  # noqa: E402
from corrflow.run.reading import participation_users
from corrflow.server.inprocess import InProcessGrid  # noqa: E402

USERS, ROUNDS = 10, 10


def _loss(arrays: ArrayRecord) -> float:
    X, y = qs.held_out()
    a = dict(arrays.items())
    if "fc.weight" in a:
        return qs.loss_of(a["fc.weight"].numpy()[0], float(a["fc.bias"].numpy()[0]), X, y)
    w, b = arrays.to_numpy_ndarrays()
    return qs.loss_of(w.ravel(), float(b.ravel()[0]), X, y)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("wrapper")
    torch_init = ArrayRecord(
        {
            "fc.weight": Array(np.zeros((1, qs.DIM), np.float32)),
            "fc.bias": Array(np.zeros(1, np.float32)),
            "bn.num_batches_tracked": Array(np.array(7, np.int64)),
        }
    )
    keras_init = ArrayRecord(qs.keras_model().get_weights())
    plans = {
        "numpy": (
            FedAvg(fraction_evaluate=0.0),
            ArrayRecord([np.zeros(qs.DIM), np.zeros(1)]),
            {"app": "numpy", "lr": 0.05},
        ),
        "torch": (
            FedProx(proximal_mu=0.1, fraction_evaluate=0.0),
            torch_init,
            {"app": "torch", "lr": 0.05},
        ),
        "keras": (FedAvg(fraction_evaluate=0.0), keras_init, {"app": "keras", "local-epochs": 2}),
    }
    out = {}

    def main(grid):
        for name, (inner, init, config) in plans.items():
            strategy = DifferentialPrivacyCorrelatedNoise(
                inner,
                clipping_norm=0.5,
                target_epsilon=8.0,
                delta=1e-5,
                epochs=2,
                num_users=USERS,
                state_dir=root / name / "state",
            )
            result = strategy.start(
                grid=grid, initial_arrays=init, num_rounds=ROUNDS, train_config=ConfigRecord(config)
            )
            out[name] = (strategy, result, init)
        # The population taken from the nodes present, then the same run started again: it resumes
        # (nothing left).
        inner, init, config = FedAvg(fraction_evaluate=0.0), plans["numpy"][1], plans["numpy"][2]
        for attempt in ("first", "again"):
            strategy = DifferentialPrivacyCorrelatedNoise(
                inner,
                clipping_norm=0.5,
                target_epsilon=8.0,
                delta=1e-5,
                epochs=2,
                state_dir=root / "present" / "state",
            )
            strategy.start(
                grid=grid, initial_arrays=init, num_rounds=4, train_config=ConfigRecord(config)
            )
            out[attempt] = strategy.privacy_report()

    # Every category goes to the ClientApp object, which routes it as Flower's SuperNode would
    # (``identity=False``: the probe is answered by the app's own registered handler).
    kinds = ("train", "evaluate", f"query.{PROBE_ACTION}")
    main(InProcessGrid(dict.fromkeys(kinds, qs.app), USERS, identity=False))
    return out


@pytest.mark.parametrize("name", ["numpy", "torch", "keras"])
def test_quickstart_apps_train_unchanged_under_the_wrapper(runs, name):
    strategy, result, init = runs[name]
    core = strategy.core
    assert core.next_round == ROUNDS and not core.ledger.rejections, (
        core.stopped_reason,
        core.ledger.rejections[:2],
    )
    assert list(result.arrays.keys()) == list(init.keys())  # names and order round-trip
    assert [a.dtype for a in result.arrays.to_numpy_ndarrays()] == [
        a.dtype for a in init.to_numpy_ndarrays()
    ]
    assert _loss(result.arrays) < 0.5 * _loss(init)  # the model learns
    # the inner metric aggregation is kept
    assert "train_loss" in result.train_metrics_clientapp[ROUNDS]
    report = json.loads(strategy.report_path.read_text())
    users = participation_users(report, strategy.run_dir)
    assert len(users) == USERS and report["rounds_completed"] == ROUNDS
    fac = Factorization.load(strategy.out_dir / "factorization.npz")
    independent = independent_epsilon(fac, users, report["noise_multiplier"], 1e-5)
    assert report["realized"]["epsilon"] == pytest.approx(independent, rel=1e-6)
    assert report["realized"]["epsilon"] <= 8.0 + 1e-9


def test_population_of_the_nodes_present_resumes_as_the_same_run(runs):
    first, again = runs["first"], runs["again"]
    assert (
        first["rounds_completed"] == again["rounds_completed"] == 4
        and first["run_id"] == again["run_id"]
    )
    assert again["realized"]["participation"] == first["realized"]["participation"]
    assert again["realized"]["epsilon"] == pytest.approx(first["realized"]["epsilon"], rel=1e-12)
    assert first["realized"]["participation"]["user_count"] == USERS


def test_integer_buffers_keep_the_servers_value(runs):
    _, result, _ = runs["torch"]
    assert int(dict(result.arrays.items())["bn.num_batches_tracked"].numpy()) == 7


def test_stateful_or_robust_inner_strategies_are_refused(tmp_path):
    for inner, why in [(FedAdam(), "server-optimizer state"), (Krum(), "FedAvg's")]:
        with pytest.raises(InvalidArgumentError, match=why):
            DifferentialPrivacyCorrelatedNoise(
                inner, clipping_norm=1.0, target_epsilon=8.0, delta=1e-5, state_dir=tmp_path
            )
    default = DifferentialPrivacyCorrelatedNoise(
        FedAvg(), clipping_norm=1.0, state_dir=tmp_path
    ).config(4)
    assert (default.target_epsilon, default.noise_multiplier, default.delta) == (
        8.0,
        None,
        1e-5,
    )  # the one default
    with pytest.raises(InvalidArgumentError, match="clipping_norm"):
        DifferentialPrivacyCorrelatedNoise(
            FedAvg(), clipping_norm=float("inf"), target_epsilon=1.0, delta=1e-5, state_dir=tmp_path
        )


def test_an_inner_strategy_asking_for_more_nodes_than_the_population_does_not_hang(tmp_path):
    """FedAvg(min_available_nodes=50) around 6 users: Flower's sample_nodes would wait forever
    (logging only at INFO). Without federated evaluation the run finishes — corrflow asks the inner
    strategy for its train config on a padded grid, and the config reaches the clients (FedAvg's own
    ``server-round``, the user's ``lr``); with it, the wrapper refuses before anything is written,
    naming the setting."""
    import threading

    from corrflow.clients.tasks import get_task

    task = get_task("numpy", 8)
    seen = []

    def spy(msg, context):
        seen.append(dict(msg.content["config"]))
        return task.handlers["train"](msg, context)

    def wrap(inner, state_dir):
        return DifferentialPrivacyCorrelatedNoise(
            inner,
            clipping_norm=1.0,
            noise_multiplier=1.0,
            delta=1e-5,
            epochs=1,
            num_users=6,
            replies="delta",
            state_dir=state_dir,
        )

    evaluating = wrap(FedAvg(min_available_nodes=50), tmp_path / "evaluating" / "state")
    with pytest.raises(
        InvalidArgumentError, match="min_available_nodes.*at most the run's 6 users"
    ):
        evaluating.start(
            grid=InProcessGrid(task.handlers, 6),
            initial_arrays=ArrayRecord(task.initial_weights()),
            num_rounds=2,
            timeout=30,
        )
    assert not (tmp_path / "evaluating").exists()
    strategy = wrap(
        FedAvg(min_available_nodes=50, min_train_nodes=40, fraction_evaluate=0.0),
        tmp_path / "state",
    )
    done = []
    worker = threading.Thread(
        target=lambda: done.append(
            strategy.start(
                grid=InProcessGrid({**task.handlers, "train": spy}, 6),
                initial_arrays=ArrayRecord(task.initial_weights()),
                num_rounds=2,
                timeout=30,
                train_config=ConfigRecord({"lr": 0.07}),
            )
        ),
        daemon=True,
    )
    worker.start()
    worker.join(120)
    assert done, "the run hung in the inner strategy's configure_train"
    assert strategy.privacy_report()["rounds_completed"] == 2
    final = done[0].arrays.to_numpy_ndarrays()
    again = strategy.start(
        grid=InProcessGrid(task.handlers, 6),
        initial_arrays=ArrayRecord(task.initial_weights()),
        num_rounds=2,
        timeout=30,
    )  # a finished run, started again, returns its model
    assert len(final) == 2 and all(
        np.array_equal(a, b) for a, b in zip(again.arrays.to_numpy_ndarrays(), final, strict=True)
    )
    assert {(c["server-round"], c["lr"]) for c in seen} == {(1, 0.07), (2, 0.07)}


def test_a_wrapper_run_writes_only_inside_its_state_dir_and_evaluates_like_fedavg(
    tmp_path, monkeypatch
):
    """A 2-round run with a relative state_dir inside a fresh git checkout: the directory is
    resolved against the working directory, everything the run writes (lock, checkpoints, journal,
    report, metrics, factorization, its .gitignore) is inside it, and git sees nothing else.
    evaluate_fn gets the starting model (round 0) and each round, as Flower's FedAvg calls it; a
    resumed start with other initial arrays is refused."""
    import subprocess

    from corrflow.clients.tasks import get_task

    repo = tmp_path / "app"
    repo.mkdir()
    (repo / "train.py").write_text("# the user's code\n")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    monkeypatch.chdir(repo)
    task = get_task("numpy", 8)
    seen = []
    strategy = DifferentialPrivacyCorrelatedNoise(
        FedAvg(fraction_evaluate=0.0),
        clipping_norm=1.0,
        noise_multiplier=1.0,
        num_users=6,
        replies="delta",
        state_dir="corrflow_state",
    )
    init = ArrayRecord(task.initial_weights())
    result = strategy.start(
        grid=InProcessGrid(task.handlers, 6),
        initial_arrays=init,
        num_rounds=2,
        evaluate_fn=lambda rnd, arrays: seen.append(rnd) or None,
    )
    assert seen == [0, 1, 2] and strategy.privacy_report()["rounds_completed"] == 2
    assert strategy.run_dir == repo / "corrflow_state"
    status = subprocess.run(
        ["git", "status", "--porcelain", "--ignored"],
        cwd=repo,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert sorted(status) == ["!! corrflow_state/", "?? train.py"], status
    other = ArrayRecord([np.ones_like(a) for a in task.initial_weights()])
    with pytest.raises(InvalidArgumentError, match="initial_arrays"):
        strategy.start(grid=InProcessGrid(task.handlers, 6), initial_arrays=other, num_rounds=2)
    assert len(result.arrays.to_numpy_ndarrays()) == 2


def test_summary_works_for_every_setting_the_constructor_accepts(tmp_path, caplog):
    """summary() (Flower calls it) describes the wrapper before start() fixes the rounds: for every
    setting the constructor accepts it logs, never raising — e.g. epochs=3, which the default 20
    rounds would not fit."""
    import itertools
    import logging

    from corrflow.choices import Participation

    accepted = 0
    for participation, epochs, min_sep in itertools.product(Participation, (1, 3), (0, 2, 4)):
        try:
            s = DifferentialPrivacyCorrelatedNoise(
                FedAvg(),
                clipping_norm=1.0,
                target_epsilon=8.0,
                participation=participation.value,
                epochs=epochs,
                min_sep=min_sep,
                state_dir=str(tmp_path),
            )
        except InvalidArgumentError:
            continue
        accepted += 1
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="corrflow"):
            s.summary()
        assert f"{epochs} epoch(s)" in caplog.text and "clipping norm 1" in caplog.text
    assert accepted >= 8


def _flower_lines(run) -> list[str]:
    """What Flower's logger printed about rounds and metrics while ``run()`` ran, numbers masked
    (the values differ: one run is private)."""
    import logging
    import re

    class Keep(logging.Handler):
        def __init__(self):
            super().__init__(logging.INFO)
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    keep, flwr_logger = Keep(), logging.getLogger("flwr")
    flwr_logger.addHandler(keep)
    try:
        run()
    finally:
        flwr_logger.removeHandler(keep)
    wanted = re.compile(r"\[ROUND|MetricRecord|Global evaluation|Initial global evaluation")
    number = re.compile(r"-?\d+(\.\d+)?(e[-+]?\d+)?")
    return [number.sub("#", line) for line in keep.lines if wanted.search(line)]


def test_a_quickstart_pytorch_app_logs_its_metrics_as_without_corrflow(tmp_path):
    """quickstart-pytorch's pieces (train and evaluate ClientApps, FedAvg with federated
    evaluation, a server-side evaluate_fn) run once with Flower's FedAvg alone and once wrapped as
    the how-to says: Flower's log shows the same lines — each round, the aggregated train and
    evaluate MetricRecords, the global evaluation — with the same metric names. The evaluate_fn's
    loss is corrflow's held-out loss (metrics.json, the learning verdict), and the report lists the
    app's aggregated metrics outside the guarantee."""

    handlers = {"train": qs.numpy_train, "evaluate": qs.evaluate}
    init = ArrayRecord([np.zeros(qs.DIM), np.zeros(1)])
    config = ConfigRecord({"app": "numpy", "lr": 0.05})

    def fedavg():
        return FedAvg(fraction_train=1.0, fraction_evaluate=1.0, min_available_nodes=6)

    def plain():
        fedavg().start(
            grid=InProcessGrid(handlers, 6),
            initial_arrays=init,
            num_rounds=4,
            train_config=config,
            evaluate_fn=qs.central_evaluate,
        )

    strategy = DifferentialPrivacyCorrelatedNoise(
        fedavg(),
        clipping_norm=0.5,
        noise_multiplier=0.3,
        num_users=6,
        state_dir=tmp_path / "state",
    )

    def wrapped():
        result = strategy.start(
            grid=InProcessGrid(handlers, 6),
            initial_arrays=init,
            num_rounds=4,
            train_config=config,
            evaluate_fn=qs.central_evaluate,
        )
        assert sorted(result.evaluate_metrics_serverapp) == [0, 1, 2, 3, 4]
        assert "eval_acc" in result.evaluate_metrics_clientapp[4]

    want, got = _flower_lines(plain), _flower_lines(wrapped)
    assert sum("Aggregated MetricRecord" in line for line in want) == 8
    assert want[0].startswith("Initial global evaluation results: {'accuracy'")
    assert "'train_loss'" in want[2] and "'eval_loss'" in want[3] and "'loss'" in want[-1]
    assert got == want
    report = strategy.privacy_report()
    assert report["learning"]["learned"] is True, report["learning"]
    metrics = json.loads((tmp_path / "state" / "metrics.json").read_text())
    loss = [m["test_loss"] for m in metrics]
    assert len(loss) == 5 and loss[-1] < loss[0]
    assert loss[0] == pytest.approx(qs.central_evaluate(0, init)["loss"])
    outside = report["outside_guarantee"]["metrics"]
    assert {"train.train_loss", "evaluate.eval_loss", "evaluate.eval_acc"} <= set(outside)


def test_an_amplified_run_keeps_the_apps_aggregated_metrics_off_the_console(tmp_path):
    """Amplified ε holds while the cohorts stay secret: the app's aggregated train and evaluate
    metrics (statistics of who was sampled) go to the operator log only; Flower's log keeps the
    rounds and the server-side evaluation, and the report names where the metrics went."""

    handlers = {"train": qs.numpy_train, "evaluate": qs.evaluate}
    strategy = DifferentialPrivacyCorrelatedNoise(
        FedAvg(fraction_evaluate=1.0, min_available_nodes=8),
        clipping_norm=0.5,
        noise_multiplier=0.5,
        num_users=8,
        participation="poisson",
        participation_rate=0.75,  # an empty cohort (no train metrics) has probability 0.25⁸
        min_sep=1,
        accountant="mmcc",
        kind="dpsgd",
        state_dir=tmp_path / "state",
    )
    lines = _flower_lines(
        lambda: strategy.start(
            grid=InProcessGrid(handlers, 8),
            initial_arrays=ArrayRecord([np.zeros(qs.DIM), np.zeros(1)]),
            num_rounds=3,
            train_config=ConfigRecord({"app": "numpy", "lr": 0.05}),
            evaluate_fn=qs.central_evaluate,
        )
    )
    assert not any("Aggregated" in line for line in lines), lines
    assert sum(line.startswith("[ROUND") for line in lines) == 3
    assert sum("'loss'" in line for line in lines) == 4  # initial + 3 global evaluations
    operator = (tmp_path / "state" / "operator" / "operator.log").read_text()
    assert operator.count("train: └──> Aggregated MetricRecord: {'train_loss'") == 3
    assert operator.count("evaluate: └──> Aggregated MetricRecord: {'eval_loss'") == 3
    outside = strategy.privacy_report()["outside_guarantee"]
    assert outside["metrics"] == [] and "evaluate.eval_loss" in outside["why"]


def test_a_round_whose_replies_all_failed_shows_no_corrflow_counters_as_the_apps_metrics(tmp_path):
    """When every reply of a round fails, the app's strategy aggregated nothing: Flower's log says
    so for that (1-based) round instead of printing corrflow's own counters (0-based round, reply
    counts) as the app's "Aggregated MetricRecord"; the counters stay in metrics.json."""

    def failing_train(msg, context):
        raise RuntimeError("this node's training broke")

    strategy = DifferentialPrivacyCorrelatedNoise(
        FedAvg(fraction_evaluate=0.0, min_available_nodes=4),
        clipping_norm=0.5,
        noise_multiplier=0.5,
        num_users=4,
        state_dir=tmp_path / "state",
    )
    lines = _flower_lines(
        lambda: strategy.start(
            grid=InProcessGrid({"train": failing_train, "evaluate": qs.evaluate}, 4),
            initial_arrays=ArrayRecord([np.zeros(qs.DIM), np.zeros(1)]),
            num_rounds=2,
            train_config=ConfigRecord({"app": "numpy", "lr": 0.05}),
        )
    )
    aggregated = [line for line in lines if "MetricRecord" in line]
    assert aggregated and not any("Aggregated MetricRecord: {" in line for line in aggregated)
    assert len(aggregated) == 2 and all(
        "no Aggregated MetricRecord in round #: no reply accepted" in line for line in aggregated
    ), aggregated
    metrics = json.loads((tmp_path / "state" / "metrics.json").read_text())
    assert metrics[1]["round"] == 0  # corrflow's own record keeps its 0-based round
