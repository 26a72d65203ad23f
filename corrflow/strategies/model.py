"""The model as the user's app sees it: the names, order and dtypes of its arrays, and which of them
train.

The server keeps floating-point arrays (the trainable ones) as float32 and sends every model with
the initial ``ArrayRecord``'s keys, order and dtypes, so a PyTorch ``state_dict`` or a Keras weight
list round-trips unchanged. Non-floating arrays (integer buffers such as BatchNorm's
``num_batches_tracked``) keep the server's values: clients cannot change them, and they carry no
noise. A reply is full weights (update = reply − model sent, subtracted in the wider of the two
dtypes — the exact difference rounded once to float32, as a float64 subtraction would give) or, with
``replies = "delta"``, the update itself.
"""

from __future__ import annotations

import io
import math
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
    trainable: tuple[int, ...]  # indices of the floating-point arrays
    frozen: tuple[np.ndarray, ...]  # the non-floating arrays, in order

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
        return cls(
            keys,
            tuple(a.dtype for a in arrays),
            tuple(tuple(a.shape) for a in arrays),
            trainable,
            tuple(a.copy() for i, a in enumerate(arrays) if i not in trainable),
        )

    @property
    def trainable_shapes(self) -> list[tuple[int, ...]]:
        return [self.shapes[i] for i in self.trainable]

    def trainable_arrays(self, initial: ArrayRecord | Sequence[np.ndarray]) -> list[np.ndarray]:
        arrays = initial.to_numpy_ndarrays() if isinstance(initial, ArrayRecord) else list(initial)
        return [np.asarray(arrays[i], dtype=np.float32).copy() for i in self.trainable]

    def full(self, params: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Every array of the model, in order and in its own dtype, from the float32 trainable
        ``params``."""
        out, frozen, trained = [], iter(self.frozen), dict(zip(self.trainable, params, strict=True))
        for i, dtype in enumerate(self.dtypes):
            out.append(trained[i].astype(dtype, copy=False) if i in trained else next(frozen))
        return out

    def record(self, params: Sequence[np.ndarray]) -> ArrayRecord:
        return ArrayRecord(
            OrderedDict(
                (k, Array(np.require(a, requirements="C")))  # keeps 0-d arrays 0-d
                for k, a in zip(self.keys, self.full(params), strict=True)
            )
        )

    def reply_arrays(self, record: ArrayRecord) -> list[np.ndarray]:
        """Read-only views of the trainable arrays in a reply, checked for names, count, dtype and
        shape (RejectedReplyError when they cannot be used). The update is formed by
        `ClippedSum`: reply − model sent for full weights,
        the reply itself for deltas."""
        keys = tuple(record.keys())
        if keys != self.keys and not (
            all(k.isdigit() for k in keys) and len(keys) == len(self.keys)
        ):
            raise RejectedReplyError(
                f"array names {list(keys)[:4]}… differ from the model's {list(self.keys)[:4]}…"
            )
        if len(keys) != len(self.keys):
            raise RejectedReplyError(f"expected {len(self.keys)} arrays, got {len(keys)}")
        payloads = list(record.values())
        out = []
        for i in self.trainable:
            try:
                a = array_view(payloads[i])
            except Exception as exc:  # undecodable array payloads of any kind
                raise RejectedReplyError(f"undecodable arrays ({exc})") from exc
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


def array_view(payload: Array) -> np.ndarray:
    """The NumPy array in a Flower ``Array`` without copying its bytes (a read-only view into the
    serialized ``np.save`` payload); other serializations go through Flower's own decoder."""
    data = payload.data
    if payload.stype != "numpy.ndarray" or not isinstance(data, bytes):
        return payload.numpy()
    head = io.BytesIO(data)
    version = np.lib.format.read_magic(head)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(head)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(head)
    else:
        return payload.numpy()
    if dtype.hasobject:
        raise ValueError("object arrays are not accepted")
    count = math.prod(shape)
    offset = head.tell()
    if len(data) - offset < count * dtype.itemsize:
        raise ValueError(
            f"{len(data) - offset} bytes of data for {count} × {dtype.itemsize}-byte values"
        )
    flat = np.frombuffer(data, dtype=dtype, count=count, offset=offset)
    return flat.reshape(shape[::-1]).T if fortran else flat.reshape(shape)


def arrays_sha256(model: ArrayRecord | Sequence[np.ndarray]) -> str:
    """SHA-256 of a model's arrays in order (dtype, shape and bytes of each; names are not hashed,
    so a list and the ArrayRecord built from it agree)."""
    from corrflow.factorization.base import arrays_sha256 as digest

    arrays = (
        model.to_numpy_ndarrays()
        if isinstance(model, ArrayRecord)
        else [np.asarray(a) for a in model]
    )
    return digest({f"{i:06d}": a for i, a in enumerate(arrays)})
