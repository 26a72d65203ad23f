"""The commands' shared options, generated from the settings model (`corrflow.config`).

One typer option per setting the ``cli`` surface exposes, with the model's flag name, type,
choices, default and help. ``simulate`` and ``audit`` take every setting; ``factorize``, ``plan``,
``account``, ``compare`` and ``runs adopt`` the ones in `COMMAND_SETTINGS`, with the same names,
choices and defaults (a command's own default is declared by the model and shown by ``--help``; a
default of ``...`` makes the option required). A command declared with `with_settings` receives
them as keyword arguments; `config_from_cli` turns them into a validated `RunConfig` whose errors
name the flag.

A new flag shared with the run is one setting in `corrflow.config.RunConfig` (surfaces, help,
constraint) plus its name in the command's `COMMAND_SETTINGS` entry (``simulate`` and ``audit``
take every ``cli`` setting without an entry).
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from enum import Enum, StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from click.core import ParameterSource

from corrflow.choices import Client
from corrflow.config import (
    RunConfig,
    help_text,
    settings_on,
    surface_default,
    surface_name,
    validated,
)
from corrflow.errors import DataFormatError
from corrflow.factorization.registry import KINDS

#: The settings each command other than simulate and audit takes from the model. ``client`` is there
# wherever a default depends on the task (momentum), so that the defaults are simulate's.
COMMAND_SETTINGS: dict[str, tuple[str, ...]] = {
    "factorize": (
        "num_rounds",
        "epochs",
        "participation",
        "min_sep",
        "kind",
        "bands",
        "buffers",
        "taper",
        "momentum",
        "cooldown_fraction",
        "client",
    ),
    "plan": (
        "num_users",
        "model_dim",
        "num_rounds",
        "target_epsilon",
        "delta",
        "momentum",
        "cooldown_fraction",
        "client",
        # the task's training, for κ measured on --proxy-data (the planner's score)
        "server_lr",
        "local_lr",
        "local_steps",
        "clip_norm",
    ),
    "account": ("participation", "accountant", "noise_multiplier", "target_epsilon", "delta"),
    "compare": (
        "num_rounds",
        "num_users",
        "epochs",
        "delta",
        "client",
        "data_path",
        "vocab_path",
        "eval_every",
    ),
    "runs adopt": ("release_registry",),
}


def _choices(name: str, annotation: Any) -> type[Enum] | None:
    """The enum the CLI offers for a setting (kinds from the registry; clients without ``app``, the
    wrapper's)."""
    if name == "kind":
        return StrEnum("Kind", {k: k for k in KINDS})
    if name == "client":
        return StrEnum("ClientChoice", {c.value: c.value for c in Client if c != Client.APP})
    for arg in typing.get_args(annotation) or (annotation,):
        if isinstance(arg, type) and issubclass(arg, Enum):
            return arg
    return None


def _cli_type(name: str, annotation: Any) -> Any:
    """The option's type: the setting's choices as an enum, optional where the model allows None."""
    enum = _choices(name, annotation)
    optional = type(None) in typing.get_args(annotation)
    base = enum or next(
        a for a in (typing.get_args(annotation) or (annotation,)) if a is not type(None)
    )
    return base | None if optional else base


def param_name(name: str) -> str:
    """The Python parameter behind a setting's flag.

    Args:
        name: the setting (a `RunConfig` field).

    Returns:
        The keyword a command receives it as (``num_users``, flag ``--users`` → ``users``).
    """
    return surface_name(name, "cli")[2:].replace("-", "_")


def settings_parameters(command: str | None = None) -> list[inspect.Parameter]:
    """The options a command takes from the settings model.

    Args:
        command: the command, as `COMMAND_SETTINGS` names it (None or absent: every CLI setting).

    Returns:
        One keyword-only parameter per setting, annotated with its typer option (flag, type,
        choices, the command's default and help; a default of ``...`` is required).
    """
    names = COMMAND_SETTINGS.get(command or "")
    params = []
    for name, info in settings_on("cli").items():
        if names is not None and name not in names:
            continue
        flag = surface_name(name, "cli")
        default = surface_default(name, "cli", command)
        if isinstance(default, Enum):
            default = default.value
        option = typer.Option(
            flag,
            help=help_text(name, command),
            case_sensitive=False,
            show_default=default not in (None, ...),
        )
        params.append(
            inspect.Parameter(
                param_name(name),
                inspect.Parameter.KEYWORD_ONLY,
                default=default,
                annotation=Annotated[_cli_type(name, info.annotation), option],
            )
        )
    return params


def with_settings(command: Callable, name: str | None = None) -> Callable:
    """A command with the settings' options added after its own parameters.

    Args:
        command: the command function; it receives the settings in ``**settings``.
        name: the command, as `COMMAND_SETTINGS` names it (None: every CLI setting).

    Returns:
        The function typer registers (its signature: the command's own parameters, then the
        settings').
    """
    own = list(inspect.signature(command).parameters.values())
    own = [p for p in own if p.kind != inspect.Parameter.VAR_KEYWORD]
    own = [
        p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
        if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD and p.name != "ctx"
        else p
        for p in own
    ]
    hints = typing.get_type_hints(command, include_extras=True)
    own = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in own]

    def wrapped(**kwargs):
        return command(**kwargs)

    wrapped.__signature__ = inspect.Signature(own + settings_parameters(name))
    wrapped.__name__, wrapped.__doc__ = command.__name__, command.__doc__
    return wrapped


