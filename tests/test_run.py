"""The run without Flower (corrflow.run): a plain Python loop trains with it alone and releases the
same bits and ε as the Flower strategy on the in-process grid, and each step of a round is checked
on value types — a rejected reply, a clipped one, an empty round, a budget stop, a resume, a
non-finite model."""

import numpy as np
import pytest
from lineage_support import segments
from strategy_support import HANDLERS, KEY
from strategy_support import small_config as _cfg

from corrflow.clients.numpy_client import local_update
from corrflow.data.synthetic import regression_partition
from corrflow.errors import InvalidArgumentError
from corrflow.run import Reply, Run, RunLock, SummedReplies, open_run_directory, prepare
from corrflow.run.round import RoundPlan
from corrflow.server.app import run_server
from corrflow.server.inprocess import InProcessGrid

USERS = [f"partition-{i}" for i in range(12)]
NODE = {u: 100 + i for i, u in enumerate(USERS)}  # any node ids: the loop is the transport
INITIAL = [np.zeros(6, np.float32), np.zeros(1, np.float32)]


def _start(cfg, fresh=False, **kw) -> Run:
    plan = prepare(cfg, USERS, INITIAL, identity="partition-id")
    return Run.start(plan, INITIAL, open_run_directory(cfg.state_dir, fresh), noise_key=KEY, **kw)


def _client(run: Run, node: int) -> Reply:
    """What corrflow's numpy ClientApp replies (full weights), computed here without Flower."""
    cfg, params = run.plan.cfg, [np.asarray(p) for p in run.state.params]
    user = USERS[node - 100]
    X, y = regression_partition(int(user.split("-")[1]), params[0].shape[0], seed=cfg.seed)
    delta = local_update(params, X, y, cfg.local_lr, cfg.local_steps)
    new = [p + d for p, d in zip(params, delta, strict=True)]
    return Reply(node, user, ["0", "1"], new, {"num-examples": len(y)})


def _routed(run: Run) -> RoundPlan:
    return run.plan_next().route(NODE, set(NODE.values()))


def test_a_plain_loop_releases_the_flower_paths_models_and_epsilon(tmp_path):
    """Six rounds in a plain loop with corrflow.run alone, and six through the Flower strategy on
    the in-process grid, with the same noise key and deterministic clients: every released model
    is the same bits, and so is every round's ε."""
    released = []
    flower = run_server(
        InProcessGrid(HANDLERS, 12),
        _cfg(tmp_path / "flower"),
        noise_key=KEY,
        quiet=True,
        on_round_end=lambda s, m: released.append([np.array(p) for p in s.params]),
    )
    cfg = _cfg(tmp_path / "plain")
    with RunLock(cfg.state_dir):
        run = _start(cfg)
        plain = []
        while (plan := run.plan_next()) is not None:
            routed = plan.route(NODE, set(NODE.values()))
            record = run.step(routed, [_client(run, n) for n in routed.expected])
            plain.append(record.params)
        run.write_report()
    assert len(plain) == len(released) == 6 and run.state.next_round == 6
    for a, b in zip(plain, released, strict=True):
        for x, y in zip(a, b, strict=True):
            assert x.tobytes() == y.tobytes()
    assert list(run.state.ledger.epsilon_history) == list(flower.ledger.epsilon_history)
    assert run.state.ledger.epsilon_history[-1] > 0
    assert run.state.ledger.selected == flower.ledger.selected
    assert run.report()["realized"]["epsilon"] == flower.report()["realized"]["epsilon"]


def test_a_rejected_and_a_clipped_reply(tmp_path):
    """A NaN reply is rejected (ledger, metrics) and adds nothing; a reply far above the clip norm
    is scaled to it: the released model is the bits of a run (same key) that received that reply
    already scaled to the clip norm and no reply at all from the NaN's node."""
    small = [np.full(6, 0.01, np.float32), np.zeros(1, np.float32)]
    big = [np.full(6, 1.0, np.float32), np.zeros(1, np.float32)]  # ℓ∞ under the zeroing bar
    scale = np.float32(0.5 / np.sqrt(6.0) * (1 - 1e-6))  # ClippedSum's clip_scale
    models = []
    for name in ("raw", "pre-clipped"):
        cfg = _cfg(tmp_path / name, clip_norm=0.5, replies="delta")
        with RunLock(cfg.state_dir):
            run = _start(cfg)
            routed = _routed(run)
            bad, top, *rest = sorted(routed.expected)
            replies = [Reply(n, USERS[n - 100], ["0", "1"], small) for n in rest]
            if name == "raw":
                nan = [np.full(6, np.nan, np.float32), small[1]]
                replies += [
                    Reply(bad, USERS[bad - 100], ["0", "1"], nan),
                    Reply(top, USERS[top - 100], ["0", "1"], big),
                ]
            else:
                replies.append(Reply(top, USERS[top - 100], ["0", "1"], [a * scale for a in big]))
            record = run.step(routed, replies)
            models.append(record.params)
        if name == "raw":
            assert record.metrics["rejected"] == 1 and record.metrics["clipped"] == 1
            assert record.metrics["kept"] == len(rest) and len(record.accepted) == len(rest) + 1
            (rejection,) = run.state.ledger.rejections
            assert rejection["user"] == routed.expected[bad]
            assert "NaN or Inf" in rejection["reason"]
        else:
            assert record.metrics["clipped"] == 0 and record.metrics["rejected"] == 1  # timed out
    for a, b in zip(*models, strict=True):
        assert a.tobytes() == b.tobytes()


