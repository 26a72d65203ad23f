"""Local training of a whole round's cohort at once, on stacked per-client weights (the cohort
engine, ``--backend cohort``).

Each client trains exactly as on the per-client path — the same data, the same data order (its
own generator seeded by (seed, user, round)), the same local steps and minibatches — but the m
clients' minibatch steps run together as batched matrix products over weights stacked along a
leading client axis (numpy ``matmul``/``einsum``). The next-word model trains in float32 (the
per-client path computes in float64: each update differs from it by about 5e-7 of its ℓ2 norm,
and float32 halves the batched step's CPU); the regression model in float64. Ragged user
data is padded to the cohort's longest and masked: a padded position, or a client whose epoch has
no batch left, contributes an exact zero, so it changes nothing. No Flower message is built: the
replies are the new weights the per-client ClientApp would send, as arrays.

Per-user data is built once per process and kept (`UserData`); the synthetic generators and the
real-format files (``--data``) both go through the task's ``user_data``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from corrflow.clients.nextword_client import _pairs

#: The per-client path's minibatch size (``corrflow.clients.nextword_client.local_train``).
NEXTWORD_BATCH = 64
#: Clients whose minibatches have about as many rows (to this multiple) train in one batched step.
ROW_GROUP = 16


@dataclass(frozen=True)
class CohortResult:
    """The cohort's local training: per client, the update (float32, model-shaped, in model order)
    and the metrics its reply carries."""

    deltas: list[list[np.ndarray]]
    metrics: list[dict]


class UserData:
    """Each user's training arrays, built on first use by ``build`` (the task's ``user_data``) and
    kept for the run — the per-client path rebuilds them in every round a user trains."""

    def __init__(self, build: Callable[[int], tuple], prepare: Callable[[tuple], tuple]):
        self._build, self._prepare = build, prepare
        self._cache: dict[int, tuple] = {}

    def __call__(self, user: int) -> tuple:
        """The prepared arrays of ``user`` (a partition index)."""
        got = self._cache.get(user)
        if got is None:
            raw = self._build(user)
            got = self._cache[user] = (*self._prepare(raw), len(raw[-1]))
        return got


def nextword_data(build: Callable[[int], tuple]) -> UserData:
    """User data for the next-word task: the (previous, next) word pairs of the user's sentences
    (PAD targets dropped, as the per-client path does) and the sentence count."""
    return UserData(build, lambda raw: _pairs(raw[0]))


def regression_data(build: Callable[[int], tuple]) -> UserData:
    """User data for the regression task: (X, y) in float64 and the example count."""
    return UserData(build, lambda raw: (raw[0].astype(np.float64), raw[1].astype(np.float64)))


def epoch_orders(rngs: Sequence[np.random.Generator], lengths: np.ndarray, batch: int):
    """One epoch's data order of every client, padded: positions (m, slots) into each client's
    pairs (0 where padded) and the mask of real ones; slots is a multiple of ``batch`` covering
    the longest client. Each client's generator draws its permutation as the per-client path does.
    """
    m, slots = len(lengths), batch * max(1, math.ceil(int(lengths.max(initial=0)) / batch))
    pos = np.zeros((m, slots), np.int64)
    mask = np.zeros((m, slots), bool)
    for i, (rng, n) in enumerate(zip(rngs, lengths, strict=True)):
        pos[i, :n] = rng.permutation(int(n))
        mask[i, :n] = True
    return pos, mask


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
    minibatch, the per-client path's data order (generator ``(*shuffle, 400)``).

    Args:
        weights: the global model [E (V, D), W (D, V), b (V)] the round sends.
        data: per client, (previous words, next words, sentence count) (`nextword_data`).
        shuffles: per client, the data-order seed the per-client path uses (seed, user, round).
        lr: the local learning rate.
        steps: local epochs.
        batch: the minibatch size.
        dtype: the arithmetic's float type (np.float64 reproduces the per-client path bit for
            bit).

    Returns:
        Per client, the update new − old (float32) and the reply's metrics
        (``num-examples``, the last minibatch's ``train-loss``).
    """
    E0, W0, b0 = (np.asarray(w, dtype) for w in weights)
    m, (V, D) = len(data), E0.shape
    E = np.repeat(E0[None], m, axis=0)
    W, b = np.repeat(W0[None], m, axis=0), np.repeat(b0[None], m, axis=0)
    prev = _padded([d[0] for d in data])
    nxt = _padded([d[1] for d in data])
    lengths = np.array([len(d[0]) for d in data], np.int64)
    rngs = [np.random.default_rng([*map(int, s), 400]) for s in shuffles]
    loss = np.full(m, np.nan)
    flat_E = E.reshape(m * V, D)  # a view: np.add.at on it updates E
    for _ in range(steps):
        pos, mask = epoch_orders(rngs, lengths, batch)
        for start in range(0, pos.shape[1], batch):
            live = mask[:, start : start + batch]
            counts = live.sum(axis=1)
            # only the clients with data left in this epoch, grouped by how many rows they have
            # (to the next multiple of ROW_GROUP), each group trimmed to its fullest client: the
            # power-law users would otherwise leave most of a padded cohort idle
            groups = -(-counts // ROW_GROUP)
            if not groups.any():
                break
            for group in np.unique(groups[groups > 0]):
                act = np.flatnonzero(groups == group)
                rows = int(counts[act].max())
                sel = pos[act, start : start + rows]
                c = act[:, None]
                loss[act] = _step(
                    E, W, b, flat_E, act, prev[c, sel], nxt[c, sel], live[act, :rows],
                    counts[act], lr,
                )  # fmt: skip
    deltas = [
        [(a[i] - a0).astype(np.float32) for a, a0 in ((E, E0), (W, W0), (b, b0))] for i in range(m)
    ]
    metrics = [
        {"num-examples": int(d[2]), "train-loss": float(loss[i])} for i, d in enumerate(data)
    ]
    return CohortResult(deltas, metrics)


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
    deltas = [[(w[i] - w0).astype(np.float32), (b[i] - b0).astype(np.float32)] for i in range(m)]
    new_w = np.stack([np.asarray(weights[0]) + d[0] for d in deltas]).astype(np.float64)
    new_b = np.stack([np.asarray(weights[1]) + d[1] for d in deltas]).astype(np.float64)
    r = (np.einsum("mnd,md->mn", X, new_w) + new_b[:, :1] - y) * live
    mse = (r**2).sum(axis=1) / counts
    metrics = [{"num-examples": int(d[2]), "train-loss": float(mse[i])} for i, d in enumerate(data)]
    return CohortResult(deltas, metrics)


def _step(E, W, b, flat_E, act, x, y, live, counts, lr) -> np.ndarray:
    """One minibatch step of the clients ``act`` (their rows ``x`` → ``y``, ``live`` the real ones,
    ``counts`` how many), in place on the stacked E, W, b; returns each one's mean batch loss."""
    V, D = E.shape[1:]
    c, Wa = act[:, None], W[act]
    h = E[c, x]  # (a, B, D)
    logits = h @ Wa + b[act][:, None, :]
    logits -= logits.max(axis=2, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=2, keepdims=True)
    rows = np.arange(x.shape[1])[None, :]
    clients = np.arange(len(act))[:, None]
    nll = -np.log(p[clients, rows, y].astype(np.float64) + 1e-12)
    g = p
    g[clients, rows, y] -= 1.0
    g *= (live / counts[:, None]).astype(g.dtype)[:, :, None]  # padded rows: exact zeros
    dh = g @ Wa.transpose(0, 2, 1)
    W[act] = Wa - lr * (h.transpose(0, 2, 1) @ g)
    b[act] -= lr * g.sum(axis=1)
    np.add.at(flat_E, (c * V + x).ravel(), (-lr * dh).reshape(-1, D).astype(E.dtype))
    return (nll * live).sum(axis=1) / counts


def _padded(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """The arrays stacked along a new client axis, zero-padded along their first axis to the
    longest."""
    longest = max((len(a) for a in arrays), default=0)
    first = arrays[0]
    out = np.zeros((len(arrays), max(longest, 1), *first.shape[1:]), first.dtype)
    for i, a in enumerate(arrays):
        out[i, : len(a)] = a
    return out