def cli_values(params: dict[str, Any]) -> dict[str, Any]:
    """The settings a command received.

    Args:
        params: the command's keyword arguments.

    Returns:
        Setting → value for the CLI settings among ``params`` that are not None (enum members as
        their values).
    """
    out = {}
    for name in settings_on("cli"):
        value = params.get(param_name(name))
        if value is not None:
            out[name] = value.value if isinstance(value, Enum) else value
    return out


def config_from_cli(params: dict[str, Any], **overrides: Any) -> RunConfig:
    """The validated run configuration of a command's settings.

    Args:
        params: the command's keyword arguments.
        overrides: settings that win over the flags.

    Returns:
        The run configuration.

    Raises:
        InvalidArgumentError: a bad value or combination, naming the flag.
    """
    return validated({**cli_values(params), **overrides}, "cli")


def given_on_command_line(ctx: typer.Context) -> set[str]:
    """The settings the user typed.

    Args:
        ctx: the command's context.

    Returns:
        The settings given on the command line (not defaults, not filled by a preset).
    """
    return {
        name
        for name in settings_on("cli")
        if ctx.get_parameter_source(param_name(name)) == ParameterSource.COMMANDLINE
    }


#: The settings that name an input file, for errors about the file's content.
FILE_SETTINGS = ("data_path", "vocab_path", "attribution_path", "manifest_path")


#: The one verbosity flag of every command that shows progress or runs an engine: -q hides the
# progress bars, -v adds the engine's own output (Flower, Ray, TensorFlow) to the progress; neither
# keeps the progress bars on stderr and the engine's output in OUT/engine.log.
Verbosity = Annotated[
    bool | None,
    typer.Option(
        "--verbose/--quiet",
        "-v/-q",
        help="-v: also the engine's own output (Flower, Ray, TensorFlow; else OUT/engine.log); "
        "-q: no progress bars",
        show_default=False,
    ),
]


def file_error_message(exc: Exception, params: dict[str, Any]) -> str:
    """An error's message for the command line.

    Args:
        exc: the error.
        params: the command's settings (keyword arguments or field names).

    Returns:
        ``exc``'s message, led by the flag whose file it is about when it is a `DataFormatError` on
        one of the command's input files (``--vocab: v.txt:302: expected UTF-8 text …``).
    """
    text = str(exc)
    if isinstance(exc, DataFormatError):
        for name in FILE_SETTINGS:
            value = params.get(param_name(name), params.get(name))
            if value and Path(str(value)).resolve() == Path(exc.path).resolve():
                return f"{surface_name(name, 'cli')}: {text}"
    return text


__all__ = [
    "COMMAND_SETTINGS",
    "Verbosity",
    "FILE_SETTINGS",
    "file_error_message",
    "cli_values",
    "config_from_cli",
    "given_on_command_line",
    "param_name",
    "settings_parameters",
    "with_settings",
]