def test_an_empty_round_and_a_silent_cohort(tmp_path):
    """No reply at all: every node sent a request is recorded as timed out, the model moves by the
    noise alone, and after max-empty-rounds such rounds the run stops, saying why."""
    cfg = _cfg(tmp_path, max_empty_rounds=2)
    with RunLock(cfg.state_dir):
        run = _start(cfg)
        before = [np.array(p) for p in run.state.params]
        routed = _routed(run)
        record = run.step(routed, [])
        assert record.accepted == () and record.metrics["rejected"] == len(routed.expected)
        assert all("timed out" in r["reason"] for r in run.state.ledger.rejections)
        assert any(np.any(p != q) for p, q in zip(run.state.params, before, strict=True))
        assert run.state.stopped_reason is None
        run.step(_routed(run), [])
        assert "no valid replies in 2 consecutive rounds" in run.state.stopped_reason
        assert run.plan_next() is None
        with pytest.raises(InvalidArgumentError):
            run.step(routed, [])


def test_a_sum_from_secure_aggregation_enters_as_the_replies_do(tmp_path):
    """step takes an already clipped and summed input (a secure-aggregation adapter's) on the same
    path: the same sum gives the same model as the replies it came from."""
    models = []
    for name, summed in (("replies", False), ("sum", True)):
        cfg = _cfg(tmp_path / name, clip_norm=100.0)  # nothing to clip: the sum is plain
        with RunLock(cfg.state_dir):
            run = _start(cfg)
            routed = _routed(run)
            replies = [_client(run, n) for n in routed.expected]
            if summed:
                total = SummedReplies.empty(run.plan.layout.trainable_shapes)
                for r in sorted(replies, key=lambda r: r.user):
                    for g, new, old in zip(total.total, r.arrays, run.state.params, strict=True):
                        g += new - old  # each within the clip norm here: nothing to clip
                    total.accepted.append(r.user)
                    total.counts["kept"] += 1
                replies = total
            models.append(run.step(routed, replies).params)
    for a, b in zip(*models, strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_budget_guard_stops_before_the_round(tmp_path):
    """A target ε below what the planned rounds spend: plan_next refuses the first round that would
    exceed it, the run stops on the record, and nothing of that round is released."""
    cfg = _cfg(tmp_path, target_epsilon=1000.0)  # the largest target: no guard
    with RunLock(cfg.state_dir):
        run = _start(cfg)
        routed = _routed(run)
        run.step(routed, [_client(run, n) for n in routed.expected])
        first = run.state.ledger.epsilon_history[0]
    cfg2 = _cfg(tmp_path / "tight", target_epsilon=first * 1.5)
    with RunLock(cfg2.state_dir):
        run = _start(cfg2)
        while (plan := run.plan_next()) is not None:
            routed = plan.route(NODE, set(NODE.values()))
            run.step(routed, [_client(run, n) for n in routed.expected])
        assert "budget guard" in run.state.stopped_reason
        eps = list(run.state.ledger.epsilon_history)
        assert 1 <= len(eps) < 6 and eps[-1] <= first * 1.5
        assert run.report()["rounds_completed"] == len(eps)


def _rounds(run: Run, count: int | None = None) -> list[list[np.ndarray]]:
    """Up to ``count`` rounds (all that remain: None) of the plain loop; each released model."""
    out = []
    while (count is None or len(out) < count) and (plan := run.plan_next()) is not None:
        routed = plan.route(NODE, set(NODE.values()))
        out.append(run.step(routed, [_client(run, n) for n in routed.expected]).params)
    return out


def _split_run(cfg, restart_key: bytes | None) -> list[list[np.ndarray]]:
    """Three rounds, a new Run from the checkpoint (a restarted process) with ``restart_key`` (None:
    from the OS, as a server draws it), the rest."""
    released = []
    for rounds, key in ((3, KEY), (None, restart_key)):
        with RunLock(cfg.state_dir):
            plan = prepare(cfg, USERS, INITIAL, identity="partition-id")
            run = Run.start(plan, INITIAL, open_run_directory(cfg.state_dir), noise_key=key)
            released += _rounds(run, rounds)
    assert run.state.next_round == 6
    return released


def test_a_resumed_run_draws_fresh_noise_and_replays_exactly(tmp_path):
    """Three rounds, a restart from the checkpoint, three more — in the plain loop, as on the Flower
    path: rounds 1–3 are the bits of an uninterrupted run, rounds 4–6 carry noise from a fresh key
    (never the uninterrupted run's, even when the restart is handed the run's first key again);
    the checkpoint holds the key segments, each journal entry names its own, and injecting the
    recorded key replays the interrupted run bit for bit."""
    from corrflow.noise.prng import fingerprint
    from corrflow.run.journal import JOURNAL, ReleaseJournal

    whole = _cfg(tmp_path / "whole")
    with RunLock(whole.state_dir):
        want = _rounds(_start(whole))
    later = bytes(range(16, 32))
    for name, restart_key in (("os", None), ("reused", KEY), ("injected", later)):
        got = _split_run(_cfg(tmp_path / name), restart_key)
        for t, (a, b) in enumerate(zip(got, want, strict=True)):
            same = all(x.tobytes() == y.tobytes() for x, y in zip(a, b, strict=True))
            assert same == (t < 3), (name, t)
    run_dir = tmp_path / "injected"
    assert segments(run_dir) == [(0, KEY), (3, later)]
    journal = ReleaseJournal(run_dir / JOURNAL).read()
    assert [e.noise_segment["first_round"] for e in journal] == [0, 0, 0, 3, 3, 3]
    assert {e.noise_segment["key_fingerprint"] for e in journal[3:]} == {
        fingerprint(later, version=2)
    }
    with RunLock(run_dir):  # a start of the finished run draws no rows: it opens no segment
        run = Run.start(
            prepare(_cfg(run_dir), USERS, INITIAL, identity="partition-id"),
            INITIAL,
            open_run_directory(run_dir),
        )
    assert run.report()["lineage"]["key_segments"] == [0, 3]
    replay = _split_run(_cfg(tmp_path / "replay"), later)
    for a, b in zip(replay, _split_run(_cfg(tmp_path / "again"), later), strict=True):
        for x, y in zip(a, b, strict=True):
            assert x.tobytes() == y.tobytes()


def test_a_non_finite_model_is_never_released(tmp_path):
    """A sum near float32's range (a secure-aggregation adapter's, entering past the clipping)
    times the largest server learning rate the settings accept overflows float32: the step refuses
    the round, the run stops with the reason, and the checkpoint, journal and report stay at the
    last finite round."""
    cfg = _cfg(tmp_path, server_lr=1e6)
    with RunLock(cfg.state_dir):
        run = _start(cfg)
        routed = _routed(run)
        summed = SummedReplies.empty(run.plan.layout.trainable_shapes)
        summed.total[0][:] = 3e38
        summed.accepted.extend(sorted(routed.expected.values()))
        summed.counts["kept"] = len(summed.accepted)
        with np.errstate(over="ignore"):  # the overflow is the point
            record = run.step(routed, summed)
    assert record is None and "non-finite model" in run.state.stopped_reason
    assert run.state.next_round == 0 and np.all(np.asarray(run.state.params[0]) == 0)
    report = run.report()
    assert report["rounds_completed"] == 0 and "non-finite" in report["stopped_reason"]
    assert not (tmp_path / "release_journal.jsonl").exists()


def test_route_returns_a_new_plan(tmp_path):
    """Routing (and so building the messages) never changes the plan plan_next returned."""
    cfg = _cfg(tmp_path)
    with RunLock(cfg.state_dir):
        run = _start(cfg)
        plan = run.plan_next()
        offline = NODE[plan.items[0]]
        routed = plan.route(NODE, set(NODE.values()) - {offline})
    assert plan.expected == {} and plan.rejections == ()
    assert routed.rejections == ((plan.items[0], "offline when selected"),)
    assert offline not in routed.expected and len(routed.expected) == len(plan.items) - 1
