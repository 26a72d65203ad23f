import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from checkpoint_support import checkpoint, secret_file
from flwr.app import ArrayRecord, Error, Message, MetricRecord, RecordDict
from lineage_support import assert_fresh_after_restart, assert_same_releases
from strategy_support import HANDLERS, KEY, request_for
from strategy_support import small_config as _cfg

from corrflow.accounting import epsilon_of, realized_sensitivity, unamplified_event
from corrflow.config import RunConfig, from_run_config, unprefixed_keys
from corrflow.errors import InvalidArgumentError
from corrflow.factorization import Factorization
from corrflow.noise import CorrelatedNoise
from corrflow.noise.engine import SECRET_FILE
from corrflow.run.checkpoint import CHECKPOINT
from corrflow.run.reading import participation_users
from corrflow.server.app import run_server
from corrflow.server.inprocess import InProcessGrid


def _zero_train(msg, ctx):
    arrays = msg.content["arrays"].to_numpy_ndarrays()
    return Message(
        content=RecordDict(
            {
                "arrays": ArrayRecord([np.zeros_like(a) for a in arrays]),
                "metrics": MetricRecord({"num-examples": 1}),
            }
        ),
        reply_to=msg,
    )


def test_zero_updates_release_exactly_the_noise_stream(tmp_path):
    cfg = _cfg(
        tmp_path, momentum=0.9, cooldown_fraction=0.5, server_lr=0.5, clip_norm=0.3, replies="delta"
    )
    s = run_server(InProcessGrid({"train": _zero_train}, 12), cfg, noise_key=KEY, quiet=True)
    fac = Factorization.load(tmp_path / "factorization.npz")
    shapes = [(6,), (1,)]
    gen = CorrelatedNoise(fac, shapes, 1.0, key=KEY)
    eta = fac.workload.learning_rates(6)
    m = [np.zeros(s_, np.float32) for s_ in shapes]
    theta = [np.zeros(s_, np.float32) for s_ in shapes]
    for t in range(6):
        w = gen.next(t)
        # cohort 12/3 = 4
        upd = [(np.float32(0) + np.float32(0.7 * 0.3) * wi) / np.float32(4) for wi in w]
        m = [np.float32(0.9) * mi + ui for mi, ui in zip(m, upd, strict=True)]
        theta = [
            (th + np.float32(0.5 * eta[t]) * mi).astype(np.float32)
            for th, mi in zip(theta, m, strict=True)
        ]
    for got, want in zip(s.params, theta, strict=True):
        np.testing.assert_array_equal(got, want)
    assert np.abs(theta[0]).max() > 0


