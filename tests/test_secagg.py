"""Secure aggregation (SecAgg+, ``--secagg``): the quantization bounds, the client's bounded update
(also when the server's range exceeds c), the secure sum against the plain sum, what reaches the
server and what the report says it saw, malicious clients (garbage keys, ciphertexts and shares,
each blamed on its sender), dropouts and redos, refusals, federated evaluation refused, Flower's
classic example ported, a SIGKILL of the server mid-protocol and a plausibility stop that holds
across a rerun (real processes)."""

import base64
import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.client import NumPyClient
from flwr.common import parameters_to_ndarrays
from flwr.common.secure_aggregation.quantization import dequantize, quantize
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS,
    RECORD_KEY_STATE,
    Key,
    Stage,
)
from flwr.compat.common import recorddict_compat as compat
from lineage_support import KEY

from corrflow.clients.numpy_client import train as numpy_train
from corrflow.clients.secagg import clip_for_secure_aggregation, with_secure_aggregation
from corrflow.config import RunConfig
from corrflow.errors import InvalidArgumentError
from corrflow.protocol import PROBE_ACTION
from corrflow.run import open_run_directory
from corrflow.run.journal import JOURNAL
from corrflow.run.resume import SECURE_SUM_REFUSED, SERVER_RECEIVED
from corrflow.run.secure_sum import (
    MAX_ATTEMPTS,
    MODULUS,
    bound_update,
    decode_counts,
    implausible,
    secure_sum_params,
)
from corrflow.server.app import run_server
from corrflow.server.inprocess import InProcessGrid, enable_offline_messages
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


def _client_reply(update, clip, clipping_range, target_range):
    """corrflow's client mod on one update, with the protocol state a server that sent
    ``clipping_range`` and ``target_range`` leaves: the bounded update it packs."""
    state = ConfigRecord(
        {
            "sample_num": 4,
            "share_num": 4,
            "threshold": 3,
            "clipping_range": clipping_range,
            "target_range": target_range,
            "mod_range": MODULUS,
            "max_weight": 1.0,
        }
    )
    enable_offline_messages()
    context = Context(1, 1, {}, RecordDict({RECORD_KEY_STATE: state}), {})
    sent = [np.zeros_like(u) for u in update]
    content = {
        "arrays": ArrayRecord(sent),
        "config": ConfigRecord({"clip-norm": clip}),
        RECORD_KEY_CONFIGS: ConfigRecord({Key.STAGE: Stage.COLLECT_MASKED_VECTORS}),
    }
    msg = Message(RecordDict(content), dst_node_id=1, message_type=MessageType.TRAIN)

    def app(m, c):
        return Message(RecordDict({"arrays": ArrayRecord(list(update))}), reply_to=m)

    fitres = compat.recorddict_to_fitres(
        clip_for_secure_aggregation(msg, context, app).content, False
    )
    return parameters_to_ndarrays(fitres.parameters)[:-1]  # the action one-hot last


def test_the_client_bound_holds_when_the_servers_range_exceeds_c():
    """A server that sends a clipping range r = 10·c: the client clips to min(c, r) − Δ√d, so
    every stochastic rounding of its update (Flower's own quantization, 200 draws) has ℓ2 norm
    ≤ c; clipped to c itself (the old min(c, r − Δ√d)), almost every draw exceeds c."""
    c, r, t, d = 1.0, 10.0, 2000, 2500  # Δ = 0.01, Δ√d = 0.5
    step = 2 * r / t
    update = [np.random.default_rng(1).normal(size=d) * 5.0]  # ‖u‖ ≈ 250 > c
    bounded = _client_reply(update, c, r, t)
    norm = float(np.linalg.norm(bounded[0]))
    assert norm == pytest.approx(c - step * math.sqrt(d), rel=1e-5)  # min(c, r) − Δ√d = 0.5

    def quantized_norms(vec):  # Flower's client: quantize into [0, T], the server dequantizes
        return np.array(
            [
                np.linalg.norm(dequantize(quantize([vec.astype(np.float64)], r, t), r, t)[0])
                for _ in range(200)
            ]
        )

    assert quantized_norms(bounded[0]).max() <= c
    assert np.mean(quantized_norms(bounded[0] * (c / norm)) > c) > 0.9
    # r below c: the range binds, r − Δ′√d with Δ′ = 2r/T
    bounded = _client_reply(update, c, 0.5, t)
    assert float(np.linalg.norm(bounded[0])) == pytest.approx(0.5 - 1 / t * math.sqrt(d), rel=1e-5)


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
        # the constant weight 1, nothing else
        assert all(dict(r) == {"num_examples": 1} for r in content.metric_records.values())
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


