"""Ctrl-C before round 1 — while the server waits for SuperNodes that have not connected — is
the operator's interrupt like any other: exit 130, corrflow's one-line message saying nothing was
trained, no traceback, nothing accounted. A real process and a real SIGINT; the SuperNodes that
never connect are an in-process grid reporting none (no Ray: the wait is the same code)."""

import signal
import subprocess
import sys
import textwrap
import time

SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    from corrflow.server.inprocess import InProcessGrid

    marker = Path(sys.argv[1])

    def none_connected(self):
        marker.touch()  # the server is waiting now
        return []

    InProcessGrid.get_node_ids = none_connected
    from corrflow.cli import main

    sys.argv = ["corrflow", *sys.argv[2:]]
    main()
    """
)


def test_ctrl_c_while_waiting_for_supernodes_exits_130(tmp_path):
    marker, out = tmp_path / "waiting", tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            SCRIPT,
            str(marker),
            "simulate",
            "--users",
            "8",
            "--rounds",
            "4",
            "--backend",
            "inprocess",
            "--out",
            str(out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    assert "interrupted" in err and "waiting for SuperNodes" in err
    assert "Nothing was trained or accounted" in err
    assert not (out / "privacy_report.json").exists()
    assert not (out / "release_journal.jsonl").exists()
