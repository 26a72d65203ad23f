"""The model as the user's app sees it: the names, order and dtypes of its arrays, and which of them train.

The server keeps floating-point arrays (the trainable ones) as float32 and sends every model with the initial
``ArrayRecord``'s keys, order and dtypes, so a PyTorch ``state_dict`` or a Keras weight list round-trips unchanged.
Non-floating arrays (integer buffers such as BatchNorm's ``num_batches_tracked``) keep the server's values: clients
cannot change them, and they carry no noise. A reply is full weights (update = reply − model sent, subtracted in the
wider of the two dtypes — the exact difference rounded once to float32, as a float64 subtraction would give) or,
with ``replies = "delta"``, the update itself.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord

from corrflow.errors import require
from corrflow.strategies.validation import RejectedReplyError

REPLIES = ("weights", "delta")


@dataclass(frozen=True)
class ModelLayout:
    keys: tuple[str, ...]
    dtypes: tuple[np.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]
    trainable: tuple[int, ...]           # indices of the floating-point arrays
    frozen: tuple[np.ndarray, ...]       # the non-floating arrays, in order

    @classmethod
    def of(cls, initial: ArrayRecord | Sequence[np.ndarray]) -> ModelLayout:
        if isinstance(initial, ArrayRecord):
            keys, arrays = tuple(initial.keys()), initial.to_numpy_ndarrays()
        else:
            arrays = [np.asarray(a) for a in initial]
            keys = tuple(str(i) for i in range(len(arrays)))
        require(len(arrays) >= 1, "initial_arrays", "at least one array")
        trainable = tuple(i for i, a in enumerate(arrays) if np.issubdtype(a.dtype, np.floating))
        require(bool(trainable), "initial_arrays", "at least one floating-point array to train")
        return cls(keys, tuple(a.dtype for a in arrays), tuple(tuple(a.shape) for a in arrays), trainable,
                   tuple(a.copy() for i, a in enumerate(arrays) if i not in trainable))

    @property
    def trainable_shapes(self) -> list[tuple[int, ...]]:
        return [self.shapes[i] for i in self.trainable]

    def trainable_arrays(self, initial: ArrayRecord | Sequence[np.ndarray]) -> list[np.ndarray]:
        arrays = initial.to_numpy_ndarrays() if isinstance(initial, ArrayRecord) else list(initial)
        return [np.asarray(arrays[i], dtype=np.float32).copy() for i in self.trainable]

    def full(self, params: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Every array of the model, in order and in its own dtype, from the float32 trainable ``params``."""
        out, frozen, trained = [], iter(self.frozen), dict(zip(self.trainable, params, strict=True))
        for i, dtype in enumerate(self.dtypes):
            out.append(trained[i].astype(dtype, copy=False) if i in trained else next(frozen))
        return out

    def record(self, params: Sequence[np.ndarray]) -> ArrayRecord:
        return ArrayRecord(OrderedDict((k, Array(np.require(a, requirements="C")))  # keeps 0-d arrays 0-d
                                       for k, a in zip(self.keys, self.full(params), strict=True)))

    def update_from_reply(self, record: ArrayRecord, params: Sequence[np.ndarray], replies: str) -> list[np.ndarray]:
        """The float32 update of the trainable arrays in a reply (RejectedReplyError when it cannot be used)."""
        keys = tuple(record.keys())
        if keys != self.keys and not (all(k.isdigit() for k in keys) and len(keys) == len(self.keys)):
            raise RejectedReplyError(f"array names {list(keys)[:4]}… differ from the model's {list(self.keys)[:4]}…")
        try:
            arrays = record.to_numpy_ndarrays()
        except Exception as exc:  # undecodable array payloads of any kind
            raise RejectedReplyError(f"undecodable arrays ({exc})") from exc
        if len(arrays) != len(self.keys):
            raise RejectedReplyError(f"expected {len(self.keys)} arrays, got {len(arrays)}")
        sent = self.full(params) if replies == "weights" else None
        update = []
        for i in self.trainable:
            a = np.asarray(arrays[i])
            if not np.issubdtype(a.dtype, np.floating):
                raise RejectedReplyError(f"array {i} ({self.keys[i]}): dtype {a.dtype}, expected a floating type")
            if a.shape != self.shapes[i]:
                raise RejectedReplyError(f"array {i} ({self.keys[i]}): shape {a.shape}, expected {self.shapes[i]}")
            if sent is None:
                u = a.astype(np.float32, copy=False)
            else:   # in the wider dtype (≥ float32): the exact difference, rounded once to float32
                u = np.subtract(a, sent[i], dtype=np.result_type(a.dtype, sent[i].dtype, np.float32))
                u = u.astype(np.float32, copy=False)
            if not np.isfinite(u).all():   # NaN/Inf in the reply, or a difference beyond float32
                raise RejectedReplyError(f"array {i} ({self.keys[i]}): NaN or Inf values")
            update.append(u)
        return update


def arrays_sha256(model: ArrayRecord | Sequence[np.ndarray]) -> str:
    """SHA-256 of a model's arrays in order (dtype, shape and bytes of each; names are not hashed, so a list and
    the ArrayRecord built from it agree)."""
    from corrflow.factorization.base import arrays_sha256 as digest

    arrays = model.to_numpy_ndarrays() if isinstance(model, ArrayRecord) else [np.asarray(a) for a in model]
    return digest({f"{i:06d}": a for i, a in enumerate(arrays)})