def test_a_failed_training_contributes_zeros_without_naming_anyone():
    fixed = _train_fixed(False)

    def crashing(msg, context):
        if int(context.node_config["partition-id"]) == 1:
            raise RuntimeError("out of memory")
        return fixed(msg, context)

    grid = InProcessGrid({"train": with_secure_aggregation(crashing)}, 4)
    plan = SimpleNamespace(expected={n: f"u{i}" for i, n in enumerate(grid.get_node_ids())})
    summed = secure_sum(grid, _messages(grid), plan, 1.0, [(DIM,), (1,)], {}, 60, None)
    assert summed.counts["zeroed"] == 1 and len(summed.accepted) == 4  # nobody is named


# -- malicious clients: every fault fails the attempt, naming the sender -------------------------
def _reply_tamper(grid, sender, key, change):
    """Make ``sender``'s replies carrying protocol ``key`` pass through ``change(record)``."""

    def tamper(replies):
        for r in replies:
            rec = r.content.config_records.get(RECORD_KEY_CONFIGS)
            if rec is not None and key in rec and int(r.metadata.src_node_id) == sender:
                change(rec)
        return replies

    grid.tamper = tamper


def _attempt(grid):
    plan = SimpleNamespace(expected={n: f"u{i}" for i, n in enumerate(grid.get_node_ids())})
    with pytest.raises(SecureSumError) as err:
        secure_sum(grid, _messages(grid), plan, 1.0, [(DIM,), (1,)], {}, 60, None)
    assert err.value.redo  # nothing was unmasked: the attempt may be redone
    return err.value.reason


def _garbage_body(rec):  # the Shamir index kept, the share itself random
    rec[Key.SHARE_LIST] = [s[:4] + os.urandom(len(s) - 4) for s in rec[Key.SHARE_LIST]]


def _three_bytes(rec):
    rec[Key.SHARE_LIST] = [s[:3] for s in rec[Key.SHARE_LIST]]


def _garbage_index(rec):
    rec[Key.SHARE_LIST] = [os.urandom(len(s)) for s in rec[Key.SHARE_LIST]]


def _swapped_owners(rec):
    owners = list(rec[Key.NODE_ID_LIST])
    rec[Key.NODE_ID_LIST] = [owners[1], owners[0], *owners[2:]]


def _one_garbage_share(rec):  # one share of one owner, its last chunk flipped
    shares = list(rec[Key.SHARE_LIST])
    shares[2] = shares[2][:-1] + bytes([shares[2][-1] ^ 0x5A])
    rec[Key.SHARE_LIST] = shares


@pytest.mark.parametrize(
    "change, says",
    [
        (_garbage_body, "does not fit the others"),
        (_three_bytes, "of 3 bytes, not 52"),
        (_garbage_index, "Shamir index"),
        (_swapped_owners, "does not fit the others"),
        (_one_garbage_share, "does not fit the others"),
    ],
)
def test_a_malformed_share_fails_the_attempt_naming_its_sender(change, says):
    """Garbage Shamir shares, 3-byte shares, swapped owners: the attempt fails before any mask
    is removed, naming the node that sent them (6 members: threshold 4 of 6 shares, so a share
    that does not fit is found by decoding without it)."""
    grid = InProcessGrid({"train": with_secure_aggregation(_train_fixed(False))}, 6)
    bad = grid.get_node_ids()[3]
    _reply_tamper(grid, bad, Key.SHARE_LIST, change)
    reason = _attempt(grid)
    assert says in reason
    named = {int(n) for n in re.findall(r"node\(?s?\)? \[?(\d+)", reason.split(" sent ")[0])}
    assert named == {bad}, reason


