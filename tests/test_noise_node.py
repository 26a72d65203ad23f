"""The noise node: a separate party holding the noise key joins the secure sum, so the server
unmasks only noised sums (corrflow.noisenode, corrflow.run.noise_node_link, the driver's noise
node path, the clients' guard mod)."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage

from corrflow.clients.noise_guard import NoiseNodeGuardError, guard_noise_node
from corrflow.clients.secagg import with_noise_node_guard, with_secure_aggregation
from corrflow.factorization.build import factorize, participation_for
from corrflow.noise import CorrelatedNoise
from corrflow.noisenode.node import NoiseNode, RecipeRefusedError
from corrflow.noisenode.protocol import PIN_SIGNATURE
from corrflow.noisenode.store import NoiseNodeStore
from corrflow.run.noise_node_link import NoiseNodeLink, NoiseNodeStream
from corrflow.run.secure_sum import (
    MODULUS,
    NOISE_HEADROOM_K,
    bound_update,
    centre,
    grid_noise,
    noise_headroom_range,
    secure_sum_params,
)
from corrflow.server.inprocess import InProcessGrid, enable_offline_messages
from corrflow.server.noise_node_sim import pin
from corrflow.strategies import secagg as driver

DIM, M_CLIENTS, SIGMA = 300, 6, 0.7


# -- the grid identity and the headroom (pure) --------------------------------------------------
def test_rounding_half_up_keeps_the_grid_identity_where_half_to_even_breaks_it():
    """S + round(y) = round(S + y) for integer S needs one tie rule everywhere: ⌊y + ½⌋ keeps it
    at ties, numpy's half-to-even does not (2 + rint(0.5) = 2, rint(2.5) = 2, but 3 + rint(0.5)
    = 3 ≠ rint(3.5) = 4)."""
    rng = np.random.default_rng(1)
    s = rng.integers(-(10**6), 10**6, size=4000)
    y = np.concatenate([rng.integers(-50, 50, 2000) + 0.5, rng.normal(0, 30, 2000)])
    step = 0.25  # y·Δ is exact in float64: n/Δ recovers y bit for bit
    ours = grid_noise(y * step, step).astype(np.int64)
    ours = np.where(ours >= MODULUS // 2, ours - MODULUS, ours)
    assert np.array_equal(s + ours, np.floor(s + y + 0.5).astype(np.int64))
    assert not np.array_equal(s + np.rint(y), np.rint(s + y))


@pytest.mark.parametrize("cohort", [2, 10, 1000])
@pytest.mark.parametrize("sigma", [0.3, 4.0])
def test_headroom_is_the_largest_range_that_leaves_k_sigma_each_side(cohort, sigma):
    t = noise_headroom_range(cohort, sigma)
    room = 2 * NOISE_HEADROOM_K * sigma
    assert cohort * t + room * t < MODULUS <= cohort * (t + 1) + room * (t + 1)
    p = secure_sum_params(cohort, 1.0, DIM, sigma)
    assert p.quantization_range in (t, t - 1) and p.quantization_range % 2 == 0
    assert p.participants == cohort + 1


def test_centre_reads_negative_noise_back():
    p = secure_sum_params(M_CLIENTS, 1.0, DIM, SIGMA)
    rng = np.random.default_rng(2)
    s = rng.integers(0, M_CLIENTS * p.quantization_range + 1, 1000)
    n = rng.integers(-int(0.9 * NOISE_HEADROOM_K * SIGMA * p.quantization_range), 10**6, 1000)
    assert np.array_equal(centre(np.mod(s + n, MODULUS), p), s + n)


# -- a noise node in process, over the in-process grid --------------------------------------------
@pytest.fixture
def node(tmp_path):
    fac = factorize("toeplitz", participation_for(4, 2, 2, kind="min-sep"), bands=2)
    path = fac.save(tmp_path / "fac.npz")
    recipe = {
        "factorization_sha256": fac.sha256(),
        "noise_multiplier": SIGMA,
        "clip_norm": 1.0,
        "delta": 1e-5,
        "rounds": 4,
        "shapes": [[DIM]],
    }
    n = NoiseNode(NoiseNodeStore(tmp_path / "node"))
    n.pin(recipe, Path(path).read_bytes())
    stream = NoiseNodeStream(NoiseNodeLink(**_identity(n)))
    stream.recipe, stream.sigma_max = recipe, n.sigma_max()
    return SimpleNamespace(node=n, stream=stream, fac=fac, recipe=recipe, dir=tmp_path / "node")


def _identity(n: NoiseNode) -> dict:
    i = n.identity()
    return {"node_id": i["node_id"], "public_key": i["public_key"], "signature": i["signature"]}


def _direct(n: NoiseNode):
    def handle(msg: Message, ctxt) -> Message:
        config = dict(msg.content.config_records[RECORD_KEY_CONFIGS])
        out = n.handle(config.pop(Key.STAGE), config)
        return Message(RecordDict({RECORD_KEY_CONFIGS: ConfigRecord(out)}), reply_to=msg)

    return handle


def _update(partition: int) -> np.ndarray:
    scale = 0.05 if partition % 3 else 0.5  # every third is clipped
    return np.random.default_rng(partition).normal(size=DIM).astype(np.float32) * scale


def _train(msg: Message, context: Context) -> Message:
    partition = int(context.node_config["partition-id"])
    # Flower's stochastic rounding draws from numpy's global RNG next: one seed per client
    np.random.seed(partition)  # noqa: NPY002
    sent = msg.content["arrays"].to_numpy_ndarrays()
    new = [sent[0] + _update(partition)]
    return Message(RecordDict({"arrays": ArrayRecord(new)}), reply_to=msg)


def _grid(node_handler=None, pins=None, m=M_CLIENTS):
    enable_offline_messages()
    handler = with_secure_aggregation(_train)
    if node_handler is not None:
        handler = with_noise_node_guard(handler)
    return InProcessGrid(
        {"train": handler},
        m,
        node_config=lambda p: pins or {},
        extra_nodes={} if node_handler is None else node_handler,
    )


def _messages(grid):
    config = ConfigRecord({"clip-norm": 1.0, "server-round": 1})
    return [
        Message(
            RecordDict({"arrays": ArrayRecord([np.zeros(DIM, np.float32)]), "config": config}),
            message_type=MessageType.TRAIN,
            dst_node_id=n,
        )
        for n in grid.get_node_ids()
    ]


def _decode(grid, params, noise=None, t=0) -> tuple[np.ndarray, driver._Attempt]:
    """One attempt through the driver's stages, the decoded sum in float64 (before the float32
    it is released in)."""
    train = {int(m.metadata.dst_node_id): m.content for m in _messages(grid)}
    members = sorted(train) + ([noise.node_id] if noise is not None else [])
    noise_id = None if noise is None else noise.node_id
    # without the noise node (the comparison), the clients' ring alone: one fewer per neighbourhood
    shares = params.num_shares - (noise is None and params.noise_sigma is not None)
    graph = driver.round_graph(sorted(train), shares, noise_id, random.Random(0))
    a = driver._Attempt(params, [(DIM,)], graph, noise=noise, round=t)
    driver._setup(a, grid, members, 60, None)
    driver._share_keys(a, grid, 60, None)
    driver._collect(a, grid, train, {"zeroing-factor": 0.0}, 60, None)
    total, counts = driver._unmask(a, grid, 60, None)
    assert sum(counts.values()) == params.cohort
    return total[0], a


# 34 clients: SecAgg+'s sparse graph (above 32), ~15 CPU-s of key agreement and Shamir shares
@pytest.mark.parametrize("m", [M_CLIENTS, pytest.param(34, marks=pytest.mark.slow)])
def test_the_noised_sum_is_the_server_noised_sum_within_half_a_step(node, m):
    """With the same client rounding, the sum decoded with the noise node inside differs from
    the sum decoded without it plus the same noise row by at most Δ/2 per coordinate (the grid
    rounding of the noise), and from the central sum of the clipped updates plus that noise by at
    most (m + 1)·Δ. At 34 clients the graph is SecAgg+'s sparse one; the noise node is still
    every client's neighbour."""
    p = secure_sum_params(m, 1.0, DIM, node.stream.sigma_max)
    pins = pin(node.node.identity())
    grid = _grid({node.stream.node_id: _direct(node.node)}, pins, m)
    noised, a = _decode(grid, p, node.stream)
    assert all(node.stream.node_id in ring for ring in a.neighbours.values())
    assert m < 32 or p.num_shares < m  # sparse at 34
    plain, _ = _decode(_grid(m=m), p)  # the same T, no noise node: --secagg's sum
    table, _ = NoiseNodeStore(node.dir).segments()
    scale = SIGMA * 1.0
    seg = table.segments[0]
    assert seg.version == 2  # a new noise node's key: the current derivation
    n = CorrelatedNoise(node.fac, [(DIM,)], scale, key=seg.key, key_version=seg.version).next(0)[0]
    n = n.astype(np.float64)
    assert np.max(np.abs(noised - (plain + n))) <= p.step / 2 * (1 + 1e-6)
    assert np.max(np.abs(noised - (plain + n))) > 0  # the noise is on the grid, not exact
    bound = p.client_bound(DIM)
    central = sum(bound_update([_update(i)], bound, 0.0)[0][0].astype(np.float64) for i in range(m))
    assert np.max(np.abs(noised - (central + n))) <= (m + 1) * p.step
    assert np.std(n) > 0.3  # a real noise row: σ·c·‖row 0 of C⁻¹‖ ≈ 0.7
    segment, head = a.receipt
    assert head == NoiseNodeStore(node.dir).head and segment["first_round"] == 0


