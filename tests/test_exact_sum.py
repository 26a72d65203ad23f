"""The round's exact sum (corrflow.run.clipping.ExactSum) and the streaming collection of replies
(corrflow.run.round.collect): the same bits for every arrival order, within the documented bound of
an exact recomputation and of the float64 sum, no overflow past the guard, rejected replies never
in the sum, the first accepted reply of an id wins, and replies consumed one at a time."""

import gc
import math
import weakref
from fractions import Fraction

import numpy as np
import pytest
from strategy_support import KEY
from strategy_support import small_config as _cfg

from corrflow.run import Reply, Run, RunLock, open_run_directory, prepare
from corrflow.run.clipping import ExactSum, RejectedReplyError, clip_scale, fixed_point_scale
from corrflow.run.round import collect

SHAPES = [(3_001,), (4, 5)]  # crosses no block: the block-crossing case is the next test's


def _updates(rng, m, scales):
    """m float32 updates of SHAPES with ℓ2 norms around ``scales`` (cycled)."""
    out = []
    for i in range(m):
        u = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
        norm = math.sqrt(sum(float((a.astype(np.float64) ** 2).sum()) for a in u))
        target = scales[i % len(scales)]
        out.append([(a * np.float32(target / norm)).astype(np.float32) for a in u])
    return out


def _clipped(u, bound):
    """What ExactSum adds for update ``u`` (float32, as it clips): u, or u · clip_scale."""
    norm = math.sqrt(sum(float((a.astype(np.float64) ** 2).sum()) for a in u))
    if norm <= bound:
        return u
    return [a * clip_scale(norm, bound) for a in u]


def test_twenty_arrival_orders_give_the_same_bits_within_the_documented_bound():
    """100 updates (kept and clipped, norms 0.01 to 3 at clip 1) added in 20 random orders: the
    int64 sums are identical; the sum equals Σ trunc(u_ij · 2^s) recomputed in Python integers;
    it is within m · 2^−s of the exact rational sum (Fractions) and within the documented bound of
    the float64 sum; the float32 total is that sum rounded once to float64 and once to float32."""
    rng = np.random.default_rng(44)
    m, clip, cap = 100, 1.0, 1_000
    s = fixed_point_scale(cap, clip)
    assert s == math.floor(62 - math.log2(cap * clip)) == 52
    updates = _updates(rng, m, [0.01, 0.5, 0.999, 3.0])
    sums = []
    for _ in range(20):
        acc = ExactSum(SHAPES, s)
        actions = [acc.add(updates[i], None, clip, 0.0) for i in rng.permutation(m)]
        assert actions.count("clipped") == 25 and actions.count("kept") == 75
        sums.append(acc)
    for other in sums[1:]:
        for a, b in zip(sums[0].sums, other.sums, strict=True):
            assert a.tobytes() == b.tobytes()
    added = [_clipped(u, clip) for u in updates]
    j = (0, 17, 1_500, 3_000)  # coordinates of the first array checked exactly
    for k in j:
        values = [float(u[0][k]) for u in added]
        ints = sum(math.trunc(Fraction(v) * 2**s) for v in values)
        assert int(sums[0].sums[0][k]) == ints
        exact = sum(Fraction(v) for v in values)
        assert abs(Fraction(ints, 2**s) - exact) < Fraction(m, 2**s)
    got = sums[0].sums[0].astype(np.float64) * 2.0**-s  # exact here: |Q| < 2^53
    stacked = np.stack([u[0].astype(np.float64) for u in added])
    f64 = stacked.sum(axis=0)
    bound = m * 2.0**-s + (m - 1) * 2.0**-53 * np.abs(stacked).sum(axis=0)
    assert np.all(np.abs(got - f64) <= bound)
    assert np.abs(got - f64).max() > 0  # the bound is exercised, not vacuous
    total = sums[0].total()
    assert total[0].dtype == np.float32 and total[1].shape == (4, 5)
    np.testing.assert_array_equal(total[0], got.astype(np.float32))
    norm = math.sqrt(sum(float((a.astype(np.float64) ** 2).sum()) for a in added[3]))
    assert norm <= clip  # a clipped update meets the bound before conversion


