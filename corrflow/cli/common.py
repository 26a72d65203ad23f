"""What every command shares: printing a result, failing with the exit code and naming flags."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, NoReturn

import numpy as np
import typer

from corrflow.cli.options import file_error_message
from corrflow.config import renamed
from corrflow.errors import DataFormatError, IntegrityError, InvalidArgumentError
from corrflow.factorization.base import Factorization

#: The ``--json`` flag of every command: exactly one JSON object as the last stdout line.
AsJson = Annotated[bool, typer.Option("--json", help="print one JSON object")]
#: σ in the papers' convention (account, plan, simulate): converted through the factorization.
PerParticipation = Annotated[
    float | None,
    typer.Option(
        "--noise-multiplier-per-participation",
        help="instead of --noise-multiplier: the papers' noise multiplier per participation "
        "σ_pp = σ · raw_sensitivity(C) / max column norm(C) (√k·σ for DP-SGD and banded C with "
        "bands ≤ b), converted to corrflow's σ through the factorization "
        "(docs/explanation/accounting.md)",
        show_default=False,
    ),
]


def emit(obj: dict, as_json: bool) -> None:
    """Print a command's result.

    Args:
        obj: the result.
        as_json: one JSON object on one line (numpy values as plain ones), else aligned
            ``key: value`` lines.
    """
    if as_json:
        print(json.dumps(obj, default=jsonable, sort_keys=True))
    else:
        for key, value in obj.items():
            print(f"{key:>24}: {value}")


def jsonable(x):
    """A numpy value as a plain JSON value (``json.dumps``'s ``default``).

    Args:
        x: a value ``json`` cannot serialise itself.

    Returns:
        The scalar (numpy scalar) or nested list (numpy array).

    Raises:
        TypeError: anything else.
    """
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"not JSON serialisable: {type(x)}")


def load_factorization(path: Path, flag: str) -> Factorization:
    """A user-given factorization file.

    Args:
        path: the file.
        flag: the flag that named it.

    Returns:
        The factorization.

    Raises:
        InvalidArgumentError: a file that cannot be read, naming ``flag`` (exit 2).
    """
    try:
        return Factorization.load(path)
    except (IntegrityError, InvalidArgumentError) as exc:
        raise InvalidArgumentError(
            flag, f"a factorization file written by `corrflow factorize` ({exc})"
        ) from None


def fail(exc: Exception, files: dict | None = None) -> NoReturn:
    """Print ``exc`` and exit 2 for bad input, else 1.

    Args:
        exc: the error; an `InvalidArgumentError` about a setting is reworded to name its flag.
        files: the command's settings, so that a data file's error is led by its flag.

    Raises:
        typer.Exit: always.
    """
    # a setting's name (not a path, not a positional NAME) is reworded as the flag
    if (
        isinstance(exc, InvalidArgumentError)
        and exc.field.replace("_", "-").replace("-", "").isalnum()
        and exc.field.islower()
    ):
        exc = as_flag(exc)
    typer.echo(f"error: {file_error_message(exc, files or {})}", err=True)
    raise typer.Exit(code=2 if isinstance(exc, (InvalidArgumentError, DataFormatError)) else 1)


def as_flag(exc: InvalidArgumentError) -> InvalidArgumentError:
    """The same error naming the command-line flag.

    Args:
        exc: an error naming a library field, a run-config key or a setting.

    Returns:
        The error naming the setting's flag, or ``--field`` for a field that is no setting.
    """
    if exc.field.startswith("--"):
        return exc
    named = renamed(exc, "cli")
    if named.field.startswith("--"):
        return named
    return InvalidArgumentError("--" + exc.field.replace("_", "-"), exc.expected, exc.got)


def check_proxy_files(proxy_data: Path, proxy_vocab: Path | None, kappa: float | None) -> None:
    """Refuse, naming the flag, a --proxy-data run that cannot measure κ: the dataset and its
    vocabulary must exist, and --kappa must not be given too (one source of κ).

    Args:
        proxy_data: the public dataset file κ is measured on.
        proxy_vocab: its vocabulary file.
        kappa: a declared κ, or None.

    Raises:
        InvalidArgumentError: naming --proxy-data, --proxy-vocab or --kappa.
    """
    if not proxy_data.is_file():
        raise InvalidArgumentError(
            "--proxy-data",
            "an existing public dataset file (a format --data reads)",
            str(proxy_data),
        )
    if proxy_vocab is None or not proxy_vocab.is_file():
        raise InvalidArgumentError(
            "--proxy-vocab", "the vocabulary file of --proxy-data", str(proxy_vocab)
        )
    if kappa is not None:
        raise InvalidArgumentError(
            "--kappa", "either --kappa or --proxy-data (one source of κ)", kappa
        )
