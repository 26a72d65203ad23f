"""corrflow's command line in the test's own process.

A test starts the CLI as a user does, ``subprocess.run([sys.executable, "-m",
"corrflow.server.cli", …], capture_output=True, text=True)``. Unless the test is marked
``integration`` or ``subprocess_cli`` (process isolation is what it checks: signals, Ray, a
crash's exit status, import-time behaviour), conftest routes such a call here: the same ``main()``
runs in this process, without an interpreter start-up and corrflow's imports per command, and the
call returns the same :class:`subprocess.CompletedProcess` (``stdout``, ``stderr``,
``returncode``). What a command may change for the rest of the process is put back after it."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import traceback
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np


def _cli_main(module: str):
    """The ``main()`` that ``python -m module`` calls (the module's, or its package's __main__)."""
    import importlib

    found = importlib.import_module(module)
    if not hasattr(found, "main"):
        found = importlib.import_module(f"{module}.__main__")
    return found.main


def _env_changes(env: Mapping[str, str] | None) -> dict[str, str | None]:
    """The variables to set (and, with None, to unset) so that os.environ equals ``env``."""
    if env is None:
        return {}
    changes: dict[str, str | None] = {k: v for k, v in env.items() if os.environ.get(k) != v}
    changes.update({k: None for k in os.environ if k not in env})
    return changes


@contextlib.contextmanager
def _process_state_restored() -> Iterator[None]:
    """What a command may change for the rest of its process — the environment, the working
    directory, logger levels and handlers, warning filters, numpy's error state, SIGINT/SIGTERM
    handlers — is put back after it, so one command cannot change the next test."""
    environ, cwd, argv = dict(os.environ), os.getcwd(), sys.argv
    manager = logging.Logger.manager
    loggers = [logging.getLogger()] + [
        lg for lg in manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    saved = {id(lg): (lg.level, lg.propagate, lg.disabled, list(lg.handlers)) for lg in loggers}
    errstate = np.geterr()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with warnings.catch_warnings():
            yield
    finally:
        sys.argv = argv
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(environ)
        for lg in [logging.getLogger()] + [
            lg for lg in manager.loggerDict.values() if isinstance(lg, logging.Logger)
        ]:
            level, propagate, disabled, kept = saved.get(id(lg), (logging.NOTSET, True, False, []))
            for h in lg.handlers:
                if h not in kept:
                    lg.removeHandler(h)
                    h.close()
            for h in kept:
                if h not in lg.handlers:
                    lg.addHandler(h)
            lg.setLevel(level)
            lg.propagate, lg.disabled = propagate, disabled
        np.seterr(**errstate)
        for s, h in handlers.items():
            signal.signal(s, h)


def run_in_process(
    *args: str,
    module: str = "corrflow.server.cli",
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    input: str | None = None,
) -> subprocess.CompletedProcess:
    """``corrflow *args`` in this process: stdout and stderr captured as a fresh interpreter's
    would be (warnings logged with no handler configured reach stderr, as Python's last-resort
    handler writes them), the exit status as ``sys.exit`` gave it (1 and the traceback on stderr
    for an uncaught exception).

    Args:
        *args: the command line after ``corrflow``.
        module: the module ``python -m`` would run.
        env: the whole environment the command sees (as ``subprocess.run``'s ``env``).
        cwd: the working directory the command runs in.
        input: text on standard input.

    Returns:
        The command's exit status and output, as ``subprocess.run(..., text=True)`` returns them.
    """
    from click.testing import CliRunner

    main = _cli_main(module)
    code: int = 0
    with (
        _process_state_restored(),
        CliRunner().isolation(input=input, env=_env_changes(env)) as (out, err, _),
    ):
        if cwd is not None:
            os.chdir(cwd)
        sys.argv = ["corrflow", *args]
        # A subprocess's unhandled warnings reach stderr through logging.lastResort; under pytest
        # the root logger has handlers (the log capture), so the last resort never fires.
        last_resort = logging.StreamHandler(sys.stderr)
        last_resort.setLevel(logging.WARNING)
        logging.getLogger().addHandler(last_resort)
        try:
            main()
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except Exception:
            traceback.print_exc(file=sys.stderr)
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
        stdout, stderr = out.getvalue(), err.getvalue()
    return subprocess.CompletedProcess(
        ["corrflow", *args], code, stdout.decode(errors="replace"), stderr.decode(errors="replace")
    )


#: How the tests start corrflow's command line in a fresh interpreter (``python -m …``).
CLI_MODULES = ("corrflow.server.cli", "corrflow.cli")


def cli_args(argv) -> tuple[str, list[str]] | None:
    """The module and the command line after it when ``argv`` starts corrflow's CLI in this
    interpreter's Python (``python -m corrflow.server.cli …``); None for any other program."""
    if not isinstance(argv, list | tuple) or len(argv) < 3:
        return None
    exe, flag, module = (str(a) for a in argv[:3])
    if (
        flag == "-m"
        and module in CLI_MODULES
        and Path(exe).resolve() == Path(sys.executable).resolve()
    ):
        return module, [str(a) for a in argv[3:]]
    return None


_CAPTURED = {"capture_output", "stdout", "stderr", "text", "universal_newlines", "encoding"}
_HANDLED = _CAPTURED | {"env", "cwd", "input", "timeout", "check", "errors"}


def in_process_run(original_run):
    """``subprocess.run``, except that a captured run of corrflow's CLI runs in this process
    (:func:`run_in_process`); every other call, and any call asking for what only a process gives
    (its own file descriptors, a process group, …), goes to ``original_run``."""

    def run(*popenargs, **kwargs):
        argv = popenargs[0] if popenargs else kwargs.get("args")
        cli = cli_args(argv)
        captured = kwargs.get("capture_output") or (
            kwargs.get("stdout") == subprocess.PIPE and kwargs.get("stderr") == subprocess.PIPE
        )
        if cli is None or len(popenargs) > 1 or not captured or set(kwargs) - _HANDLED - {"args"}:
            return original_run(*popenargs, **kwargs)
        text = bool(
            kwargs.get("text") or kwargs.get("universal_newlines") or kwargs.get("encoding")
        )
        stdin = kwargs.get("input")
        if isinstance(stdin, bytes):
            stdin = stdin.decode()
        module, args = cli
        done = run_in_process(
            *args, module=module, env=kwargs.get("env"), cwd=kwargs.get("cwd"), input=stdin
        )
        done.args = argv
        if not text:
            done.stdout, done.stderr = done.stdout.encode(), done.stderr.encode()
        if kwargs.get("check"):
            done.check_returncode()
        return done

    return run