def test_a_row_is_never_sent_twice(node):
    """A redo of round 1 draws its row afresh under a new key segment; a restarted noise node
    opens a new segment at the round it is asked for next; the journal names each send."""
    p = secure_sum_params(M_CLIENTS, 1.0, DIM, node.stream.sigma_max)
    pins = pin(node.node.identity())
    first, _ = _decode(_grid({node.stream.node_id: _direct(node.node)}, pins), p, node.stream)
    again, _ = _decode(_grid({node.stream.node_id: _direct(node.node)}, pins), p, node.stream)
    restarted = NoiseNode(NoiseNodeStore(node.dir))  # a new process over the same directory
    grid = _grid({node.stream.node_id: _direct(restarted)}, pins)
    _decode(grid, p, node.stream, t=1)
    journal = NoiseNodeStore(node.dir).entries
    assert [(e["round"], e["send"]) for e in journal] == [(0, 1), (0, 2), (1, 1)]
    firsts = [e["segment"]["first_round"] for e in journal]
    prints = [e["segment"]["key_fingerprint"] for e in journal]
    assert firsts == [0, 0, 1] and len(set(prints)) == 3
    assert len({e["input_sha256"] for e in journal}) == 3
    assert np.max(np.abs(first - again)) > 10 * p.step  # another row, not the same one
    report = json.loads((node.dir / "noise_node_report.json").read_text())
    assert report["rounds_contributed"] == 2 and report["sends"] == 3
    assert report["rounds_sent_more_than_once"] == [0]
    assert report["journal_head"] == journal[-1]["hash"]
    # the restarted node's tallies (kept with its journal) cover the sends before its start too
    assert sorted(s["key_fingerprint"] for s in report["key_segments"]) == sorted(prints)