def test_blocks_zeroing_rejections_and_the_overflow_guard():
    """Across 2¹⁶-float blocks: a NaN, an Inf or an update that needs clipping where clipping is not
    allowed raise before the sum changes, a zeroed update adds nothing, and a contribution that
    would take Σ ℓ2 bounds to 2^(63−s) is refused (int64 cannot overflow)."""
    rng = np.random.default_rng(3)
    shapes = [(150_001,)]
    s = fixed_point_scale(2, 1.0)
    acc = ExactSum(shapes, s)
    u = [(rng.standard_normal(150_001) * 1e-3).astype(np.float32)]
    assert acc.add(u, None, 1.0, 0.0) == "kept"
    before = acc.sums[0].copy()
    np.testing.assert_array_equal(before, np.trunc(u[0].astype(np.float64) * 2.0**s))
    for bad in (np.nan, np.inf):
        v = [u[0].copy()]
        v[0][140_000] = bad
        with pytest.raises(RejectedReplyError, match="NaN or Inf"):
            acc.add(v, None, 1.0, 0.0)
    with pytest.raises(RejectedReplyError, match="needs clipping"):
        acc.add([u[0] * 1e4], None, 1.0, 0.0, allow_clip=False)
    assert acc.add([np.full(150_001, 50.0, np.float32)], None, 1.0, 10.0) == "zeroed"
    np.testing.assert_array_equal(acc.sums[0], before)
    assert acc.add([u[0] * 1e4], None, 1.0, 0.0) == "clipped"
    # two contributions of bound 1 fit (cap · c · 2^s ≤ 2^62); the guard allows up to 2^(63−s)
    with pytest.raises(RejectedReplyError, match="exact sum is full"):
        acc.add(u, None, 2.0 * 2.0 ** (62 - s), 0.0)
    assert np.abs(acc.sums[0]).max() < 2**63
    # a scale beyond float32's exponent range converts in float64, with the same truncation
    tiny = [np.array([3e-30, -7e-31, 1e-45, 0.0], np.float32)]
    wide = ExactSum([(4,)], fixed_point_scale(2, 1e-29))
    assert wide.scale > 127 and wide.add(tiny, None, 1e-29, 0.0) == "kept"
    assert [int(q) for q in wide.sums[0]] == [
        math.trunc(Fraction(float(v)) * 2**wide.scale) for v in tiny[0]
    ]
    with pytest.raises(ValueError, match="positive and finite"):
        fixed_point_scale(0, 1.0)
    assert fixed_point_scale(342_477, 1.0) == 43


def test_the_compiled_passes_against_numpy():
    """The compiled first pass (``clip_kernels``) forms u = fl32(a − s) in the wider dtype exactly
    as NumPy does, its Σ u² is the float64 sum of float64 squares (to rounding), its ℓ∞ exact, for
    float32 and float64 replies, full weights and deltas, lengths with and without a tail; the
    second pass adds exactly trunc(fl32(u · scale) · 2^s)."""
    from corrflow.run import clip_kernels as k

    rng = np.random.default_rng(7)
    for n in (1, 7, 8, 1_003, 70_001):
        for dtype in (np.float32, np.float64):
            a = rng.standard_normal(n).astype(dtype)
            s = (a + rng.standard_normal(n).astype(dtype) * 1e-3).astype(dtype)
            for sent in (s, None):
                u = np.empty(n, np.float32)
                want = (a if sent is None else a - sent).astype(np.float32)
                sq, linf = k.copy_norms(a, u) if sent is None else k.difference_norms(a, sent, u)
                np.testing.assert_array_equal(u, want)
                assert linf == np.abs(want).max()
                assert sq == pytest.approx(float(np.dot(want.astype(float), want)), rel=1e-12)
        scale, to_int = np.float32(0.37), np.float32(2.0**40)
        q = rng.integers(-(2**40), 2**40, n)
        want_q = q + np.trunc((u * scale).astype(np.float32).astype(np.float64) * 2.0**40).astype(
            np.int64
        )
        k.add_fixed_point(u, scale, to_int, q)
        np.testing.assert_array_equal(q, want_q)


