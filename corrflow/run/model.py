"""The model as the user's app sees it: the names, order and dtypes of its arrays, and which of them
train.

The server keeps floating-point arrays (the trainable ones) as float32 and sends every model with
the initial model's names, order and dtypes, so a PyTorch ``state_dict`` or a Keras weight list
round-trips unchanged. Non-floating arrays (integer buffers such as BatchNorm's
``num_batches_tracked``) keep the server's values: clients cannot change them, and they carry no
noise. A reply is full weights (update = reply − model sent, subtracted in the wider of the two
dtypes — the exact difference rounded once to float32, as a float64 subtraction would give) or, with
``replies = "delta"``, the update itself. Knows nothing of Flower: the strategies' messaging
converts ``ArrayRecord``s to and from the arrays and names used here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from corrflow.errors import require
from corrflow.factorization.base import arrays_sha256 as _digest
from corrflow.run.clipping import RejectedReplyError


@dataclass(frozen=True)
class ModelLayout:
    """Names, dtypes and shapes of the model's arrays, which of them train, and the values of the
    frozen (non-floating) ones."""

    keys: tuple[str, ...]
    dtypes: tuple[np.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]
    trainable: tuple[int, ...]  # indices of the floating-point arrays
    frozen: tuple[np.ndarray, ...]  # the non-floating arrays, in order

    @classmethod
    def of(cls, arrays: Sequence[np.ndarray], keys: Sequence[str] | None = None) -> ModelLayout:
        """The layout of the initial model ``arrays`` (names ``keys``; default "0", "1", …)."""
        arrays = [np.asarray(a) for a in arrays]
        keys = tuple(str(i) for i in range(len(arrays))) if keys is None else tuple(keys)
        require(len(arrays) >= 1, "initial_arrays", "at least one array")
        require(len(keys) == len(arrays), "initial_arrays", "one name per array", list(keys))
        trainable = tuple(i for i, a in enumerate(arrays) if np.issubdtype(a.dtype, np.floating))
        require(bool(trainable), "initial_arrays", "at least one floating-point array to train")
        return cls(
            keys,
            tuple(a.dtype for a in arrays),
            tuple(tuple(a.shape) for a in arrays),
            trainable,
            tuple(a.copy() for i, a in enumerate(arrays) if i not in trainable),
        )

    #: the trainable arrays' shapes and names, in order (derived once)
    trainable_shapes: tuple[tuple[int, ...], ...] = field(init=False, compare=False)
    trainable_names: tuple[str, ...] = field(init=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "trainable_shapes", tuple(self.shapes[i] for i in self.trainable))
        object.__setattr__(self, "trainable_names", tuple(self.keys[i] for i in self.trainable))

    def trainable_arrays(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The trainable arrays of a whole model, as float32 copies."""
        return [np.asarray(arrays[i], dtype=np.float32).copy() for i in self.trainable]

    def full(self, params: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Every array of the model, in order and in its own dtype, from the float32 trainable
        ``params``."""
        out, frozen, trained = [], iter(self.frozen), dict(zip(self.trainable, params, strict=True))
        for i, dtype in enumerate(self.dtypes):
            out.append(trained[i].astype(dtype, copy=False) if i in trained else next(frozen))
        return out

    def reply_arrays(
        self,
        names: Sequence[str],
        arrays: Sequence[np.ndarray],
        undecodable: str | None = None,
    ) -> list[np.ndarray]:
        """The trainable arrays of a reply, checked in this order: its array ``names`` are the
        model's (or all-digit names of the same count: a list-based client's); its arrays could be
        decoded (``undecodable``: why not); its ``arrays`` (all of the model's, in order) have the
        model's shapes and floating dtypes. RejectedReplyError when they cannot be used. The update
        is formed by `corrflow.run.clipping.ExactSum`: reply − model sent for full weights, the
        reply itself for deltas."""
        keys, expected = tuple(names), len(self.keys)
        if keys != self.keys and not (all(k.isdigit() for k in keys) and len(keys) == expected):
            raise RejectedReplyError(
                f"array names {list(keys)[:4]}… differ from the model's {list(self.keys)[:4]}…"
            )
        if len(keys) != expected:
            raise RejectedReplyError(f"expected {expected} arrays, got {len(keys)}")
        if undecodable is not None:
            raise RejectedReplyError(f"undecodable arrays ({undecodable})")
        if len(arrays) != expected:
            raise RejectedReplyError(f"expected {expected} arrays, got {len(arrays)}")
        out = []
        for i in self.trainable:
            a = arrays[i]
            if not np.issubdtype(a.dtype, np.floating):
                raise RejectedReplyError(
                    f"array {i} ({self.keys[i]}): dtype {a.dtype}, expected a floating type"
                )
            if a.shape != self.shapes[i]:
                raise RejectedReplyError(
                    f"array {i} ({self.keys[i]}): shape {a.shape}, expected {self.shapes[i]}"
                )
            out.append(a)
        return out

    def sent(self, params: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The trainable arrays as the clients received them (in the model's own dtypes)."""
        full = self.full(params)
        return [full[i] for i in self.trainable]


def arrays_sha256(arrays: Sequence[np.ndarray]) -> str:
    """SHA-256 of a model's arrays in order (dtype, shape and bytes of each; names are not hashed,
    so a list and a Flower ``ArrayRecord`` built from it agree)."""
    return _digest({f"{i:06d}": np.asarray(a) for i, a in enumerate(arrays)})
