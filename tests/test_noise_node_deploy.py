"""A deployment's noise node (``corrflow noise-node``): the command's input checks, the pinned
recipe and the pin, the process that serves the noise node behind its own SuperNode and the relay
its ClientApp uses, and the server's side (the pin in the run config, the grid without the noise
node). The loopback deployment with a noise node and its drills is in tests/test_deploy.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from flwr.common.secure_aggregation.secaggplus_constants import Key, Stage

from corrflow.errors import InvalidArgumentError
from corrflow.noisenode.protocol import RECIPE_KEY, SIGNATURE_KEY, id_message, signed_keys_message
from corrflow.noisenode.service import SOCKET_KEY, NoiseNodeServiceError, relay
from corrflow.run.secure_sum import secure_sum_params
from corrflow.server.noise_node_deploy import WithoutNoiseNode, deployed_noise_node, link_from_pin

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "deploy" / "app"
RUN = (
    "corrflow.num-rounds=3 corrflow.epochs=3 corrflow.secure-aggregation=true "
    "corrflow.noise-node=true"
)


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "corrflow.cli", "noise-node", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def _init(d: Path, node_id: str = "77", run: str = "", *extra: str, env: dict | None = None):
    """``corrflow noise-node --init-only`` on ``d`` for the app's run config (or ``run``)."""
    args = ["--dir", str(d), "--node-id", node_id, "--app", str(APP), "--run-config", run or RUN]
    return _cli(*args, "--init-only", *extra, env=env)


@pytest.fixture(scope="module")
def pinned(tmp_path_factory) -> tuple[Path, dict]:
    """A noise node directory pinned to the loopback app's 3-round secure run (node id 77)."""
    d = tmp_path_factory.mktemp("nn") / "node"
    done = _init(d, "77", RUN, "--json")
    assert done.returncode == 0, done.stderr
    return d, json.loads(done.stdout.splitlines()[-1])


def test_the_pin_verifies_and_names_the_recipe_the_server_plans(pinned):
    """pin.json's signature verifies under its public key for its node id; the pinned recipe is
    the 3-round plan of the app's config (σ from the accountant, the numpy task's shapes), and the
    factorization file is the one it names."""
    d, pins = pinned
    assert json.loads((d / "pin.json").read_text()) == {k: v for k, v in pins.items() if k != "dir"}
    key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(pins["public_key"]))
    key.verify(bytes.fromhex(pins["signature"]), id_message(77))  # raises when it does not
    assert pins["node_id"] == 77 and 'noise-node-id="77"' in pins["node_config"]
    recipe = json.loads((d / "recipe.json").read_text())
    assert recipe["rounds"] == 3 and recipe["clip_norm"] == 1.0 and recipe["delta"] == 1e-5
    assert recipe["noise_multiplier"] > 0
    from corrflow.factorization.base import Factorization

    assert Factorization.load(d / "factorization.npz").sha256() == recipe["factorization_sha256"]
    # the server reads the same pin from its run config
    link = link_from_pin(pins["run_config"].split('noise-node-pin="')[1].rstrip('"'))
    assert (link.node_id, link.public_key.hex()) == (77, pins["public_key"])
    assert oct(d.stat().st_mode & 0o777) == "0o700"
    assert oct((d / "identity.key").stat().st_mode & 0o777) == "0o600"