def test_garbage_keys_and_ciphertexts_are_blamed_on_their_sender():
    """A garbage public key is refused at setup naming its sender; a ciphertext that does not
    authenticate is reported by every receiver, and the driver names its sender — never the
    honest receivers."""
    grid = InProcessGrid({"train": with_secure_aggregation(_train_fixed(False))}, 5)
    bad = grid.get_node_ids()[1]
    _reply_tamper(grid, bad, Key.PUBLIC_KEY_2, lambda r: r.__setitem__(Key.PUBLIC_KEY_2, b"xyz"))
    reason = _attempt(grid)
    assert reason == f"{Stage.SETUP}: node {bad} sent a public key that is not an EC public key"

    def forge(rec):  # valid Fernet form, wrong HMAC: only the receivers can tell
        raw = [bytearray(base64.urlsafe_b64decode(c)) for c in rec[Key.CIPHERTEXT_LIST]]
        for r in raw:
            r[40] ^= 1
        rec[Key.CIPHERTEXT_LIST] = [base64.urlsafe_b64encode(bytes(r)) for r in raw]

    grid = InProcessGrid({"train": with_secure_aggregation(_train_fixed(False))}, 5)
    bad = grid.get_node_ids()[1]
    others = sorted(set(grid.get_node_ids()) - {bad})
    _reply_tamper(grid, bad, Key.CIPHERTEXT_LIST, forge)
    reason = _attempt(grid)
    assert reason == (
        f"{Stage.COLLECT_MASKED_VECTORS}: share ciphertexts that did not authenticate or "
        f"decrypt: node {bad}'s (failed at node(s) {others})"
    )

    grid = InProcessGrid({"train": with_secure_aggregation(_train_fixed(False))}, 5)
    bad = grid.get_node_ids()[2]
    _reply_tamper(
        grid, bad, Key.CIPHERTEXT_LIST, lambda r: r.__setitem__(Key.CIPHERTEXT_LIST, [b"abc"] * 4)
    )
    assert _attempt(grid) == (
        f"{Stage.SHARE_KEYS}: node {bad} sent a share ciphertext that is not a Fernet token"
    )


def test_a_persistent_malicious_client_stops_the_run_naming_it(tmp_path):
    """Garbage shares at every attempt: three attempts, then the run stops on the record (the
    report names the sender), no exception, nothing released."""
    first = {}

    def tamper(replies):  # the lowest node of round 1's cohort sends garbage shares
        first.setdefault("node", min(int(r.metadata.src_node_id) for r in replies))
        for r in replies:
            rec = r.content.config_records.get(RECORD_KEY_CONFIGS)
            if Key.SHARE_LIST in rec and int(r.metadata.src_node_id) == first["node"]:
                _garbage_body(rec)
        return replies

    grid = InProcessGrid(_secure(), 12, tamper=tamper)
    cfg = _cfg(tmp_path, "m", secure_aggregation=True)
    s = run_server(grid, cfg, noise_key=KEY, quiet=True)
    report = json.loads((Path(cfg.state_dir) / "privacy_report.json").read_text())
    assert report["rounds_completed"] == 0 and s.next_round == 0
    reason = report["stopped_reason"]
    assert "the secure sum failed 3 times" in reason and f"node(s) [{first['node']}]" in reason
    assert not (Path(cfg.state_dir) / SECURE_SUM_REFUSED).exists()  # a plain rerun may redo it


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


