"""The noise node as a child process (``corrflow simulate --secagg --noise-node``): its own
interpreter, its state in its own directory, reached only through a pipe that carries stage
messages' config records — the server's process never holds its key.

`NoiseNodeProcess` starts it (a fresh interpreter, not a fork: nothing of the parent's memory is
shared; one end of a private socket pair its only channel),
restarts it when it died (a new start of the node: its next row opens a new key segment) and
answers the in-process grid's messages to the noise node's id (`NoiseNodeProcess.handler`).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path

from flwr.app import ConfigRecord, Context, Error, Message, RecordDict
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

from corrflow.errors import CorrflowError
from corrflow.run.noise_node_link import NoiseNodeLink

log = logging.getLogger("corrflow")

#: Seconds the parent waits for the child to start, and for one answer.
START_TIMEOUT, CALL_TIMEOUT = 120.0, 120.0


def serve(conn, directory: str) -> None:
    """The child's loop: one request in, one answer out, until the connection closes."""
    from corrflow.noisenode.node import NoiseNode
    from corrflow.noisenode.store import NoiseNodeStore

    node = NoiseNode(NoiseNodeStore(directory))
    conn.send({"ok": node.identity()})
    while True:
        try:
            req = conn.recv()
        except (EOFError, OSError):
            return
        conn.send(answer(node, req))


def answer(node, req: dict) -> dict:
    """The noise node's answer to one request: ``{"ok": …}`` or ``{"error": reason}`` (a refusal
    is an answer, it never crashes the node).

    Args:
        node: the `corrflow.noisenode.node.NoiseNode`.
        req: ``{"op": "pin", "recipe", "factorization": path}`` or ``{"op": "stage", "stage",
            "config"}``.

    Returns:
        The answer.
    """
    try:
        if req["op"] == "pin":
            out = node.pin(req["recipe"], Path(req["factorization"]).read_bytes())
        elif req["op"] == "stage":
            out = node.handle(req["stage"], req["config"])
        else:
            raise ValueError(f"unknown request {req['op']!r}")
        return {"ok": out}
    except Exception as exc:  # answered, never crashes the node
        return {"error": f"{type(exc).__name__}: {exc}"}


def main() -> None:
    """``python -m corrflow.noisenode.process DIR FD``: serve over the socket FD the parent
    passed. The terminal's Ctrl-C is the parent's to handle: it closes the connection, which ends
    this process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with Connection(int(sys.argv[2])) as conn:
        serve(conn, sys.argv[1])


class NoiseNodeError(CorrflowError):
    """The noise node refused a request or could not be reached."""


class NoiseNodeProcess:
    """The noise node's child process over ``directory`` (module docstring)."""

    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        self._proc = None
        self._conn = None
        self.identity: dict = {}

    def start(self) -> dict:
        """Start the child (a fresh interpreter: ``python -m corrflow.noisenode.process``), one
        end of a private socket pair its only channel; returns its identity.

        Raises:
            NoiseNodeError: it did not answer within `START_TIMEOUT` seconds.
        """
        ours, theirs = socket.socketpair()
        with ours, theirs:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "corrflow.noisenode.process", str(self.dir)]
                + [str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
            )
            self._conn = Connection(ours.detach())
        if not self._conn.poll(START_TIMEOUT):
            self.close()
            raise NoiseNodeError(f"the noise node in {self.dir} did not start")
        self.identity = self._answer(self._conn.recv())
        return self.identity

    @property
    def pid(self) -> int | None:
        """The child's process id, or None when not started."""
        return self._proc.pid if self._proc is not None else None

    def alive(self) -> bool:
        """Whether the child is running."""
        return self._proc is not None and self._proc.poll() is None

    def call(self, request: dict, timeout: float = CALL_TIMEOUT):
        """One request's answer.

        Raises:
            NoiseNodeError: the node refused (its reason), or died or did not answer.
        """
        if not self.alive():
            raise ConnectionError("the noise node is not running")
        try:
            self._conn.send(request)
            if not self._conn.poll(timeout):
                raise ConnectionError("the noise node did not answer")
            return self._answer(self._conn.recv())
        except (EOFError, BrokenPipeError, ConnectionResetError, OSError) as exc:
            raise ConnectionError(f"the noise node died ({type(exc).__name__})") from exc

    @staticmethod
    def _answer(reply: dict):
        if "error" in reply:
            raise NoiseNodeError(reply["error"])
        return reply["ok"]

    def pin(self, recipe: dict, factorization: Path) -> float:
        """Pin the run's recipe on the noise node.

        Args:
            recipe: `corrflow.run.noise_node_link.noise_recipe`'s.
            factorization: the run's factorization file.

        Returns:
            σ_max as the noise node computed it.

        Raises:
            NoiseNodeError: the noise node refused (pinned to another recipe, or another file).
        """
        return float(
            self.call({"op": "pin", "recipe": recipe, "factorization": str(factorization)})[
                "sigma_max"
            ]
        )

    def link(self) -> NoiseNodeLink:
        """The server's link to this node, pinning through it."""
        i = self.identity
        return NoiseNodeLink(
            int(i["node_id"]), i["public_key"], i["signature"], pin=lambda r, f: self.pin(r, f)
        )

    def handler(self, msg: Message, ctxt: Context) -> Message:
        """The in-process grid's handler for the noise node's id: a SecAgg+ stage message goes to
        the child; a dead child is started again at the next setup (the round that lost it fails
        and is redone)."""
        config = dict(msg.content.config_records[RECORD_KEY_CONFIGS])
        stage = config.pop(Key.STAGE)
        if not self.alive() and stage == "setup":
            log.warning("the noise node had stopped; starting it again from %s", self.dir)
            self.start()
        try:
            out = self.call({"op": "stage", "stage": stage, "config": config})
        except ConnectionError as exc:
            return Message(Error(code=5, reason=f"Node Unavailable: {exc}"), reply_to=msg)
        return Message(RecordDict({RECORD_KEY_CONFIGS: ConfigRecord(out)}), reply_to=msg)

    def close(self) -> None:
        """Close the connection (the child's loop ends) and wait for the child, killing it after
        10 s."""
        if self._conn is not None:
            self._conn.close()
        if self._proc is not None:
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = self._conn = None


if __name__ == "__main__":
    main()