def test_a_second_start_keeps_the_pin_and_refuses_another_run_or_id(pinned):
    """The same run config starts again with the same pin; another run's config or another node
    id exits 2 naming the flag, and the directory is unchanged."""
    d, pins = pinned
    again = _init(d, "77", RUN, "--json")
    assert again.returncode == 0 and json.loads(again.stdout.splitlines()[-1]) == pins
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    other = RUN.replace("num-rounds=3", "num-rounds=4").replace("epochs=3", "epochs=4")
    refused = _init(d, "77", other)
    assert refused.returncode == 2 and "--run-config" in refused.stderr
    assert "pinned to another recipe" in refused.stderr and "Traceback" not in refused.stderr
    wrong = _init(d, "78")
    assert wrong.returncode == 2 and "--node-id" in wrong.stderr and "node id 77" in wrong.stderr
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--node-id", "0", "--run-config", RUN], "--node-id"),
        (
            [
                "--node-id",
                "3",
                "--run-config",
                RUN.replace(" corrflow.noise-node=true", ""),
                "--init-only",
            ],
            "--run-config",
        ),
        (
            ["--node-id", "3", "--run-config", RUN + " corrflow.bogus=1", "--init-only"],
            "--run-config",
        ),
        (["--node-id", "3", "--run-config", "corrflow.num-rounds=", "--init-only"], "--run-config"),
        (["--node-id", "3", "--app", "/nonexistent", "--run-config", RUN, "--init-only"], "--app"),
        (
            [
                "--node-id",
                "3",
                "--run-config",
                RUN,
                "--superlink",
                "127.0.0.1:1",
                "--root-certificates",
                "/nonexistent",
            ],
            "--root-certificates",
        ),
        (["--node-id", "3", "--run-config", RUN, "--port", "0"], "--port"),
    ],
)
def test_bad_input_exits_2_naming_the_flag_and_writes_nothing(tmp_path, args, flag):
    d = tmp_path / "node"
    done = (
        _cli("--dir", str(d), "--app", str(APP), *args)
        if "--app" not in args
        else _cli("--dir", str(d), *args)
    )
    assert done.returncode == 2, done.stderr
    assert f"error: {flag}" in done.stderr and "Traceback" not in done.stderr
    assert not d.exists()


def test_a_directory_under_corrflow_home_is_refused(tmp_path):
    home = tmp_path / "home"
    env = {**os.environ, "CORRFLOW_HOME": str(home)}
    done = _init(home / "nn", "3", env=env)
    assert done.returncode == 2 and "error: --dir" in done.stderr
    assert not (home / "nn").exists()


# -- the server's side -------------------------------------------------------------------------
def test_the_server_reads_and_checks_the_pin(pinned):
    _, pins = pinned
    good = f"77:{pins['public_key']}:{pins['signature']}"
    assert link_from_pin(good).signature.hex() == pins["signature"]
    for bad in (
        "",
        "77",
        f"78:{pins['public_key']}:{pins['signature']}",
        good + ":1",
        f"77:{pins['public_key']}:{'0' * 128}",
        f"x:{pins['public_key']}:{pins['signature']}",
    ):
        with pytest.raises(InvalidArgumentError, match="corrflow.noise-node-pin"):
            link_from_pin(bad)
    cfg = SimpleNamespace(noise_node=True, noise_node_pin=None)
    with pytest.raises(InvalidArgumentError, match="corrflow.noise-node-pin"):
        deployed_noise_node(cfg, object())
    with pytest.raises(InvalidArgumentError, match="corrflow.noise-node"):
        deployed_noise_node(SimpleNamespace(noise_node=False, noise_node_pin=good), object())
    grid = object()
    assert deployed_noise_node(SimpleNamespace(noise_node=False, noise_node_pin=""), grid) == (
        grid,
        None,
    )


def test_the_run_does_not_see_the_noise_node_among_its_nodes():
    """The noise node is no user: not listed, not asked for its identity; other calls pass."""

    class Grid:
        def get_node_ids(self):
            return [5, 77, 9]

        def get_nodes(self):
            return [SimpleNamespace(node_id=n, public_key=b"k") for n in (5, 77, 9)]

        def push_messages(self, messages):
            return ["sent", *messages]

    grid = WithoutNoiseNode(Grid(), 77)
    assert grid.get_node_ids() == [5, 9]
    assert [n.node_id for n in grid.get_nodes()] == [5, 9]
    assert grid.push_messages(["to 77"]) == ["sent", "to 77"]


