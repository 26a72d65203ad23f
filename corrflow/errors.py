"""Error types shared by every layer (docs "Conventions": bad input names the field and what was
expected)."""

from __future__ import annotations

from typing import Any


class CorrflowError(Exception):
    """Base class of corrflow's own errors."""


class InvalidArgumentError(CorrflowError, ValueError):
    """A caller passed a value that cannot be used; ``field`` names it (the CLI maps this to exit
    code 2)."""

    def __init__(self, field: str, expected: str, got: Any = None):
        self.field = field
        self.expected = expected
        self.got = got
        msg = f"{field}: expected {expected}"
        if got is not None:
            msg += f", got {_short(got)}"
        super().__init__(msg)

    def __reduce__(self):
        # pickled by its fields (an error raised in a worker process reaches the parent intact)
        return type(self), (self.field, self.expected, self.got)


class DataFormatError(CorrflowError, ValueError):
    """A data file does not follow its format; the message names the file and the line (or table
    row)."""

    def __init__(self, path: Any, where: Any, expected: str, got: Any = None):
        self.path = str(path)
        self.where = where
        self.expected = expected
        loc = f"{self.path}:{where}" if where is not None else self.path
        msg = f"{loc}: expected {expected}"
        self.got = got
        if got is not None:
            msg += f", got {_short(got)}"
        super().__init__(msg)

    def __reduce__(self):
        return type(self), (self.path, self.where, self.expected, self.got)


class IntegrityError(CorrflowError):
    """A stored artifact (factorization file, state file) is corrupted, foreign, or inconsistent."""


def _short(value: Any, limit: int = 80) -> str:
    # a message's own text (e.g. every setting that differs)
    if isinstance(value, str) and len(value) <= 1000:
        return repr(value)
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def require(condition: bool, field: str, expected: str, got: Any = None) -> None:
    """Raise `InvalidArgumentError` unless ``condition`` holds."""
    if not condition:
        raise InvalidArgumentError(field, expected, got)


class NoiseWorkerLostError(CorrflowError):
    """A noise worker (or the Ray cluster holding it) was lost and could not be restored from its
    checkpoint: the round in progress is not released and the run stops, naming the worker."""
