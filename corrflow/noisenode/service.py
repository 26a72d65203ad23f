"""The noise node in a deployment (``corrflow noise-node``): its own Flower SuperNode, with its own
TLS root certificate and SuperNode authentication key, whose ClientApp only relays.

The noise node's key and round state live in one long-lived process (`serve`), never in Flower's
ClientApp processes: the SuperNode it starts (``flower-supernode``, its child) runs corrflow's
ClientApp, which sees ``noise-node-socket`` in its node config and relays each SecAgg+ stage
message through that local socket (`relay`); the socket's directory is private (0700) and every
connection proves the per-start secret next to it (`multiprocessing.connection`'s challenge).

The recipe is pinned at start from the run config the operator gives the noise node — the same
one the server runs — planned the way the server plans it
(`corrflow.server.noise_node_deploy.recipe_from_run_config`): the noise node computes the
factorization and σ itself and never takes them from the server. `pin.json` holds what the clients
and the server pin (`pin_lines`).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge
from pathlib import Path

from corrflow.errors import CorrflowError, InvalidArgumentError
from corrflow.fileio import write_json
from corrflow.noisenode.protocol import PIN_ID, PIN_KEY, PIN_SIGNATURE, SOCKET_KEY

log = logging.getLogger("corrflow")

#: The socket and the per-start secret in the private socket directory; the pin in the node's.
SOCKET, AUTHKEY, PIN_FILE = "s", "authkey", "pin.json"
#: The socket directory's name prefix, and the file in the noise node's directory that records it.
SOCKET_PREFIX, SOCKET_RECORD = "corrflow-nn-", "socket-dir"
#: Seconds the relay waits for the noise node's answer to one stage.
RELAY_TIMEOUT = 120.0


class NoiseNodeServiceError(CorrflowError):
    """The noise node's SuperNode stopped, or a relay could not reach the noise node."""


@dataclass(frozen=True)
class SuperNodeArgs:
    """How the noise node's SuperNode reaches the SuperLink: its Fleet API address, the root
    certificate that verifies the SuperLink's TLS certificate, the SuperNode authentication
    private key registered for the noise node, and the local port of its Runtime API."""

    superlink: str
    root_certificates: Path
    auth_key: Path
    port: int
    flwr_bin: Path


def pin_lines(identity: dict) -> dict:
    """What the clients' node config and the server's run config pin: the noise node's id, its
    long-term public key and the id's signature.

    Args:
        identity: `corrflow.noisenode.node.NoiseNode.identity`'s.

    Returns:
        ``{"node_id", "public_key", "signature", "node_config", "run_config"}`` (hex; the last two
        ready to paste into ``--node-config`` and ``--run-config``).
    """
    nid, key, sig = int(identity["node_id"]), identity["public_key"].hex(), identity["signature"]
    sig = sig.hex()
    return {
        "node_id": nid,
        "public_key": key,
        "signature": sig,
        "node_config": f'{PIN_ID}="{nid}" {PIN_KEY}="{key}" {PIN_SIGNATURE}="{sig}"',
        "run_config": f'corrflow.noise-node=true corrflow.noise-node-pin="{nid}:{key}:{sig}"',
    }


def write_pin(directory: Path, identity: dict) -> dict:
    """Write ``pin.json`` (public) into the noise node's directory; returns its content."""
    pins = pin_lines(identity)
    write_json(directory / PIN_FILE, pins, indent=1)
    return pins


# -- the relay: the ClientApp side -----------------------------------------------------------------
def relay(stage: str, config: dict, node_config) -> dict:
    """Relay one SecAgg+ stage message to the noise node through its local socket.

    Args:
        stage: the stage.
        config: the stage message's config record, as a dict (without the stage).
        node_config: the SuperNode's node config (``noise-node-socket``).

    Returns:
        The noise node's reply.

    Raises:
        NoiseNodeServiceError: the noise node cannot be reached, or it refused (its reason).
    """
    path = Path(str(node_config[SOCKET_KEY]))
    try:
        key = (path.parent / AUTHKEY).read_bytes()
        with Client(str(path), family="AF_UNIX", authkey=key) as conn:
            conn.send({"op": "stage", "stage": stage, "config": config})
            if not conn.poll(RELAY_TIMEOUT):
                raise NoiseNodeServiceError("the noise node did not answer")
            reply = conn.recv()
    except (OSError, EOFError, AuthenticationError) as exc:
        raise NoiseNodeServiceError(f"the noise node at {path} is not reachable: {exc}") from exc
    if "error" in reply:
        raise NoiseNodeServiceError(f"the noise node refused: {reply['error']}")
    return reply["ok"]


