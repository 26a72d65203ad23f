"""The run's changing state, its fixed secrets, and the read-only view of the state that everyone
but the run sees.

`RunState` is what changes: the model, the optimizer's momentum, the ledger, the metric
history, the next round, the streak of empty rounds, the stop reason and pending overrides. Only
`Run` holds it; everything outside reads `RunView`, whose
attributes cannot be assigned and whose lists, dicts and arrays cannot be changed through it — so
the single-writer rule holds by type, not by convention. `RunSecrets` is fixed for the run's
life: the report salt, the server secret (HMAC key of checkpoints and journal), the sampler key of
an amplified run, the run id and the SHA-256 of the initial model.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from corrflow.accounting.tracking import IncrementalSensitivity
from corrflow.run.ledger import Ledger


@dataclass
class RunState:
    params: list[np.ndarray]
    momentum: list[np.ndarray]
    ledger: Ledger = field(default_factory=Ledger)
    metrics_history: list[dict] = field(default_factory=list)
    next_round: int = 0
    empty_streak: int = 0
    stopped_reason: str | None = None
    pending_overrides: dict[int, list[str]] = field(default_factory=dict)
    # the realised sensitivity, kept from each round's cohort (derived from ledger.selected: rebuilt
    # on restore, never persisted)
    sensitivity: IncrementalSensitivity | None = None


@dataclass(frozen=True)
class RunSecrets:
    salt: bytes
    secret: bytes
    sampler_key: bytes | None
    run_id: str
    initial_sha256: str

    @classmethod
    def new(cls, amplified: bool, initial_sha256: str) -> RunSecrets:
        return cls(
            secrets.token_bytes(32),
            secrets.token_bytes(32),
            secrets.token_bytes(32) if amplified else None,
            secrets.token_hex(8),
            initial_sha256,
        )


@dataclass(frozen=True)
class Stop:
    """The run stops before its planned rounds (budget guard, interrupt, a non-finite model), for
    ``reason``."""

    reason: str


@dataclass(frozen=True)
class Override:
    """An operator adds ``items`` to round ``round``'s cohort (checked by the separation monitor
    like any item)."""

    round: int
    items: list[str]


def read_only(value: Any) -> Any:
    """``value`` as seen from outside the run: lists and tuples as `ReadOnlyList`, dicts as
    `ReadOnlyDict`, arrays as non-writeable views, anything else as it is (immutable).
    O(1): nothing is copied, the wrappers read through to the run's own objects."""
    if isinstance(value, list | tuple):
        return ReadOnlyList(value)
    if isinstance(value, dict):
        return ReadOnlyDict(value)
    if isinstance(value, np.ndarray):
        view = value.view()
        view.flags.writeable = False
        return view
    return value


class ReadOnlyList(Sequence):
    """A sequence that reads through to a list of the run's and cannot change it; equal to any
    sequence with equal items."""

    __slots__ = ("_data",)

    def __init__(self, data: Sequence):
        object.__setattr__(self, "_data", data)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return ReadOnlyList(self._data[i])
        return read_only(self._data[i])

    def __len__(self) -> int:
        return len(self._data)

    def __eq__(self, other) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None

    def __setattr__(self, name, value):
        raise AttributeError(f"the run's state is read-only outside the run ({name})")

    def __repr__(self) -> str:
        return repr(self._data)


class ReadOnlyDict(Mapping):
    """A mapping that reads through to a dict of the run's and cannot change it."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping):
        object.__setattr__(self, "_data", data)

    def __getitem__(self, key):
        return read_only(self._data[key])

    def __iter__(self) -> Iterator:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __setattr__(self, name, value):
        raise AttributeError(f"the run's state is read-only outside the run ({name})")

    def __repr__(self) -> str:
        return repr(self._data)


class _View:
    """Read-only attribute access to an object of the run's (see `read_only`)."""

    __slots__ = ("_of",)
    _fields: tuple[str, ...] = ()

    def __init__(self, of: Any):
        object.__setattr__(self, "_of", of)

    def __getattr__(self, name: str):
        if name not in self._fields:
            raise AttributeError(name)
        return read_only(getattr(self._of, name))

    def __setattr__(self, name, value):
        raise AttributeError(
            f"the run's state is read-only outside the run: {type(self).__name__}.{name} cannot be "
            "assigned (a round changes it through Run.step)"
        )

    __delattr__ = __setattr__

    def __dir__(self):
        return list(self._fields)


class LedgerView(_View):
    """The ledger as seen from outside the run."""

    __slots__ = ()
    _fields = ("selected", "replied", "rejections", "overrides", "rounds_completed")

    @property
    def epsilon_history(self) -> ReadOnlyList:
        return ReadOnlyList(self._of.epsilon_history)

    def to_dict(self) -> dict:
        """A deep copy of the ledger, as checkpoints store it."""
        return _copy(self._of.to_dict())


class RunView(_View):
    """The run's state as seen from outside the run (see the module docstring)."""

    __slots__ = ()
    _fields = (
        "params",
        "momentum",
        "metrics_history",
        "next_round",
        "empty_streak",
        "stopped_reason",
        "pending_overrides",
    )

    @property
    def ledger(self) -> LedgerView:
        return LedgerView(self._of.ledger)


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_copy(v) for v in value]
    return value
