"""Shared by the tests that start real processes (Ray heads, SuperLinks, SuperNodes): find what a
process started and stop all of it by pid, so no test leaves processes behind."""

import contextlib
import os
import signal
import socket
import subprocess
from pathlib import Path


def descendants(root: int) -> list[int]:
    """The pids below ``root`` in the process tree, read from /proc (children, grandchildren, …)."""
    parents = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                parents[int(proc.name)] = int(
                    (proc / "stat").read_text().rsplit(")", 1)[1].split()[1]
                )
    found, frontier = [], [root]
    while frontier:
        frontier = [p for p, pp in parents.items() if pp in frontier]
        found += frontier
    return found


def stop_tree(proc: subprocess.Popen) -> None:
    """SIGTERM a process started in its own session (``ray start --block`` stops the Ray processes
    it started), then SIGKILL it and anything it left behind, by pid."""
    children = descendants(proc.pid)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
    for pid in [proc.pid, *children]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def free_ports(n: int) -> list[int]:
    """``n`` TCP ports free on 127.0.0.1 now (bound, read and released: a SuperLink or Ray head
    started next can take them)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def start_ray_head(
    temp: Path, num_cpus: int = 1, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, str]:
    """``ray start --head --block`` in its own session, on loopback, with free ports and its own
    temp directory ``temp`` (keep it short: Ray's unix sockets live there), so that no other
    ray.init() on this machine finds it; returns the process and the head's address once it
    answers a TCP connect. Stop it with `stop_tree` (or SIGKILL every pid of it: a lost head).

    ``env`` is added to the head's environment: Ray's settings (``RAY_<name>``, e.g.
    ``RAY_memory_usage_threshold``) are read from it by the head's processes when they start."""
    import sys
    import time

    port, *ports = free_ports(5)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **(env or {})}
    env.pop("RAY_ADDRESS", None)
    head = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "ray"),
            "start",
            "--head",
            "--block",
            f"--port={port}",
            f"--num-cpus={num_cpus}",
            "--object-store-memory=100000000",
            "--include-dashboard=false",
            "--disable-usage-stats",
            "--node-ip-address=127.0.0.1",
            f"--temp-dir={temp}",
            f"--ray-client-server-port={ports[0]}",
            f"--dashboard-agent-listen-port={ports[1]}",
            f"--dashboard-agent-grpc-port={ports[2]}",
            f"--metrics-export-port={ports[3]}",
        ],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 180
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
            return head, f"127.0.0.1:{port}"
        except OSError:
            if head.poll() is not None or time.monotonic() > deadline:
                stop_tree(head)
                raise RuntimeError("the Ray head did not start") from None
            time.sleep(1)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` and everything below it at once, by pid (a crashed machine)."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