def test_a_huge_finite_update_is_clipped_and_other_dtypes_take_the_numpy_pass():
    """An update whose float32 squares overflow (|u| ~ 10³⁰) is finite, so it is clipped to the
    bound, not refused or zeroed; a float16 reply (NumPy's pass) sums to the same bits as the same
    values in float32 (the compiled pass)."""
    s = fixed_point_scale(4, 1.0)
    acc = ExactSum([(5,)], s)
    huge = [np.array([1e30, -2e30, 0.0, 3.0, 1e30], np.float32)]
    assert acc.add(huge, None, 1.0, 0.0) == "clipped"
    added = acc.sums[0].astype(np.float64) * 2.0**-s
    assert 0.99 < float(np.linalg.norm(added)) <= 1.0
    half = [np.array([0.5, -0.25, 0.125, 1e-3, 0.0], np.float16)]
    a16, a32 = ExactSum([(5,)], s), ExactSum([(5,)], s)
    zero16, zero32 = [np.zeros(5, np.float16)], [np.zeros(5, np.float32)]
    kept = a32.add([half[0].astype(np.float32)], zero32, 1.0, 0.0)
    assert a16.add(half, zero16, 1.0, 0.0) == kept == "kept"
    np.testing.assert_array_equal(a16.sums[0], a32.sums[0])
    with pytest.raises(RejectedReplyError, match="NaN or Inf"):
        a16.add([np.array([0, 0, np.inf, 0, 0], np.float16)], zero16, 1.0, 0.0)


# -- through collect, on a real run plan -----------------------------------------------------------

USERS = [f"partition-{i}" for i in range(12)]
NODE = {u: 100 + i for i, u in enumerate(USERS)}
INITIAL = [np.zeros(6, np.float32), np.zeros(1, np.float32)]


def _plan(tmp_path):
    cfg = _cfg(tmp_path, clip_norm=0.5, replies="delta")
    plan = prepare(cfg, USERS, INITIAL, identity="partition-id")
    return cfg, plan


def test_collect_is_order_free_first_accepted_wins_and_streams(tmp_path):
    """One routed round's replies — kept, clipped, a NaN, a duplicate of an answered id (different
    values), a duplicate of a rejected id, a foreign sender — in 20 orders: the same sum bits,
    accepted ids and rejected ids every time, except where a duplicate of an accepted id decides
    (the first arrival wins; a NaN after its id's valid reply is rejected as a duplicate, not as a
    NaN); each reply is released before the next is pulled."""
    cfg, plan = _plan(tmp_path)
    with RunLock(cfg.state_dir):
        run = Run.start(plan, INITIAL, open_run_directory(cfg.state_dir), noise_key=KEY)
        routed = run.plan_next().route(NODE, set(NODE.values()))
        rng = np.random.default_rng(7)
        nodes = sorted(routed.expected)
        assert len(nodes) >= 4
        nan_node, big_node, dup_node, *rest = nodes

        def reply(node, values):
            arrays = [values.astype(np.float32), np.zeros(1, np.float32)]
            return Reply(node, USERS[node - 100], ["0", "1"], arrays)

        base = [reply(n, rng.standard_normal(6) * 0.05) for n in rest]
        base.append(reply(big_node, np.full(6, 1.0)))
        base.append(reply(nan_node, np.full(6, np.nan)))
        base.append(reply(nan_node, np.full(6, 0.01)))  # a duplicate of a rejected id: it counts
        base.append(Reply(999, "stranger", ["0", "1"], INITIAL))
        first, second = reply(dup_node, np.full(6, 0.02)), reply(dup_node, np.full(6, 0.03))
        results = {}
        for _ in range(20):
            order = [base[i] for i in rng.permutation(len(base))]
            at = int(rng.integers(0, len(order) + 1))
            winner = "first" if rng.random() < 0.5 else "second"
            pair = (first, second) if winner == "first" else (second, first)
            order = order[:at] + [pair[0]] + order[at:] + [pair[1]]
            out = collect(run.plan, routed, iter(order), run.state.params, lambda *a: None)
            key = (
                b"".join(t.tobytes() for t in out.total),
                tuple(out.accepted),
                tuple(who for who, _ in out.rejections),
                tuple(sorted(out.counts.items())),
            )
            results.setdefault(winner, set()).add(key)
        assert {w: len(v) for w, v in results.items()} == {"first": 1, "second": 1}
        (a,), (b,) = results["first"], results["second"]
        assert a[0] != b[0] and a[1:] == b[1:]
        accepted, rejections, counts = a[1], a[2], dict(a[3])
        assert list(accepted) == sorted(accepted) and len(accepted) == len(nodes)
        assert counts == {"kept": len(nodes) - 1, "clipped": 1, "zeroed": 0, "rejected": 3}
        assert sorted(rejections, key=str) == sorted(
            [USERS[dup_node - 100], USERS[nan_node - 100], "stranger"]
        )

        # streamed: the collector holds no reply once it asked for the next one
        held: list[weakref.ref] = []

        def pulled():
            for n in nodes:
                r = reply(n, rng.standard_normal(6) * 0.05)
                held.append(weakref.ref(r.arrays[0]))
                yield r
                del r
                gc.collect()
                assert held[-1]() is None

        out = collect(run.plan, routed, pulled(), run.state.params, lambda *a: None)
        assert len(out.accepted) == len(nodes)
        assert run.plan.sum_scale == fixed_point_scale(12, 0.5) == 59