def test_the_noise_node_refuses_other_parameters_and_lone_cohorts(node):
    p = secure_sum_params(M_CLIENTS, 1.0, DIM, node.stream.sigma_max)
    setup = {
        Key.SAMPLE_NUMBER: p.participants,
        Key.SHARE_NUMBER: p.num_shares,
        Key.THRESHOLD: p.threshold,
        Key.CLIPPING_RANGE: p.clipping_range,
        Key.TARGET_RANGE: p.quantization_range,
        Key.MOD_RANGE: p.modulus,
        Key.MAX_WEIGHT: 1.0,
    }
    ok = {**setup, "corrflow-recipe": json.dumps(node.recipe)}
    assert set(node.node.handle(Stage.SETUP, ok)) >= {Key.PUBLIC_KEY_1, Key.PUBLIC_KEY_2}
    for field, value in [("noise_multiplier", 0.0), ("factorization_sha256", "0" * 64)]:
        asked = {**setup, "corrflow-recipe": json.dumps({**node.recipe, field: value})}
        with pytest.raises(RecipeRefusedError, match=field):
            node.node.handle(Stage.SETUP, asked)
    with pytest.raises(RecipeRefusedError, match="T, M"):  # a range without the noise's room
        node.node.handle(Stage.SETUP, {**ok, Key.TARGET_RANGE: p.quantization_range * 4})
    with pytest.raises(RecipeRefusedError, match="1 client"):
        node.node.handle(Stage.SETUP, {**ok, Key.SAMPLE_NUMBER: 2})
    from corrflow.errors import IntegrityError

    with pytest.raises(IntegrityError, match=r"another recipe \(differs in \['noise_multiplier'\]"):
        node.node.store.pin({**node.recipe, "noise_multiplier": 0.0}, b"")


