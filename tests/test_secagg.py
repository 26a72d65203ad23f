"""Secure aggregation (SecAgg+, ``--secagg``): the quantization bounds, the client's bounded update,
the secure sum against the plain sum, what reaches the server, dropouts and redos, refusals, and a
SIGKILL of the server mid-protocol (a real process)."""

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from lineage_support import KEY

from corrflow.clients.numpy_client import train as numpy_train
from corrflow.clients.secagg import with_secure_aggregation
from corrflow.config import RunConfig
from corrflow.errors import InvalidArgumentError
from corrflow.run.journal import JOURNAL
from corrflow.run.secure_sum import (
    MAX_ATTEMPTS,
    MODULUS,
    bound_update,
    decode_counts,
    implausible,
    secure_sum_params,
)
from corrflow.server.app import run_server
from corrflow.server.inprocess import InProcessGrid
from corrflow.strategies.secagg import SecureSumError, secure_sum

HERE = Path(__file__).parent


# -- the Flower-free numbers -----------------------------------------------------------------------
@pytest.mark.parametrize("m", [2, 3, 10, 33, 100, 1023, 1024, 5000, 100_000])
def test_the_modular_sum_never_wraps(m):
    p = secure_sum_params(m, 1.0, 10)
    # m values in [0, T] (stochastic rounding reaches T itself) plus the weights' m·T stay < M
    assert m * p.quantization_range < MODULUS and p.quantization_range % 2 == 0
    assert p.quantization_range < 2**31  # Flower's client rounds into int32
    assert 2 <= p.threshold <= p.num_shares <= m
    if m > 1024:  # Flower's fixed 2²² would have wrapped here
        assert m * 2**22 >= MODULUS


def test_the_client_bound_leaves_room_for_quantization():
    p = secure_sum_params(10, 2.0, 10**5)
    assert p.step == pytest.approx(4.0 / p.quantization_range)
    assert p.client_bound(10**5) == pytest.approx(2.0 - p.step * math.sqrt(10**5))
    with pytest.raises(InvalidArgumentError, match="secure-aggregation"):
        secure_sum_params(10**6, 1e-3, 10**7)  # Δ√d = 2c√d/T above the clip
    with pytest.raises(InvalidArgumentError, match="cohort"):
        secure_sum_params(1, 1.0, 10)


def test_bound_update_zeroes_clips_and_keeps():
    big = [np.full(4, 3.0), np.array([4.0])]  # ‖u‖₂ = √(36 + 16) ≈ 7.21
    out, action = bound_update(big, 1.0, 100.0)
    norm = math.sqrt(sum(float(np.sum(np.square(a, dtype=np.float64))) for a in out))
    assert action == "clipped" and norm <= 1.0 and norm > 1.0 - 1e-5
    assert all(a.dtype == np.float32 for a in out)
    np.testing.assert_allclose(out[0] / out[1][0], big[0] / 4.0, rtol=1e-6)  # direction kept
    small = [np.array([0.1, -0.2]), np.array([0.05])]
    out, action = bound_update(small, 1.0, 100.0)
    assert action == "kept" and np.allclose(out[0], small[0])
    out, action = bound_update(big, 1.0, 3.5)  # ℓ∞ 4 > 3.5: zeroed (000 App. F.3)
    assert action == "zeroed" and not any(a.any() for a in out)
    out, action = bound_update([np.array([np.nan, 1.0])], 1.0, 0.0)
    assert action == "zeroed" and not out[0].any()


def test_plausibility_refuses_without_naming_anyone():
    p = secure_sum_params(4, 1.0, 3)
    ok = [np.array([1.0, 1.0, 1.0])]  # norm √3 ≤ 4·1
    assert implausible(ok, {"kept": 4, "clipped": 0, "zeroed": 0}, 4, p) is None
    assert "ℓ2 norm" in implausible([np.full(3, 3.0)], {"kept": 4}, 4, p)
    assert "not finite" in implausible([np.array([np.inf, 0, 0])], {"kept": 4}, 4, p)
    assert "add up" in implausible(ok, {"kept": 3, "clipped": 0, "zeroed": 0}, 4, p)
    assert decode_counts(np.array([3.0, 1.0, 0.0]) * p.clipping_range + 1e-7, p) == {
        "kept": 3,
        "clipped": 1,
        "zeroed": 0,
    }


# -- the secure sum over the in-process grid -------------------------------------------------------
DIM = 2000