def _kill_run(out, **env_extra):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent.parent), **env_extra)
    script = str(Path(__file__).parent / "strategy_kill_run.py")
    return subprocess.run(
        [sys.executable, script, str(out)], env=env, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The uninterrupted 8-round run the kill tests compare against (read, never resumed)."""
    full = tmp_path_factory.mktemp("uninterrupted") / "full"
    r = _kill_run(full)
    assert r.returncode == 0, r.stderr[-2000:]
    return full


@pytest.mark.integration
def test_kill_and_restart_draws_fresh_noise_and_replays_exactly(tmp_path, uninterrupted):
    """SIGKILL after round 4's checkpoint, restart with a key from the OS (as a server does): rounds
    1–4 are released as by an uninterrupted run, rounds 5–8 with fresh noise (never a repeat of
    the uninterrupted run's); the checkpoint and the journal record the key segments, and
    injecting the recorded keys into a second interrupted run replays every round bit for bit."""
    full, crash, replay = uninterrupted, tmp_path / "crash", tmp_path / "replay"
    r = _kill_run(crash, KILL_AFTER="3")
    assert r.returncode == -9  # killed after round 3's checkpoint
    state = checkpoint(crash).public
    assert state["next_round"] == 4
    r = _kill_run(crash, NOISE_KEY="os")
    assert r.returncode == 0, r.stderr[-2000:]
    table = assert_fresh_after_restart(full, crash, 4)
    rep_full = json.loads((full / "privacy_report.json").read_text())
    rep_crash = json.loads((crash / "privacy_report.json").read_text())
    assert rep_crash["realized"]["epsilon"] == rep_full["realized"]["epsilon"]
    assert rep_crash["rounds_completed"] == 8
    assert rep_crash["lineage"]["key_segments"] == [0, 4]
    assert rep_full["lineage"]["key_segments"] == [0]
    assert _kill_run(replay, KILL_AFTER="3").returncode == -9
    r = _kill_run(replay, NOISE_KEY=table[1][1].hex())
    assert r.returncode == 0, r.stderr[-2000:]
    assert_same_releases(replay, crash)
    np.testing.assert_array_equal(np.load(replay / "final.npy"), np.load(crash / "final.npy"))


@pytest.mark.integration
def test_kill_mid_ring_row_resumes_with_fresh_noise(tmp_path, uninterrupted):
    """SIGKILL halfway through round 6's row of the noise ring: the published checkpoint (round 5)
    never needs the slot being written, so the restart resumes from it; rounds 1–5 as released by
    an uninterrupted run, rounds 6–8 fresh."""
    full, crash = uninterrupted, tmp_path / "crash"
    r = _kill_run(crash, KILL_IN_RING="5")
    assert r.returncode == -9
    state = checkpoint(crash).public
    assert state["next_round"] == 5  # round 5 (0-based) was not checkpointed
    r = _kill_run(crash, NOISE_KEY="os")
    assert r.returncode == 0, r.stderr[-2000:]
    assert_fresh_after_restart(full, crash, 5)


def _tamper(kind):
    def tamper(replies):
        out = []
        for i, msg in enumerate(replies):
            if i != 0:
                out.append(msg)
                continue
            arrays = msg.content["arrays"].to_numpy_ndarrays()
            if kind == "nan":
                arrays[0][0] = np.nan
                out.append(
                    Message(
                        content=RecordDict(
                            {"arrays": ArrayRecord(arrays), "metrics": msg.content["metrics"]}
                        ),
                        reply_to=request_for(msg),
                    )
                )
            elif kind == "shape":
                out.append(
                    Message(
                        content=RecordDict(
                            {
                                "arrays": ArrayRecord([arrays[0][:-1], arrays[1]]),
                                "metrics": msg.content["metrics"],
                            }
                        ),
                        reply_to=request_for(msg),
                    )
                )
            elif kind == "dtype":
                out.append(
                    Message(
                        content=RecordDict(
                            {
                                "arrays": ArrayRecord([a.astype(np.int32) for a in arrays]),
                                "metrics": msg.content["metrics"],
                            }
                        ),
                        reply_to=request_for(msg),
                    )
                )
            elif kind == "keys":
                out.append(
                    Message(
                        content=RecordDict(
                            {"weights": ArrayRecord(arrays), "metrics": msg.content["metrics"]}
                        ),
                        reply_to=request_for(msg),
                    )
                )
            elif kind == "error":
                out.append(
                    Message(Error(code=2, reason="device out of memory"), reply_to=request_for(msg))
                )
            elif kind == "duplicate":
                out.extend([msg, msg])
            elif kind == "sender":
                foreign = Message(content=RecordDict({}), message_type="train", dst_node_id=999)
                out.append(Message(content=msg.content, reply_to=foreign))
        return out

    return tamper


@pytest.mark.parametrize(
    "kind, reason",
    [
        ("nan", "NaN"),
        ("shape", "shape"),
        ("dtype", "dtype"),
        ("keys", "records"),
        ("error", "client error"),
        ("duplicate", "duplicate"),
        ("sender", "unexpected sender"),
    ],
)
def test_malformed_replies_rejected_round_goes_on(tmp_path, caplog, kind, reason):
    cfg = _cfg(tmp_path, num_rounds=2, epochs=1, num_users=4)
    with caplog.at_level(logging.WARNING, logger="corrflow"):
        s = run_server(
            InProcessGrid(HANDLERS, 4, tamper=_tamper(kind)), cfg, noise_key=KEY, quiet=True
        )
    assert s.next_round == 2
    assert any(reason in r["reason"] for r in s.ledger.rejections), s.ledger.rejections
    assert any(reason in rec.getMessage() for rec in caplog.records)
    # Rejected or not, every selected user counts as participating.
    assert all(len(v) == 1 for v in s.ledger.selected.values()) and len(s.ledger.selected) == 4


def test_workload_mismatch_and_unknown_config(tmp_path):
    with pytest.raises(InvalidArgumentError, match="nonsense"):
        from_run_config({"corrflow.num-users": 10, "corrflow.nonsense": 1})
    with pytest.raises(InvalidArgumentError, match="epochs"):
        RunConfig(num_rounds=5, epochs=2, noise_multiplier=1.0)
    cfg = _cfg(tmp_path)
    run_server(InProcessGrid(HANDLERS, 12), cfg, noise_key=KEY, quiet=True)
    from corrflow.run.optimizer import check_workload_matches

    fac = Factorization.load(tmp_path / "factorization.npz")
    with pytest.raises(InvalidArgumentError, match="factorization"):
        check_workload_matches(fac.workload, 0.3, 0.25)  # the config default is β = 0.5


def test_budget_guard_stops_before_exceeding_target(tmp_path):
    cfg = _cfg(tmp_path, noise_multiplier=None, target_epsilon=5.0)
    s = run_server(InProcessGrid(HANDLERS, 12), cfg, noise_key=KEY, quiet=True)
    rep = json.loads((tmp_path / "privacy_report.json").read_text())
    # calibrated σ: the plan fits exactly
    assert rep["realized"]["epsilon"] <= 5.0 + 1e-9 and s.next_round == 6
    # The same σ with a target that one round already exceeds: round 1 is refused before anything is
    # sent.
    tight = _cfg(tmp_path / "tight", noise_multiplier=s.sigma, target_epsilon=1.0)
    t = run_server(InProcessGrid(HANDLERS, 12), tight, noise_key=KEY, quiet=True)
    assert (
        t.next_round == 0
        and "would spend" in t.stopped_reason
        and "round 1 of 6" in t.stopped_reason
    )
    assert (
        json.loads((tmp_path / "tight" / "privacy_report.json").read_text())["stopped_reason"]
        == t.stopped_reason
    )


@pytest.mark.integration
@pytest.mark.xdist_group("processes")
def test_end_to_end_flower_simulation(tmp_path):
    """`corrflow simulate` on Flower's engine (Ray): 12 users, 20 rounds, numpy client — at most 40
    lines of output without --verbose (Flower's, Ray's and TensorFlow's own output goes to
    engine.log), exit 0.

    σ = 0.3 because the run must learn for exit 0: at σ = 0.7 (ρ 0.37, a cohort of 1–2) 3 of 5 noise
    draws ended above the initial loss (exit 3); at 0.3 seventeen in-process draws ended 74–96%
    below it."""
    out = tmp_path / "run"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "corrflow.server.cli",
            "simulate",
            "--users",
            "12",
            "--rounds",
            "20",
            "--epochs",
            "2",
            "--noise-multiplier",
            "0.3",
            "--out",
            str(out),
        ],
        env=dict(os.environ, PYTHONPATH=str(Path(__file__).parent.parent)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = (r.stdout + r.stderr).splitlines()
    assert len(lines) <= 40, "\n".join(lines)
    assert sum(line.startswith("round ") for line in lines) == 20 and (out / "engine.log").exists()
    report = json.loads((out / "privacy_report.json").read_text())
    users = participation_users(report, out)
    assert report["rounds_completed"] == 20 and len(users) == 12
    assert all(
        len(u["rounds"]) == 2 and u["rounds"][1] - u["rounds"][0] == 10 for u in users.values()
    )
    fac = Factorization.load(out / "factorization.npz")
    sens, _ = realized_sensitivity(fac.encoder, {k: v["rounds"] for k, v in users.items()})
    assert report["realized"]["epsilon"] == pytest.approx(
        epsilon_of(unamplified_event(0.3, sens.value), 1e-5), rel=1e-12
    )


def test_end_to_end_inprocess(tmp_path):
    cfg = _cfg(tmp_path)
    report = json.loads(
        json.dumps(run_server(InProcessGrid(HANDLERS, 12), cfg, quiet=True).report())
    )
    _check_run(tmp_path, cfg, report)


def _check_run(tmp_path, cfg, report):
    on_disk = json.loads((tmp_path / "privacy_report.json").read_text())
    assert on_disk["rounds_completed"] == 6 and report["rounds_completed"] == 6
    users = participation_users(on_disk, tmp_path)
    assert len(users) == 12
    rounds = sorted(tuple(u["rounds"]) for u in users.values())
    # fixed-epoch: b = 3, same slot every epoch
    assert all(len(r) == 2 and r[1] - r[0] == 3 for r in rounds)
    assert sorted({r[0] for r in rounds}) == [0, 1, 2]
    fac = Factorization.load(tmp_path / "factorization.npz")
    sens, _ = realized_sensitivity(fac.encoder, {str(i): list(r) for i, r in enumerate(rounds)})
    independent = epsilon_of(unamplified_event(cfg.noise_multiplier, sens.value), cfg.delta)
    assert on_disk["realized"]["epsilon"] == pytest.approx(independent, rel=1e-12)
    assert on_disk["planned"]["epsilon"] == pytest.approx(independent, rel=1e-9)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert (
        len(metrics) == 7
        and metrics[0]["round"] == -1
        and all(m["replies"] == 4 for m in metrics[1:])
    )
    model = checkpoint(tmp_path).arrays("model")[0]
    assert np.abs(model).max() > 0  # the global model moved


def test_checkpoint_is_private(tmp_path):
    import stat

    cfg = _cfg(tmp_path, num_rounds=2, epochs=1, num_users=4)
    run_server(InProcessGrid(HANDLERS, 4), cfg, noise_key=KEY, quiet=True)
    state = tmp_path / "state"
    assert stat.S_IMODE(os.stat(state).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(state / "secrets").st_mode) == 0o700
    secrets = [secret_file(tmp_path, n) for n in ("report_salt", "server_secret", SECRET_FILE)]
    # the checkpoint, the secrets, the ring (the banded buffer's rows)
    for path in (state / CHECKPOINT, *secrets, state / "noise_ring.bin"):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    report = (tmp_path / "privacy_report.json").read_text()
    # no raw user id, no key
    assert not re.search(r"partition-\d", report) and KEY.hex() not in report


def test_non_private_baseline_adds_no_noise(tmp_path):
    cfg = _cfg(tmp_path, noise_multiplier=None, non_private=True, replies="delta")
    s = run_server(InProcessGrid({"train": _zero_train}, 12), cfg, quiet=True)
    assert all(np.all(p == 0) for p in s.params)  # zero updates, no noise → the model stays at zero
    rep = json.loads((tmp_path / "privacy_report.json").read_text())
    assert rep["realized"]["epsilon"] is None and rep["planned"]["epsilon"] is None
    with pytest.raises(InvalidArgumentError, match="non-private"):
        RunConfig(non_private=True, noise_multiplier=1.0)


def test_run_config_parsing():
    cfg = from_run_config(
        {
            "corrflow.num-users": 20,
            "corrflow.num-rounds": 10,
            "corrflow.epochs": 2,
            "corrflow.target-epsilon": 4,
            "corrflow.kind": "bisr",
            "corrflow.non-private": False,
            "local-epochs": 3,
            "num-users": 99,
        }
    )
    # the user's keys are theirs
    assert cfg.num_users == 20 and cfg.target_epsilon == 4.0 and cfg.kind == "bisr"
    assert unprefixed_keys({"num-users": 99, "local-epochs": 3}) == ["num-users"]
    for bad in (
        {"non-private": "false"},
        {"num-users": 2.5},
        {"delta": "small"},
        {"clip-norm": True},
    ):
        with pytest.raises(InvalidArgumentError, match="corrflow." + next(iter(bad))):
            from_run_config(
                {"corrflow.target-epsilon": 4, **{"corrflow." + k: v for k, v in bad.items()}}
            )


def test_missing_replies_are_named_offline_timed_out_or_crashed(tmp_path, caplog):
    """A node the SuperLink cannot reach (the error comes from the SuperLink, node 1, answering the
    message sent to the node), a reply that never arrives, and a ClientApp that raises with a
    multi-line traceback: one line each, and the traceback only in the log."""

    def train(msg, ctx):
        if ctx.node_config["partition-id"] == 1:
            raise RuntimeError("CUDA out of memory\nTraceback (most recent call last):\n  File ...")
        return HANDLERS["train"](msg, ctx)

    def superlink_error(reply):
        request = Message(content=RecordDict({}), message_type="train", dst_node_id=1)
        request.metadata.__dict__["_message_id"] = reply.metadata.reply_to_message_id
        return Message(
            Error(code=5, reason="Error: Node Unavailable — no heartbeat"), reply_to=request
        )

    def tamper(replies):
        part = {r: grid.nodes[int(r.metadata.src_node_id)] for r in replies}
        return [superlink_error(r) if part[r] == 3 else r for r in replies if part[r] != 2]

    grid = InProcessGrid({"train": train}, 4, tamper=tamper)
    cfg = _cfg(tmp_path, num_rounds=1, epochs=1, num_users=4)
    with caplog.at_level(logging.WARNING, logger="corrflow"):
        s = run_server(grid, cfg, noise_key=KEY, quiet=True)
    reasons = {r["user"]: r["reason"] for r in s.ledger.rejections}
    assert (
        reasons["partition-1"]
        == "client error: ClientApp exception: RuntimeError: CUDA out of memory"
    )
    assert reasons["partition-2"].startswith("timed out: no reply within node-timeout")
    assert reasons["partition-3"] == "offline: the SuperLink had no heartbeat from the node"
    assert set(reasons) == {"partition-1", "partition-2", "partition-3"} and s.ledger.replied == {
        "partition-0": [0]
    }
    assert "Traceback" in caplog.text and "round 1: rejected reply from node" in caplog.text


def test_clipped_sum_matches_a_float64_reference_and_rejects_before_adding():
    """The fused in-place sum: u = reply − sent (float64 reply: the exact difference rounded once),
    ℓ2 ≤ bound, zeroing on ℓ∞, NaN/Inf rejected without touching the sum; blocks of 2¹⁶ floats are
    crossed (d = 150 001)."""
    from corrflow.run.clipping import ClippedSum, RejectedReplyError

    rng = np.random.default_rng(5)
    shapes = [(150_001,), (3, 4)]
    sent = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    replies = [
        [(p + rng.standard_normal(p.shape) * scale).astype(dt) for p in sent]
        for scale, dt in ((0.001, np.float32), (1.0, np.float64), (0.0001, np.float16))
    ]
    acc = ClippedSum(shapes)
    actions = [acc.add(r, sent, bound=2.0, zeroing=0.0) for r in replies]
    assert actions[:2] == ["kept", "clipped"]
    expected = [np.zeros(s) for s in shapes]
    for r in replies:
        u = [
            np.subtract(a, s, dtype=np.result_type(a.dtype, np.float32))
            .astype(np.float32)
            .astype(np.float64)
            for a, s in zip(r, sent, strict=True)
        ]
        norm = np.sqrt(sum((x**2).sum() for x in u))
        for e, x in zip(expected, u, strict=True):
            e += x * min(1.0, 2.0 / norm)
    for got, want in zip(acc.total, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    before = [g.copy() for g in acc.total]
    bad = [r.copy() for r in replies[0]]
    bad[1][2, 3] = np.nan
    with pytest.raises(RejectedReplyError, match=r"array 1 \(1\): NaN or Inf"):
        acc.add(bad, sent, bound=2.0, zeroing=0.0)
    with pytest.raises(RejectedReplyError, match="needs clipping"):
        acc.add(replies[1], sent, bound=2.0, zeroing=0.0, allow_clip=False)
    assert (
        acc.add([np.full(s, 50.0, np.float32) for s in shapes], None, bound=2.0, zeroing=10.0)
        == "zeroed"
    )
    for g, b in zip(acc.total, before, strict=True):
        np.testing.assert_array_equal(g, b)  # rejected and zeroed replies add nothing
    clipped = ClippedSum(shapes)
    clipped.add(replies[1], sent, bound=2.0, zeroing=0.0)
    assert np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in clipped.total)) <= 2.0


def test_array_view_reads_replies_without_copying_and_as_flower_does():
    from flwr.app import Array

    from corrflow.strategies.messaging import array_view

    rng = np.random.default_rng(1)
    for a in (
        rng.standard_normal((3, 5)).astype(np.float32),
        np.asfortranarray(rng.standard_normal((4, 6))),
        rng.standard_normal(7).astype(">f4"),
        np.array(2.5, np.float32),
        np.zeros((0, 3), np.float16),
    ):
        payload = Array(a)
        view = array_view(payload)
        np.testing.assert_array_equal(view, payload.numpy())
        assert (
            view.dtype == payload.numpy().dtype
            and view.shape == a.shape
            and not view.flags.writeable
        )
    data = Array(np.ones(10, np.float32)).data[:-4]
    truncated = Array(dtype="float32", shape=(10,), stype="numpy.ndarray", data=data)
    with pytest.raises(ValueError, match="bytes of data"):
        array_view(truncated)