def _stage_message(nid: int, config: dict) -> Message:
    enable_offline_messages()
    return Message(
        RecordDict({RECORD_KEY_CONFIGS: ConfigRecord(config)}),
        message_type=MessageType.TRAIN,
        dst_node_id=nid,
    )


def test_the_guard_refuses_a_round_without_the_pinned_noise_node(node):
    identity = node.node.identity()
    ctx = Context(run_id=1, node_id=5, node_config=pin(identity), state=RecordDict(), run_config={})
    reached = []

    def inner(msg, ctxt):
        reached.append(dict(msg.content.config_records[RECORD_KEY_CONFIGS]))
        return msg

    nid = identity["node_id"]
    keys = node.node.handle(
        Stage.SETUP,
        {
            Key.SAMPLE_NUMBER: 3,
            **{
                k: v
                for k, v in zip(
                    (Key.SHARE_NUMBER, Key.THRESHOLD, Key.CLIPPING_RANGE),
                    (3, 2, 1.0),
                    strict=True,
                )
            },
            Key.TARGET_RANGE: secure_sum_params(
                2, 1.0, DIM, node.stream.sigma_max
            ).quantization_range,
            Key.MOD_RANGE: MODULUS,
            Key.MAX_WEIGHT: 1.0,
            "corrflow-recipe": json.dumps(node.recipe),
        },
    )
    pk = [keys[Key.PUBLIC_KEY_1], keys[Key.PUBLIC_KEY_2]]
    sig = keys["corrflow-noise-signature"]
    good = {
        Key.STAGE: Stage.SHARE_KEYS,
        str(nid): pk,
        "5": [b"a", b"b"],
        "corrflow-noise-signature": sig,
    }
    guard_noise_node(_stage_message(5, good), ctx, inner)
    assert "corrflow-noise-signature" not in reached[-1]  # stripped for the stock mod
    cases = [
        ({k: v for k, v in good.items() if k != str(nid)}, "without the pinned noise node"),
        ({**good, "corrflow-noise-signature": b"x" * 64}, "not signed"),
        ({**good, str(nid): [b"k1", b"k2"]}, "not signed"),  # a substituted noise node
        (
            {Key.STAGE: Stage.UNMASK, Key.ACTIVE_NODE_ID_LIST: [5], Key.DEAD_NODE_ID_LIST: [nid]},
            "declares the noise node dropped",
        ),
    ]
    for config, why in cases:
        with pytest.raises(NoiseNodeGuardError, match=why):
            guard_noise_node(_stage_message(5, config), ctx, inner)
    assert len(reached) == 1
    bare = Context(run_id=1, node_id=5, node_config={}, state=RecordDict(), run_config={})
    with pytest.raises(NoiseNodeGuardError, match="no noise node pinned"):
        guard_noise_node(_stage_message(5, good), bare, inner)
    # a forged pin is refused every time, also after the true pin was verified (and remembered)
    forged = {**pin(identity), PIN_SIGNATURE: "00" * 64}
    for _ in range(2):
        bad = Context(run_id=1, node_id=5, node_config=forged, state=RecordDict(), run_config={})
        with pytest.raises(NoiseNodeGuardError, match="pin does not verify"):
            guard_noise_node(_stage_message(5, good), bad, inner)
    guard_noise_node(_stage_message(5, good), ctx, inner)
    assert len(reached) == 2