class WireGrid(InProcessGrid):
    """Records every reply the server pulls, classified here independently of corrflow's record:
    (message type, what it carried)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.received: list[tuple[str, str]] = []

    def pull_messages(self, message_ids):
        replies = list(super().pull_messages(message_ids))
        for r in replies:
            kind = r.metadata.message_type.split(".")[0]
            if r.has_error():
                self.received.append((kind, "error replies"))
                continue
            rec = r.content.config_records.get(RECORD_KEY_CONFIGS, {})
            for key, name in [
                (Key.PUBLIC_KEY_1, "public keys"),
                (Key.CIPHERTEXT_LIST, "encrypted shares"),
                (Key.MASKED_PARAMETERS, "masked vectors"),
                (Key.SHARE_LIST, "secret shares"),
            ]:
                if key in rec:
                    self.received.append((kind, name))
            if kind == "query":
                self.received.append((kind, "identity replies"))
            if any(len(a) for a in r.content.array_records.values()):
                self.received.append((kind, "arrays in the clear"))
            for m in r.content.metric_records.values():
                if set(m) - {"num_examples"}:
                    self.received.append((kind, f"metrics in the clear ({', '.join(sorted(m))})"))
        return replies

    def counts(self) -> dict:
        out: dict = {}
        for kind, what in self.received:
            out.setdefault(kind, {}).setdefault(what, 0)
            out[kind][what] += 1
        return out


def test_the_report_says_what_crossed_the_wire(tmp_path):
    """The report's ``server_saw`` comes from the record of every reply the server received: an
    honest run's record (checked against the grid's own count of every reply it delivered) holds
    protocol messages and identity answers only; a client that sends its update and a metric in
    the clear is named in the statement, even though the driver refused its replies."""
    grid = WireGrid(_secure(), 12)
    cfg = _cfg(tmp_path, "w", secure_aggregation=True)
    run_server(grid, cfg, noise_key=KEY, quiet=True)
    section = json.loads((Path(cfg.state_dir) / "privacy_report.json").read_text())[
        "secure_aggregation"
    ]
    assert section["received"] == grid.counts()
    assert section["received"]["query"] == {"identity replies": 12}
    assert section["received"]["train"]["masked vectors"] == 4 * 6  # 4 rounds, cohorts of 6
    assert set(section["received"]["train"]) == {
        "public keys",
        "encrypted shares",
        "masked vectors",
        "secret shares",
    }
    assert section["server_saw"].startswith("only masked vectors")
    assert "never one user's update or per-user metric" in section["server_saw"]
    assert "(12 identity replies)" in section["server_saw"]

    secure = with_secure_aggregation(numpy_train)

    def leaky(msg, context):  # partition 0 ignores the protocol and answers in the clear
        if int(context.node_config["partition-id"]) != 0:
            return secure(msg, context)
        content = {"arrays": ArrayRecord([np.ones(3)]), "metrics": MetricRecord({"loss": 0.5})}
        return Message(RecordDict(content), reply_to=msg)

    grid = WireGrid({"train": leaky}, 12)
    cfg = _cfg(tmp_path, "leak", secure_aggregation=True)
    s = run_server(grid, cfg, noise_key=KEY, quiet=True)
    report = json.loads((Path(cfg.state_dir) / "privacy_report.json").read_text())
    assert report["secure_aggregation"]["received"] == grid.counts()
    leaked = grid.counts()["train"]["arrays in the clear"]
    assert leaked == MAX_ATTEMPTS and s.stopped_reason  # the round with partition 0 stops the run
    assert report["secure_aggregation"]["server_saw"].startswith(
        f"per-user data in the clear: train arrays in the clear ×{leaked}, "
        f"train metrics in the clear (loss) ×{leaked}; besides that, only masked vectors"
    )


def test_the_wrapper_refuses_federated_evaluation_under_secure_aggregation():
    from flwr.serverapp.strategy import FedAvg

    from corrflow import DifferentialPrivacyCorrelatedNoise

    with pytest.raises(InvalidArgumentError, match="fraction_evaluate") as err:
        DifferentialPrivacyCorrelatedNoise(FedAvg(), secure_aggregation=True, clipping_norm=1.0)
    assert "in the clear" in str(err.value) and "evaluate_fn" in str(err.value)
    DifferentialPrivacyCorrelatedNoise(FedAvg(), clipping_norm=1.0)  # without SecAgg: as before


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
    # what the server received covers both process starts: 12 identity answers each; rounds 1–2
    # and the killed round 3's setup and share-keys stages, then rounds 3–4 again (cohorts of 6)
    received = report["secure_aggregation"]["received"]
    assert received == json.loads((out / SERVER_RECEIVED).read_text())
    assert received["query"] == {"identity replies": 24}
    assert received["train"] == {
        "public keys": 30,
        "encrypted shares": 30,
        "masked vectors": 24,
        "secret shares": 24,
    }


def test_a_plausibility_stop_holds_across_reruns(tmp_path):
    """A real server process whose round-1 sum fails the plausibility check (one client adds two
    to the action counts inside its masked vector) stops with exit code 1; the plain rerun, the
    real CLI, refuses to sum that round again (exit 1, saying why and naming --fresh) and changes
    nothing; ``--fresh`` moves the stopped run aside with its refusal."""
    out = tmp_path / "p"
    helper = [sys.executable, str(HERE / "secagg_kill_run.py"), str(out)]
    first = subprocess.run(
        helper, env={**os.environ, "WRONG_COUNTS": "1"}, capture_output=True, text=True, cwd=HERE
    )
    assert first.returncode == 1, first.stderr
    report = (out / "privacy_report.json").read_text()
    stopped = json.loads(report)["stopped_reason"]
    assert "round 1 of 4: the secure sum refused after unmasking" in stopped
    assert "do not add up" in stopped
    assert json.loads((out / SECURE_SUM_REFUSED).read_text()) == {"round": 0, "reason": stopped}
    cli = [sys.executable, "-m", "corrflow.server.cli", "simulate", "--secagg", "--backend"]
    cli += ["inprocess", "--users", "12", "--rounds", "4", "--epochs", "2", "--out", str(out)]
    again = subprocess.run(cli, capture_output=True, text=True, cwd=tmp_path)
    assert again.returncode == 1 and "Traceback" not in again.stderr, again.stderr
    assert SECURE_SUM_REFUSED in again.stderr and "round 1 of 4" in again.stderr
    assert "second sum of the same cohort" in again.stderr and "--fresh" in again.stderr
    assert (out / "privacy_report.json").read_text() == report  # nothing summed or rewritten
    assert not (out / JOURNAL).exists() or not (out / JOURNAL).read_text().strip()
    assert open_run_directory(out, fresh=True).checkpoint is None  # --fresh: a new run may start
    assert not (out / SECURE_SUM_REFUSED).exists()
    assert [p.name for p in (out / "previous-runs").glob(f"*/{SECURE_SUM_REFUSED}")]


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


# -- Flower's classic apps: a copy of Flower's secure-aggregation example (examples/flower-secure-
# aggregation, client_app.py), its PyTorch task replaced by local synthetic linear regression
W_TRUE = np.linspace(-1.0, 1.0, 8)


def load_data(partition_id: int, num_partitions: int):
    rng = np.random.default_rng(100 + partition_id)
    x = rng.normal(size=(40, 8))
    y = x @ W_TRUE + 0.05 * rng.normal(size=40)
    return (x[:30], y[:30]), (x[30:], y[30:])


def mse(w, data):
    x, y = data
    return float(np.mean((x @ w - y) ** 2))


class FlowerClient(NumPyClient):
    def __init__(self, trainloader, valloader, local_epochs, learning_rate):
        self.trainloader, self.valloader = trainloader, valloader
        self.local_epochs, self.lr = local_epochs, learning_rate

    def fit(self, parameters, config):
        """Train the model with data of this client."""
        w = parameters[0].copy()
        x, y = self.trainloader
        for _ in range(self.local_epochs):
            w -= self.lr * 2 * x.T @ (x @ w - y) / len(y)
        return [w], len(y), {"train_loss": mse(w, self.trainloader)}

    def evaluate(self, parameters, config):
        """Evaluate the model on the data this client has."""
        loss = mse(parameters[0], self.valloader)
        return loss, len(self.valloader[1]), {"accuracy": -loss}


def client_fn(context: Context):
    """Construct a Client that will be run in a ClientApp."""
    partition_id = context.node_config["partition-id"]
    num_partitions = context.node_config["num-partitions"]
    trainloader, valloader = load_data(partition_id, num_partitions)
    return FlowerClient(trainloader, valloader, local_epochs=5, learning_rate=0.05).to_client()


def test_flowers_classic_secagg_example_runs_with_one_changed_line(tmp_path):
    """The example's ``ClientApp(client_fn=client_fn, mods=[secaggplus_mod])`` with corrflow's
    mods fails as Flower says; ``secure_client_fn_app(client_fn)`` (the one documented change)
    trains under corrflow's secure aggregation with the server-side evaluation the how-to's port
    uses (``FedAvg(fraction_evaluate=0.0)`` + ``evaluate_fn``); the server receives no metric."""
    from flwr.clientapp import ClientApp
    from flwr.serverapp.strategy import FedAvg

    from corrflow import (
        DifferentialPrivacyCorrelatedNoise,
        register_identity,
        secure_aggregation_mods,
        secure_client_fn_app,
    )

    with pytest.raises(ValueError, match="but not both"):
        register_identity(ClientApp(client_fn=client_fn, mods=secure_aggregation_mods()))

    app = secure_client_fn_app(client_fn)
    grid = WireGrid({"train": app, f"query.{PROBE_ACTION}": app}, 6, identity=False)
    held_out = load_data(99, 6)[1]

    def evaluate_fn(server_round, arrays):
        return MetricRecord({"loss": mse(arrays.to_numpy_ndarrays()[0], held_out)})

    strategy = DifferentialPrivacyCorrelatedNoise(
        FedAvg(fraction_evaluate=0.0),
        clipping_norm=1.0,
        noise_multiplier=0.3,
        delta=1e-5,
        epochs=2,
        num_users=6,
        identity="partition-id",
        secure_aggregation=True,
        state_dir=str(tmp_path / "state"),
    )
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord([np.zeros(8)]),
        num_rounds=4,
        timeout=30,
        evaluate_fn=evaluate_fn,
    )
    report = strategy.privacy_report()
    assert report["rounds_completed"] == 4 and report["stopped_reason"] is None
    losses = [result.evaluate_metrics_serverapp[t]["loss"] for t in range(5)]
    assert losses[-1] < 0.5 * losses[0]  # it learns: mse(0) = ‖w‖²-ish ≈ 3.4
    received = report["secure_aggregation"]["received"]
    assert received == grid.counts() and set(received) == {"query", "train"}
    assert report["secure_aggregation"]["server_saw"].startswith("only masked vectors")


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
