"""Keep TensorFlow out of Flower's simulation engine when the clients do not use it.

Flower 1.41/1.42's simulation engine imports TensorFlow whenever it is installed
(``flwr.simulation.ray_transport.utils`` runs ``import tensorflow`` at import time, only to offer
GPU memory growth): in the process that starts the engine and in every Ray worker that runs
ClientApps. With the ``keras`` extra installed that costs about 4.5 CPU-s per process before round
1, for clients that never touch TensorFlow.

For a numpy client, corrflow therefore:

- imports the engine with ``sys.modules["tensorflow"] = None`` (Python's documented way to make
  ``import tensorflow`` raise ModuleNotFoundError, which Flower catches), removed right after, so
  that corrflow's own optional TensorFlow use (the TensorFlow noise backend) still imports it;
- sets ``RAY_RUNTIME_ENV_HOOK`` while the engine runs: Ray calls that hook on the runtime
  environment Flower passes to ``ray.init`` (Flower sets its own ``runtime_env``, so the backend
  config cannot carry one), and the hook adds a ``worker_process_setup_hook`` that does the same
  in each worker before any actor starts.

A Keras client's simulation, and a process whose ``RAY_RUNTIME_ENV_HOOK`` is set already, are left
as they are.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

RAY_HOOK = "RAY_RUNTIME_ENV_HOOK"
#: Ray's per-worker setup hook (``runtime_env["worker_process_setup_hook"]``).
WORKER_SETUP_HOOK = f"{__name__}.hide_tensorflow_in_worker"


def with_worker_setup_hook(runtime_env: dict | None) -> dict:
    """``RAY_RUNTIME_ENV_HOOK`` for an engine whose clients do not use TensorFlow.

    Args:
        runtime_env: the runtime environment ``ray.init`` was given (None: none).

    Returns:
        It, with ``worker_process_setup_hook`` set unless it named one.
    """
    return {"worker_process_setup_hook": WORKER_SETUP_HOOK, **(runtime_env or {})}


def hide_tensorflow_in_worker() -> None:
    """In a Ray worker of such an engine: ``import tensorflow`` fails at once (the worker's
    ClientApps never need it; a TensorFlow already imported is kept)."""
    sys.modules.setdefault("tensorflow", None)


@contextmanager
def tensorflow_absent(hide: bool) -> Iterator[None]:
    """While the block runs, when ``hide`` (and TensorFlow is not imported yet), ``import
    tensorflow`` raises ModuleNotFoundError; afterwards it imports as usual.

    Args:
        hide: the clients do not use TensorFlow.
    """
    if not hide or "tensorflow" in sys.modules:
        yield
        return
    sys.modules["tensorflow"] = None
    try:
        yield
    finally:
        if "tensorflow" in sys.modules and sys.modules["tensorflow"] is None:
            del sys.modules["tensorflow"]


@contextmanager
def ray_workers_without_tensorflow(hide: bool) -> Iterator[None]:
    """While the block runs, when ``hide`` (and no ``RAY_RUNTIME_ENV_HOOK`` is set), a Ray started
    in it hides TensorFlow from its workers (`with_worker_setup_hook`); afterwards the variable is
    unset again.

    Args:
        hide: the clients do not use TensorFlow.
    """
    if not hide or RAY_HOOK in os.environ:
        yield
        return
    os.environ[RAY_HOOK] = f"{__name__}.with_worker_setup_hook"
    try:
        yield
    finally:
        os.environ.pop(RAY_HOOK, None)
