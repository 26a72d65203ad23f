"""A dependency-free codec for ``tf.train.Example`` protocol buffers (the rows of TFF's SQLite
datasets).

Only the wire format of ``tensorflow/core/example/{example,feature}.proto`` is needed: Example{1:
Features}, Features{1: map<string, Feature>}, Feature{oneof 1: BytesList, 2: FloatList, 3:
Int64List}, each list field 1 (floats and int64s packed, unpacked also accepted). Reading the real
files therefore needs neither TensorFlow nor TensorFlow Federated; the tests check byte equality
with TensorFlow's own serializer when it is installed.
"""

from __future__ import annotations

import struct

import numpy as np

Value = list[bytes] | np.ndarray


class ProtoError(ValueError):
    """The bytes are not a well-formed tf.train.Example."""


_SMALL = [bytes([i]) for i in range(128)]


def _varint(value: int) -> bytes:
    if 0 <= value < 128:
        return _SMALL[value]
    value &= (1 << 64) - 1  # int64 negatives are 10-byte two's complement varints
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ProtoError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ProtoError("varint longer than 10 bytes")


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _feature(value) -> bytes:
    if isinstance(value, (bytes, str)):
        value = [value]
    if isinstance(value, np.ndarray) and value.dtype.kind == "f":
        return _field(2, _field(1, np.asarray(value, "<f4").tobytes()) if value.size else b"")
    if isinstance(value, np.ndarray) and value.dtype.kind in "iu":
        return _field(3, _field(1, b"".join(_varint(int(v)) for v in value)) if value.size else b"")
    items = [v.encode() if isinstance(v, str) else bytes(v) for v in value]
    return _field(1, b"".join(_field(1, v) for v in items))


def encode_example(features: dict) -> bytes:
    """Serialize ``{name: bytes | str | [bytes|str] | float ndarray | int ndarray}`` as a
    tf.train.Example. Map entries are written in sorted key order (as TensorFlow's deterministic
    serializer does)."""
    entries = b"".join(
        _field(1, _field(1, k.encode()) + _field(2, _feature(features[k])))
        for k in sorted(features)
    )
    return _field(1, entries)


def _messages(buf: bytes):
    """Yield (field number, wire type, payload or int) of one message level."""
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(buf, pos)
            yield number, wire, value
        elif wire == 2:
            size, pos = _read_varint(buf, pos)
            if pos + size > len(buf):
                raise ProtoError("truncated length-delimited field")
            yield number, wire, buf[pos : pos + size]
            pos += size
        elif wire == 5:
            if pos + 4 > len(buf):
                raise ProtoError("truncated fixed32")
            yield number, wire, buf[pos : pos + 4]
            pos += 4
        elif wire == 1:
            if pos + 8 > len(buf):
                raise ProtoError("truncated fixed64")
            yield number, wire, buf[pos : pos + 8]
            pos += 8
        else:
            raise ProtoError(f"unsupported wire type {wire}")


def _decode_list(kind: int, payload: bytes) -> Value:
    if kind == 1:
        return [v for n, w, v in _messages(payload) if n == 1 and w == 2]
    values: list = []
    for n, w, v in _messages(payload):
        if n != 1:
            continue
        if kind == 2:
            values.extend(
                struct.unpack(f"<{len(v) // 4}f", v) if w == 2 else struct.unpack("<f", v)
            )
        elif w == 2:
            pos = 0
            while pos < len(v):
                x, pos = _read_varint(v, pos)
                values.append(x - (1 << 64) if x >= 1 << 63 else x)
        else:
            values.append(v - (1 << 64) if v >= 1 << 63 else v)
    return np.asarray(values, dtype=np.float32 if kind == 2 else np.int64)


def decode_example(data: bytes) -> dict[str, Value]:
    """Parse a serialized tf.train.Example into ``{name: [bytes] | float32 array | int64
    array}``."""
    out: dict[str, Value] = {}
    for n, w, features in _messages(bytes(data)):
        if n != 1 or w != 2:
            continue
        for m, w2, entry in _messages(features):
            if m != 1 or w2 != 2:
                continue
            key, value = None, None
            for f, w3, payload in _messages(entry):
                if f == 1 and w3 == 2:
                    key = payload.decode("utf-8")
                elif f == 2 and w3 == 2:
                    value = [b""][:0]
                    for kind, w4, lst in _messages(payload):
                        if kind in (1, 2, 3) and w4 == 2:
                            value = _decode_list(kind, lst)
            if key is None:
                raise ProtoError("feature map entry without a key")
            out[key] = value if value is not None else []
    return out