# -- the transport side: replies pulled a few ids at a time ----------------------------------------


def test_reply_stream_pulls_a_few_ids_at_a_time_and_the_grid_delivers_on_pull():
    """The in-process grid runs a handler when its reply is pulled, not at push; `ReplyStream` asks
    for at most ``batch`` ids per pull and yields every reply once; a stop raises before the next
    pull (the round is abandoned, nothing summed is kept)."""
    import threading

    from flwr.app import ConfigRecord, MessageType, RecordDict
    from flwr.app import Message as FlowerMessage

    from corrflow.server.inprocess import InProcessGrid
    from corrflow.strategies.messaging import ReplyStream, RoundAbandonedError

    calls: list[int] = []

    def handler(msg, ctx):
        calls.append(int(ctx.node_config["partition-id"]))
        return FlowerMessage(RecordDict({"c": ConfigRecord({"p": calls[-1]})}), reply_to=msg)

    grid = InProcessGrid({"train": handler}, 10, identity=False)
    asked: list[int] = []
    pull = grid.pull_messages
    grid.pull_messages = lambda ids: (asked.append(len(list(ids))), pull(ids))[1]

    def messages():
        return [
            FlowerMessage(RecordDict({}), message_type=MessageType.TRAIN, dst_node_id=n)
            for n in grid.get_node_ids()
        ]

    stream = ReplyStream(grid, messages(), 60.0, threading.Event(), batch=3)
    assert calls == [] and asked == []  # pushed, nothing delivered yet
    seen = []
    for reply in stream:
        seen.append(int(reply.content["c"]["p"]))
        assert len(calls) <= -(-len(seen) // 3) * 3  # never more delivered than pulled
    assert sorted(seen) == list(range(10)) and asked == [3, 3, 3, 1]

    stop = threading.Event()
    stream = ReplyStream(grid, messages(), 60.0, stop, batch=4)
    got = iter(stream)
    next(got)
    stop.set()
    with pytest.raises(RoundAbandonedError):
        list(got)


def test_a_round_waiting_for_replies_names_the_silent_nodes(monkeypatch, caplog):
    """A node that never answers (a SuperNode stuck on a message of an ended run) is named while the
    round waits, well before node-timeout; the replies that came are yielded, the silent one times
    out."""
    from types import SimpleNamespace

    from corrflow.strategies import messaging

    class SlowGrid:  # a deployed grid: replies come on later pulls; node 7 never answers
        def __init__(self):
            self.pushed = []

        def push_messages(self, msgs):  # as Flower's grids: each pushed message gets its id
            self.pushed = list(msgs)
            for i, m in enumerate(self.pushed):
                m.metadata.message_id = f"m{i}"
            return [f"m{i}" for i in range(len(self.pushed))]

        def pull_messages(self, ids):
            out = []
            for i in ids:
                m = self.pushed[int(i[1:])]
                if m.metadata.dst_node_id != 7:  # ReplyStream reads a reply's metadata only
                    meta = SimpleNamespace(
                        reply_to_message_id=i, src_node_id=m.metadata.dst_node_id
                    )
                    out.append(SimpleNamespace(metadata=meta))
            return out

    monkeypatch.setattr(messaging, "WAIT_REPORT_S", 0.1)
    msgs = [SimpleNamespace(metadata=SimpleNamespace(dst_node_id=n)) for n in (3, 7, 11)]
    with caplog.at_level("WARNING", logger="corrflow"):
        got = list(messaging.ReplyStream(SlowGrid(), msgs, 0.45, None, batch=2))
    assert sorted(r.metadata.src_node_id for r in got) == [3, 11]
    waits = [r.getMessage() for r in caplog.records if "still missing" in r.getMessage()]
    assert waits and all(w.startswith("1 of 3 replies still missing") for w in waits)
    assert "from node(s) 7;" in waits[0] and "node-timeout 0.45 s" in waits[0]