# -- the noise node's process and the relay (real processes) --------------------------------------
def _fake_flower(tmp_path: Path) -> Path:
    """A stand-in for Flower's bin directory whose flower-supernode records its arguments and
    waits: the service's own process, socket and relay are real."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "flower-supernode"
    script.write_text(
        f"#!{sys.executable}\nimport sys, time, json\n"
        f"open({str(tmp_path / 'argv.json')!r}, 'w').write(json.dumps(sys.argv[1:]))\n"
        "time.sleep(600)\n"
    )
    script.chmod(0o755)
    return bin_dir


def _setup_config(recipe: dict, clients: int = 3) -> dict:
    dim = sum(int(__import__("math").prod(s)) for s in recipe["shapes"])
    from corrflow.accounting.noise_scale import noise_std_per_round
    from corrflow.factorization.base import Factorization

    fac = Factorization.load(Path(recipe["_dir"]) / "factorization.npz")
    sigma = float(noise_std_per_round(fac, recipe["noise_multiplier"])["max"])
    p = secure_sum_params(max(clients, 2), recipe["clip_norm"], dim, sigma)
    return {
        Key.SAMPLE_NUMBER: clients + 1,
        Key.SHARE_NUMBER: clients + 1,
        Key.THRESHOLD: p.threshold,
        Key.CLIPPING_RANGE: p.clipping_range,
        Key.TARGET_RANGE: p.quantization_range,
        Key.MOD_RANGE: p.modulus,
        RECIPE_KEY: json.dumps({k: v for k, v in recipe.items() if k != "_dir"}),
    }


@pytest.mark.integration
@pytest.mark.subprocess_cli
def test_the_noise_node_serves_through_its_relay_and_stops_with_its_supernode(tmp_path, pinned):
    """``corrflow noise-node`` starts its SuperNode with its own TLS root and authentication key
    and a node config naming its private socket; the relay gets signed SecAgg+ keys for a request
    with the pinned recipe and the noise node's refusal otherwise; SIGTERM stops it (exit 0,
    socket removed); a SuperNode that dies ends it (exit 1)."""
    d, pins = pinned
    bin_dir = _fake_flower(tmp_path)
    ca, key = tmp_path / "ca.crt", tmp_path / "noise"
    ca.write_text("ca"), key.write_text("key")
    args = [
        "--dir",
        str(d),
        "--node-id",
        "77",
        "--app",
        str(APP),
        "--run-config",
        RUN,
        "--superlink",
        "127.0.0.1:9",
        "--root-certificates",
        str(ca),
        "--auth-supernode-private-key",
        str(key),
        "--port",
        "9190",
        "--flwr-bin",
        str(bin_dir),
        "--supernode-log",
        str(tmp_path / "sn.log"),
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "corrflow.cli", "noise-node", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "argv.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        time.sleep(0.5)
        argv = json.loads((tmp_path / "argv.json").read_text())
        opts = dict(zip(argv[::2], argv[1::2], strict=False))
        assert opts["--root-certificates"] == str(ca)
        assert opts["--auth-supernode-private-key"] == str(key)
        assert opts["--superlink"] == "127.0.0.1:9" and opts["--port"] == "9190"
        sock = opts["--node-config"].split('"')[1]
        node_config = {SOCKET_KEY: sock}
        recipe = {**json.loads((d / "recipe.json").read_text()), "_dir": str(d)}
        out = relay(Stage.SETUP, _setup_config(recipe), node_config)
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(pins["public_key"])).verify(
            out[SIGNATURE_KEY], signed_keys_message(out[Key.PUBLIC_KEY_1], out[Key.PUBLIC_KEY_2])
        )
        zero = {**recipe, "noise_multiplier": 0.0}
        with pytest.raises(NoiseNodeServiceError, match="noise_multiplier = 0.0"):
            relay(Stage.SETUP, _setup_config(zero), node_config)
        with pytest.raises(NoiseNodeServiceError, match="a cohort of 1"):
            relay(Stage.SETUP, _setup_config(recipe, clients=1), node_config)
        (Path(sock).parent / "authkey").write_bytes(b"x" * 32)  # a stranger without the secret
        with pytest.raises(NoiseNodeServiceError, match="not reachable"):
            relay(Stage.SETUP, _setup_config(recipe), node_config)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert not Path(sock).parent.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # a SIGKILLed start's socket directory is removed by the next start; its SuperNode dies: the
    # noise node stops, exit 1
    (tmp_path / "argv.json").unlink()
    stale = Path(tempfile.mkdtemp(prefix="corrflow-nn-"))
    (d / "socket-dir").write_text(str(stale))
    proc = subprocess.Popen(
        [sys.executable, "-m", "corrflow.cli", "noise-node", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "argv.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        time.sleep(0.3)
        child = [
            int(p)
            for p in subprocess.run(
                ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True
            ).stdout.split()
        ]
        assert len(child) == 1
        os.kill(child[0], signal.SIGKILL)
        assert not stale.exists()
        assert proc.wait(timeout=30) == 1
        assert "SuperNode exited" in proc.stderr.read()
        assert not (d / "socket-dir").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