def test_the_server_refuses_to_unmask_without_the_noise_node(node):
    """A noise node that does not answer fails the attempt before anything is unmasked."""
    p = secure_sum_params(M_CLIENTS, 1.0, DIM, node.stream.sigma_max)
    pins = pin(node.node.identity())
    silent = _direct(node.node)

    def drop_collect(msg, ctxt):
        stage = msg.content.config_records[RECORD_KEY_CONFIGS][Key.STAGE]
        if stage == Stage.COLLECT_MASKED_VECTORS:
            from flwr.app import Error

            return Message(Error(code=5, reason="Node Unavailable"), reply_to=msg)
        return silent(msg, ctxt)

    grid = _grid({node.stream.node_id: drop_collect}, pins)
    with pytest.raises(driver.SecureSumError, match="noise node did not answer") as exc:
        _decode(grid, p, node.stream)
    assert exc.value.redo
    assert not NoiseNodeStore(node.dir).entries  # nothing was sent


def test_a_round_with_one_client_online_is_not_released_with_a_noise_node(node):
    """Without a noise node such a round releases noise only; with one the server holds no noise
    and the noise node joins no sum of fewer than 2 clients: the attempt fails (retried, then the
    run stops), and no row is sent."""
    grid = _grid({node.stream.node_id: _direct(node.node)}, pin(node.node.identity()), m=1)
    plan = SimpleNamespace(expected={n: "u" for n in grid.get_node_ids()}, round=0)
    with pytest.raises(driver.SecureSumError, match="needs at least 2") as exc:
        driver.secure_sum(grid, _messages(grid), plan, 1.0, [(DIM,)], {}, 60, None, node.stream)
    assert exc.value.redo and not NoiseNodeStore(node.dir).entries


# -- real processes -----------------------------------------------------------------------------
CLI = [sys.executable, "-m", "corrflow.server.cli", "simulate", "--secagg", "--backend"]
CLI += ["inprocess", "--users", "20", "--epochs", "2", "--json"]


def _files(*roots: Path):
    for root in roots:
        for path in root.rglob("*"):
            if path.is_file():
                yield path


