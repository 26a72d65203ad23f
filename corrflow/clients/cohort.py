"""Local training of a whole round's cohort at once, on stacked per-client weights (the cohort
engine, ``--backend cohort``).

Each client trains exactly as on the per-client path — the same data, the same data order (its
own generator seeded by (seed, user, round)), the same local steps and minibatches — but the m
clients' minibatch steps run together as batched matrix products (numpy ``matmul``, BLAS) over
weights stacked along a leading client axis. The next-word model trains in float32 (the
per-client path computes in float64: each update differs from it by about 4e-7 of its ℓ2 norm);
the regression model in float64.

Next-word clients are sorted by pair count and step through their minibatches tick by tick (a
client's s-th minibatch at tick s), so the clients still training at a tick are a prefix of the
stack and train on views, not copies. A minibatch shorter than its step's rows (the last of an
epoch) is padded with rows of weight zero, which contribute exact zeros. The softmax is left
unnormalised (`_step`). The products and ``exp`` are numpy's (BLAS, numpy's vector ``exp``: numba's
wheels have none); what numpy needs several passes or a Python loop for is a compiled numba loop:
the data orders (`corrflow.clients.permutations`: NumPy's own generators, drawn without building
one per client), the schedule, the rows' gather, one pass per step over the probabilities (row
sums, target entries, the rows' gradient weights, the last minibatch's loss) and the embedding
rows' repeated updates. A step's scratch arrays are allocated once per round. Regression data is
padded to the cohort's longest and masked. No Flower message is built: the replies are the new
weights the per-client ClientApp would send, as arrays.

Per-user data is built once per process and kept (`UserData`); the synthetic generators and the
real-format files (``--data``) both go through the task's ``user_data``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numba
import numpy as np

from corrflow.clients.nextword_client import _pairs
from corrflow.clients.permutations import permutations

#: The per-client path's minibatch size (``corrflow.clients.nextword_client.local_train``).
NEXTWORD_BATCH = 64
#: A row whose Σ exp(logit) falls below this has terms under float32's normal range: the tick is
#: recomputed with the max-shifted softmax (as it is when a logit overflows exp).
SUM_FLOOR = 1e-25
#: At most this many probabilities (clients · rows · V) are formed at once: a tick's clients are
#: trained in chunks under it. A step passes over them five times (product, exp, row pass, two
#: gradient products), so a chunk is kept within a core's L2 cache (512 KiB in float32: 10 clients
#: of 64 rows at V = 204, about 8% less CPU per round than all 44 at once on the stackoverflow
#: preset; at V = 10,004 one client a chunk).
PROBABILITY_FLOATS = 2**17
#: A tick's slots train in two batched steps, not one, where that pads this many rows fewer: a
#: step costs about as much fixed CPU as this many rows (measured on the stackoverflow preset).
SPLIT_ROWS = 128


@dataclass(frozen=True)
class CohortResult:
    """The cohort's local training: the updates new − old (float32), stacked per model array along
    a leading axis whose row ``slot[i]`` is client i's, and the metrics each client's reply
    carries."""

    stacked: list[np.ndarray]
    slot: np.ndarray
    metrics: list[dict]

    @property
    def deltas(self) -> list[list[np.ndarray]]:
        """Per client, its update, model-shaped, in model order."""
        return [[a[j] for a in self.stacked] for j in self.slot]

    def new_weights(self, sent: Sequence[np.ndarray]) -> list[list[np.ndarray]]:
        """Per client, the model it replies: ``sent`` plus its update, added as the per-client
        ClientApp adds them."""
        new = [np.asarray(s) + d for s, d in zip(sent, self.stacked, strict=True)]
        return [[a[j] for a in new] for j in self.slot]


class UserData:
    """Each user's training arrays, built on first use by ``build`` (the task's ``user_data``) and
    kept for the run — the per-client path rebuilds them in every round a user trains."""

    def __init__(
        self,
        build: Callable[[int], tuple],
        prepare: Callable[[tuple], tuple],
        build_many: Callable[[list[int]], list[tuple]] | None = None,
    ):
        self._build, self._prepare, self._build_many = build, prepare, build_many
        self._cache: dict[int, tuple] = {}

    def __call__(self, user: int) -> tuple:
        """The prepared arrays of ``user`` (a partition index)."""
        got = self._cache.get(user)
        if got is None:
            got = self._cache[user] = self._prepared(self._build(user))
        return got

    def many(self, users: Sequence[int]) -> list[tuple]:
        """The prepared arrays of each of ``users``; those not yet built are built together when
        the task can (``build_many``: the task's ``users_data``)."""
        new = [u for u in dict.fromkeys(users) if u not in self._cache]
        if new and self._build_many is not None:
            for user, raw in zip(new, self._build_many(new), strict=True):
                self._cache[user] = self._prepared(raw)
        return [self(u) for u in users]

    def _prepared(self, raw: tuple) -> tuple:
        return (*self._prepare(raw), len(raw[-1]))


def nextword_data(
    build: Callable[[int], tuple], build_many: Callable[[list[int]], list[tuple]] | None = None
) -> UserData:
    """User data for the next-word task: the (previous, next) word pairs of the user's sentences
    (PAD targets dropped, as the per-client path does) and the sentence count."""
    return UserData(build, lambda raw: _pairs(raw[0]), build_many)


def regression_data(build: Callable[[int], tuple]) -> UserData:
    """User data for the regression task: (X, y) in float64 and the example count."""
    return UserData(build, lambda raw: (raw[0].astype(np.float64), raw[1].astype(np.float64)))


@dataclass(frozen=True)
class MinibatchSchedule:
    """Every minibatch of a round's clients, by tick: client slot j (the clients sorted by pair
    count, most first: ``order[j]`` is its index in the cohort) takes its s-th minibatch — its
    epochs' minibatches in the per-client path's order — at tick s, so the clients still training
    at tick t are slots ``0 … active[t] − 1``.

    Attributes:
        order: (m,) the cohort index of each slot.
        active: (T + 1,) how many slots train at each tick (0 after the last).
        rows: (m, T, batch) the stacked embedding row of each minibatch row (slot · V + previous
            word); 0 where padded.
        targets: (m, T, batch) the next word; 0 where padded.
        weights: (m, T, batch) lr / the minibatch's size on real rows, 0 where padded.
        counts: (m, T) the minibatch sizes (0 once a slot is done).
    """

    order: np.ndarray
    active: np.ndarray
    rows: np.ndarray
    targets: np.ndarray
    weights: np.ndarray
    counts: np.ndarray


def minibatch_schedule(
    data: Sequence[tuple[np.ndarray, np.ndarray, int]],
    shuffles: Sequence[tuple[int, ...]],
    lr: float,
    steps: int,
    batch: int,
    vocab: int,
    dtype: type,
) -> MinibatchSchedule:
    """The round's `MinibatchSchedule`: each client's generator ``(*shuffle, 400)`` draws one
    permutation of its pairs per epoch, as `corrflow.clients.nextword_client.local_train` does.

    Args:
        data: per client, (previous words, next words, sentence count).
        shuffles: per client, its data-order seed.
        lr: the local learning rate (folded into the rows' weights).
        steps: local epochs.
        batch: the minibatch size.
        vocab: V, the stride of a slot's rows in the stacked embeddings.
        dtype: the weights' float type.

    Returns:
        The schedule, its slots sorted by pair count (most first).
    """
    lengths = np.array([len(d[0]) for d in data], np.int64)
    m, per_epoch = len(data), -(-lengths // batch)
    order = np.argsort(-lengths, kind="stable")
    ticks = int(per_epoch.max(initial=0)) * steps
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    n = lengths[order]  # per slot; its epochs' permutations are drawn in turn
    drawn = permutations([(*map(int, shuffles[i]), 400) for i in order], n, steps)
    rows = np.zeros((m, ticks, batch), np.int64)
    targets = np.zeros((m, ticks, batch), np.int64)
    weights = np.zeros((m, ticks, batch), dtype)
    counts = np.zeros((m, ticks), np.int64)
    prev = np.concatenate([d[0] for d in data] + [np.zeros(0, np.int64)]).astype(np.int64)
    nxt = np.concatenate([d[1] for d in data] + [np.zeros(0, np.int64)]).astype(np.int64)
    _fill_schedule(
        drawn, n, offsets[order], prev, nxt, steps, vocab, lr, rows, targets, weights, counts
    )
    active = np.append((counts > 0).sum(axis=0), 0)
    return MinibatchSchedule(order, active, rows, targets, weights, counts)


@numba.njit(cache=True, nogil=True)
def _fill_schedule(
    drawn, n, offsets, prev, nxt, steps, vocab, lr, rows, targets, weights, counts
):  # pragma: no cover - compiled
    """Slot j's e-th epoch is permutation ``drawn`` (slots, then epochs, in turn) of its n[j]
    pairs (at ``offsets[j]`` in ``prev``/``nxt``), cut into minibatches in order: the q-th at tick
    e · ⌈n[j] / batch⌉ + q, its rows weighted lr / its size (the last one of an epoch short)."""
    batch = rows.shape[2]
    at = 0
    for j in range(len(n)):
        per_epoch = (n[j] + batch - 1) // batch
        for e in range(steps):
            for q in range(per_epoch):
                t, lo = e * per_epoch + q, q * batch
                size = min(batch, n[j] - lo)
                counts[j, t] = size
                w = lr / size
                for r in range(size):
                    k = drawn[at + lo + r] + offsets[j]
                    rows[j, t, r] = prev[k] + j * vocab
                    targets[j, t, r] = nxt[k]
                    weights[j, t, r] = w
            at += n[j]


@numba.njit(cache=True)
def tick_slices(counts, active, cap, split_rows=SPLIT_ROWS):  # pragma: no cover - compiled
    """Every tick's training slots cut into contiguous slices, each padded to its fullest slot:
    chunks of at most ``cap`` slots, each cut once more where that pads the fewest rows, if it
    saves more than ``split_rows``.

    Args:
        counts: (slots, ticks) the minibatch sizes (`MinibatchSchedule.counts`).
        active: (ticks + 1,) how many slots train at each tick.
        cap: the most slots in one slice.
        split_rows: the padded rows a second slice must save.

    Returns:
        (slices, 4) int64 rows (tick, start, stop, rows), by tick, then in slot order.
    """
    out = np.empty((2 * (len(counts) // cap + 1) * (len(active) - 1), 4), np.int64)
    k = 0
    for t in range(len(active) - 1):
        for start in range(0, active[t], cap):
            c = counts[start : min(start + cap, active[t]), t]
            n = len(c)
            head = np.empty(n, np.int64)  # the fullest of slots start … start + i
            tail = np.empty(n, np.int64)  # … of slots start + i …
            head[0], tail[n - 1] = c[0], c[n - 1]
            for i in range(1, n):
                head[i] = max(head[i - 1], c[i])
                tail[n - 1 - i] = max(tail[n - i], c[n - 1 - i])
            best, cut = n * head[n - 1], 0
            cut_padded = best
            for i in range(1, n):  # slots start … start + i − 1, then the rest
                padded = i * head[i - 1] + (n - i) * tail[i]
                if padded < best - split_rows and (cut == 0 or padded < cut_padded):
                    cut, cut_padded = i, padded
            if cut:
                out[k, 0], out[k, 1], out[k, 2], out[k, 3] = t, start, start + cut, head[cut - 1]
                k += 1
                lo, rows = start + cut, tail[cut]
            else:
                lo, rows = start, head[n - 1]
            out[k, 0], out[k, 1], out[k, 2], out[k, 3] = t, lo, start + n, rows
            k += 1
    return out[:k]


def train_nextword(
    weights: Sequence[np.ndarray],
    data: Sequence[tuple[np.ndarray, np.ndarray, int]],
    shuffles: Sequence[tuple[int, ...]],
    lr: float,
    steps: int,
    batch: int = NEXTWORD_BATCH,
    dtype: type = np.float32,
) -> CohortResult:
    """``steps`` epochs of minibatch SGD for each client of the cohort, all at once: the low-rank
    bigram model of `corrflow.clients.nextword_client` (E, W, b), mean cross-entropy per
    minibatch, the per-client path's data order (`minibatch_schedule`).

    Each client's weights are stacked as E' = [E | 1] (V, D + 1) and W' = [W; b] (D + 1, V), so
    one product gives the logits E'[prev]·W' and one product W''s gradient, b's included.

    Args:
        weights: the global model [E (V, D), W (D, V), b (V)] the round sends.
        data: per client, (previous words, next words, sentence count) (`nextword_data`).
        shuffles: per client, the data-order seed the per-client path uses (seed, user, round).
        lr: the local learning rate.
        steps: local epochs.
        batch: the minibatch size.
        dtype: the arithmetic's float type.

    Returns:
        Per client, the update new − old (float32) and the reply's metrics
        (``num-examples``, the last minibatch's ``train-loss``).
    """
    E0, W0, b0 = (np.asarray(w, dtype) for w in weights)
    m, (V, D) = len(data), E0.shape
    plan = minibatch_schedule(data, shuffles, lr, steps, batch, V, dtype)
    E = np.ones((m, V, D + 1), dtype)
    E[:, :, :D] = E0
    W = np.empty((m, D + 1, V), dtype)
    W[:, :D], W[:, D] = W0, b0
    cap = max(1, PROBABILITY_FLOATS // (batch * V))
    slice_rows = min(m, cap) * batch
    state = _Stacked(
        E,
        W,
        np.empty(slice_rows * V, dtype),
        np.full(m, np.nan),
        np.empty((slice_rows, D + 1), dtype),
        np.empty(slice_rows, dtype),
        np.empty((slice_rows, D), dtype),
        np.empty((min(m, cap), D + 1, V), dtype),
    )
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        for t, start, stop, rows in tick_slices(plan.counts, plan.active, cap).tolist():
            _step(state, plan, t, start, stop, rows)
    slot = np.argsort(plan.order)  # the slot of each client
    deltas = [E[:, :, :D] - E0, W[:, :D] - W0, W[:, D] - b0]
    loss = state.loss[slot]
    return CohortResult(
        [d.astype(np.float32, copy=False) for d in deltas],
        slot,
        [{"num-examples": int(d[2]), "train-loss": float(loss[i])} for i, d in enumerate(data)],
    )


@dataclass
class _Stacked:
    """The stacked weights E' (m, V, D + 1), W' (m, D + 1, V) in slot order, the probabilities'
    buffer, each slot's last minibatch loss, and a step's gathered rows E'[prev], their weights
    w / s, the embedding rows' gradient factors P·W[:D]ᵀ and W''s gradients."""

    E: np.ndarray
    W: np.ndarray
    buffer: np.ndarray
    loss: np.ndarray
    h: np.ndarray
    scale: np.ndarray
    dh: np.ndarray
    grad_w: np.ndarray


def _step(state: _Stacked, plan: MinibatchSchedule, t: int, start: int, stop: int, rows: int):
    """Tick ``t``'s minibatch step of slots ``start … stop − 1`` (their first ``rows`` rows), in
    place. With P = exp(logits) and s its row sums, the gradient of a row's weighted
    cross-entropy w·CE is (w/s)·(P − s·e_y), so P is never normalised: P − s·e_y is formed in
    place and w/s scales the (rows × D) factors instead."""
    m, V, D1 = state.E.shape
    n, size = stop - start, (stop - start) * rows
    E = state.E.reshape(m * V, D1)  # slot j's row of word v is j·V + v (the schedule's rows)
    x = plan.rows[start:stop, t, :rows].reshape(size)
    h = state.h[:size]
    _gather(E, x, h)
    Ws = state.W[start:stop]
    P = state.buffer[: size * V].reshape(n, rows, V)
    scale = state.scale[:size]
    done = max(int(plan.active[t + 1]), start)  # slots from it take their last minibatch now
    args = (
        P,
        plan.targets[start:stop, t, :rows],
        plan.weights[start:stop, t, :rows],
        plan.counts[start:stop, t],
        done - start,
        state.loss[start:stop],
        scale.reshape(n, rows),
    )
    h3 = h.reshape(n, rows, D1)
    np.matmul(h3, Ws, out=P)
    np.exp(P, out=P)
    if not _gradient_rows(*args, SUM_FLOOR):
        # A logit overflowed exp or a row's terms all fell under float's normal range: softmax
        # is shift-invariant, so the row max is subtracted and the rows recomputed.
        np.matmul(h3, Ws, out=P)
        P -= P.max(axis=2, keepdims=True)
        np.exp(P, out=P)
        _gradient_rows(*args, 0.0)
    dh = state.dh[:size]
    np.matmul(P, Ws[:, : D1 - 1].transpose(0, 2, 1), out=dh.reshape(n, rows, D1 - 1))
    _embedding_step(E, x, dh, scale, h)
    grad_w = np.matmul(h3.transpose(0, 2, 1), P, out=state.grad_w[:n])
    np.subtract(Ws, grad_w, out=Ws)


@numba.njit(cache=True, nogil=True)
def _gather(E, rows, h):  # pragma: no cover - compiled
    """h[i] = E[rows_i] (numpy's take, without its per-call checks)."""
    for i in range(len(rows)):
        h[i, :] = E[rows[i], :]


@numba.njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _row_sum(row):  # pragma: no cover - compiled
    """Σ row, reassociated into SIMD lanes (no finite-math assumption: an overflow must show)."""
    acc = row[0]
    for v in range(1, len(row)):
        acc += row[v]
    return acc


@numba.njit(cache=True, nogil=True)
def _gradient_rows(P, y, w, counts, first, loss, scale, floor):  # pragma: no cover - compiled
    """Per row (slot j, row r) of P = exp(logits) (slots, rows, V): its sum s, P[y] −= s in
    place, scale = w / s; the mean cross-entropy −log(P[y]/s + 1e-12) over its real rows into
    ``loss[j]`` for slots from ``first`` on (their last minibatch). False, with P half-formed,
    when a row's s is not finite or not above ``floor``: the caller recomputes P shifted."""
    n, rows, _ = P.shape
    for j in range(n):
        nll = 0.0
        for r in range(rows):
            row = P[j, r]
            s = _row_sum(row)
            if not (math.isfinite(s) and s > floor):
                return False
            k = y[j, r]
            p = row[k] / s
            row[k] -= s
            scale[j, r] = w[j, r] / s
            if w[j, r] > 0:
                nll -= math.log(float(p) + 1e-12)
        if j >= first:
            loss[j] = nll / counts[j]
    return True


@numba.njit(cache=True, nogil=True)
def _embedding_step(E, rows, dh, scale, h):  # pragma: no cover - compiled
    """E[rows_i, :D] −= scale_i · dh_i, rows repeating (np.subtract.at's sum, one pass), and
    h_i *= scale_i for W's gradient."""
    for i in range(len(rows)):
        r, c = rows[i], scale[i]
        for k in range(dh.shape[1]):
            E[r, k] -= c * dh[i, k]
        for k in range(h.shape[1]):
            h[i, k] *= c


def train_regression(
    weights: Sequence[np.ndarray],
    data: Sequence[tuple[np.ndarray, np.ndarray, int]],
    lr: float,
    steps: int,
) -> CohortResult:
    """``steps`` full-batch gradient steps on the mean squared error for each client at once (the
    per-client path's `corrflow.clients.numpy_client.local_update`), with ragged example counts
    padded and masked.

    Args:
        weights: the global model [w (d,), b (1,)].
        data: per client, (X, y, example count) (`regression_data`).
        lr: the local learning rate.
        steps: gradient steps.

    Returns:
        Per client, the update new − old (float32) and the reply's metrics (``num-examples``,
        ``train-loss``: the mean squared error of the new float32 weights on the client's data).
    """
    w0, b0 = (np.asarray(a, np.float64) for a in weights)
    m = len(data)
    X = _padded([d[0] for d in data])  # (m, N, d)
    y = _padded([d[1] for d in data])
    counts = np.array([len(d[1]) for d in data], np.float64)
    live = np.arange(y.shape[1])[None, :] < counts[:, None]
    w, b = np.repeat(w0[None], m, axis=0), np.repeat(b0[None], m, axis=0)
    for _ in range(steps):
        r = (np.einsum("mnd,md->mn", X, w) + b[:, :1] - y) * live
        w = w - lr * 2 * np.einsum("mnd,mn->md", X, r) / counts[:, None]
        b = b - lr * 2 * (r.sum(axis=1) / counts)[:, None]
    deltas = [(w - w0).astype(np.float32), (b - b0).astype(np.float32)]
    new_w = (np.asarray(weights[0]) + deltas[0]).astype(np.float64)
    new_b = (np.asarray(weights[1]) + deltas[1]).astype(np.float64)
    r = (np.einsum("mnd,md->mn", X, new_w) + new_b[:, :1] - y) * live
    mse = (r**2).sum(axis=1) / counts
    metrics = [{"num-examples": int(d[2]), "train-loss": float(mse[i])} for i, d in enumerate(data)]
    return CohortResult(deltas, np.arange(m), metrics)


def _padded(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """The arrays stacked along a new client axis, zero-padded along their first axis to the
    longest."""
    longest = max((len(a) for a in arrays), default=0)
    first = arrays[0]
    out = np.zeros((len(arrays), max(longest, 1), *first.shape[1:]), first.dtype)
    for i, a in enumerate(arrays):
        out[i, : len(a)] = a
    return out
