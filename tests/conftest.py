import contextlib
import os
import secrets
import shutil
import signal
import tempfile
from pathlib import Path

import numpy as np
import pytest

# Runs share $CORRFLOW_HOME (the release registry, the plan cache): the suite's own, never the
# user's. Set when this file is imported — before the test modules, whose subprocess environments
# copy os.environ at import.
_HOME = tempfile.mkdtemp(prefix="corrflow-home-")
os.environ["CORRFLOW_HOME"] = _HOME
# Every process the suite starts inherits this mark (Flower's SuperLink, SuperExec, Ray's daemons
# included), so the suite can find and stop what it started — by pid, never by a name another user's
# process could share.
SUITE_MARK = f"CORRFLOW_TEST_SUITE={secrets.token_hex(8)}"
os.environ["CORRFLOW_TEST_SUITE"] = SUITE_MARK.split("=", 1)[1]


def processes_started_by_the_suite() -> dict[int, str]:
    """pid → command line of every live process (but this one) whose environment carries the suite's
    mark."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if SUITE_MARK.encode() in (proc / "environ").read_bytes().split(b"\0"):
                found[int(proc.name)] = (
                    (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                )
    return found


def stop_processes(pids) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


SERVICE_NAMES = ("flower-", "flwr", "raylet", "gcs_server", "ray::", "corrflow")
#: Processes a module's teardown had to stop (Ray's actors outlive `ray.shutdown()` for a while on a
# loaded machine).
STOPPED_AFTER_MODULE: list[str] = []


def services_started_by_the_suite() -> dict[int, str]:
    return {
        pid: cmd
        for pid, cmd in processes_started_by_the_suite().items()
        if any(name in cmd for name in SERVICE_NAMES)
    }


@pytest.fixture(scope="module", autouse=True)
def stop_what_the_module_started(request):
    """After each module: the Flower/Ray processes it started get a grace period to exit on their
    own, then are stopped by pid — so one module's leftovers never load the next, and none outlives
    the suite."""
    before = set(services_started_by_the_suite())
    yield
    import time

    deadline = time.monotonic() + 20
    while (
        left := {p: c for p, c in services_started_by_the_suite().items() if p not in before}
    ) and time.monotonic() < deadline:
        time.sleep(0.5)
    if left:
        stop_processes(left)
        STOPPED_AFTER_MODULE.append(
            f"{request.module.__name__}: {sorted(c.split()[0] for c in left.values())}"
        )


@pytest.fixture(scope="session", autouse=True)
def corrflow_home():
    yield _HOME
    shutil.rmtree(_HOME, ignore_errors=True)
    left = services_started_by_the_suite()
    stop_processes(left)
    assert not left, f"processes the suite started are still running (stopped now): {left}"


@pytest.fixture
def rng():
    return np.random.default_rng(20261121)


_STARTED = __import__("time").monotonic()


def pytest_terminal_summary(terminalreporter):
    """The suite's duration and CPU time (this process and every child it waited for), for the
    15-minute budget on 2 cores."""
    import resource
    import time

    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    cpu = own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
    terminalreporter.write_line(
        f"corrflow suite: {time.monotonic() - _STARTED:.0f} s wall, {cpu:.0f} s CPU "
        f"({os.cpu_count()} cores)"
    )
    for line in STOPPED_AFTER_MODULE:
        terminalreporter.write_line(
            f"stopped after the module (still running 20 s after it ended): {line}"
        )