@pytest.mark.integration
def test_simulate_with_a_noise_node_keeps_epsilon_and_the_key_off_the_server(tmp_path):
    """The CLI run exits 0 with the ε of ``--secagg`` alone; the noise node's report counts 4
    rounds and its journal head is the server's; no file of the server's run directory or
    $CORRFLOW_HOME holds any noise key byte string."""
    home = tmp_path / "home"
    env = {**os.environ, "CORRFLOW_HOME": str(home)}
    run = subprocess.run(
        [*CLI, "--rounds", "4", "--noise-node", "--out", str(tmp_path / "nn")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert run.returncode == 0, run.stderr
    plain = subprocess.run(
        [*CLI, "--rounds", "4", "--out", str(tmp_path / "sa")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert plain.returncode == 0, plain.stderr
    ours, theirs = json.loads(run.stdout), json.loads(plain.stdout)
    assert ours["realized"]["epsilon"] == theirs["realized"]["epsilon"]
    node_dir = tmp_path / "nn.noise-node"
    node = json.loads((node_dir / "noise_node_report.json").read_text())
    assert node["rounds_contributed"] == 4 and node["sends"] == 4
    assert node["journal_head"] == ours["noise_node"]["journal_head"]
    assert ours["noise_node"]["node_id"] == node["node_id"]
    assert "colludes with the noise node" in ours["trust_model"]["server"]
    from corrflow.schemas import validate

    validate("privacy-report", json.loads((tmp_path / "nn" / "privacy_report.json").read_text()))
    assert "never holds a noiseless sum" in ours["secure_aggregation"]["noiseless_sum"]
    rows = json.loads((node_dir / "keys.json").read_text())["segments"]
    assert all(len(row) == 3 and row[2] == 2 for row in rows)  # new keys: version 2, recorded
    keys = [bytes.fromhex(row[1]) for row in rows]
    secrets = [*keys, *(k.hex().encode() for k in keys), (node_dir / "identity.key").read_bytes()]
    for path in _files(tmp_path / "nn", home):
        data = path.read_bytes()
        assert not any(s in data for s in secrets), path
    assert not any((tmp_path / "nn").rglob("keys.json"))


@pytest.mark.integration
def test_a_killed_noise_node_is_restarted_and_never_repeats_a_row(node, tmp_path):
    """The noise node's process is SIGKILLed right after it sent round 1's masked vector (its row
    is released: the server unmasks without it), then before round 2's collect (that attempt
    fails, nothing unmasked); the next setup starts it again and round 2 is redone with a row of
    a new key segment: the journal holds each sent row once."""
    from corrflow.noisenode.process import NoiseNodeProcess

    proc = NoiseNodeProcess(node.dir)  # the same directory the fixture pinned
    proc.start()
    try:
        p = secure_sum_params(M_CLIENTS, 1.0, DIM, node.stream.sigma_max)
        kill_at = {(0, Stage.COLLECT_MASKED_VECTORS, "after"), (1, Stage.SHARE_KEYS, "after")}
        t_now = [0]

        def killer(msg, ctxt):
            stage = msg.content.config_records[RECORD_KEY_CONFIGS][Key.STAGE]
            reply = proc.handler(msg, ctxt)
            if (t_now[0], stage, "after") in kill_at:
                kill_at.discard((t_now[0], stage, "after"))
                os.kill(proc.pid, signal.SIGKILL)
                proc._proc.wait()
            return reply

        pins = pin(proc.identity)
        grid = _grid({node.stream.node_id: killer}, pins)
        _decode(grid, p, node.stream, t=0)  # unmasked although the node died after sending
        t_now[0] = 1
        with pytest.raises(driver.SecureSumError, match="noise node did not answer"):
            _decode(_grid({node.stream.node_id: killer}, pins), p, node.stream, t=1)
        _decode(_grid({node.stream.node_id: killer}, pins), p, node.stream, t=1)
        journal = NoiseNodeStore(node.dir).entries
        assert [e["round"] for e in journal] == [0, 1]
        assert [e["segment"]["first_round"] for e in journal] == [0, 1]  # restarts: new segments
        assert len({e["segment"]["key_fingerprint"] for e in journal}) == 2
    finally:
        proc.close()


@pytest.mark.integration
def test_a_server_killed_mid_round_resumes_with_the_noise_node(tmp_path):
    """The server (with its noise node child) is SIGKILLed as it sends round 3's unmask stage:
    the noise node has sent round 3's row, the server released rounds 1–2 only. The rerun
    resumes, the noise node (restarted) sends round 3 again under a new key segment, and the
    journals agree: every server release names the noise node's last send of that round, no row
    was sent twice, and the heads match."""
    out = tmp_path / "k"
    helper = [sys.executable, str(Path(__file__).parent / "noise_node_kill_run.py"), str(out)]
    env = {**os.environ, "CORRFLOW_HOME": str(tmp_path / "home")}
    first = subprocess.run(
        helper, env={**env, "KILL_AT_UNMASK": "3"}, capture_output=True, text=True, cwd=tmp_path
    )
    assert first.returncode == -signal.SIGKILL, first.stderr
    journal = out / "release_journal.jsonl"
    assert [json.loads(x)["round"] for x in journal.read_text().splitlines()] == [0, 1]
    node_dir = tmp_path / "k.noise-node"
    second = subprocess.run(helper, env=env, capture_output=True, text=True, cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    report = json.loads((out / "privacy_report.json").read_text())
    node = json.loads((node_dir / "noise_node_report.json").read_text())
    assert report["rounds_completed"] == 4 and node["rounds_contributed"] == 4
    assert node["rounds_sent_more_than_once"] == [2] and node["sends"] == 5
    assert node["journal_head"] == report["noise_node"]["journal_head"]
    sends = [json.loads(x) for x in (node_dir / "journal.jsonl").read_text().splitlines()]
    assert [e["round"] for e in sends] == [0, 1, 2, 2, 3]
    assert [e["segment"]["first_round"] for e in sends] == [0, 0, 0, 2, 2]
    assert len({e["segment"]["key_fingerprint"] for e in sends}) == 2
    released = [json.loads(x) for x in journal.read_text().splitlines()]
    assert [e["round"] for e in released] == [0, 1, 2, 3]
    last = {e["round"]: e["segment"] for e in sends}  # a round's last send is the released one
    assert all(e["noise_segment"] == last[e["round"]] for e in released)
    assert math.isfinite(report["realized"]["epsilon"])


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--noise-node"], "--secagg as well"),
        (["--secagg", "--noise-node", "--noise-node-dir", "{out}/node"], "outside --out"),
        (["--secagg", "--noise-node", "--noise-node-dir", "{home}/node"], "outside --out"),
        (["--secagg", "--noise-node", "--backend", "cohort"], "--backend inprocess"),
    ],
)
def test_bad_noise_node_flags_are_refused_writing_nothing(tmp_path, extra, says):
    out, home = tmp_path / "out", tmp_path / "home"
    args = [a.format(out=out, home=home) for a in extra]
    cmd = [sys.executable, "-m", "corrflow.server.cli", "simulate", "--users", "20"]
    cmd += ["--rounds", "4", "--epochs", "2", "--out", str(out), *args]
    if "--backend" not in args:
        cmd += ["--backend", "inprocess"]
    env = {**os.environ, "CORRFLOW_HOME": str(home)}
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert says in r.stderr and "noise-node" in r.stderr
    assert not out.exists() and not (tmp_path / "out.noise-node").exists()


def test_a_checkpoint_resumes_only_with_its_own_noise_node(node, tmp_path):
    """The server's checkpoint keeps the noise node's receipts (public) and its key; another noise
    node, or a run without one, is refused."""
    from dataclasses import replace

    from corrflow.errors import IntegrityError
    from corrflow.run.checkpoint import Checkpoint, SecretFiles

    stream = node.stream
    stream.receive(0, {"first_round": 0, "key_fingerprint": "ab" * 16}, "f" * 64)
    stream.add([np.zeros(DIM, np.float32)], 0, np.float32(1.0))
    secrets = SecretFiles(tmp_path)
    noise = stream.save(tmp_path, secrets)
    assert secrets.take() == {}  # the server holds no noise secret
    ckpt = Checkpoint(tmp_path / "checkpoint.zip", "round-000001", "", {}, noise, {})
    back = NoiseNodeStream.restore(ckpt, stream.link)
    assert back.next_round == 1 and back.journal_head == "f" * 64
    assert back.segments.segment_for(0).public()["key_fingerprint"] == "ab" * 16
    other = NoiseNodeLink(stream.node_id, b"\x01" * 32, b"")
    with pytest.raises(IntegrityError, match="public key"):
        NoiseNodeStream.restore(ckpt, other)
    with pytest.raises(IntegrityError, match="without --noise-node"):
        NoiseNodeStream.restore(replace(ckpt, noise={}), stream.link)
    with pytest.raises(IntegrityError, match="no receipt"):  # a sum without the node's receipt
        back.add([np.zeros(DIM, np.float32)], 1, np.float32(1.0))


def test_the_server_receives_only_protocol_messages_from_the_noise_node(node):
    """Every reply of the noise node carries only SecAgg+'s keys, ciphertexts, masked vectors
    and shares, plus its public receipt: no array, no metric, nothing of its key."""
    replies = []
    inner = _direct(node.node)

    def recording(msg, ctxt):
        reply = inner(msg, ctxt)
        replies.append(reply)
        return reply

    p = secure_sum_params(M_CLIENTS, 1.0, DIM, node.stream.sigma_max)
    _decode(_grid({node.stream.node_id: recording}, pin(node.node.identity())), p, node.stream)
    allowed = {
        Key.PUBLIC_KEY_1,
        Key.PUBLIC_KEY_2,
        "corrflow-noise-signature",
        Key.DESTINATION_LIST,
        Key.CIPHERTEXT_LIST,
        Key.MASKED_PARAMETERS,
        "corrflow-noise-segment",
        "corrflow-noise-journal-head",
        Key.NODE_ID_LIST,
        Key.SHARE_LIST,
    }
    keys = NoiseNodeStore(node.dir).segments()[0].segments[0].key
    assert len(replies) == 4
    for reply in replies:
        content = reply.content
        assert set(content.config_records) == {RECORD_KEY_CONFIGS}
        assert not content.array_records and not content.metric_records
        record = dict(content.config_records[RECORD_KEY_CONFIGS])
        assert set(record) <= allowed
        items = [x for v in record.values() for x in (v if isinstance(v, list) else [v])]
        flat = b"".join(x if isinstance(x, bytes) else str(x).encode() for x in items)
        assert keys not in flat and keys.hex().encode() not in flat
