import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

# Two xdist workers share the 2 cores the suite is sized for: a multi-threaded BLAS on top of them
# oversubscribes the cores, and OpenBLAS's waiting threads spin — test_compare's tiny comparisons
# took 70 CPU-s with the default 2 BLAS threads against 34 with one. One BLAS thread per process:
# this one (set before NumPy loads its BLAS; threadpoolctl below in case it already had) and every
# process the suite starts, Ray's workers included (they inherit the environment).
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from threadpoolctl import threadpool_limits  # noqa: E402

threadpool_limits(limits=1, user_api="blas")

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


_SUBPROCESS_RUN = subprocess.run


@pytest.fixture(scope="session", autouse=True)
def cli_in_process():
    """A captured ``subprocess.run`` of corrflow's CLI runs in the test's own process
    (tests/cli_support.py), module fixtures included; `cli_in_a_subprocess` keeps real processes
    for the tests whose point they are."""
    from cli_support import in_process_run

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess, "run", in_process_run(_SUBPROCESS_RUN))
        yield


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory, cli_in_process):
    """A finished 4-round run (10 users, 2 epochs, the in-process engine), trained once per test
    process: tests that only read a finished run's files share it; a test that edits them takes
    `finished_run_copy` (a copy is another run to the release registry: never resume one)."""
    from typer.testing import CliRunner

    from corrflow.cli import app

    run = tmp_path_factory.mktemp("finished") / "run"
    args = ["simulate", "--users", "10", "--rounds", "4", "--epochs", "2"]
    res = CliRunner().invoke(
        app, [*args, "--backend", "inprocess", "--out", str(run)], catch_exceptions=False
    )
    assert res.exit_code == 0, res.output
    return run


@pytest.fixture
def finished_run_copy(finished_run, tmp_path) -> Path:
    """A copy of `finished_run`'s files for a test to edit: without its state directory and lock
    (what a report reader sees)."""
    return Path(
        shutil.copytree(
            finished_run,
            tmp_path / "run",
            ignore=shutil.ignore_patterns("state", ".corrflow.lock*"),
        )
    )


@pytest.fixture(autouse=True)
def cli_in_a_subprocess(request, monkeypatch):
    """Tests marked ``integration`` or ``subprocess_cli`` start the CLI in a fresh interpreter."""
    if request.node.get_closest_marker("integration") or request.node.get_closest_marker(
        "subprocess_cli"
    ):
        monkeypatch.setattr(subprocess, "run", _SUBPROCESS_RUN)


@pytest.fixture
def rng():
    return np.random.default_rng(20261121)


def _seconds_since_this_process_started() -> float:
    """From /proc: pytest's own start-up (before this file is imported) counts toward the wall."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


#: The suite's clock and the machine's load when it started (the controller's, under xdist).
_STARTED = __import__("time").monotonic() - _seconds_since_this_process_started()
_LOAD_AT_START = os.getloadavg()
#: The wall time above which an idle machine has run the default suite too slowly (the budget is
# 8 minutes on 2 cores with `-n 2`); a warning, never a failure, since a loaded machine is slower.
WALL_BUDGET_S = 780.0
IDLE_LOAD = 0.5
TIERS = ("unit", "integration", "slow")


def pytest_addoption(parser, pluginmanager):
    """pyproject's addopts run the suite on 2 xdist workers; with xdist absent or blocked
    (``-p no:xdist``, for a debugger) its options are accepted and ignored, so the same command
    runs serially."""
    if not (pluginmanager.has_plugin("xdist") or pluginmanager.has_plugin("xdist.plugin")):
        group = parser.getgroup("xdist", "distributed testing (pytest-xdist is not loaded)")
        # _addoption: pytest reserves lowercase short options for itself and for plugins (xdist
        # registers -n the same way).
        group._addoption("-n", "--numprocesses", dest="numprocesses", default=None)
        group._addoption("--dist", dest="dist", default="no")
        group._addoption("--no-loadscope-reorder", action="store_true")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Every test is in exactly one tier: ``integration`` (real processes) and ``slow`` are marked
    in the test files, the rest are ``unit``. Runs before xdist reads the groups: the tests that
    share a module's fixture are grouped (`_shares_a_module_fixture`)."""
    for item in items:
        tiers = [t for t in TIERS if item.get_closest_marker(t)]
        if "unit" in tiers and len(tiers) > 1:
            raise pytest.UsageError(f"{item.nodeid}: marked unit and {tiers[1:]}")
        if not tiers:
            item.add_marker(pytest.mark.unit)
    if hasattr(config, "workerinput"):
        _name_the_groups(config, items)
        # xdist hands out work in collection order (addopts: --no-loadscope-reorder): the
        # "processes" group, the longest chain of tests one worker must run in turn, goes first.
        items.sort(key=lambda item: _group(item) != PROCESSES)


