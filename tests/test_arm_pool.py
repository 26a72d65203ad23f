"""`corrflow.server.arm_pool`, the pool behind ``compare --jobs``: each arm's result is handed on
as soon as that arm finishes (not when the last one does), an arm's error stops the pool from
starting more, and bad --jobs values are refused by name. Real spawned processes."""

import os
import signal
import time
from pathlib import Path

import pytest

from corrflow.errors import CorrflowError, InvalidArgumentError
from corrflow.server.arm_pool import check_jobs, run_in_processes


def nap(seconds: float, marker: str | None = None) -> dict:
    """A stand-in arm: sleeps, leaves a marker file, and says which process ran it."""
    time.sleep(seconds)
    if marker is not None:
        Path(marker).write_text("ran")
    return {"pid": os.getpid(), "seconds": seconds}


def fail(message: str) -> dict:
    raise ValueError(message)


def test_results_arrive_as_arms_finish():
    seen: list[tuple[int, float]] = []
    run_in_processes(nap, [(0.0,), (2.0,), (0.0,)], 2, lambda i, res: seen.append((i, time.time())))
    order = [i for i, _ in seen]
    assert order == [0, 2, 1]  # the long arm last, the short ones as each finished
    assert seen[-1][1] - seen[0][1] > 1.5  # the first was reported while the long arm still ran


def test_an_arms_error_stops_the_pool_from_starting_more(tmp_path):
    later = tmp_path / "later"
    seen: list[int] = []
    with pytest.raises(ValueError, match="arm broke"):
        run_in_processes(
            _dispatch,
            [("fail", "arm broke"), ("nap", 1.0), ("nap", 0.0, str(later)), ("nap", 0.0)],
            1,
            lambda i, res: seen.append(i),
        )
    assert not later.exists() and seen == []


def _dispatch(what: str, *args):
    return fail(*args) if what == "fail" else nap(*args)


class UnpicklableError(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a}/{b}")


def refuse(kind: str) -> dict:
    if kind == "field":
        raise InvalidArgumentError("users", "a positive integer", -3)
    if kind == "unpicklable":
        raise UnpicklableError(1, 2)
    if kind == "die":  # as the out-of-memory killer would: no exception, no clean-up
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(float(kind))
    return {}


def test_errors_cross_the_process_boundary_and_a_dead_worker_never_hangs():
    with pytest.raises(InvalidArgumentError) as err:
        run_in_processes(refuse, [("field",)], 2, lambda i, res: None)
    assert (err.value.field, err.value.got) == ("users", -3)  # intact, not a broken pool
    with pytest.raises(CorrflowError, match=r"UnpicklableError: 1/2"):
        run_in_processes(refuse, [("unpicklable",)], 2, lambda i, res: None)
    started = time.monotonic()
    with pytest.raises(CorrflowError, match="an arm's process died"):
        run_in_processes(refuse, [("die",), ("3",)], 2, lambda i, res: None)
    assert time.monotonic() - started < 30


def test_bad_jobs_are_refused_by_name():
    assert check_jobs(3, "cohort") == 3
    for bad in (0, -1, True, 1.5):
        with pytest.raises(InvalidArgumentError, match="jobs"):
            check_jobs(bad, "inprocess")
    with pytest.raises(InvalidArgumentError, match="jobs.*flower"):
        check_jobs(2, "flower")
    assert check_jobs(1, "flower") == 1
