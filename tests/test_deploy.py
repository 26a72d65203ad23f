"""The deploy/ kit: shell scripts pass shellcheck, the compose file validates against the Compose
Specification, key fingerprints equal what Flower stores for a registered SuperNode, and the whole
secure deployment runs on loopback (deploy/loopback.sh --drills): TLS + SuperNode authentication,
three registered SuperNodes, three rounds, an unregistered SuperNode refused, a SuperNode restarted
and a killed ServerApp resumed from its checkpoint, with the text client (--client nextword) in the
same deployment: each SuperNode trains on its own data file named in its node config, and the
held-out loss falls."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
from checkpoint_support import checkpoint
from flwr.cli.supernode.register import try_load_public_key
from process_support import free_ports, stop_tree

from corrflow.accounting.report import hash_user_id
from corrflow.factorization import Factorization
from corrflow.run.reading import participation_users

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    """A command from the test extra, in this interpreter's environment (or on PATH)."""
    path = BIN / name if (BIN / name).exists() else shutil.which(name)
    assert path, f"{name} is missing: pip install -e '.[test]'"
    return str(path)


def test_shell_scripts_pass_shellcheck():
    scripts = sorted(str(p) for p in DEPLOY.rglob("*.sh"))
    assert len(scripts) >= 4
    res = subprocess.run(
        [tool("shellcheck"), "--severity=style", *scripts], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_compose_file_validates_against_the_compose_spec(tmp_path):
    compose = DEPLOY / "compose.yaml"
    ok = subprocess.run(
        [tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(compose)],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    # The validator rejects what the specification forbids (here an unknown service key).
    broken = tmp_path / "compose.yaml"
    broken.write_text(
        compose.read_text().replace("services:\n", "services:\n  bad:\n    imagee: x\n", 1)
    )
    bad = subprocess.run(
        [tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(broken)],
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0


def test_pki_makes_owner_only_files_keeps_keys_and_fingerprints_match_flower(tmp_path):
    out = tmp_path / "pki"
    made = subprocess.run(
        [
            str(DEPLOY / "pki.sh"),
            "--san",
            "IP:127.0.0.1",
            "--san",
            "DNS:link.example.org",
            str(out),
            "dev1",
            "dev2",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for f in [
        "ca.key",
        "ca.crt",
        "superlink.key",
        "superlink.crt",
        "supernodes/dev1",
        "supernodes/dev1.pub",
    ]:
        assert stat.S_IMODE((out / f).stat().st_mode) == 0o600, f
    san = subprocess.run(
        ["openssl", "x509", "-in", str(out / "superlink.crt"), "-noout", "-ext", "subjectAltName"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "IP Address:127.0.0.1" in san and "DNS:link.example.org" in san
    subprocess.run(
        ["openssl", "verify", "-CAfile", str(out / "ca.crt"), str(out / "superlink.crt")],
        check=True,
        capture_output=True,
    )
    # Re-running keeps every existing key (a new SuperNode is added); --force replaces.
    before = (out / "supernodes/dev1").read_bytes()
    again = subprocess.run(
        [str(DEPLOY / "pki.sh"), str(out), "dev1", "dev3"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert (out / "supernodes/dev1").read_bytes() == before and "kept" in again and "dev3" in again
    subprocess.run(
        [str(DEPLOY / "pki.sh"), "--force", str(out), "dev1"], capture_output=True, check=True
    )
    assert (out / "supernodes/dev1").read_bytes() != before
    # The identity the ServerApp derives: SHA-256 of the bytes `flwr supernode register` stores (PEM
    # SPKI).
    pubs = [out / "supernodes" / f"{n}.pub" for n in ("dev1", "dev2", "dev3")]
    printed = subprocess.run(
        [str(DEPLOY / "fingerprint.sh"), *map(str, pubs)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    for pub, line in zip(pubs, printed, strict=True):
        stored = try_load_public_key(pub)
        assert stored.startswith(b"-----BEGIN PUBLIC KEY-----\n")
        assert line.split()[0] == "key-" + hashlib.sha256(stored).hexdigest()[:24]
    assert f"corrflow identity {printed[1].split()[0]}" in made


def test_deploy_app_config_is_a_valid_node_key_run_config():
    import tomllib

    from corrflow.config import from_run_config

    app = tomllib.loads((DEPLOY / "app" / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    assert app["components"] == {
        "serverapp": "corrflow.server.app:app",
        "clientapp": "corrflow.clients.dispatch:app",
    }
    from flwr.common.config import flatten_dict

    cfg = from_run_config(flatten_dict(app["config"]))  # as Flower flattens the nested table
    assert cfg.identity == "node-key" and Path(cfg.state_dir).is_absolute()


def test_pki_rejects_bad_arguments(tmp_path):
    res = subprocess.run(
        [str(DEPLOY / "pki.sh"), "--san", "localhost", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2 and "--san" in res.stderr
    res = subprocess.run(
        [str(DEPLOY / "pki.sh"), str(tmp_path), "bad/name"], capture_output=True, text=True
    )
    assert res.returncode == 2 and "bad/name" in res.stderr


def _processes_using(path: Path) -> list[int]:
    """Live processes whose environment names ``path`` (every Flower process of the run has
    FLWR_HOME there)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if str(path).encode() in (proc / "environ").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                continue
    return found


def _loopback(work: Path, *args: str, timeout: float = 540) -> dict:
    """Run deploy/loopback.sh with ``args`` in ``work``; assert it succeeded, printed the report's
    path last and left no process alive; return the privacy report."""
    env = {
        **os.environ,
        "FLWR_BIN": str(BIN),
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    proc = subprocess.Popen(
        [str(DEPLOY / "loopback.sh"), "--workdir", str(work), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the script's exit trap stops every process it started
        stdout, stderr = proc.communicate(timeout=180)
        pytest.fail(f"loopback.sh took more than {timeout:.0f} s:\n{_script_output(stderr)}")
    assert proc.returncode == 0, _script_output(stderr)
    report_path = Path(stdout.strip().splitlines()[-1])
    assert report_path == work / "server" / "privacy_report.json"
    assert not _processes_using(work), "processes of the loopback run are still alive"
    return json.loads(report_path.read_text())


def _script_output(stderr: str) -> str:
    """The script's own timeline (every ``[loopback …]`` line), then the tail of what it printed on
    failure (the ServerApps' warnings, the SuperLink's log, each SuperNode's messages)."""
    timeline = [line for line in stderr.splitlines() if line.startswith("[loopback ")]
    return "\n".join(timeline) + "\n--- tail of the output\n" + stderr[-8000:]


def _gaussian_epsilon_every_round(work: Path, report: dict) -> float:
    """ε of the Gaussian mechanism at σ / sensitivity, the sensitivity recomputed from the stored
    encoder C for the realised pattern (every user in every round): sens² = Σ_ij |(CᵀC)_ij|."""
    fac = Factorization.load(work / "server" / "factorization.npz")
    assert fac.sha256() == report["mechanism"]["factorization_sha256"]
    C = fac.encoder.matrix()
    sens = float(np.sqrt(np.abs(C.T @ C).sum()))
    return dp_accounting.get_epsilon_gaussian(report["noise_multiplier"] / sens, report["delta"])


#: Rounds of the loopback drill: the kill after round 1 leaves one round for the resumed run (the
# held-out loss fell in every one of 160 simulations of 2 and 3 rounds at the drill's settings).
ROUNDS = 2


@pytest.mark.integration
@pytest.mark.xdist_group("processes")
def test_loopback_deployment_of_the_text_client_with_tls_node_auth_restart_and_resume(tmp_path):
    """One loopback deployment carries both checks: the failure drills (TLS, SuperNode
    authentication, a refused unregistered SuperNode, a restarted SuperNode, a SIGKILLed ServerApp
    resumed) and the text client on each SuperNode's own data file; separately they cost two
    SuperLinks, two data builds and two sets of ServerApp and ClientApp start-ups."""
    work = tmp_path / "loopback"
    report = _loopback(work, "--client", "nextword", "--rounds", str(ROUNDS), "--drills")
    salt, fingerprints = _check_identities_and_epsilon(work, report)
    _check_the_drills(work, report, salt, fingerprints)
    _check_the_text_client(work, report)


def _check_identities_and_epsilon(work: Path, report: dict) -> tuple[bytes, list[str]]:
    """The three registered keys' fingerprints, hashed with the checkpoint's salt, are the report's
    users, each in every round; ε is the Gaussian mechanism's for that pattern, recomputed from the
    stored encoder; returns the salt and the fingerprints."""
    registered = [line.split() for line in (work / "registered.txt").read_text().splitlines()]
    assert [r[0] for r in registered] == ["sn1", "sn2", "sn3"]
    pubs = [work / "pki" / "supernodes" / f"{name}.pub" for name in ("sn1", "sn2", "sn3")]
    fingerprints = ["key-" + hashlib.sha256(try_load_public_key(p)).hexdigest()[:24] for p in pubs]
    assert [r[2] for r in registered] == fingerprints
    salt = checkpoint(work / "server").secrets["report_salt"]
    users = participation_users(report, work / "server")
    assert set(users) == {hash_user_id(fp, salt) for fp in fingerprints}
    assert report["rounds_completed"] == ROUNDS and report["realized"]["rejections"] == 0
    assert report["stopped_reason"] is None
    assert all(u["rounds"] == list(range(ROUNDS)) for u in users.values())

    # ε, δ and the clip norm are the drill's (loopback.sh), ε the Gaussian mechanism's.
    assert (report["target_epsilon"], report["delta"], report["clip_norm"]) == (32.0, 1e-5, 0.25)
    expected = _gaussian_epsilon_every_round(work, report)
    assert report["realized"]["epsilon"] == pytest.approx(expected, rel=1e-6)
    assert report["realized"]["epsilon"] <= report["target_epsilon"]
    assert (
        report["total"]["epsilon"] == report["realized"]["epsilon"]
        and report["total"]["delta"] == 1e-5
    )
    return salt, fingerprints


def _check_the_drills(work: Path, report: dict, salt: bytes, fingerprints: list[str]) -> None:
    """The unregistered SuperNode was refused, sn1 came back under the same node id, and the
    ServerApp killed after round k < ROUNDS was resumed there with the first k rounds unchanged."""
    users = participation_users(report, work / "server")
    registered = [line.split() for line in (work / "registered.txt").read_text().splitlines()]
    # The unregistered fourth SuperNode was refused (Flower error 2004) and never became a user.
    assert (work / "rogue.txt").read_text().split()[1] != "0"
    assert "2004" in (work / "logs" / "rogue.log").read_text()
    rogue = (
        "key-"
        + hashlib.sha256(try_load_public_key(work / "pki/supernodes/rogue.pub")).hexdigest()[:24]
    )
    assert hash_user_id(rogue, salt) not in users

    # sn1 was restarted: the same node id before and after, the one assigned at registration; its
    # ledger goes on.
    drills = dict(line.split() for line in (work / "drills.txt").read_text().splitlines())
    sn1_ids = re.findall(r"SuperNode ID: (\d+)", (work / "logs" / "sn1.log").read_text())
    assert len(sn1_ids) >= 2 and set(sn1_ids) == {registered[0][1]}
    assert users[hash_user_id(fingerprints[0], salt)]["rounds"] == list(range(ROUNDS))

    # The ServerApp was killed after round k < ROUNDS and the second run resumed there: the first k
    # rounds' metrics are the checkpoint's, unchanged, and the ServerApp logged the resumption.
    k = int(drills["killed-after-round"])
    assert 1 <= k < ROUNDS

    def rounds(entries):  # metrics.json opens with the initial model's evaluation (round −1)
        return [e for e in entries if e["round"] >= 0]

    # At the kill, the ledger log held each recorded round's metrics (a line past the checkpoint,
    # from a round killed before its checkpoint, is cut off on resume and never released).
    logged = (work / "ledger-at-kill.jsonl").read_text().splitlines()
    at_kill = [json.loads(line)["metrics"] for line in logged][:k]
    final = rounds(json.loads((work / "server" / "metrics.json").read_text()))
    assert len(final) == ROUNDS and len(at_kill) == k
    for before, after in zip(at_kill, final, strict=False):
        assert {key: after[key] for key in before if key in after} == {
            key: before[key] for key in after if key in before
        }
        assert after["aggregation_seconds"] == before["aggregation_seconds"]
    second = (work / "logs" / f"serverapp-{drills['second-run']}.log").read_text()
    assert f"resumed from round-{k:06d} at round {k + 1}" in second  # 1-based: the next round


def _check_the_text_client(work: Path, report: dict) -> None:
    """The next-word model learned from each SuperNode's own data file named in its node config
    (not the file the server sent), under the public vocabulary that spends nothing."""
    from corrflow.data.vocab import Vocabulary

    data, nodes, logs = work / "data", work / "nodes", work / "logs"
    # Its initial weights (W = 0, b = 0) predict uniformly over the vocabulary's tokens, so the
    # held-out loss before training is exactly ln V — the numpy client's squared error would not be.
    vocab = Vocabulary.load(data / "vocab.txt")
    learning = report["learning"]
    assert learning["initial_test_loss"] == pytest.approx(np.log(vocab.num_tokens), rel=1e-9)
    assert (
        learning["learned"] is True and learning["final_test_loss"] < learning["initial_test_loss"]
    )
    assert (
        report["vocabulary"]["source"] == "public"
        and report["vocabulary"]["inside_guarantee"] is True
    )
    assert (
        report["vocabulary"]["sha256"]
        == hashlib.sha256((data / "vocab.txt").read_bytes()).hexdigest()
    )
    assert report["vocabulary"]["words"] == len(vocab.words)
    manifest = json.loads((data / "manifest.json").read_text())
    assert (
        manifest["num_partitions"] == 3 and Path(manifest["path"]) == data / "stackoverflow.sqlite"
    )
    for i in range(3):
        own = nodes / f"sn{i + 1}"
        log = (logs / f"sn{i + 1}.log").read_text()
        assert (
            f"partition-id {i} trains on the SuperNode's own data file "
            f"{own / 'stackoverflow.sqlite'} (node config data-path), vocabulary "
            f"{own / 'vocab.txt'}"
        ) in log
        assert str(data / "stackoverflow.sqlite") not in log
        assert (own / "vocab.txt").read_bytes() == (data / "vocab.txt").read_bytes()


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    import socket
    import time

    start = time.monotonic()
    while True:
        assert proc.poll() is None, (
            f"the process meant to listen on port {port} exited with {proc.returncode}"
        )
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        assert time.monotonic() - start < timeout, (
            f"nothing listens on 127.0.0.1:{port} after {timeout:.0f} s"
        )
        time.sleep(0.5)


RAY_DRIVER = """
import sys
from flwr.simulation import run_simulation
from corrflow.clients.tasks import get_task
from corrflow.server.app import make_server_app
from corrflow.config import RunConfig, from_run_config, unprefixed_keys
from corrflow.run.reading import participation_users

address, out = sys.argv[1], sys.argv[2]
cfg = RunConfig(num_users=3, num_rounds=2, epochs=2, target_epsilon=8.0, state_dir=out)
task = get_task(cfg.client, cfg.model_dim, cfg.data_path, cfg.vocab_path, cfg.seq_len)
run_simulation(server_app=make_server_app(cfg, out, quiet=True), client_app=task.client_app,
               num_supernodes=3,
               backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                               "init_args": {"address": address}})
"""


@pytest.fixture
def ray_cluster():
    """A Ray head with no CPUs and a worker with two, on loopback, in their own sessions and temp
    directory (so no other ray.init() on this machine finds them); yields the head's address;
    stopped by pid."""
    import tempfile

    ray = tool("ray")
    # short: Ray's unix sockets live below it
    temp = Path(tempfile.mkdtemp(prefix="rc", dir="/tmp"))
    head_port, *ports = free_ports(8)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    common = [
        "--block",
        "--disable-usage-stats",
        "--node-ip-address=127.0.0.1",
        "--include-log-monitor=false",
    ]
    head = [
        ray,
        "start",
        "--head",
        f"--port={head_port}",
        "--num-cpus=0",
        "--include-dashboard=false",
        f"--temp-dir={temp}",
        f"--ray-client-server-port={ports[0]}",
        f"--dashboard-agent-listen-port={ports[1]}",
        f"--dashboard-agent-grpc-port={ports[2]}",
        f"--metrics-export-port={ports[3]}",
        *common,
    ]
    procs = [
        subprocess.Popen(
            head,
            env=env,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    ]
    address = f"127.0.0.1:{head_port}"
    try:
        procs.append(
            subprocess.Popen(
                [
                    ray,
                    "start",
                    f"--address={address}",
                    "--num-cpus=2",
                    f"--dashboard-agent-listen-port={ports[4]}",
                    f"--dashboard-agent-grpc-port={ports[5]}",
                    f"--metrics-export-port={ports[6]}",
                    *common,
                ],
                env=env,
                start_new_session=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        # Ray sizes Flower's actor pool when the run starts: wait until the worker has joined.
        wait = subprocess.run(
            [sys.executable, "-c", CLUSTER_WAIT, address],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert wait.returncode == 0, wait.stderr[-3000:]
        yield address, temp
    finally:
        for proc in reversed(procs):
            stop_tree(proc)
        shutil.rmtree(temp, ignore_errors=True)


CLUSTER_WAIT = """
import sys, time, ray
ray.init(address=sys.argv[1])
start = time.monotonic()
while ray.cluster_resources().get("CPU", 0) < 2:
    if time.monotonic() - start > 240:
        sys.exit("the Ray worker did not join within 240 s")
    time.sleep(0.5)
"""
CLUSTER_CHECK = """
import json, sys, ray
ray.init(address=sys.argv[1])
alive = sum(n["Alive"] for n in ray.nodes())
print(json.dumps({"alive_nodes": alive, "cpus": ray.cluster_resources().get("CPU")}))
"""


def _check_cluster_and_report(address: str, out: Path, rounds: int) -> None:
    res = subprocess.run(
        [sys.executable, "-c", CLUSTER_CHECK, address], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr[-3000:]
    # The head has no CPUs, so every ClientApp actor of the run ran on the worker.
    assert json.loads(res.stdout.strip().splitlines()[-1]) == {"alive_nodes": 2, "cpus": 2.0}
    report = json.loads((out / "privacy_report.json").read_text())
    assert report["rounds_completed"] == rounds
    assert [u["rounds"] for u in participation_users(report, out).values()] == [[0, 1]] * 3


@pytest.mark.integration
@pytest.mark.xdist_group("processes")
@pytest.mark.slow
def test_run_simulation_on_an_existing_ray_cluster(ray_cluster):
    """The deprecated run_simulation passes backend init args to ray.init: ``init_args.address``."""
    address, temp = ray_cluster
    out = temp / "run"
    res = subprocess.run(
        [sys.executable, "-c", RAY_DRIVER, address, str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
        timeout=480,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    _check_cluster_and_report(address, out, 2)


@pytest.mark.integration
@pytest.mark.xdist_group("processes")
@pytest.mark.slow
def test_flwr_run_on_an_existing_ray_cluster_through_the_superlink(ray_cluster):
    """`flwr run` reaches an existing cluster only through the simulation SuperLink's RAY_ADDRESS
    environment."""
    address, temp = ray_cluster
    (port,) = free_ports(1)
    home, cli, out = temp / "superlink-home", temp / "cli-home", temp / "flwr-run"
    cli.mkdir()
    (cli / "config.toml").write_text(
        f'[superlink]\ndefault = "sim"\n\n[superlink.sim]\naddress = "127.0.0.1:{port}"\n'
        "insecure = true\n"
    )
    env = {
        **os.environ,
        "RAY_USAGE_STATS_ENABLED": "0",
        "FLWR_TELEMETRY_ENABLED": "0",
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    link = subprocess.Popen(
        [
            tool("flower-superlink"),
            "--insecure",
            "--simulation",
            "--disable-runtime-dependency-installation",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--database",
            str(temp / "superlink.db"),
        ],
        env={**env, "RAY_ADDRESS": address, "FLWR_HOME": str(home)},
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_listening(port, link)
        run_config = (
            "corrflow.num-users=3 corrflow.num-rounds=2 corrflow.epochs=2 "
            'corrflow.identity="partition-id" '
            f'corrflow.state-dir="{out}"'
        )
        res = subprocess.run(
            [
                tool("flwr"),
                "run",
                ".",
                "sim",
                "--stream",
                "--run-config",
                run_config,
                "--federation-config",
                "num-supernodes=3",
            ],
            cwd=DEPLOY / "app",
            env={**env, "FLWR_HOME": str(cli)},
            capture_output=True,
            text=True,
            timeout=480,
        )
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    finally:
        stop_tree(link)
    _check_cluster_and_report(address, out, 2)


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.xdist_group("processes")
def test_loopback_with_a_noise_node_survives_killing_it_and_the_server_mid_round(tmp_path):
    """deploy/loopback.sh --secagg --noise-node --drills (about 11 minutes on a loaded 2-core
    machine, hence slow; the default tier checks the command in tests/test_noise_node_deploy.py):
    the noise node is a fourth party with its own registered key and SuperNode; the ServerApp is
    SIGKILLed mid-round and resumed, the noise node is SIGKILLed right after it sent a row of the
    resumed run and restarted. Every round is released once, with the noise node's row: the two
    reports agree on rounds and journal head, no row was sent twice under one key segment, ε is
    the Gaussian mechanism's (as without the noise node), and no server file holds a noise key."""
    work = tmp_path / "loopback"
    report = _loopback(work, "--secagg", "--noise-node", "--rounds", "3", "--drills", timeout=1500)
    assert report["rounds_completed"] == 3 and report["stopped_reason"] is None
    assert report["realized"]["epsilon"] == pytest.approx(
        _gaussian_epsilon_every_round(work, report), rel=1e-6
    )
    registered = (work / "noise-registered.txt").read_text().split()
    node = report["noise_node"]
    assert registered[0] == "noise" and str(node["node_id"]) == registered[1]
    assert report["trust_model"]["server"].startswith("honest-but-curious")
    mine = json.loads((work / "noise-node" / "noise_node_report.json").read_text())
    assert mine["rounds_contributed"] == node["rounds_contributed"] == 3
    assert mine["journal_head"] == node["journal_head"]
    sends = [json.loads(line) for line in (work / "noise-node" / "journal.jsonl").open()]
    rows = [(e["round"], e["segment"]["key_fingerprint"]) for e in sends]
    assert len(rows) == len(set(rows)) and {r for r, _ in rows} == {0, 1, 2}
    drills = dict(line.split() for line in (work / "drills.txt").read_text().splitlines())
    assert int(drills["killed-after-round"]) in (1, 2)
    assert int(drills["noise-node-restart-attempts"]) >= 1
    # the noise node was killed mid-run: the round it could not finish was redone with a fresh row
    # (a later key segment) or the run stopped and a third run resumed
    assert drills["noise-drill-status"] == "finished:completed" or "third-run" in drills
    assert len(mine["current_key_segments"]) >= 2  # its restart opened a new segment
    text = (work / "noise-node.txt").read_text()
    assert "key-found-in-server-files 0" in text and "repeated-rows 0" in text