PROCESSES = "processes"


def _name_the_groups(config, items) -> None:
    """Put each test's xdist group into its node id (``…::test@group``), which is what
    ``--dist loadgroup`` schedules by. xdist 3.8 does this by assigning ``item._nodeid``, which
    pytest ≥ 9.2 no longer reads (the id lives in ``item._id``): without this, grouped tests went
    to both workers and two Ray instances could compete."""
    if not getattr(config.option, "loadgroup", False):  # set on each worker under --dist loadgroup
        return
    try:
        from _pytest.nodeid import NodeId
    except ImportError:  # pytest < 9.2 reads xdist's own ``_nodeid``
        return
    for item in items:
        group = _group(item)
        if group is None or "@" in item.nodeid:
            continue
        if not isinstance(getattr(item, "_id", None), NodeId):
            continue
        item._id = NodeId.parse(f"{item.nodeid}@{group}")


def _group(item) -> str | None:
    mark = item.get_closest_marker("xdist_group")
    return None if mark is None else (mark.args or [mark.kwargs.get("name")])[0]


def pytest_itemcollected(item):
    """Groups the tests that share a module's fixture as each is collected: xdist reads the groups
    in its own collection hook, which runs before this file's."""
    if not item.get_closest_marker("xdist_group") and _shares_a_module_fixture(item):
        item.add_marker(pytest.mark.xdist_group(item.module.__name__))


def _shares_a_module_fixture(item) -> bool:
    """Whether ``item`` uses a module- or session-scoped fixture of its own test module (a run, a
    plan, a comparison computed once for the module): xdist then runs the module's tests that
    use it on one worker, so the fixture is computed once, not once per worker."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    for defs in info.name2fixturedefs.values():
        last = defs[-1]
        if str(last.scope) != "function" and str(last.baseid).endswith(".py"):
            return True
    return False


def _cpu_seconds() -> float:
    """CPU seconds of this process and of every child it has waited for (their children too)."""
    import resource

    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    """An xdist worker hands its CPU time and what its modules left running to the controller
    (after its session fixtures have stopped the processes they started)."""
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output["corrflow_cpu_s"] = _cpu_seconds()
        output["corrflow_stopped"] = list(STOPPED_AFTER_MODULE)


_WORKERS: dict[str, dict] = {}


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    _WORKERS[node.gateway.id] = getattr(node, "workeroutput", {}) or {}


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The suite's closing line: wall time, CPU time of the whole process tree (the controller and
    its xdist workers with every child they waited for; Ray daemons that detach from it are not
    counted) and the 1-minute load average at start and end. Warns above the wall budget when the
    machine was idle at the start, and says why when no test ran (exit 5)."""
    import time

    if hasattr(config, "workerinput"):
        return
    wall = time.monotonic() - _STARTED
    cpu = _cpu_seconds()
    stopped = list(STOPPED_AFTER_MODULE)
    if _WORKERS:
        # The workers have reported; don't count them twice through RUSAGE_CHILDREN.
        import resource

        own = resource.getrusage(resource.RUSAGE_SELF)
        cpu = own.ru_utime + own.ru_stime
        cpu += sum(out.get("corrflow_cpu_s", 0.0) for out in _WORKERS.values())
        stopped += [line for out in _WORKERS.values() for line in out.get("corrflow_stopped", [])]
    load_end = os.getloadavg()
    workers = len(_WORKERS) or 1
    terminalreporter.write_line(
        f"corrflow suite: {wall:.0f} s wall, {cpu:.0f} s CPU, {workers} worker(s) on "
        f"{os.cpu_count()} cores; load average (1 min) {_LOAD_AT_START[0]:.2f} at start, "
        f"{load_end[0]:.2f} at end"
    )
    if wall > WALL_BUDGET_S and _LOAD_AT_START[0] < IDLE_LOAD:
        terminalreporter.write_line(
            f"WARNING: the suite took {wall:.0f} s on a machine idle at its start, over its "
            f"{WALL_BUDGET_S:.0f} s budget: mark what is slow @pytest.mark.slow",
            yellow=True,
            bold=True,
        )
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        terminalreporter.write_line(
            "corrflow suite: no test ran (exit 5): check the paths, -k and -m "
            f"(this run's marker expression: {config.option.markexpr!r})",
            red=True,
            bold=True,
        )
    for line in stopped:
        terminalreporter.write_line(
            f"stopped after the module (still running 20 s after it ended): {line}"
        )
