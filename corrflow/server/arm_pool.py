"""Train a comparison's arms side by side: each arm in its own process (``compare --jobs N``).

An arm is a whole run with its own directory, seed and state, so arms share nothing but the
machine: N processes train N arms at once and every result has the same bits as a sequential
comparison (each run's randomness comes from its own seed, never from its process). The
workers are started with ``spawn`` (not ``fork``: the parent may hold BLAS threads and open
files), limit their BLAS to ⌊cores / N⌋ threads each (OpenBLAS's spinning waiters would otherwise
oversubscribe the cores), and log at the parent's level.

An error in one arm stops the pool from starting more arms; the arms already running finish
(their results are kept for a rerun, as in a sequential comparison) and the error is raised.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool

from corrflow.errors import CorrflowError, require


def check_jobs(jobs: int, backend: str) -> int:
    """``jobs`` when it is a positive integer, and 1 on Flower's engine (each arm starts its own
    Ray cluster: two at once compete for the same ports and memory).

    Raises:
        InvalidArgumentError: naming ``jobs``.
    """
    require(
        isinstance(jobs, int) and not isinstance(jobs, bool) and jobs >= 1,
        "jobs",
        "a positive integer (arms trained at once, one process each)",
        jobs,
    )
    require(
        jobs == 1 or backend != "flower",
        "jobs",
        "1 with --backend flower (each arm starts its own Ray cluster); use inprocess or cohort",
        jobs,
    )
    return jobs


def _worker_setup(blas_threads: int, corrflow_level: int) -> None:
    from threadpoolctl import threadpool_limits

    threadpool_limits(blas_threads)
    logging.getLogger("corrflow").setLevel(corrflow_level)


def _guarded(train: Callable, *args):
    """``train(*args)`` in a worker; an exception that would not survive the trip back (a
    constructor pickle cannot call) comes back as a `CorrflowError` with its text instead of
    breaking the pool."""
    try:
        return train(*args)
    except Exception as exc:
        try:
            pickle.loads(pickle.dumps(exc))
        except Exception:
            raise CorrflowError(f"{type(exc).__name__}: {exc}") from None
        raise


def run_in_processes(
    train: Callable,
    calls: Sequence[tuple],
    jobs: int,
    done: Callable[[int, dict], None],
) -> None:
    """``train(*calls[i])`` for every i, at most ``jobs`` at once, each in a worker process;
    ``done(i, result)`` in this process as each finishes (in the order they finish).

    Args:
        train: a module-level function (it is pickled by name).
        calls: its arguments, one tuple per arm (picklable).
        jobs: worker processes (one arm at a time needs no pool, but works).
        done: called with the call's index and its result.

    Raises:
        The first exception an arm raised (after the arms already running have finished);
        CorrflowError when a worker process died; KeyboardInterrupt (the workers get the same
        signal and stop their runs).
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    blas = max(1, (cores or 1) // jobs)
    pool = ProcessPoolExecutor(
        max_workers=min(jobs, len(calls)),
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_worker_setup,
        initargs=(blas, logging.getLogger("corrflow").getEffectiveLevel()),
    )
    waiting = iter(enumerate(calls))
    pending: dict = {}

    def top_up() -> None:
        # never more submitted than workers: the pool would queue the rest ahead, and an arm
        # queued there still runs after another arm's error
        for i, args in waiting:
            pending[pool.submit(_guarded, train, *args)] = i
            if len(pending) >= jobs:
                return

    try:
        top_up()
        while pending:
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in finished:
                i = pending.pop(fut)
                done(i, fut.result())  # an arm's error leaves through the finally below
            top_up()
    except BrokenProcessPool as exc:
        # a worker died (killed, out of memory). The pool's own clean-up sends SIGTERM, which a
        # run in another worker takes as "stop after this round" and then lives on idle: join
        # would wait for ever
        for proc in list(getattr(pool, "_processes", {}).values()):
            if proc.is_alive():
                proc.kill()
        raise CorrflowError(
            f"an arm's process died ({exc}); the arms finished are kept, a rerun of the same "
            "command continues"
        ) from exc
    except KeyboardInterrupt:
        # a terminal's Ctrl-C reaches the workers too; a signal to this process alone must be
        # passed on, or the running arms would train to their end before the pool could close
        for proc in list(getattr(pool, "_processes", {}).values()):
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGINT)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