# -- the service: the noise node's process --------------------------------------------------------
class NoiseNodeService:
    """The noise node's process: its `NoiseNode` behind a private local socket, and the SuperNode
    child that relays to it (module docstring)."""

    def __init__(self, node):
        self.node = node
        _remove_stale(node.store.dir / SOCKET_RECORD)  # a killed start's socket directory
        self.sockdir = Path(tempfile.mkdtemp(prefix=SOCKET_PREFIX))  # short: AF_UNIX paths
        os.chmod(self.sockdir, 0o700)
        (node.store.dir / SOCKET_RECORD).write_text(str(self.sockdir))
        self.authkey = secrets.token_bytes(32)
        (self.sockdir / AUTHKEY).touch(mode=0o600)
        (self.sockdir / AUTHKEY).write_bytes(self.authkey)
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(self.sockdir / SOCKET))
        self.server.listen(8)
        self.server.settimeout(0.5)
        self.child: subprocess.Popen | None = None
        self._stop = False

    @property
    def socket_path(self) -> Path:
        """The socket the relay connects to."""
        return self.sockdir / SOCKET

    def start_supernode(self, args: SuperNodeArgs, log_file) -> subprocess.Popen:
        """Start the noise node's SuperNode (``flower-supernode``) with its own TLS root
        certificate and authentication key, its node config naming this process's socket."""
        cmd = [
            str(args.flwr_bin / "flower-supernode"),
            "--root-certificates",
            str(args.root_certificates),
            "--superlink",
            args.superlink,
            "--auth-supernode-private-key",
            str(args.auth_key),
            "--host",
            "127.0.0.1",
            "--port",
            str(args.port),
            "--node-config",
            f'{SOCKET_KEY}="{self.socket_path}"',
        ]
        env = {**os.environ, "PATH": f"{args.flwr_bin}{os.pathsep}{os.environ.get('PATH', '')}"}
        self.child = subprocess.Popen(
            cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent
        )
        return self.child

    def serve(self) -> int:
        """Answer relayed requests until SIGTERM/SIGINT (0) or the SuperNode's exit (1)."""
        from corrflow.noisenode.process import answer

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: setattr(self, "_stop", True))
        while not self._stop:
            if self.child is not None and self.child.poll() is not None:
                log.error("the noise node's SuperNode exited with code %s", self.child.returncode)
                return 1
            try:
                sock, _ = self.server.accept()
            except TimeoutError:
                continue
            except InterruptedError:
                continue
            sock.settimeout(None)
            with Connection(sock.detach()) as conn:
                try:
                    deliver_challenge(conn, self.authkey)
                    answer_challenge(conn, self.authkey)
                    conn.send(answer(self.node, conn.recv()))
                except (OSError, EOFError, ValueError, AuthenticationError) as exc:  # a stranger
                    log.warning("a relay connection failed: %s", exc)
        return 0

    def close(self) -> None:
        """Stop the SuperNode (SIGTERM, SIGKILL after 15 s) and remove the socket directory."""
        if self.child is not None and self.child.poll() is None:
            self.child.terminate()
            try:
                self.child.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.child.kill()
                self.child.wait()
        self.server.close()
        shutil.rmtree(self.sockdir, ignore_errors=True)
        (self.node.store.dir / SOCKET_RECORD).unlink(missing_ok=True)


def _remove_stale(record: Path) -> None:
    """Remove the socket directory a SIGKILLed start left behind (only a corrflow socket
    directory in the temporary directory, as recorded)."""
    if not record.is_file():
        return
    stale = Path(record.read_text().strip())
    if stale.parent == Path(tempfile.gettempdir()) and stale.name.startswith(SOCKET_PREFIX):
        shutil.rmtree(stale, ignore_errors=True)
    record.unlink()


def _die_with_parent() -> None:
    """In the SuperNode's process before exec: SIGTERM when the noise node's process dies, so
    that a killed noise node leaves no SuperNode behind relaying to nothing (Linux only)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def flower_bin(given: Path | None) -> Path:
    """The directory holding ``flower-supernode``: ``given``, else this interpreter's, else PATH's.

    Raises:
        InvalidArgumentError (``--flwr-bin``): none holds it.
    """
    candidates = [given] if given is not None else [Path(sys.executable).parent]
    if given is None and (found := shutil.which("flower-supernode")):
        candidates.append(Path(found).parent)
    for d in candidates:
        if (Path(d) / "flower-supernode").is_file():
            return Path(d)
    raise InvalidArgumentError(
        "--flwr-bin", "a directory holding flower-supernode", str(given or "PATH")
    )


def run_service(node, args: SuperNodeArgs, log_path: Path) -> int:
    """Serve ``node`` behind its SuperNode until stopped (`NoiseNodeService.serve`'s exit code)."""
    service = NoiseNodeService(node)
    try:
        with open(log_path, "ab") as log_file:
            service.start_supernode(args, log_file)
            log.info(
                "noise node %d: SuperNode started (pid %d), log %s",
                node.store.node_id,
                service.child.pid,
                log_path,
            )
            return service.serve()
    finally:
        service.close()
