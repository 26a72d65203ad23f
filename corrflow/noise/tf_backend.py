"""TensorFlow backend of `CorrelatedNoise`: the same modes and state,
computed with TensorFlow ops on the default device (a GPU when TensorFlow sees one).

Randomness: ``tf.random.stateless_normal(..., alg="philox")`` seeded by
`corrflow.noise.keys.tf_seed` (derived from the key, round and chunk), so each (round, chunk) draw
is a pure function of the secret key — deterministic for a key on a given device, but not
bit-identical to the NumPy backend (the promise is the same distribution, not the same bits).
"""

from __future__ import annotations

import numpy as np

from corrflow.errors import InvalidArgumentError
from corrflow.noise.engine import STATEFUL_MODES, CorrelatedNoise
from corrflow.noise.keys import tf_seed
from corrflow.noise.segments import SegmentedSource


def _tf():
    try:
        import tensorflow as tf
    except ImportError as exc:  # pragma: no cover - depends on the optional dependency
        raise InvalidArgumentError(
            "backend", "TensorFlow installed for the tensorflow backend"
        ) from exc
    return tf


class TFGaussianSource:
    """Stateless Philox draws on the TensorFlow device, keyed by (secret key, round, chunk) under
    the key's derivation ``version``."""

    name = "tf-philox"

    def __init__(self, key: bytes, version: int):
        self._key, self._version = key, version
        self._tf = _tf()

    def seed(self, round_index: int, chunk: int) -> np.ndarray:
        seed = tf_seed(self._key, round_index, chunk, version=self._version)
        return np.frombuffer(seed, dtype="<i8").copy()

    def normal(self, round_index: int, chunk: int, size: int):
        tf = self._tf
        return tf.random.stateless_normal(
            [size], seed=self.seed(round_index, chunk), dtype=tf.float32, alg="philox"
        )


class TFCorrelatedNoise(CorrelatedNoise):
    """`CorrelatedNoise` whose draws and recursions run in TensorFlow; ``next`` returns NumPy
    arrays."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._source = SegmentedSource(self._source.table, TFGaussianSource)
        tf = self._tf = _tf()
        if self._buffer is not None:
            self._tf_buffer = tf.Variable(
                tf.zeros(self._buffer.shape, dtype=tf.float32), trainable=False
            )

    def _advance(self, t: int) -> np.ndarray:
        stateful = self.mode in STATEFUL_MODES
        out = self._compute(t, self._tf_buffer if stateful else None)
        if stateful:  # keep the NumPy mirror current for checkpoints
            self._buffer[...] = self._tf_buffer.numpy()
        return out

    def _compute(self, t: int, buf) -> np.ndarray:
        tf = self._tf
        parts = []
        if self.mode == "banded":
            coefs = self.factorization.encoder.row_band(t)
            p = len(coefs)
            weights = np.zeros((1, max(p - 1, 0)), dtype=np.float32)
            for r in range(1, p):
                if t - r >= 0:
                    weights[0, (t - r) % (p - 1)] = coefs[r]
            w = tf.constant(weights)
            for c, lo, hi in self._chunks():
                acc = self._source.normal(t, c, hi - lo)
                if p > 1 and t > 0:
                    acc = acc - tf.reshape(tf.matmul(w, buf[:, lo:hi]), [-1])
                acc = acc / np.float32(coefs[0])
                if p > 1:
                    buf[t % (p - 1), lo:hi].assign(acc)
                parts.append(acc)
        # the engine's recursion, in float64 with a float32 state (engine docstring)
        elif self.mode == "blt":
            enc = self.factorization.encoder
            for c, lo, hi in self._chunks():
                y = tf.cast(self._source.normal(t, c, hi - lo), tf.float64)
                state = [tf.cast(buf[j, lo:hi], tf.float64) for j in range(enc.buffers)]
                for s_j, w in zip(state, enc.output_scale, strict=True):
                    y = y - float(w) * s_j
                for j, (s_j, d) in enumerate(zip(state, enc.buf_decay, strict=True)):
                    buf[j, lo:hi].assign(tf.cast(float(d) * s_j + y, tf.float32))
                parts.append(tf.cast(y * (self.stddev / enc.scale), tf.float32))
            return tf.concat(parts, axis=0).numpy()
        else:
            terms = self._terms(t)
            for c, lo, hi in self._chunks():
                acc = tf.zeros([hi - lo], dtype=tf.float32)
                for j, coef in terms:
                    acc = acc + np.float32(coef) * self._source.normal(j, c, hi - lo)
                parts.append(acc)
        out = tf.concat(parts, axis=0) * np.float32(self.stddev)
        return out.numpy()

    def _stateless(self, t: int, out: np.ndarray) -> None:
        out[...] = self._compute(t, None)

    def _replay(self, t: int) -> np.ndarray:
        if self.mode not in STATEFUL_MODES:
            return self._compute(t, None)
        tf = self._tf
        scratch = tf.Variable(tf.zeros(self._buffer.shape, dtype=tf.float32), trainable=False)
        out = None
        for s in range(t + 1):
            out = self._compute(s, scratch)
        return out

    def load_buffer(self) -> None:
        """After a restore: copy the NumPy buffer into the TensorFlow variable."""
        if self._buffer is not None:
            self._tf_buffer.assign(self._buffer)