def _fixed_update(partition: int, identical: bool) -> list[np.ndarray]:
    rng = np.random.default_rng(0 if identical else partition)
    scale = 0.02 if identical or partition % 3 else 0.2  # every third needs clipping
    return [rng.normal(size=DIM).astype(np.float32) * scale, np.array([0.01], np.float32)]


def _train_fixed(identical: bool):
    def train(msg: Message, context: Context) -> Message:
        sent = msg.content["arrays"].to_numpy_ndarrays()
        update = _fixed_update(int(context.node_config["partition-id"]), identical)
        new = [s + u for s, u in zip(sent, update, strict=True)]
        return Message(RecordDict({"arrays": ArrayRecord(new)}), reply_to=msg)

    return train


class RecordingGrid(InProcessGrid):
    """Keeps every reply that reaches the server, by the stage it answers."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[str, Message]] = []

    def push_messages(self, messages):
        messages = list(messages)
        stages = {
            str(m.content.config_records[RECORD_KEY_CONFIGS][Key.STAGE])
            for m in messages
            if RECORD_KEY_CONFIGS in m.content.config_records
        }
        ids = super().push_messages(messages)
        self.seen += [(next(iter(stages), ""), r) for r in self._replies]
        return ids


def _messages(grid, clip=1.0):
    sent = [np.zeros(DIM, np.float32), np.zeros(1, np.float32)]
    config = ConfigRecord({"clip-norm": clip, "server-round": 1})
    return [
        Message(
            RecordDict({"arrays": ArrayRecord(sent), "config": config}),
            message_type=MessageType.TRAIN,
            dst_node_id=n,
        )
        for n in grid.get_node_ids()
    ]


def _plain_sum(nodes, identical, bound):
    total = [np.zeros(DIM), np.zeros(1)]
    for partition in range(nodes):
        out, _ = bound_update(_fixed_update(partition, identical), bound, 0.0)
        total = [t + o for t, o in zip(total, out, strict=True)]
    return total


@pytest.mark.parametrize("identical", [True, False])
def test_secure_sum_is_the_plain_sum_within_m_delta(identical):
    m = 10
    grid = RecordingGrid({"train": with_secure_aggregation(_train_fixed(identical))}, m)
    plan = SimpleNamespace(expected={n: f"user-{i}" for i, n in enumerate(grid.get_node_ids())})
    summed = secure_sum(
        grid, _messages(grid), plan, 1.0, [(DIM,), (1,)], {"zeroing-factor": 0.0}, 60, None
    )
    p = secure_sum_params(m, 1.0, DIM + 1)
    plain = _plain_sum(m, identical, p.client_bound(DIM + 1))
    for got, want in zip(summed.total, plain, strict=True):
        # m·Δ from the stochastic rounding, plus float32's rounding of the released sum
        assert np.max(np.abs(got - want)) <= m * p.step + 1e-7 * np.max(np.abs(want))
    assert summed.accepted == sorted(plan.expected.values()) and not summed.rejections
    expected_clipped = 0 if identical else len([i for i in range(m) if i % 3 == 0])
    assert summed.counts["clipped"] == expected_clipped
    assert summed.counts["kept"] == m - expected_clipped

    # What reached the server: public keys, encrypted shares, masked vectors, shares — never an
    # update, a metric of one client, or an array record with data.
    stages = {s for s, _ in grid.seen}
    assert stages == {Stage.SETUP, Stage.SHARE_KEYS, Stage.COLLECT_MASKED_VECTORS, Stage.UNMASK}
    t = p.quantization_range
    for stage, reply in grid.seen:
        content = reply.content
        assert not reply.has_error()
        assert all(len(r) == 0 for r in content.array_records.values())
        assert all(
            dict(r) == {"num_examples": 1} for r in content.metric_records.values()
        )  # the constant weight 1, nothing else
        others = {k: dict(r) for k, r in content.config_records.items() if k != RECORD_KEY_CONFIGS}
        assert others in ({}, {"fitres.metrics": {}, "fitres.status": {"code": 0, "message": ""}})
        if stage == Stage.COLLECT_MASKED_VECTORS:
            from flwr.common import bytes_to_ndarray

            vec = [bytes_to_ndarray(b) for b in content[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS]]
            # an unmasked quantized update lies in [0, T]; a masked one is uniform in [0, M)
            assert np.mean(vec[1] > t) > 0.8


def test_the_in_process_grid_keeps_one_context_per_node():
    def count(msg, context):
        seen = context.state.config_records.setdefault("seen", ConfigRecord({"n": 0}))
        seen["n"] = int(seen["n"]) + 1
        return Message(RecordDict({"n": ConfigRecord({"n": seen["n"]})}), reply_to=msg)

    grid = InProcessGrid({"train": count}, 3)
    for expected in (1, 2, 3):
        grid.push_messages(_messages(grid))
        assert [int(r.content["n"]["n"]) for r in grid.pull_messages([])] == [expected] * 3


def test_a_malformed_masked_vector_fails_the_round_naming_the_node():
    grid = InProcessGrid({"train": with_secure_aggregation(_train_fixed(False))}, 4)
    victim = grid.get_node_ids()[2]

    def tamper(replies):
        for r in replies:
            rec = r.content.config_records.get(RECORD_KEY_CONFIGS)
            if (
                rec is not None
                and Key.MASKED_PARAMETERS in rec
                and r.metadata.src_node_id == victim
            ):
                rec[Key.MASKED_PARAMETERS] = rec[Key.MASKED_PARAMETERS][:-1]
        return replies

    grid.tamper = tamper
    plan = SimpleNamespace(expected={n: f"u{i}" for i, n in enumerate(grid.get_node_ids())})
    with pytest.raises(SecureSumError, match=f"node {victim}") as err:
        secure_sum(grid, _messages(grid), plan, 1.0, [(DIM,), (1,)], {}, 60, None)
    assert err.value.redo  # nothing was unmasked


def test_a_failed_training_contributes_zeros_and_a_bad_ciphertext_fails_naming_the_node():
    fixed = _train_fixed(False)

    def crashing(msg, context):
        if int(context.node_config["partition-id"]) == 1:
            raise RuntimeError("out of memory")
        return fixed(msg, context)

    grid = InProcessGrid({"train": with_secure_aggregation(crashing)}, 4)
    plan = SimpleNamespace(expected={n: f"u{i}" for i, n in enumerate(grid.get_node_ids())})
    summed = secure_sum(grid, _messages(grid), plan, 1.0, [(DIM,), (1,)], {}, 60, None)
    assert summed.counts["zeroed"] == 1 and len(summed.accepted) == 4  # nobody is named

    grid = InProcessGrid({"train": with_secure_aggregation(fixed)}, 4)
    victim = grid.get_node_ids()[1]
    original = grid.push_messages

    def push(messages):  # flip a byte of every ciphertext forwarded to the victim
        messages = list(messages)
        for m in messages:
            rec = m.content.config_records.get(RECORD_KEY_CONFIGS)
            if rec is not None and Key.CIPHERTEXT_LIST in rec and m.metadata.dst_node_id == victim:
                rec[Key.CIPHERTEXT_LIST] = [
                    c[:-1] + bytes([c[-1] ^ 1]) for c in rec[Key.CIPHERTEXT_LIST]
                ]
        return original(messages)

    grid.push_messages = push
    with pytest.raises(SecureSumError, match=f"node {victim} failed") as err:
        secure_sum(grid, _messages(grid), plan, 1.0, [(DIM,), (1,)], {}, 60, None)
    assert err.value.redo


# -- whole runs ------------------------------------------------------------------------------------
def _cfg(tmp_path, name, **kw):
    return RunConfig(
        num_users=12,
        num_rounds=4,
        epochs=2,
        noise_multiplier=0.7,
        model_dim=6,
        identity="partition-id",
        state_dir=str(tmp_path / name),
        **kw,
    )


class DropGrid(InProcessGrid):
    """Drops the replies of the first ``drop`` nodes (by node id) asked at ``stage``, in the
    attempts (calls of that stage, counted over the run) listed."""

    def __init__(self, handlers, n, stage, drop, attempts):
        super().__init__(handlers, n)
        self.stage, self.drop, self.attempts, self.calls = stage, drop, set(attempts), 0

    def push_messages(self, messages):
        messages = list(messages)
        hit = any(  # read before delivery: Flower's mod pops the stage from the record
            RECORD_KEY_CONFIGS in m.content.config_records
            and m.content.config_records[RECORD_KEY_CONFIGS][Key.STAGE] == self.stage
            for m in messages
        )
        ids = super().push_messages(messages)
        if hit:
            self.calls += 1
            if self.calls in self.attempts:
                gone = sorted(int(m.metadata.dst_node_id) for m in messages)[: self.drop]
                self._replies = [r for r in self._replies if r.metadata.src_node_id not in gone]
        return ids


def _secure(train=numpy_train):
    return {"train": with_secure_aggregation(train)}


def test_secagg_run_has_the_plain_runs_epsilon_and_model(tmp_path):
    plain = run_server(
        InProcessGrid({"train": numpy_train}, 12), _cfg(tmp_path, "p"), noise_key=KEY, quiet=True
    )
    secure = run_server(
        InProcessGrid(_secure(), 12),
        _cfg(tmp_path, "s", secure_aggregation=True),
        noise_key=KEY,
        quiet=True,
    )
    rp, rs = plain.report(), secure.report()
    assert rs["realized"]["epsilon"] == rp["realized"]["epsilon"]
    assert rs["rounds_completed"] == 4 and rs["stopped_reason"] is None
    # same noise, same replies up to quantization: the released models agree closely
    for a, b in zip(plain.params, secure.params, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4)
    trust = rs["secure_aggregation"]
    assert trust["server_saw"].startswith("only masked vectors")
    assert "honest-but-curious" in trust["threat_model"]


def test_dropouts_above_the_threshold_release_the_round(tmp_path):
    grid = DropGrid(_secure(), 12, Stage.COLLECT_MASKED_VECTORS, drop=1, attempts={1})
    s = run_server(grid, _cfg(tmp_path, "d", secure_aggregation=True), noise_key=KEY, quiet=True)
    r = s.report()
    assert r["rounds_completed"] == 4
    first = s.metrics_history[0]
    assert first["accepted"] == 5 and first["rejected"] == 1
    assert any("dropped out of the secure sum" in x["reason"] for x in s.ledger.rejections)


def test_dropouts_below_the_threshold_redo_the_round_with_the_same_noise(tmp_path):
    clean = run_server(
        InProcessGrid(_secure(), 12),
        _cfg(tmp_path, "c", secure_aggregation=True),
        noise_key=KEY,
        quiet=True,
    )
    # attempt 1 of round 1 loses 3 of 6 in the collect stage (threshold 4 of 6): not unmasked
    grid = DropGrid(_secure(), 12, Stage.COLLECT_MASKED_VECTORS, drop=3, attempts={1})
    redone = run_server(
        grid, _cfg(tmp_path, "r", secure_aggregation=True), noise_key=KEY, quiet=True
    )
    assert grid.calls == 4 + 1  # one collect stage per round, and round 1's redo
    assert redone.report()["rounds_completed"] == 4
    assert redone.metrics_history[0]["accepted"] == 6
    for a, b in zip(clean.params, redone.params, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)  # the same noise: only quantization differs


def test_persistent_dropouts_stop_the_run_unreleased(tmp_path):
    attempts = set(range(1, MAX_ATTEMPTS + 1))
    grid = DropGrid(_secure(), 12, Stage.SHARE_KEYS, drop=3, attempts=attempts)
    cfg = _cfg(tmp_path, "x", secure_aggregation=True)
    s = run_server(grid, cfg, noise_key=KEY, quiet=True)
    report = json.loads((Path(cfg.state_dir) / "privacy_report.json").read_text())
    assert report["rounds_completed"] == 0
    assert "secure sum failed 3 times" in report["stopped_reason"]
    assert "nothing of that round was released" in report["stopped_reason"]
    assert (
        not (Path(cfg.state_dir) / JOURNAL).exists()
        or not (Path(cfg.state_dir) / JOURNAL).read_text().strip()
    )
    assert s.next_round == 0


@pytest.mark.parametrize(
    "kw, why",
    [
        ({"participation": "poisson"}, "cohort is no longer secret"),
        ({"participation": "cyclic-poisson", "min_sep": 2}, "cohort is no longer secret"),
        ({"non_private": True, "noise_multiplier": None}, "private run"),
        ({"num_users": 3}, "cohorts of at least 2 users"),  # rounds/epochs = 2: cohorts of 1
    ],
)
def test_refusals(kw, why):
    base = {"num_users": 20, "num_rounds": 4, "epochs": 2, "secure_aggregation": True, **kw}
    with pytest.raises(InvalidArgumentError, match=why):
        RunConfig(**base)


def test_cli_refuses_amplified_and_cross_silo_with_exit_2(tmp_path):
    cli = [
        sys.executable,
        "-m",
        "corrflow.server.cli",
        "simulate",
        "--secagg",
        "--backend",
        "inprocess",
    ]
    r = subprocess.run(
        [
            *cli,
            "--users",
            "20",
            "--rounds",
            "4",
            "--participation",
            "poisson",
            "--out",
            str(tmp_path / "a"),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "no longer secret" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "a").exists()
    r = subprocess.run(
        [*cli, "--users", "20", "--rounds", "4", "--epochs", "2", "--mode", "cross-silo"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "cross-device mode" in r.stderr or "--manifest" in r.stderr
    r = subprocess.run(
        [*cli[:3], "audit", "--secagg", "--users", "20", "--rounds", "4", "--epochs", "2"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert r.returncode == 2 and "no secure aggregation in an audit" in r.stderr


@pytest.mark.integration
def test_sigkill_mid_protocol_resumes_by_redoing_the_round(tmp_path):
    """A real server process is killed inside round 3's collect stage (after rounds 1–2 were
    released); the restarted server redoes round 3 and releases every round exactly once."""
    out = tmp_path / "k"
    env = {**os.environ, "KILL_ROUND_STAGE": "3"}
    helper = [sys.executable, str(HERE / "secagg_kill_run.py"), str(out)]
    first = subprocess.run(helper, env=env, capture_output=True, text=True, cwd=HERE)
    assert first.returncode == -signal.SIGKILL, first.stderr
    journal = [json.loads(x) for x in (out / JOURNAL).read_text().splitlines()]
    assert [e["round"] for e in journal] == [0, 1]
    second = subprocess.run(helper, capture_output=True, text=True, cwd=HERE)
    assert second.returncode == 0, second.stderr
    journal = [json.loads(x) for x in (out / JOURNAL).read_text().splitlines()]
    assert [e["round"] for e in journal] == [0, 1, 2, 3]
    report = json.loads((out / "privacy_report.json").read_text())
    assert report["rounds_completed"] == 4 and report["stopped_reason"] is None


def test_the_wrapper_keyword_runs_a_flower_app_with_secure_aggregation(tmp_path):
    """``DifferentialPrivacyCorrelatedNoise(FedAvg(), secure_aggregation=True)`` around a plain
    numpy app whose ClientApp has `secure_aggregation_mods`: the run completes and its report
    states the trust model; the inner strategy gets no per-client metrics."""
    from flwr.serverapp.strategy import FedAvg

    from corrflow import DifferentialPrivacyCorrelatedNoise
    from corrflow.clients.tasks import get_task

    task = get_task("numpy", 8)
    strategy = DifferentialPrivacyCorrelatedNoise(
        FedAvg(fraction_evaluate=0.0),
        clipping_norm=1.0,
        noise_multiplier=1.0,
        delta=1e-5,
        epochs=1,
        num_users=6,
        secure_aggregation=True,
        state_dir=str(tmp_path / "state"),
    )
    strategy.start(
        grid=InProcessGrid(_secure(task.handlers["train"]), 6),
        initial_arrays=ArrayRecord(task.initial_weights()),
        num_rounds=2,
        timeout=30,
    )
    report = strategy.privacy_report()
    assert report["rounds_completed"] == 2
    assert report["secure_aggregation"]["reconstruction_threshold"] == 2  # cohort 3: ⌈⅔·3⌉


@pytest.mark.integration
@pytest.mark.xdist_group("processes")
@pytest.mark.slow
def test_secagg_on_flowers_simulation_engine(tmp_path):
    """Flower's engine (Ray) keeps one Context per node across the stages' messages — the stock
    mod keeps its stage there; a lost Context fails the share-keys stage. About 3 minutes."""
    from corrflow.server.simulation import simulate

    cfg = RunConfig(
        num_users=6,
        num_rounds=2,
        epochs=1,
        model_dim=6,
        secure_aggregation=True,
        state_dir=str(tmp_path / "ray"),
    )
    report = simulate(cfg, backend="flower", quiet=True, verbose=False)
    assert report["rounds_completed"] == 2 and report["realized"]["rejections"] == 0
    assert "secure_aggregation" in report


@pytest.mark.integration
@pytest.mark.xdist_group("processes")
@pytest.mark.slow
def test_loopback_deployment_with_secure_aggregation(tmp_path):
    """deploy/loopback.sh --secagg --drills: TLS, SuperNode authentication, a killed ServerApp
    resumed — with SecAgg+ every round. About 3 minutes."""
    from test_deploy import _loopback

    work = tmp_path / "loopback"
    report = _loopback(work, "--rounds", "3", "--secagg", "--drills")
    assert report["rounds_completed"] == 3 and report["realized"]["rejections"] == 0
    assert report["secure_aggregation"]["server_saw"].startswith("only masked vectors")
    assert (work / "secagg.txt").read_text().startswith("secagg: the server saw only masked")
