"""The run's noise streams against their one interface, the `NoiseStream` protocol: the in-process
stream, the noise workers' and the noise node's each satisfy it, none inherits from another, and
none has a member that only refuses (a stream either does what the protocol says or is not one)."""

from __future__ import annotations

import ast
import inspect
import textwrap

import numpy as np
import pytest

from corrflow.errors import IntegrityError
from corrflow.factorization.build import factorize, participation_for
from corrflow.noise.segments import SegmentTable
from corrflow.run.noise import LocalNoiseStream, NoiseStream
from corrflow.run.noise_node_link import NoiseNodeLink, NoiseNodeStream
from corrflow.run.noise_shards import ShardedNoiseStream

MEMBERS = ("lost", "next_round", "segments", "watch", "add", "skip", "save")
STREAMS = (LocalNoiseStream, ShardedNoiseStream, NoiseNodeStream)
KEY = bytes(range(16))


@pytest.fixture(scope="module")
def fac():
    return factorize("toeplitz", participation_for(4, 2), bands=2)


def _link() -> NoiseNodeLink:
    return NoiseNodeLink(7, bytes(32), bytes(64))


def _sharded(fac) -> ShardedNoiseStream:
    """A noise workers' stream as the run holds it between rounds, without starting Ray (its
    constructor launches the workers): the protocol reads only its round and its key segments."""
    s = object.__new__(ShardedNoiseStream)
    s._next, s._table = 0, SegmentTable.single(KEY)
    return s


def test_each_stream_is_a_noise_stream(fac):
    streams = [
        LocalNoiseStream.new(fac, [(5,)], KEY),
        _sharded(fac),
        NoiseNodeStream(_link()),
    ]
    for s in streams:
        assert isinstance(s, NoiseStream), type(s).__name__
        assert s.lost is None and s.next_round == 0
        assert [seg.first_round for seg in s.segments.segments] in ([0], [])
    assert not isinstance(object(), NoiseStream)


@pytest.mark.parametrize("cls", STREAMS, ids=lambda c: c.__name__)
def test_no_stream_inherits_or_has_a_member_that_only_raises(cls):
    assert cls.__mro__[1:] == (object,)  # nothing inherited to override with a refusal
    for name in MEMBERS:
        assert hasattr(cls, name), (cls.__name__, name)
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        body = [
            b
            for b in fn.body
            if not (isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant))  # docstring
        ]
        only_raises = len(body) == 1 and isinstance(body[0], ast.Raise)
        assert not only_raises, f"{cls.__name__}.{fn.name} only raises"


def test_the_noise_nodes_stream_takes_its_receipt_when_skipped_as_when_added():
    stream = NoiseNodeStream(_link())
    total = [np.ones(3, np.float32)]
    with pytest.raises(IntegrityError, match="no receipt of the noise node"):
        stream.skip(0)  # nothing from the noise node: nothing is released
    segment = {"first_round": 0, "key_fingerprint": "ab" * 16}
    stream.receive(0, segment, "1" * 64)
    stream.skip(0)
    stream.receive(1, segment, "2" * 64)
    stream.add(total, 1, np.float32(3.0))
    assert total[0].tolist() == [1.0, 1.0, 1.0]  # the noise node's noise is in the sum already
    assert stream.next_round == 2 and stream.journal_head == "2" * 64
    with pytest.raises(IntegrityError):
        stream.add(total, 2, np.float32(3.0))
