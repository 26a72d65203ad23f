"""The one atomic-write helper: a failed or killed write leaves the old file whole; secrets are
owner-only."""

import json
import os
import stat
import subprocess
import sys

import pytest

from corrflow.fileio import TEMP_PREFIX, atomic_file, write_bytes, write_json, write_text


def test_write_replaces_whole_files(tmp_path):
    p = tmp_path / "sub" / "r.json"
    write_json(p, {"epsilon": 8.0}, sort_keys=True)
    assert json.loads(p.read_text()) == {"epsilon": 8.0}
    write_text(p, "second")
    assert p.read_text() == "second" and os.listdir(p.parent) == ["r.json"]
    key = write_bytes(tmp_path / "k.key", b"\x00secret", private=True)
    assert key.read_bytes() == b"\x00secret" and stat.S_IMODE(key.stat().st_mode) == 0o600
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~umask  # shared files: what open() would give


def test_an_exception_mid_write_keeps_the_old_file(tmp_path):
    p = tmp_path / "report.json"
    write_text(p, "old")
    with pytest.raises(RuntimeError), atomic_file(p, "w") as f:
        f.write("half of a new")
        raise RuntimeError("disk full")
    assert p.read_text() == "old" and os.listdir(tmp_path) == ["report.json"]


@pytest.mark.integration
def test_sigkill_mid_write_keeps_the_old_file(tmp_path):
    """A real process killed (SIGKILL) while writing: the target keeps its old bytes; only a
    temporary is left."""
    p = tmp_path / "report.json"
    write_text(p, '{"epsilon": 1.0}')
    code = (
        f"import os, signal\nfrom corrflow.fileio import atomic_file\n"
        f"with atomic_file({str(p)!r}, 'w') as f:\n"
        f"    f.write('{{\"epsilon\": 9'); f.flush(); os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert proc.returncode == -9
    assert json.loads(p.read_text()) == {"epsilon": 1.0}
    assert [n for n in os.listdir(tmp_path) if n != "report.json"][0].startswith(TEMP_PREFIX)
