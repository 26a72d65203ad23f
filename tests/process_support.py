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
